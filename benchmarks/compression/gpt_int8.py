#!/usr/bin/env python3
"""Weight-only int8 for the GPT: the example GPT (examples/gpt_fortunes.ini) trained for --steps on
the fortunes, then, side by side in one run on the same checkpoint:
  - `dtrain eval --int8`: validation loss and bits per byte, fp32 against int8 weights, forward time;
  - `dtrain generate` with and without --int8: wall time for --tokens bytes (the same seed), and the
    process's peak resident memory, alternated --repeats times (medians).
Writes OUT/gpt_int8.md.

  benchmarks/compression/gpt_int8.py --dtrain build/dtrain --out runs/gpt_int8
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def sh(cmd, **kw):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True, **kw)


def timed_generate(args, ckpt, int8):
    """(seconds, peak resident MiB, text) of one `dtrain generate` (os.wait4: that child's own rusage)."""
    cmd = [args.dtrain, "generate", "--checkpoint", ckpt, "--prompt", "The ", "--tokens", str(args.tokens),
           "--seed", "3", "--threads", str(args.threads)] + (["--int8"] if int8 else [])
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    text = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    t = time.time() - t0
    if status != 0:
        raise SystemExit(f"generate failed (status {status}): {' '.join(cmd)}")
    return t, usage.ru_maxrss / 1024.0, text


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "gpt_int8"))
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = os.path.join(args.out, "fortunes")
    if not os.path.isfile(os.path.join(data, "val.h5")):
        sh([args.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data])
    ckpt = os.path.join(args.out, "ckpt")
    if not os.path.isdir(ckpt):
        sh([args.dtrain, "train", "--config", os.path.join(ROOT, "examples", "gpt_fortunes.ini"), "--data", data,
            "--steps", str(args.steps), "--checkpoint-dir", ckpt, "--metrics", os.path.join(args.out, "train.jsonl"),
            "--progress", "off", "--threads", str(args.threads)])
    ev = sh([args.dtrain, "eval", "--checkpoint", ckpt, "--data", data, "--batch-size", "32", "--int8",
             "--threads", str(args.threads)]).stdout
    times, rss, samples = {False: [], True: []}, {False: [], True: []}, {}
    for _ in range(args.repeats):
        for int8 in (False, True):
            t, mib, text = timed_generate(args, ckpt, int8)
            times[int8].append(t)
            rss[int8].append(mib)
            samples[int8] = text
    rss = {k: statistics.median(v) for k, v in rss.items()}
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    t32, t8 = statistics.median(times[False]), statistics.median(times[True])
    lines = ["# Weight-only int8 for the GPT example\n",
             f"{cpu}, {os.cpu_count()} cores, {args.threads} thread(s); the example GPT after {args.steps} steps.\n",
             "```", ev.strip(), "```\n",
             "| generate | wall s (median of %d) | tokens/s | peak RSS MiB |" % args.repeats, "| --- | ---: | ---: | ---: |",
             f"| fp32 | {t32:.2f} | {args.tokens / t32:.1f} | {rss[False]:.1f} |",
             f"| int8 weights | {t8:.2f} | {args.tokens / t8:.1f} | {rss[True]:.1f} |",
             f"\nSpeed-up {t32 / t8:.2f}x. Samples (seed 3):\n", "fp32: `" + samples[False][:120].replace("\n", " ") + "`",
             "", "int8: `" + samples[True][:120].replace("\n", " ") + "`\n"]
    with open(os.path.join(args.out, "gpt_int8.md"), "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
