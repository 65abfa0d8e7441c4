#!/usr/bin/python3
"""Data-parallel weak scaling, dtrain against PyTorch DDP (gloo), side by side in one run:
SimpleCNN, synthetic batches of 64 per rank, 1 thread per rank, 1 -> 2 ranks under mpirun.
Scaling efficiency = samples/s at N ranks / (N x samples/s at 1 rank). Rounds alternate between
the frameworks and the best of each is kept. Also measured, on dtrain only:
  - the share of allreduce time hidden behind backward: ResNet-20 with small buckets, comm wait
    with overlap against comm wait with every bucket sent after backward;
  - bytes each rank puts on the wire per step, for each compressor.

usage: benchmarks/peers/compare_ddp_scaling.py [--dtrain build/dtrain] [--rounds 3]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ENV = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")


def mpirun(np):
    # One core per rank: Open MPI's default binding for <= 2 ranks, and what "1 thread per rank" means.
    return ["mpirun", "-n", str(np), "--oversubscribe", "--bind-to", "core" if np <= os.cpu_count() else "none"]


def dtrain(args, np, extra, steps=300):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        cmd = mpirun(np) + [args.dtrain, "train", "--progress", "off", "--threads", "1", "--steps", str(steps),
                            "--log-every", str(steps), "--metrics", metrics] + extra
        r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
        if r.returncode:
            sys.exit(f"dtrain failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
        lines = [json.loads(l) for l in open(metrics)]
        return lines


def independent_pair(args, extra, steps=300):
    """Two 1-rank dtrain jobs at once, one per core, no communication at all: the most two ranks
    can do on this machine (shared caches and memory bandwidth), the ceiling for weak scaling."""
    procs, files = [], []
    tmp = tempfile.mkdtemp()
    for core in (0, 1):
        m = os.path.join(tmp, f"m{core}.jsonl")
        files.append(m)
        cmd = ["taskset", "-c", str(core), args.dtrain, "train", "--progress", "off", "--threads", "1", "--steps",
               str(steps), "--log-every", str(steps), "--metrics", m] + extra
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV))
    for p in procs:
        p.wait()
    return sum([json.loads(l) for l in open(m)][-1]["samples_per_s"] for m in files)


def torch_ddp(np, batch):
    cmd = mpirun(np) + ["/usr/bin/python3", os.path.join(HERE, "torch_ddp_simple_cnn.py"), "--batch-size", str(batch)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if r.returncode:
        sys.exit(f"torch failed:\n{r.stdout}\n{r.stderr}")
    return json.loads([l for l in r.stdout.splitlines() if l.startswith("{")][-1])["samples_per_s"]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtrain", default="build/dtrain")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    cnn = ["--synthetic", "--model", "simple_cnn", "--batch-size", str(args.batch), "--lr", "0.01",
           "--lr-schedule", "constant"]
    best = {}
    for _ in range(args.rounds):
        for np in (1, 2):
            d = dtrain(args, np, cnn)[-1]["samples_per_s"]
            t = torch_ddp(np, args.batch)
            best[("dtrain", np)] = max(best.get(("dtrain", np), 0), d)
            best[("torch", np)] = max(best.get(("torch", np), 0), t)
        best["pair"] = max(best.get("pair", 0), independent_pair(args, cnn))
    print(f"## Weak scaling, SimpleCNN, batch {args.batch}/rank, 1 thread/rank, best of {args.rounds}\n")
    print("| framework | 1 rank samples/s | 2 ranks samples/s | efficiency |")
    print("|---|---|---|---|")
    for fw in ("dtrain", "torch"):
        one, two = best[(fw, 1)], best[(fw, 2)]
        print(f"| {'dtrain' if fw == 'dtrain' else 'PyTorch DDP (gloo)'} | {one:.0f} | {two:.0f} | {two / (2 * one):.1%} |")
    one = best[("dtrain", 1)]
    print(f"| two independent 1-rank dtrain jobs, one per core, no communication | {one:.0f} | {best['pair']:.0f} "
          f"| {best['pair'] / (2 * one):.1%} |")
    print(f"\ndtrain / PyTorch DDP throughput at 2 ranks: {best[('dtrain', 2)] / best[('torch', 2)]:.2f}x; "
          f"dtrain's 2 ranks reach {best[('dtrain', 2)] / best['pair']:.1%} of the no-communication ceiling\n")

    # Overlap: ResNet-20 (1.1 MB of gradients) in 0.125 MiB buckets on 2 ranks.
    res = ["--synthetic", "--synthetic-shape", "3,32,32", "--model", "resnet20", "--batch-size", "32",
           "--bucket-mb", "0.125", "--lr", "0.01", "--lr-schedule", "constant"]
    waits = {}
    for ov in ("true", "false"):
        lines = dtrain(args, 2, res + ["--overlap", ov], steps=40)
        waits[ov] = lines[-2]["comm_wait_s"]
        step = lines[-2]["step_time_s"]
    hidden = 1 - waits["true"] / waits["false"] if waits["false"] > 0 else float("nan")
    print("## Overlap (ResNet-20, 32x32, batch 32/rank, 0.125 MiB buckets, 2 ranks)\n")
    print(f"comm wait per step: {1e3 * waits['false']:.2f} ms with every bucket sent after backward, "
          f"{1e3 * waits['true']:.2f} ms with overlap; share hidden behind backward {hidden:.0%} "
          f"(step {1e3 * step:.1f} ms)\n")

    print("## Bytes on the wire per step and rank (SimpleCNN, 2 ranks)\n")
    print("| compression | bytes/step | vs none |")
    print("|---|---|---|")
    base = None
    for c in ("none", "fp16", "bf16", "topk:0.01", "powersgd:2", "sign", "qsgd:16"):
        # --compression-warmup 0: the steady state (top-k starts dense otherwise)
        b = dtrain(args, 2, cnn + ["--compression", c, "--compression-warmup", "0"], steps=20)[-2]["bytes_sent_per_step"]
        base = base or b
        print(f"| {c} | {b} | {b / base:.3f} |")


if __name__ == "__main__":
    main()
