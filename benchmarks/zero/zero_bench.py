#!/usr/bin/python3
"""ZeRO stages side by side: tokens/s and the model state per rank of the GPT trained on 2 ranks
(1 thread each) with plain data parallel, ZeRO-1, ZeRO-2 and ZeRO-3 (with and without prefetch,
and with bf16 all-gathers). The runs of one model alternate over --rounds rounds and each layout
keeps its best round, so a slow moment of the machine does not land on one layout only. Ratios are
against data parallel measured in the same rounds. Prints a markdown table per model.

usage: benchmarks/zero/zero_bench.py [--dtrain build/dtrain] [--data DIR] [--models 6x256,12x768]
       [--steps 8] [--batch 8] [--context 128] [--rounds 2] [--allreduce mpi]

tokens/s is dtrain's training throughput (the steps after the first; the closing validation pass,
one batch here, is not in it). --allreduce picks the MPI backend's algorithm for every layout: mpi
(Open MPI's collectives, dtrain's default) or shm/auto (the node's shared window, which carries
data parallel's allreduce and ZeRO's reduce-scatters and allgathers on one node).
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
LAYOUTS = [
    ("data parallel", ["--zero", "0"]),
    ("ZeRO-1", ["--zero", "1"]),
    ("ZeRO-2", ["--zero", "2"]),
    ("ZeRO-3, prefetch", ["--zero", "3"]),
    ("ZeRO-3, no prefetch", ["--zero", "3", "--zero-prefetch", "false"]),
    ("ZeRO-3, bf16 all-gathers", ["--zero", "3", "--zero-gather-dtype", "bf16"]),
]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout + r.stderr


def measure(base, extra):
    out = run(["mpirun", "-n", "2", "--bind-to", "none"] + base + extra)
    tps = float(re.search(r"([\d.]+) tokens/s, first step", out).group(1))
    state = float(re.search(r"memory of rank 0 \(MiB\): model state ([\d.]+)", out).group(1))
    rss = float(re.search(r"memory of rank 0 \(MiB\):.*peak RSS ([\d.]+)", out).group(1))
    return tps, state, rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", default="build/dtrain")
    ap.add_argument("--data", default="")
    ap.add_argument("--models", default="6x256,12x768")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--allreduce", default="mpi")
    a = ap.parse_args()
    data = a.data
    if not data:
        data = os.path.join(tempfile.mkdtemp(prefix="dtrain-zero-"), "fortunes")
        run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data])
    cpu = run(["sh", "-c", "grep -m1 'model name' /proc/cpuinfo || echo unknown"]).strip()
    print(f"{cpu}; 2 ranks x 1 thread; batch {a.batch} x context {a.context} per rank; {a.steps} steps; "
          f"best of {a.rounds} alternating rounds; --allreduce {a.allreduce}\n")
    for spec in a.models.split(","):
        layers, width = spec.split("x")
        base = [a.dtrain, "train", "--model", "gpt", "--data", data, "--layers", layers, "--width", width,
                "--heads", str(max(1, int(width) // 64)), "--context", str(a.context), "--batch-size", str(a.batch),
                "--steps", str(a.steps), "--eval-every", "0", "--log-every", "0", "--threads", "1",
                "--warmup-steps", "1", "--progress", "off", "--eval-batches", "1", "--allreduce", a.allreduce]
        best = {}
        for _ in range(a.rounds):
            for name, extra in LAYOUTS:
                tps, state, rss = measure(base, extra)
                old = best.get(name)
                best[name] = (max(tps, old[0]) if old else tps, state, rss)
        plain = best["data parallel"][0]
        print(f"GPT {layers} x {width}\n")
        print("| layout | tokens/s | x data parallel | model state per rank MiB | peak RSS rank 0 MiB |")
        print("|---|---|---|---|---|")
        for name, _ in LAYOUTS:
            tps, state, rss = best[name]
            print(f"| {name} | {tps:.0f} | {tps / plain:.3f} | {state:.1f} | {rss:.1f} |")
        print()


if __name__ == "__main__":
    main()
