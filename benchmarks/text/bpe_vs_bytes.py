#!/usr/bin/env python3
"""A GPT on a SentencePiece BPE vocabulary against the byte-level GPT, at equal training compute, on
the fortunes (Debian's `fortunes`).

Both take the example's shape and recipe (examples/gpt_fortunes.ini: 4 blocks of width 128, windows
of 128 tokens, batch 16). The byte model trains --steps steps; the BPE model as many steps as the
same multiply-adds allow: per token the blocks cost L * (12 w^2 + 2 T w) and the tied head V * w +
10 w (the cost model of nn::gpt_costs), so the larger vocabulary makes a BPE step dearer. Each
final checkpoint is then evaluated by `dtrain eval` on its own validation stream, the same held-out
text (the split is by bytes, before tokenizing): bits per byte of text are comparable across
tokenizers. Writes OUT/bpe_vs_bytes.md.

  benchmarks/text/bpe_vs_bytes.py --dtrain build/dtrain --out runs/bpe_vs_bytes [--steps 1000] [--vocab-size 1024]
"""
import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FORTUNES = "/usr/share/games/fortunes"
LAYERS, WIDTH, CONTEXT, BATCH = 4, 128, 128, 16  # examples/gpt_fortunes.ini


def sh(cmd):
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def macs_per_token(vocab):
    """Forward multiply-adds per token (nn::gpt_costs); training is about three times this."""
    block = 12.0 * WIDTH * WIDTH + 2.0 * CONTEXT * WIDTH
    return LAYERS * block + vocab * WIDTH + 10.0 * WIDTH + 2.0 * WIDTH


def convert(args, name, extra):
    out = os.path.join(args.out, "data-" + name)
    line = sh([args.dtrain, "convert", "text", "--inputs", FORTUNES, "--out", out] + extra).strip().splitlines()[-1]
    m = re.search(r"(\d+) train tokens \((\d+) bytes\), (\d+) validation tokens \((\d+) bytes\).*vocabulary (\d+)",
                  line)
    return out, {"train_tokens": int(m[1]), "train_bytes": int(m[2]), "val_tokens": int(m[3]),
                 "val_bytes": int(m[4]), "vocab": int(m[5])}


def train_and_eval(args, name, data, steps):
    run = os.path.join(args.out, name)
    t0 = time.time()
    sh([args.dtrain, "train", "--config", os.path.join(ROOT, "examples", "gpt_fortunes.ini"), "--data", data,
        "--steps", str(steps), "--eval-every", "0", "--progress", "off", "--threads", str(args.threads),
        "--metrics", run + ".jsonl", "--checkpoint-dir", run, "--checkpoint-every", str(steps)])
    seconds = time.time() - t0
    out = sh([args.dtrain, "eval", "--checkpoint", run, "--data", data, "--batch-size", "16",
              "--threads", str(args.threads)])
    m = re.search(r"fp32\s+loss ([\d.]+) nats/token, ([\d.]+) bits/byte", out)
    return {"nats": float(m[1]), "bpb": float(m[2]), "seconds": seconds}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(ROOT, "build", "dtrain"))
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "bpe_vs_bytes"))
    ap.add_argument("--steps", type=int, default=1000, help="steps of the byte-level model")
    ap.add_argument("--vocab-size", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)

    rows = []
    for name, extra in (("bytes", []), ("bpe", ["--tokenizer", "bpe", "--vocab-size", str(args.vocab_size)])):
        data, stats = convert(args, name, extra)
        macs = macs_per_token(stats["vocab"])
        steps = args.steps if name == "bytes" else int(round(args.steps * macs_per_token(256) / macs))
        result = train_and_eval(args, name, data, steps)
        rows.append(dict(name=name, steps=steps, macs=macs, **stats, **result))

    with open(os.path.join(args.out, "bpe_vs_bytes.md"), "w") as f:
        f.write("| tokenizer | vocabulary | bytes/token | steps | tokens trained | text bytes trained | "
                "forward MACs/token | training MACs (x 1e12) | val bits/byte | val nats/token | train s |\n")
        f.write("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
        for r in rows:
            per_token = r["train_bytes"] / r["train_tokens"]
            tokens = r["steps"] * BATCH * CONTEXT
            f.write("| %s | %d | %.2f | %d | %d | %.0f | %.0f | %.2f | %.4f | %.4f | %.0f |\n"
                    % (r["name"], r["vocab"], per_token, r["steps"], tokens, tokens * per_token, r["macs"],
                       3 * r["macs"] * tokens / 1e12, r["bpb"], r["nats"], r["seconds"]))
    print(open(os.path.join(args.out, "bpe_vs_bytes.md")).read())


if __name__ == "__main__":
    main()
