#!/usr/bin/python3
"""A Llama-family decoder in PyTorch 1.13, written from the published architecture (Touvron et al.,
2023, and Hugging Face's LlamaForCausalLM module names): RMSNorm before attention and MLP and before
the output layer, rotary position embedding with the "rotate half" pairing on queries and keys,
grouped-query attention (each key/value head serves heads / kv_heads query heads), a SwiGLU MLP
(down(silu(gate x) * up x)), no biases, an untied output layer. The peer of dtrain's --model llama:
its state_dict names are Hugging Face's (model.embed_tokens.weight, model.layers.<i>.self_attn.
q_proj.weight, ..., lm_head.weight), so it loads `dtrain export` of a Llama and what it saves loads
into dtrain.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, c, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotary_tables(positions, head_dim, base, dtype, device=None):
    """cos and sin [T, head_dim] for positions 0..T-1: frequencies base^(-2i/head_dim), each twice."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv)
    both = torch.cat([angles, angles], dim=-1)
    return both.cos().to(device, dtype), both.sin().to(device, dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


# True: attention through F.scaled_dot_product_attention (PyTorch 2; torch_gpt.py --sdpa sets it).
FUSED_ATTENTION = False


class Attention(nn.Module):
    def __init__(self, c, heads, kv_heads, bias):
        super().__init__()
        self.h, self.kv, self.hd = heads, kv_heads, c // heads
        self.q_proj = nn.Linear(c, heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(c, kv_heads * self.hd, bias=bias)
        self.v_proj = nn.Linear(c, kv_heads * self.hd, bias=bias)
        self.o_proj = nn.Linear(heads * self.hd, c, bias=bias)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        group = self.h // self.kv  # query head h reads key/value head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        if FUSED_ATTENTION:  # PyTorch 2's fused kernels (flash / memory-efficient), no [T, T] tensor
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.hd))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        s = s.masked_fill(~mask, float("-inf"))
        y = F.softmax(s, dim=-1) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.h * self.hd))


class Mlp(nn.Module):
    def __init__(self, c, hidden, bias):
        super().__init__()
        self.gate_proj = nn.Linear(c, hidden, bias=bias)
        self.up_proj = nn.Linear(c, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, c, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, heads, kv_heads, hidden, eps, bias):
        super().__init__()
        self.input_layernorm = RMSNorm(c, eps)
        self.self_attn = Attention(c, heads, kv_heads, bias)
        self.post_attention_layernorm = RMSNorm(c, eps)
        self.mlp = Mlp(c, hidden, bias)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, vocab, layers, c, heads, kv_heads, hidden, eps, bias):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, c)
        self.layers = nn.ModuleList([Layer(c, heads, kv_heads, hidden, eps, bias) for _ in range(layers)])
        self.norm = RMSNorm(c, eps)


class Llama(nn.Module):
    """ids [B, T] -> logits [B*T, vocab] (flattened as dtrain's)."""

    def __init__(self, vocab, context, layers, heads, width, kv_heads, hidden, rope_base=10000.0, eps=1e-5,
                 bias=False):
        super().__init__()
        self.model = Body(vocab, layers, width, heads, kv_heads, hidden, eps, bias)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.context, self.head_dim, self.base = context, width // heads, rope_base

    def forward(self, ids):
        t = ids.shape[1]
        x = self.model.embed_tokens(ids)
        cos, sin = rotary_tables(t, self.head_dim, self.base, x.dtype, x.device)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x)).reshape(-1, self.lm_head.out_features)


def from_export_metadata(meta):
    """The Llama of a `dtrain export`'s metadata ("gpt": vocab, context, layers, heads, width;
    "lm_shape": kv heads, MLP width, rms, rotary, swiglu, bias, tied; "rope_base")."""
    vocab, context, layers, heads, width = [int(v) for v in meta["gpt"].split(",")]
    kv, hidden, rms, rotary, swiglu, bias, tied = [int(v) for v in meta["lm_shape"].split(",")]
    if not (rms and rotary and swiglu) or tied:
        raise SystemExit("torch_llama: the export is not an untied Llama (RMSNorm, rotary, SwiGLU)")
    return Llama(vocab, context, layers, heads, width, kv, hidden, float(meta["rope_base"]), bias=bool(bias))
