#!/usr/bin/python3
"""Pipeline schedules and activation checkpointing, measured: peak activation memory and peak
resident memory per stage, the measured and ideal bubble, and tokens/s, for the GPT of the
model-parallel issue (6 layers, width 256, 8 heads, context 128, byte vocabulary) trained a few
steps on 2 ranks as 2 pipeline stages (1 thread each), under GPipe and 1F1B, with and without
recomputation; and on one rank with and without recomputation. Prints a markdown table.

usage: benchmarks/pipeline/pipeline_memory.py [--dtrain build/dtrain] [--data DIR] [--steps 6]
       [--batch 16] [--micro 8]
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile

MODEL = ["--layers", "6", "--width", "256", "--heads", "8", "--context", "128"]
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", default="build/dtrain")
    ap.add_argument("--data", default="")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--micro", type=int, default=8)
    a = ap.parse_args()
    data = a.data
    if not data:
        data = os.path.join(tempfile.mkdtemp(prefix="dtrain-pp-"), "fortunes")
        run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data])
    base = [a.dtrain, "train", "--model", "gpt", "--data", data] + MODEL + [
        "--batch-size", str(a.batch), "--steps", str(a.steps), "--eval-every", "0", "--eval-batches", "1",
        "--log-every", "0", "--threads", "1", "--warmup-steps", "1"]
    rows = []
    for sched in ["gpipe", "1f1b"]:
        for recompute in [False, True]:
            cmd = ["mpirun", "-n", "2", "--bind-to", "none"] + base + [
                "--pp", "2", "--schedule", sched, "--micro-batches", str(a.micro)]
            if recompute:
                cmd.append("--checkpoint-activations")
            out = run(cmd)
            tps = float(re.search(r"([\d.]+) tokens/s, peak RSS", out).group(1))
            for m in re.finditer(r"stage (\d): blocks \[(\d+), (\d+)\).*measured bubble ([\d.]+) % \(ideal ([\d.]+) %\), "
                                 r"peak activations ([\d.]+) MiB, peak RSS ([\d.]+) MiB", out):
                rows.append((f"pp 2, {sched}, {a.micro} micro-batches", "on" if recompute else "off",
                             m.group(1), f"{m.group(2)}-{int(m.group(3)) - 1}", m.group(6), m.group(7),
                             f"{m.group(4)} ({m.group(5)})", f"{tps:.0f}"))
    for recompute in [False, True]:
        cmd = base + (["--checkpoint-activations"] if recompute else [])
        out = run(cmd)
        m = re.search(r"([\d.]+) tokens/s, peak RSS ([\d.]+) MiB", out)
        rows.append(("1 rank", "on" if recompute else "off", "-", "0-5", "-", m.group(2), "-", f"{float(m.group(1)):.0f}"))
    print(f"GPT 6 x 256, 8 heads, context 128, batch {a.batch}, {a.steps} steps, 1 thread per rank\n")
    print("| layout | recompute | stage | blocks | peak activations MiB | peak RSS MiB | bubble % (ideal) | tokens/s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")


if __name__ == "__main__":
    main()
