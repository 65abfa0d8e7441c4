#!/usr/bin/python3
"""dtrain against PyTorch, side by side in one run: SimpleCNN training on the same synthetic
1x28x28 batches, 1 thread each, SGD with momentum. Reports samples/s at each batch size, peak
resident memory (/usr/bin/time -v) and dtrain's time from process start to its first step, as a
markdown table with ratios. The two frameworks alternate, `--rounds` times, and the best of each
is kept, so background noise hits both alike.

usage: benchmarks/peers/compare_simple_cnn.py [--dtrain build/dtrain] [--batches 64 256] [--rounds 3]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def timed(cmd, env):
    """Runs cmd under /usr/bin/time -v; returns (stdout, peak RSS in MiB)."""
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return r.stdout, int(rss.group(1)) / 1024.0 if rss else float("nan")


def run_dtrain(args, batch, env):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        steps = max(50, args.samples // batch)
        # mpirun -n 1 is how dtrain is launched; the process measured is the rank itself.
        cmd = ["mpirun", "-n", "1", "--bind-to", "none", "/usr/bin/time", "-v", args.dtrain, "train", "--synthetic",
               "--model", "simple_cnn", "--batch-size", str(batch), "--steps", str(steps), "--threads", "1",
               "--lr", "0.01", "--lr-schedule", "constant", "--momentum", "0.9", "--progress", "off",
               "--log-every", str(steps), "--metrics", metrics]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode != 0:
            sys.exit(f"dtrain failed:\n{r.stdout}\n{r.stderr}")
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
        summary = [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]
        return (summary["samples_per_s"], summary["samples_per_cpu_s"], int(rss.group(1)) / 1024.0,
                summary["first_step_at_s"])


def run_torch(args, batch, env):
    steps = max(50, args.samples // batch)
    out, rss = timed(["/usr/bin/python3", os.path.join(HERE, "torch_simple_cnn.py"), "bench", "--batch-size",
                      str(batch), "--steps", str(steps), "--threads", "1"], env)
    r = json.loads(out.strip().splitlines()[-1])
    return r["samples_per_s"], r["samples_per_cpu_s"], rss


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtrain", default="build/dtrain")
    p.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=25600, help="samples per timed run")
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    # Import time of torch alone, for the start-up comparison.
    r = subprocess.run(["/usr/bin/python3", "-c", "import time; t=time.perf_counter(); import torch; "
                        "print(time.perf_counter()-t)"], capture_output=True, text=True, env=env)
    torch_import_s = float(r.stdout.strip())
    rows = []
    for batch in args.batches:
        best_d, best_t, cpu_d, cpu_t, rss_d, rss_t, first = 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1e9
        for _ in range(args.rounds):
            sd, cd, md, fs = run_dtrain(args, batch, env)
            st, ct, mt = run_torch(args, batch, env)
            best_d, best_t, cpu_d, cpu_t = max(best_d, sd), max(best_t, st), max(cpu_d, cd), max(cpu_t, ct)
            rss_d, rss_t, first = max(rss_d, md), max(rss_t, mt), min(first, fs)
        rows.append((batch, best_d, best_t, cpu_d, cpu_t, rss_d, rss_t, first))
    print(f"SimpleCNN training, synthetic 1x28x28, 1 thread, SGD momentum; best of {args.rounds} alternating rounds\n")
    print("| batch | dtrain samples/s | PyTorch samples/s | speed ratio | per CPU-second ratio | dtrain peak RSS MiB "
          "| PyTorch peak RSS MiB | memory ratio | dtrain first step after start (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, sd, st, cd, ct, md, mt, fs in rows:
        print(f"| {b} | {sd:.0f} | {st:.0f} | {sd / st:.2f}x | {cd / ct:.2f}x | {md:.0f} | {mt:.0f} | {md / mt:.2f} "
              f"| {fs:.3f} |")
    print("\nper CPU-second: samples per second of process CPU time (all threads), which background load on a "
          "shared machine disturbs less than wall time")
    print(f"\nimport torch alone: {torch_import_s:.2f} s")


if __name__ == "__main__":
    main()
