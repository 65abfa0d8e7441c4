#!/usr/bin/python3
"""dtrain against PyTorch on the same GPT (6 layers, width 256, 8 heads, context 128, byte
vocabulary), 1 thread each, batch 8, AdamW: training tokens per second and peak resident memory
(/usr/bin/time -v). Both train on the same byte-token file (made with `dtrain convert text` from
/usr/share/games/fortunes unless --data is given). The two alternate `--rounds` times and the best
of each is kept, so background load hits both alike. Prints a markdown table.

usage: benchmarks/peers/compare_gpt.py [--dtrain build/dtrain] [--data DIR] [--steps 20] [--rounds 2]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--layers", "6", "--width", "256", "--heads", "8", "--context", "128"]


def timed(cmd, env):
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return r.stdout, int(rss.group(1)) / 1024.0 if rss else float("nan")


def run_dtrain(a, data, env):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        # 3 warm-up steps logged apart from the timed ones, as the peer does.
        steps = 3 + a.steps
        cmd = [a.dtrain, "train", "--model", "gpt", "--data", data, *MODEL, "--batch-size", "8", "--steps",
               str(steps), "--threads", "1", "--log-every", "3", "--eval-every", "0", "--eval-batches", "1",
               "--warmup-steps", "0", "--metrics", metrics]
        _, rss = timed(cmd, env)
        rows = [json.loads(l) for l in open(metrics)]
        logged = [r for r in rows if "loss" in r and "tokens_per_s" in r]
        timed_rows = logged[1:]  # everything after the first 3 steps
        tps = sum(r["tokens_per_s"] for r in timed_rows) / len(timed_rows)
        return tps, rss


def run_torch(a, data, env):
    out, rss = timed(["/usr/bin/python3", os.path.join(HERE, "torch_gpt.py"), "--steps", str(a.steps), "--warmup",
                      "3", "--threads", "1", "--batch", "8", "--tokens", os.path.join(data, "train.h5")], env)
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"], rss


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", default=os.path.join(HERE, "..", "..", "build", "dtrain"))
    ap.add_argument("--data")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tmp = None
    data = a.data
    if not data:
        tmp = tempfile.TemporaryDirectory()
        data = tmp.name
        subprocess.run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data],
                       check=True, capture_output=True)
    best = {"dtrain": (0.0, float("inf")), "pytorch": (0.0, float("inf"))}
    for _ in range(a.rounds):
        for name, fn in (("dtrain", run_dtrain), ("pytorch", run_torch)):
            tps, rss = fn(a, data, env)
            best[name] = (max(best[name][0], tps), min(best[name][1], rss))
    d, p = best["dtrain"], best["pytorch"]
    print("| GPT 6x256, ctx 128, batch 8, AdamW, 1 thread | tokens/s | peak RSS (MiB) |")
    print("| --- | ---: | ---: |")
    print(f"| dtrain | {d[0]:.0f} | {d[1]:.0f} |")
    print(f"| PyTorch 1.13 | {p[0]:.0f} | {p[1]:.0f} |")
    print(f"| dtrain / PyTorch | {d[0] / p[0]:.2f}x | {d[1] / p[1]:.2f} |")


if __name__ == "__main__":
    main()
