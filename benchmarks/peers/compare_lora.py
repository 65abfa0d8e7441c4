#!/usr/bin/python3
"""LoRA fine-tuning, dtrain against a PyTorch peer on the same pretrained Llama, data, rank and steps.

1. dtrain pretrains a small Llama (4 x 128, 4 heads over 2 key/value heads, context 128) on the
   fortunes as bytes and exports it under Hugging Face's names (base.safetensors).
2. A prompt/completion set is written from fortune lines: the prompt "lower: <line in lower
   case>\\nupper: ", the completion the line in upper case; `dtrain convert sft` tokenizes it (bytes)
   with its loss mask and holds out 10 % of the records.
3. For each seed, both fine-tune the base with LoRA (rank --rank, alpha --alpha, on q and v), every
   other weight frozen, the same steps, batch, constant learning rate and AdamW (no decay, no
   clipping), one padded sample per window, the loss the mean over completion tokens:
   - dtrain: `dtrain train --init-from base.safetensors --lora-rank ...`, evaluated by `dtrain eval`;
   - the peer: torch_llama.py loads base.safetensors strictly, a LoRA module (A uniform in
     +-1/sqrt(in), B zero, output scaled by alpha/rank) wraps q_proj and v_proj, and it reads the
     same token files with h5py.
4. The completion loss over every held-out record before (the base: dtrain eval and the peer must
   agree) and after; the tables give each side's reduction and dtrain's over the peer's:
   - independent: each side draws its own adapters' A and its own records (--seeds runs);
   - same draws: the peer starts from dtrain's initial A (read from a 1-step checkpoint, where A
     has not moved yet as B is zero) and draws dtrain's records, reproducing dtrain's sampler
     (xoshiro256** seeded per step by splitmix64), so both see the same batches (--same-seeds runs).

usage: benchmarks/peers/compare_lora.py [--dtrain build/dtrain] [--steps 200] [--seeds 3] [--same-seeds 1]
                                        [--threads 2]
"""
import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
SHAPE = ["--model", "llama", "--layers", "4", "--width", "128", "--heads", "4", "--kv-heads", "2", "--context", "128"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def dtrain_eval(a, checkpoint, data):
    out = run([a.dtrain, "eval", "--checkpoint", checkpoint, "--data", data, "--threads", str(a.threads)])
    return float(re.search(r"loss ([0-9.]+) nats", out).group(1))


def write_sft(path, records, seed):
    lines = []
    for name in sorted(os.listdir("/usr/share/games/fortunes")):
        full = os.path.join("/usr/share/games/fortunes", name)
        if "." in name or not os.path.isfile(full) or os.path.islink(full):
            continue
        for line in open(full, encoding="utf-8", errors="replace"):
            line = line.strip()
            if 20 <= len(line) <= 50 and line.isascii() and any(c.isalpha() for c in line):
                lines.append(line)
    random.Random(seed).shuffle(lines)
    with open(path, "w") as f:
        for line in lines[:records]:
            f.write(json.dumps({"prompt": f"lower: {line.lower()}\nupper: ", "completion": line.upper()}) + "\n")


# --- the peer -------------------------------------------------------------------------------------

MASK = (1 << 64) - 1


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return x, z ^ (z >> 31)


def derive_seed(seed, stream):
    return splitmix64(seed ^ ((stream * 0xD1B54A32D192ED03) & MASK))[1]


def rotl(x, k):
    return ((x << k) | (x >> (64 - k))) & MASK


class DtrainDraws:
    """dtrain's record draws on one data-parallel rank: step s's rows from xoshiro256** seeded with
    derive_seed(derive_seed(seed, 0), s), each row rejection-sampled below the record count."""

    def __init__(self, seed, rows):
        self.data_seed, self.rows, self.step, self.left, self.s = derive_seed(seed, 0), rows, 0, 0, None

    def next(self):
        s = self.s
        out = (rotl((s[1] * 5) & MASK, 7) * 9) & MASK
        t = (s[1] << 17) & MASK
        s[2] ^= s[0]
        s[3] ^= s[1]
        s[1] ^= s[2]
        s[0] ^= s[3]
        s[2] ^= t
        s[3] = rotl(s[3], 45)
        return out

    def randrange(self, n):
        if self.left == 0:
            x, self.s = derive_seed(self.data_seed, self.step), []
            for _ in range(4):
                x, z = splitmix64(x)
                self.s.append(z)
            self.step, self.left = self.step + 1, self.rows
        self.left -= 1
        limit = MASK - MASK % n
        while True:
            x = self.next()
            if x < limit:
                return x % n


def peer(a, base_file, data, seed, initial_a=None):
    """(completion loss before, after) of the peer's LoRA run; with `initial_a` (per layer, dtrain's
    fused A: q's rows, then v's) it starts from those adapters and draws dtrain's records."""
    import h5py
    import numpy as np
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from check_export import read_safetensors
    from torch_llama import from_export_metadata

    torch.manual_seed(seed)
    torch.set_num_threads(a.threads)
    tensors, meta = read_safetensors(np, base_file)
    model = from_export_metadata(meta)
    model.load_state_dict({k: torch.from_numpy(v) for k, v in tensors.items()}, strict=True)
    for p in model.parameters():
        p.requires_grad_(False)

    class LoRA(nn.Module):
        def __init__(self, base, rank, alpha, start=None):
            super().__init__()
            bound = 1.0 / math.sqrt(base.in_features)
            self.base, self.scale = base, alpha / rank
            first = torch.empty(rank, base.in_features).uniform_(-bound, bound) if start is None else start
            self.A = nn.Parameter(first)
            self.B = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + self.scale * (x @ self.A.t()) @ self.B.t()

    for i, layer in enumerate(model.model.layers):
        qa, va = (None, None) if initial_a is None else (torch.tensor(initial_a[i][:a.rank]),
                                                         torch.tensor(initial_a[i][a.rank:]))
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj, a.rank, a.alpha, qa)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj, a.rank, a.alpha, va)
    trained = [p for p in model.parameters() if p.requires_grad]

    def stream(path):
        with h5py.File(path, "r") as f:
            return f["tokens"][:].astype(np.int64), f["sample_offsets"][:], f["loss_mask"][:]

    t = model.context

    def windows(s, samples):
        tokens, offsets, mask = s
        ids = torch.zeros(len(samples), t, dtype=torch.long)
        targets = torch.full((len(samples), t), -1, dtype=torch.long)
        for i, k in enumerate(samples):
            first, end = int(offsets[k]), int(offsets[k + 1])
            n = min(end - first, t + 1)
            ids[i, :min(n, t)] = torch.from_numpy(tokens[first:first + min(n, t)])
            for j in range(1, n):
                if mask[first + j]:
                    targets[i, j - 1] = int(tokens[first + j])
        return ids, targets

    def completion_loss(s):
        model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            samples = list(range(len(s[1]) - 1))
            for at in range(0, len(samples), 64):
                ids, targets = windows(s, samples[at:at + 64])
                total += F.cross_entropy(model(ids), targets.reshape(-1), ignore_index=-1, reduction="sum").item()
                count += int((targets >= 0).sum())
        model.train()
        return total / count

    train, val = stream(os.path.join(data, "train.h5")), stream(os.path.join(data, "val.h5"))
    before = completion_loss(val)
    opt = torch.optim.AdamW(trained, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    draw = random.Random(seed) if initial_a is None else DtrainDraws(seed, a.batch)
    for _ in range(a.steps):
        ids, targets = windows(train, [draw.randrange(len(train[1]) - 1) for _ in range(a.batch)])
        loss = F.cross_entropy(model(ids), targets.reshape(-1), ignore_index=-1)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, completion_loss(val)


# --- dtrain -------------------------------------------------------------------------------------------

def dtrain_lora(a, work, base_file, data, seed, steps):
    """The checkpoint folder of dtrain's LoRA run of `steps` steps."""
    out = os.path.join(work, f"lora{seed}-{steps}")
    run([a.dtrain, "train", *SHAPE, "--data", data, "--init-from", base_file, "--lora-rank", str(a.rank),
         "--lora-alpha", str(a.alpha), "--lora-targets", "q,v", "--steps", str(steps), "--batch-size",
         str(a.batch), "--lr", str(a.lr), "--min-lr", str(a.lr), "--warmup-steps", "0", "--weight-decay",
         "0", "--clip-grad-norm", "0", "--beta2", "0.999", "--eval-every", "0", "--seed", str(seed),
         "--threads", str(a.threads), "--checkpoint-dir", out])
    return out


def initial_adapters(checkpoint_dir):
    """Each layer's fused A of a dtrain checkpoint (after 1 step B has moved, A not yet)."""
    import h5py
    import numpy as np
    name = sorted(f for f in os.listdir(checkpoint_dir) if f.endswith(".h5"))[-1]
    with h5py.File(os.path.join(checkpoint_dir, name), "r") as f:
        keys = sorted((k for k in f["param"].keys() if k.endswith("qkv.lora_A")), key=lambda k: int(k.split(".")[1]))
        return [np.array(f["param"][k]) for k in keys]


def table(title, rows):
    print(f"\n{title}\n")
    print("| seed | base (dtrain eval) | base (peer) | dtrain after | peer after | dtrain drop | peer drop |"
          " drop ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for seed, b, pb, d, p in rows:
        print(f"| {seed} | {b:.4f} | {pb:.4f} | {d:.4f} | {p:.4f} | {b - d:.4f} | {pb - p:.4f} |"
              f" {(b - d) / (pb - p):.3f} |")
    d_drop = sum(b - d for _, b, _, d, _ in rows) / len(rows)
    p_drop = sum(pb - p for _, _, pb, _, p in rows) / len(rows)
    print(f"| mean | | | | | {d_drop:.4f} | {p_drop:.4f} | {d_drop / p_drop:.3f} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtrain", default=os.path.join(HERE, "..", "..", "build", "dtrain"))
    ap.add_argument("--pretrain-steps", type=int, default=400)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--seeds", type=int, default=3, help="runs with independent A and draws")
    ap.add_argument("--same-seeds", type=int, default=1, help="runs where the peer takes dtrain's A and draws")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", help="keep the files here (default: a temporary folder)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = a.work or tmp
        os.makedirs(work, exist_ok=True)
        text, sft = os.path.join(work, "text"), os.path.join(work, "sft")
        run([a.dtrain, "convert", "text", "--inputs", "/usr/share/games/fortunes", "--out", text])
        run([a.dtrain, "train", *SHAPE, "--data", text, "--steps", str(a.pretrain_steps), "--batch-size", "16",
             "--eval-every", "0", "--threads", str(a.threads), "--checkpoint-dir", os.path.join(work, "base")])
        base_file = os.path.join(work, "base.safetensors")
        run([a.dtrain, "export", "--checkpoint", os.path.join(work, "base"), "--out", base_file])
        write_sft(os.path.join(work, "sft.jsonl"), a.records, 1)
        run([a.dtrain, "convert", "sft", "--inputs", os.path.join(work, "sft.jsonl"), "--out", sft])
        base_dtrain = dtrain_eval(a, os.path.join(work, "base"), sft)
        rows, same = [], []
        for seed in range(1, a.seeds + 1):
            d_after = dtrain_eval(a, dtrain_lora(a, work, base_file, sft, seed, a.steps), sft)
            p_before, p_after = peer(a, base_file, sft, seed)
            rows.append((seed, base_dtrain, p_before, d_after, p_after))
            print(f"independent, seed {seed}: base {base_dtrain:.4f} (peer {p_before:.4f}); after {a.steps} steps "
                  f"dtrain {d_after:.4f}, peer {p_after:.4f}", flush=True)
        for seed in range(1, a.same_seeds + 1):
            d_after = dtrain_eval(a, dtrain_lora(a, work, base_file, sft, seed, a.steps), sft)
            start = initial_adapters(dtrain_lora(a, work, base_file, sft, seed, 1))
            p_before, p_after = peer(a, base_file, sft, seed, start)
            same.append((seed, base_dtrain, p_before, d_after, p_after))
            print(f"same draws, seed {seed}: after {a.steps} steps dtrain {d_after:.4f}, peer {p_after:.4f}",
                  flush=True)
        setup = (f"LoRA rank {a.rank}, alpha {a.alpha:g}, q and v; {a.steps} steps of {a.batch} records, "
                 f"lr {a.lr:g}; completion loss (nats/token) over every held-out record.")
        if rows:
            table(f"Independent adapters' A and record draws. {setup}", rows)
        if same:
            table(f"The same initial A and the same records every step (the peer draws as dtrain). {setup}", same)
        rows += same
        agree = max(abs(b - pb) for _, b, pb, _, _ in rows)
        print(f"\nbase loss, dtrain eval against the peer: max difference {agree:.2e}")
        if agree > 1e-3:
            sys.exit("the two sides do not start from the same model and data")


if __name__ == "__main__":
    main()
