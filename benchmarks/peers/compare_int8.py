#!/usr/bin/python3
"""dtrain's int8 inference against PyTorch's, side by side in one run: the same trained SimpleCNN
checkpoint evaluated on the Fashion-MNIST test set by `dtrain eval --int8` (oneDNN int8 kernels,
calibrated on the first 10 training batches of 256) and by torch_int8_simple_cnn.py (PyTorch 1.13
eager-mode static post-training quantization of the same weights, calibrated on the same batches,
every quantized engine the build has). Per thread count the two alternate --repeats times, so
background load hits both alike; every run's forward throughput is kept, with the 1-minute load
average before it, and the table gives each run, the medians and their ratios (dtrain / PyTorch,
against the faster PyTorch engine).

usage: benchmarks/peers/compare_int8.py --checkpoint CKPT [--dtrain build/dtrain]
           [--data data/fashion-mnist] [--threads 1 2] [--repeats 3] [--out runs/compare_int8]
"""
import argparse
import csv
import json
import os
import re
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
LINE = re.compile(r"^(fp32|int8)\s+accuracy ([0-9.]+)%, loss [0-9.]+, \d+ samples, forward [0-9.]+ s, "
                  r"(\d+) samples/s", re.M)


def run(cmd):
    lock = ["flock", os.environ["DTRAIN_BENCH_LOCK"]] if os.environ.get("DTRAIN_BENCH_LOCK") else []
    r = subprocess.run(lock + cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def dtrain_rows(args, threads):
    out = run([args.dtrain, "eval", "--checkpoint", args.checkpoint, "--data", os.path.join(args.data, "test"),
               "--int8", "--calibration-data", os.path.join(args.data, "train"), "--threads", str(threads)])
    return [{"framework": "dtrain", "engine": "oneDNN", "precision": m[0], "test_accuracy": float(m[1]) / 100,
             "samples_per_s": float(m[2])} for m in LINE.findall(out)]


def torch_rows(args, threads):
    out = run(["/usr/bin/python3", os.path.join(HERE, "torch_int8_simple_cnn.py"), "--checkpoint", args.checkpoint,
               "--data", args.data, "--threads", str(threads)])
    rows = [json.loads(l) for l in out.splitlines() if l.startswith("{")]
    return [{"framework": "pytorch " + r["torch"], "engine": r["engine"], "precision": r["precision"],
             "test_accuracy": r["test_accuracy"], "samples_per_s": r["samples_per_s"]}
            for r in rows if "error" not in r]


def processor():
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = re.search(r"Model name:\s*(.+)", out)
    return name.group(1).strip() if name else "unknown processor"


def table(rows, thread_counts):
    lines = ["| threads | framework | engine | precision | test accuracy | samples/s, each run | median | dtrain / this |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for threads in thread_counts:
        sel = [r for r in rows if r["threads"] == threads]
        keys = list(dict.fromkeys((r["framework"], r["engine"], r["precision"]) for r in sel))
        med = {k: statistics.median(r["samples_per_s"] for r in sel if (r["framework"], r["engine"], r["precision"])
                                    == k) for k in keys}
        ours = {p: med.get(("dtrain", "oneDNN", p)) for p in ("fp32", "int8")}
        for k in keys:
            runs = [r for r in sel if (r["framework"], r["engine"], r["precision"]) == k]
            each = ", ".join(f"{r['samples_per_s']:.0f}" for r in runs)
            ratio = f"{ours[k[2]] / med[k]:.2f}x" if k[0] != "dtrain" and ours[k[2]] else ""
            lines.append(f"| {threads} | {k[0]} | {k[1]} | {k[2]} | {100 * runs[0]['test_accuracy']:.2f} % | {each} "
                         f"| {med[k]:.0f} | {ratio} |")
    return lines


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    p.add_argument("--data", default=os.path.join(ROOT, "data", "fashion-mnist"))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "compare_int8"))
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for threads in args.threads:
        for rep in range(args.repeats):
            for side in (dtrain_rows, torch_rows):
                load = os.getloadavg()[0]
                for r in side(args, threads):
                    rows.append(dict(r, threads=threads, repeat=rep + 1, load_before=load))
                    print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "compare_int8.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    loads = [r["load_before"] for r in rows]
    lines = [f"SimpleCNN inference on the Fashion-MNIST test set, batch 256, {processor()}; "
             f"{args.repeats} alternating runs per thread count, load average (1 min) before them "
             f"{min(loads):.1f} to {max(loads):.1f}", ""] + table(rows, args.threads)
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(args.out, "compare_int8.md"), "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
