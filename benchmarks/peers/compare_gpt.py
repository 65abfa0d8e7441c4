#!/usr/bin/python3
"""dtrain against PyTorch on the same GPT (6 layers, width 256, 8 heads, context 128, byte
vocabulary), or with --model llama the same size of Llama (2 key/value heads; the peer is
torch_llama.py), --threads each (1 by default), batch 8, AdamW: training tokens per second and peak resident memory
(/usr/bin/time -v; `--context` and `--batch` change the window and the batch), in four configurations: dtrain fp32, dtrain bf16 (`--precision bf16`: bf16
GEMM operands, fp32 accumulation, weights and optimizer), PyTorch fp32 and PyTorch bf16 autocast
(torch.autocast('cpu', dtype=torch.bfloat16)). All train on the same byte-token file (made with
`dtrain convert text` from /usr/share/games/fortunes unless --data is given). The four alternate
`--rounds` times and the best of each is kept, so background load hits all alike.

Then a learning check: dtrain trains --learn-steps steps in fp32 and in bf16 from the same seed and
compares the validation loss at the end; bf16 passes when it is within --learn-tol (relative) of
fp32. Prints markdown tables; exits 1 when the learning check fails.

`--configs` picks a subset (e.g. dtrain:fp32,dtrain:bf16,dtrain:fp16,pytorch:fp32 on a processor
without AVX512-BF16, where PyTorch's bf16 autocast crawls at under 100 tokens/s); dtrain:fp16 is
`--precision fp16` (half GEMM operands, dynamic loss scaling).

usage: benchmarks/peers/compare_gpt.py [--dtrain build/dtrain] [--data DIR] [--steps 20] [--rounds 2]
                                       [--configs dtrain:fp32,...] [--learn-steps 200] [--learn-tol 0.02]
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--layers", "6", "--width", "256", "--heads", "8"]
LLAMA = ["--kv-heads", "2"]  # --model llama: 8 query heads over 2 key/value heads
CONFIGS = [("dtrain", "fp32"), ("dtrain", "bf16"), ("pytorch", "fp32"), ("pytorch", "bf16")]


def timed(cmd, env):
    r = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    return r.stdout, int(rss.group(1)) / 1024.0 if rss else float("nan")


def dtrain_cmd(a, data, precision, steps, metrics, log_every, eval_batches):
    shape = MODEL + ["--context", str(a.context)] + (LLAMA if a.model == "llama" else [])
    return [a.dtrain, "train", "--model", a.model, "--data", data, *shape, "--batch-size", str(a.batch), "--steps", str(steps),
            "--threads", str(a.threads), "--log-every", str(log_every), "--eval-every", "0", "--eval-batches",
            str(eval_batches), "--warmup-steps", "0", "--precision", precision, "--metrics", metrics]


def run_dtrain(a, data, precision, env):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        # 3 warm-up steps logged apart from the timed ones, as the peer does.
        _, rss = timed(dtrain_cmd(a, data, precision, 3 + a.steps, metrics, 3, 1), env)
        rows = [json.loads(l) for l in open(metrics)]
        logged = [r for r in rows if "loss" in r and "tokens_per_s" in r]
        timed_rows = logged[1:]  # everything after the first 3 steps
        tps = sum(r["tokens_per_s"] for r in timed_rows) / len(timed_rows)
        return tps, rss


def run_torch(a, data, precision, env):
    out, rss = timed(["/usr/bin/python3", os.path.join(HERE, "torch_gpt.py"), "--model", a.model,
                      *(LLAMA if a.model == "llama" else []), "--context", str(a.context), "--steps", str(a.steps),
                      "--warmup", "3", "--threads", str(a.threads), "--batch", str(a.batch), "--tokens", os.path.join(data, "train.h5"), "--precision",
                      precision], env)
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"], rss


def dtrain_val_loss(a, data, precision, env):
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        timed(dtrain_cmd(a, data, precision, a.learn_steps, metrics, a.learn_steps, 16), env)
        summary = [r for r in (json.loads(l) for l in open(metrics)) if "summary" in r][-1]
        return summary["val_loss"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtrain", default=os.path.join(HERE, "..", "..", "build", "dtrain"))
    ap.add_argument("--data")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                    help="llama: dtrain's --model llama against benchmarks/peers/torch_llama.py, kv heads 2")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=128, help="tokens per window (both frameworks)")
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--learn-steps", type=int, default=200, help="steps of the bf16-vs-fp32 check (0: skip it)")
    ap.add_argument("--learn-tol", type=float, default=0.02, help="relative validation loss difference allowed")
    ap.add_argument("--configs", default=",".join(f"{f}:{p}" for f, p in CONFIGS),
                    help="comma-separated framework:precision pairs (dtrain:fp32|bf16|fp16, pytorch:fp32|bf16)")
    a = ap.parse_args()
    configs = [tuple(c.split(":")) for c in a.configs.split(",")]
    for c in configs:
        if c not in CONFIGS + [("dtrain", "fp16")]:
            sys.exit(f"--configs: unknown configuration {':'.join(c)}")
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
    tmp = None
    data = a.data
    if not data:
        tmp = tempfile.TemporaryDirectory()
        data = tmp.name
        subprocess.run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", data],
                       check=True, capture_output=True)
    best = {c: (0.0, float("inf")) for c in configs}
    for r in range(a.rounds):
        for c in configs:
            tps, rss = (run_dtrain if c[0] == "dtrain" else run_torch)(a, data, c[1], env)
            print(f"round {r + 1}: {c[0]} {c[1]}: {tps:.0f} tokens/s, peak RSS {rss:.0f} MiB", file=sys.stderr)
            best[c] = (max(best[c][0], tps), min(best[c][1], rss))

    def tps(c):
        return best[c][0]

    def rss(c):
        return best[c][1]

    shape = "Llama 6x256 (kv heads 2)" if a.model == "llama" else "GPT 6x256"
    print(f"| {shape}, ctx {a.context}, batch {a.batch}, AdamW, {a.threads} thread(s) | tokens/s | peak RSS (MiB) |")
    print("| --- | ---: | ---: |")
    names = {"dtrain": "dtrain", "pytorch": "PyTorch 1.13"}
    labels = {("dtrain", "fp32"): "fp32", ("dtrain", "bf16"): "bf16 (`--precision bf16`)",
              ("pytorch", "fp32"): "fp32", ("pytorch", "bf16"): "bf16 autocast",
              ("dtrain", "fp16"): "fp16 (`--precision fp16`)"}
    for c in configs:
        print(f"| {names[c[0]]} {labels[c]} | {tps(c):.0f} | {rss(c):.0f} |")
    print()
    print("| ratio | tokens/s | peak RSS |")
    print("| --- | ---: | ---: |")
    for num, den in ((("dtrain", "fp32"), ("pytorch", "fp32")), (("dtrain", "bf16"), ("pytorch", "fp32")),
                     (("dtrain", "fp16"), ("pytorch", "fp32")), (("dtrain", "bf16"), ("pytorch", "bf16"))):
        if num not in best or den not in best:
            continue
        print(f"| dtrain {num[1]} / PyTorch {den[1]} | {tps(num) / tps(den):.2f}x | {rss(num) / rss(den):.2f} |")

    if a.learn_steps > 0:
        v32 = dtrain_val_loss(a, data, "fp32", env)
        v16 = dtrain_val_loss(a, data, "bf16", env)
        rel = abs(v16 - v32) / v32
        ok = rel <= a.learn_tol
        print()
        print(f"| dtrain after {a.learn_steps} steps | validation loss (nats/byte) |")
        print("| --- | ---: |")
        print(f"| fp32 | {v32:.4f} |")
        print(f"| bf16 | {v16:.4f} |")
        print(f"| relative difference | {rel:.4f} ({'within' if ok else 'OUTSIDE'} {a.learn_tol}) |")
        if not ok:
            sys.exit(1)


if __name__ == "__main__":
    main()
