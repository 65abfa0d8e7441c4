#!/usr/bin/python3
"""The dtrain GPT in PyTorch 1.13: byte vocabulary, token + position embedding N(0, 0.02), pre-LN
blocks (causal self-attention with a fused qkv projection, GELU MLP 4x), final LayerNorm, tied
unembedding; nn.Linear keeps PyTorch's default init, as dtrain's. Trains on windows of a byte
stream (an HDF5 token file from `dtrain convert text`, or random bytes) with AdamW (beta2 0.95)
and prints one JSON line: tokens per second over the timed steps (after warm-up steps).
--precision bf16 runs forward and loss under torch.autocast(device, dtype=torch.bfloat16) (bf16
matmuls, fp32 master weights and optimizer), PyTorch's own mixed precision; --device cuda trains
on a GPU, where --precision fp32 turns TF32 off and tf32 turns it on, and fp16 runs autocast to
float16 with GradScaler's dynamic loss scaling.

On a PyTorch 2 host --sdpa, --compile and --fused-adamw give PyTorch's fast paths
(benchmarks/gpu/lm_vs_pytorch.sh); --val-batches reports a validation loss after training.

usage: torch_gpt.py [--model gpt|llama] [--kv-heads 2] [--layers 6] [--width 256] [--heads 8] [--context 128] [--batch 8]
                    [--steps 20] [--warmup 3] [--threads 1] [--tokens FILE.h5|FILE.npy] [--precision fp32|tf32|bf16|fp16]
                    [--device cpu|cuda] [--vocab 256] [--sdpa] [--compile] [--fused-adamw] [--val-batches N]
"""
import argparse
import contextlib
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


FUSED_ATTENTION = False  # --sdpa


class Attention(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.h = h
        self.qkv = nn.Linear(c, 3 * c)
        self.proj = nn.Linear(c, c)

    def forward(self, x):  # x (B, T, C)
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.h, c // self.h).transpose(1, 2) for z in (q, k, v))  # (B, H, T, hd)
        if FUSED_ATTENTION:  # PyTorch 2's fused kernels (flash / memory-efficient), no [T, T] tensor
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.proj(y.transpose(1, 2).reshape(b, t, c))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.h)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, c, h):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(c), Attention(c, h)
        self.ln2, self.fc, self.fc2 = nn.LayerNorm(c), nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))  # as dtrain and GPT-2


class Gpt(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, width) * 0.02)
        self.wpe = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids):  # ids (B, T) -> logits (B*T, V)
        x = self.wte[ids] + self.wpe[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln_f(x).reshape(-1, x.shape[-1]) @ self.wte.t()


def load_tokens(path):  # an HDF5 token file of dtrain convert text, or its tokens as .npy
    if path.endswith(".npy"):  # where h5py is missing
        import numpy
        return torch.from_numpy(numpy.load(path).astype("int64"))
    import h5py
    with h5py.File(path, "r") as f:
        return torch.from_numpy(f["tokens"][:].astype("int64"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--model", choices=["gpt", "llama"], default="gpt",
                    help="llama: torch_llama.py's Llama (RMSNorm, rotary, SwiGLU, --kv-heads, untied)")
    ap.add_argument("--kv-heads", type=int, default=0, help="llama: key/value heads (0: --heads)")
    ap.add_argument("--mlp-width", type=int, default=0, help="llama: MLP width (0: 8/3 of the width rounded up to 32)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", help="HDF5 token file (dtrain convert text) or its tokens as .npy; random bytes otherwise")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--vocab", type=int, default=256, help="vocabulary (token ids of --tokens must be below it)")
    ap.add_argument("--sdpa", action="store_true",
                    help="attention through F.scaled_dot_product_attention (PyTorch 2; refused where missing)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (PyTorch 2; refused where missing)")
    ap.add_argument("--fused-adamw", action="store_true", help="AdamW(fused=True) (PyTorch 2 on cuda)")
    ap.add_argument("--val-batches", type=int, default=0,
                    help="after training, the mean loss over this many fixed batches of --val-tokens (or --tokens)")
    ap.add_argument("--val-tokens", help="HDF5 token file to validate on (default: --tokens)")
    ap.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default="fp32",
                    help="fp32 (on cuda: TF32 off), tf32 (cuda only), bf16 autocast, or fp16 autocast with "
                         "GradScaler's dynamic loss scaling (cuda only)")
    a = ap.parse_args()
    if a.sdpa and not hasattr(F, "scaled_dot_product_attention"):
        ap.error(f"--sdpa: PyTorch {torch.__version__} has no F.scaled_dot_product_attention")
    if a.compile and not hasattr(torch, "compile"):
        ap.error(f"--compile: PyTorch {torch.__version__} has no torch.compile")
    global FUSED_ATTENTION
    FUSED_ATTENTION = a.sdpa
    dev = torch.device(a.device)
    if a.precision in ("tf32", "fp16") and dev.type != "cuda":
        ap.error(f"--precision {a.precision} needs --device cuda")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = a.precision == "tf32"
        torch.backends.cudnn.allow_tf32 = a.precision == "tf32"
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.precision)
    autocast = torch.autocast(dev.type, dtype=half) if half else contextlib.nullcontext()
    scaler = torch.cuda.amp.GradScaler(enabled=a.precision == "fp16")
    torch.set_num_threads(a.threads)
    torch.manual_seed(1)
    stream = load_tokens(a.tokens) if a.tokens else torch.randint(0, 256, (1 << 20,))
    if a.model == "llama":  # the same shape as dtrain's --model llama
        import torch_llama
        torch_llama.FUSED_ATTENTION = a.sdpa
        hidden = a.mlp_width or (8 * a.width // 3 + 31) // 32 * 32
        model = torch_llama.Llama(a.vocab, a.context, a.layers, a.heads, a.width, a.kv_heads or a.heads,
                                  hidden).to(dev)
    else:
        model = Gpt(a.vocab, a.context, a.layers, a.heads, a.width).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and n != "wpe"]
    plain = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and n != "wpe")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.95), **({"fused": True} if a.fused_adamw else {}))
    params = sum(p.numel() for p in model.parameters())
    if a.compile:
        model = torch.compile(model)
    t = a.context
    losses = []
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            t0 = time.perf_counter()
        off = torch.randint(0, stream.numel() - t - 1, (a.batch,))
        win = torch.stack([stream[o: o + t + 1] for o in off.tolist()])
        win = win.to(dev)
        with autocast:
            loss = F.cross_entropy(model(win[:, :-1]), win[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    dt = time.perf_counter() - t0
    val_loss = None
    if a.val_batches > 0:  # consecutive windows from the start of the validation stream
        val = load_tokens(a.val_tokens) if a.val_tokens else stream
        total = 0.0
        with torch.no_grad(), autocast:
            for i in range(a.val_batches):
                win = torch.stack([val[(i * a.batch + j) * t: (i * a.batch + j) * t + t + 1] for j in range(a.batch)])
                win = win.to(dev)
                total += F.cross_entropy(model(win[:, :-1]), win[:, 1:].reshape(-1)).item()
        val_loss = total / a.val_batches
    print(json.dumps({"framework": "pytorch " + torch.__version__, "precision": a.precision,
                      "tokens_per_s": a.steps * a.batch * t / dt, "parameters": params, "first_loss": losses[0],
                      "last_loss": losses[-1], "val_loss": val_loss, "device": str(dev),
                      "sdpa": a.sdpa, "compiled": a.compile,
                      "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else 0}))


if __name__ == "__main__":
    main()
