#!/usr/bin/env python3
"""Checkpoint stall: the training loop's time in checkpoints, written in the loop against written in
the background (--checkpoint-async), for the GPT example (examples/gpt_fortunes.ini) on the fortunes.

Each repeat runs both modes one after the other (same steps, same checkpoint interval, a fresh
checkpoint directory), so both see the same machine load. The stall is the run summary's
checkpoint_stall_s: from entering a checkpoint to the loop going on, including a wait for the
previous background write. Reports per mode the median over repeats of the stall per checkpoint,
the background write's duration (from the log) and the throughput, and the ratio async / sync,
against the target of 20 %. Writes OUT/stall.md.

  benchmarks/checkpoint/async_stall.py --dtrain build/dtrain --out runs/ckpt-stall
Exit status 0 when the ratio is within --target, 1 otherwise.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def prepare_data(args):
    data = os.path.join(args.out, "fortunes")
    if not os.path.isfile(os.path.join(data, "train.h5")):
        subprocess.run([args.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data],
                       check=True, stdout=subprocess.DEVNULL)
    return data


def run(args, data, mode, repeat):
    """One training; returns {stall_s, checkpoints, write_s (list), tokens_per_s}."""
    out = os.path.join(args.out, f"{mode}-{repeat}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    metrics = os.path.join(out, "metrics.jsonl")
    cmd = [args.dtrain, "train", "--config", os.path.join(ROOT, "examples", "gpt_fortunes.ini"), "--data", data,
           "--steps", str(args.steps), "--checkpoint-every", str(args.every), "--checkpoint-dir",
           os.path.join(out, "ckpt"), "--keep-checkpoints", "2", "--metrics", metrics, "--eval-every", "0",
           "--progress", "off", "--threads", str(args.threads), "--checkpoint-async",
           "true" if mode == "async" else "false"]
    if args.ranks > 1:
        cmd = ["mpirun", "-n", str(args.ranks), "--bind-to", "none"] + cmd
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    with open(os.path.join(out, "train.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{mode}: the training failed (status {proc.returncode}); see {out}/train.log")
    summary = [json.loads(line) for line in open(metrics) if '"summary": "run"' in line][-1]
    writes = [float(w) for w in re.findall(r"written in the background in ([0-9.]+) s", proc.stdout)]
    syncs = [float(w) for w in re.findall(r"^checkpoint \S+ \(([0-9.]+) s\)$", proc.stdout, re.M)]
    return {"stall_s": summary["checkpoint_stall_s"], "checkpoints": args.steps // args.every,
            "write_s": writes or syncs, "tokens_per_s": summary.get("tokens_per_s", 0.0)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "ckpt-stall"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--every", type=int, default=25, help="steps between checkpoints")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ranks", type=int, default=1)
    ap.add_argument("--target", type=float, default=0.20, help="largest async/sync stall ratio that passes")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = prepare_data(args)
    runs = {"sync": [], "async": []}
    for r in range(args.repeats):
        for mode in runs:
            runs[mode].append(run(args, data, mode, r))
    per_ckpt = {m: statistics.median(x["stall_s"] / x["checkpoints"] for x in v) for m, v in runs.items()}
    write = {m: statistics.median(w for x in v for w in x["write_s"]) if any(x["write_s"] for x in v) else 0.0
             for m, v in runs.items()}
    speed = {m: statistics.median(x["tokens_per_s"] for x in v) for m, v in runs.items()}
    ratio = per_ckpt["async"] / per_ckpt["sync"]
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    lines = ["# Checkpoint stall: in the loop against in the background\n",
             f"GPT example, {args.steps} steps, a checkpoint every {args.every} ({args.steps // args.every} per run), "
             f"{args.ranks} rank(s) x {args.threads} thread(s), median of {args.repeats} repeats run side by side; "
             f"{cpu}, {os.cpu_count()} cores.\n",
             "| mode | stall per checkpoint (ms) | write (ms) | tokens/s |", "| --- | ---: | ---: | ---: |"]
    for m in runs:
        lines.append(f"| {m} | {1e3 * per_ckpt[m]:.1f} | {1e3 * write[m]:.1f} | {speed[m]:.0f} |")
    lines.append(f"\nStall async / sync: {100 * ratio:.1f} % (target <= {100 * args.target:.0f} %).\n")
    with open(os.path.join(args.out, "stall.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
