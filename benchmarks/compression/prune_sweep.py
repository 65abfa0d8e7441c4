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
import os

from runs import add_common_args, train, write_table


def prune_run(args, sparsity, structured):
    tag = f"{'structured' if structured else 'unstructured'}-{sparsity:g}"
    summary = train(args, tag, ["--prune-sparsity", sparsity, "--prune-structured",
                                "true" if structured else "false"])
    return {"pruning": "structured" if structured else "unstructured", "sparsity": sparsity,
            "achieved": summary.get("sparsity", 0.0), "test_accuracy": summary["test_accuracy"],
            "samples_per_s": summary["samples_per_s"]}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, "prune_sweep")
    p.add_argument("--sparsity", type=float, nargs="+", default=[0, 0.5, 0.8, 0.9, 0.95])
    p.add_argument("--structured", type=float, nargs="*", default=[0.5])
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = [prune_run(args, s, False) for s in args.sparsity] + [prune_run(args, s, True) for s in args.structured]
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
    write_table(args.out, "prune_sweep.md", lines)
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
