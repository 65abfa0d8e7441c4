#!/usr/bin/python3
"""A GPT larger than data parallel lets 4 ranks hold on one machine (issue "Models larger than a
rank's memory", the scale target). Three runs on 4 ranks x 1 thread:
  1. data parallel (--zero 0): must be refused before its first step, exit 2, with the bytes;
  2. ZeRO-3 built shard by shard: --steps steps, each rank's peak RSS and model state from the
     memory report, against data parallel's model state per rank (16 bytes a parameter);
  3. on a smaller GPT, ZeRO-1 and ZeRO-3 over the same steps: their losses must be equal.
Prints a markdown table; exits non-zero when a check fails.

usage: benchmarks/zero/scale_bench.py [--dtrain build/dtrain] [--data DIR] [--model 26x1280]
       [--small 4x256] [--steps 10]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
MPI = ["mpirun", "-n", "4", "--oversubscribe", "--bind-to", "none"]


def run(cmd, want_rc=0):
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode != want_rc:
        sys.exit(f"exit {r.returncode}, wanted {want_rc}: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def gpt(a, data, spec, steps):
    layers, width = spec.split("x")
    return [a.dtrain, "train", "--model", "gpt", "--data", data, "--layers", layers, "--width", width,
            "--heads", str(max(1, int(width) // 64)), "--context", "64", "--batch-size", "1",
            "--steps", str(steps), "--eval-every", "0", "--log-every", "1", "--threads", "1", "--progress", "off"]


def losses(out):
    return [float(x) for x in re.findall(r"^step \d+/\d+ loss ([\d.]+)", out, re.M)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", default="build/dtrain")
    ap.add_argument("--data", default="")
    ap.add_argument("--model", default="26x1280")
    ap.add_argument("--small", default="4x256")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    data = a.data
    if not data:
        data = os.path.join(tempfile.mkdtemp(prefix="dtrain-scale-"), "fortunes")
        run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data])
    cpu = run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo || echo unknown"]).strip()
    mem = run(["sh", "-c", "grep MemTotal /proc/meminfo"]).split()[1]
    print(f"{cpu}; {int(mem) / 1048576:.1f} GiB; 4 ranks x 1 thread; GPT {a.model}, batch 1 x context 64 per rank\n")

    refused = run(MPI + gpt(a, data, a.model, a.steps) + ["--zero", "0"], want_rc=2)
    need = re.search(r"needs ([\d.]+) GiB \(parameters ([\d.]+)", refused)
    if not need:
        sys.exit("data parallel was not refused with the bytes it needs:\n" + refused)
    dp_state_mib = float(need.group(1)) * 1024

    out = run(MPI + gpt(a, data, a.model, a.steps) + ["--zero", "3", "--memory-report", "true"])
    params = int(re.search(r"(\d+) parameters on rank 0", out).group(1))
    ranks = {}
    for m in re.finditer(r"memory of rank (\d) \(MiB\): model state ([\d.]+),.*peak RSS ([\d.]+)", out):
        ranks[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    big = losses(out)
    if len(big) != a.steps or len(ranks) != 4:
        sys.exit("ZeRO-3 did not report every step and rank:\n" + out)
    first = re.search(r"first step ([\d.]+) s after process start", out).group(1)

    z1 = losses(run(MPI + gpt(a, data, a.small, a.steps) + ["--zero", "1"]))
    z3 = losses(run(MPI + gpt(a, data, a.small, a.steps) + ["--zero", "3"]))

    print(f"data parallel: refused before its first step (exit 2): {need.group(0)} GiB ...\n")
    print(f"ZeRO-3, GPT {a.model} ({params / 1e6:.0f} M parameters), {a.steps} steps, first step {first} s "
          f"after process start; losses {' '.join(f'{x:.4f}' for x in big)}\n")
    print("| rank | model state MiB | peak RSS MiB | data parallel's model state MiB | peak RSS / that |")
    print("|---|---|---|---|---|")
    for r in sorted(ranks):
        state, rss = ranks[r]
        print(f"| {r} | {state:.1f} | {rss:.1f} | {dp_state_mib:.1f} | {rss / dp_state_mib:.3f} |")
    print(f"\nGPT {a.small}, {a.steps} steps on 4 ranks: ZeRO-1 losses {' '.join(f'{x:.4f}' for x in z1)}")
    print(f"GPT {a.small}, {a.steps} steps on 4 ranks: ZeRO-3 losses {' '.join(f'{x:.4f}' for x in z3)}")
    if z1 != z3 or len(z1) != a.steps:
        sys.exit("ZeRO-3's losses differ from ZeRO-1's")
    print("equal at every step (as printed, 4 decimals)")


if __name__ == "__main__":
    main()
