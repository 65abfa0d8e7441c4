#!/usr/bin/python3
"""Accuracy against sparsity: SimpleCNN trained on Fashion-MNIST with dtrain's magnitude pruning
(examples/fashion_cnn.ini, 2 ranks, the cubic ramp over the first 80 % of the steps) at each
unstructured sparsity, plus structured pruning (whole output channels), all in one run on the same
machine. Writes prune_sweep.csv, a markdown table (printed and prune_sweep.md) and prune_sweep.png
into --out, with each run's gap to the dense run in points of test accuracy.

usage: benchmarks/compression/prune_sweep.py [--dtrain build/dtrain] [--data data/fashion-mnist]
           [--sparsity 0 0.5 0.8 0.9 0.95] [--structured 0.5] [--epochs 10] [--out runs/prune_sweep]
"""
import argparse
import csv
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train(args, sparsity, structured):
    tag = f"{'structured' if structured else 'unstructured'}-{sparsity:g}"
    metrics = os.path.join(args.out, tag + ".jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    cmd = ["mpirun", "-n", "2", "--bind-to", "none", args.dtrain, "train", "--config",
           os.path.join(ROOT, "examples", "fashion_cnn.ini"), "--data", os.path.join(args.data, "train"),
           "--test-data", os.path.join(args.data, "test"), "--global-batch-size", "64", "--epochs",
           str(args.epochs), "--progress", "off", "--metrics", metrics, "--checkpoint-dir",
           os.path.join(args.out, "ckpt-" + tag), "--prune-sparsity", str(sparsity),
           "--prune-structured", "true" if structured else "false"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    summary = [json.loads(l) for l in open(metrics) if '"summary"' in l][-1]
    return {"pruning": "structured" if structured else "unstructured", "sparsity": sparsity,
            "achieved": summary.get("sparsity", 0.0), "test_accuracy": summary["test_accuracy"],
            "samples_per_s": summary["samples_per_s"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "fashion-mnist"))
    p.add_argument("--sparsity", type=float, nargs="+", default=[0, 0.5, 0.8, 0.9, 0.95])
    p.add_argument("--structured", type=float, nargs="*", default=[0.5])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "prune_sweep"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = [train(args, s, False) for s in args.sparsity] + [train(args, s, True) for s in args.structured]
    dense = next((r["test_accuracy"] for r in rows if r["sparsity"] == 0), None)
    with open(os.path.join(args.out, "prune_sweep.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    lines = ["| pruning | target sparsity | achieved | test accuracy | vs dense (points) | samples/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        gap = f"{100 * (r['test_accuracy'] - dense):+.2f}" if dense is not None else "n/a"
        lines.append(f"| {r['pruning']} | {100 * r['sparsity']:.0f} % | {100 * r['achieved']:.1f} % | "
                     f"{100 * r['test_accuracy']:.2f} % | {gap} | {r['samples_per_s']:.0f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "prune_sweep.md"), "w") as f:
        f.write(table + "\n")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    un = [r for r in rows if r["pruning"] == "unstructured"]
    plt.figure(figsize=(5, 3.5))
    plt.plot([100 * r["achieved"] for r in un], [100 * r["test_accuracy"] for r in un], "o-", label="unstructured")
    st = [r for r in rows if r["pruning"] == "structured"]
    if st:
        plt.plot([100 * r["achieved"] for r in st], [100 * r["test_accuracy"] for r in st], "s", label="structured")
    plt.xlabel("sparsity of the pruned weights (%)")
    plt.ylabel("test accuracy (%)")
    plt.title("SimpleCNN on Fashion-MNIST, dtrain magnitude pruning")
    plt.legend()
    plt.grid(alpha=0.3)
    plt.tight_layout()
    plt.savefig(os.path.join(args.out, "prune_sweep.png"), dpi=120)


if __name__ == "__main__":
    main()
