#!/usr/bin/python3
"""Inference speed of a structurally pruned SimpleCNN once its pruned channels are cut out
(`dtrain prune-export`), against the same model kept at full width with the channels masked to zero.

Trains SimpleCNN with 50 % of each layer's output channels pruned (the reference recipe of
prune_sweep.py), unless --checkpoint names one; exports the shrunk model; then runs
`dtrain eval --int8` on the Fashion-MNIST test set for both models, alternating, --repeats times
per thread count, so both see the same machine load. Each eval reports fp32 and int8 forward
throughput (forward time only, batch 256). Writes shrink_speed.csv and shrink_speed.md into --out.

usage: benchmarks/compression/shrink_speed.py [--dtrain build/dtrain] [--data data/fashion-mnist]
           [--checkpoint DIR_OR_FILE] [--threads 1 2] [--repeats 3] [--out runs/shrink_speed]
"""
import argparse
import csv
import os
import re
import statistics
import subprocess
import sys

from runs import add_common_args, train, write_table

LINE = re.compile(r"^(fp32|int8)\s+accuracy ([0-9.]+)%, loss ([0-9.]+), (\d+) samples, forward ([0-9.]+) s, "
                  r"(\d+) samples/s", re.M)


def run(cmd):
    lock = ["flock", os.environ["DTRAIN_BENCH_LOCK"]] if os.environ.get("DTRAIN_BENCH_LOCK") else []
    print("running:", " ".join(cmd), flush=True)
    r = subprocess.run(lock + cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def load():
    return os.getloadavg()[0]


def evaluate(args, ckpt, threads):
    """fp32 and int8 of one `dtrain eval --int8`: {precision: (accuracy, samples/s)}."""
    out = run([args.dtrain, "eval", "--checkpoint", ckpt, "--data", os.path.join(args.data, "test"), "--int8",
               "--calibration-data", os.path.join(args.data, "train"), "--threads", str(threads)])
    found = {m[0]: (float(m[1]), float(m[5])) for m in LINE.findall(out)}
    if set(found) != {"fp32", "int8"}:
        sys.exit(f"no fp32/int8 lines in:\n{out}")
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "shrink_speed")
    p.add_argument("--checkpoint", help="a SimpleCNN checkpoint pruned with --prune-structured (default: train one)")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dense = args.checkpoint
    if not dense:
        summary = train(args, f"structured-{args.sparsity:g}",
                        ["--prune-sparsity", args.sparsity, "--prune-structured", "true"])
        print(f"trained: test accuracy {100 * summary['test_accuracy']:.2f} %", flush=True)
        dense = os.path.join(args.out, f"ckpt-structured-{args.sparsity:g}")
    small = os.path.join(args.out, "shrunk.h5")
    print(run([args.dtrain, "prune-export", "--checkpoint", dense, "--out", small]), flush=True)
    rows = []
    for threads in args.threads:
        for rep in range(args.repeats):
            for model, ckpt in (("masked (full width)", dense), ("shrunk", small)):
                before = load()
                for precision, (acc, rate) in evaluate(args, ckpt, threads).items():
                    rows.append({"model": model, "precision": precision, "threads": threads, "repeat": rep + 1,
                                 "test_accuracy": acc, "samples_per_s": rate, "load_before": before})
    with open(os.path.join(args.out, "shrink_speed.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = ["| precision | threads | model | test accuracy | samples/s, each run | median | shrunk / masked |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for precision in ("fp32", "int8"):
        for threads in args.threads:
            med = {}
            for model in ("masked (full width)", "shrunk"):
                sel = [r for r in rows if r["model"] == model and r["precision"] == precision
                       and r["threads"] == threads]
                med[model] = statistics.median(r["samples_per_s"] for r in sel)
                ratio = f"{med['shrunk'] / med['masked (full width)']:.2f}x" if model == "shrunk" else ""
                each = ", ".join(f"{r['samples_per_s']:.0f}" for r in sel)
                lines.append(f"| {precision} | {threads} | {model} | {sel[0]['test_accuracy']:.2f} % | {each} | "
                             f"{med[model]:.0f} | {ratio} |")
    loads = [r["load_before"] for r in rows]
    lines.append(f"\nload average (1 min) before the runs: {min(loads):.1f} to {max(loads):.1f}")
    write_table(args.out, "shrink_speed.md", lines)


if __name__ == "__main__":
    main()
