"""A plain-torch GPT of the same GPTConfig, written independently of megakern's ops, loading the same state_dict.

Everything explicit: F.layer_norm / RMSNorm by hand, rotary by "rotate half" on the first rotary_dim features,
attention by a masked softmax over repeated kv heads, GELU by its formulas (tanh, or erf), parallel or sequential
residual blocks, F.cross_entropy over full logits. Computes in the parameters'
dtype (fp64 in the tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RefNorm(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.rms, self.eps = config.norm == "rmsnorm", config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.n_embd))
        self.bias = nn.Parameter(torch.zeros(config.n_embd)) if not self.rms and config.bias else None

    def forward(self, x):
        if self.rms:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


def rotate(x, pos, rotary_dim, base):
    """x (B, T, H, hs) rotated at positions pos (B, T): GPT-NeoX halves on the first rotary_dim features."""
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = pos.to(torch.float64)[..., None] * inv_freq  # (B, T, rotary_dim / 2)
    cos, sin = angles.cos().to(x.dtype)[:, :, None, :], angles.sin().to(x.dtype)[:, :, None, :]
    x1, x2, rest = x[..., :rotary_dim // 2], x[..., rotary_dim // 2:rotary_dim], x[..., rotary_dim:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class RefAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        hs = config.n_embd // config.n_head
        self.qkv = nn.Linear(config.n_embd, (config.n_head + 2 * config.n_kv_head) * hs, bias=config.bias)
        self.proj = nn.Linear(config.n_head * hs, config.n_embd, bias=config.bias)

    def forward(self, x, pos, doc):
        c = self.config
        B, T, _ = x.shape
        nh, nkv, hs = c.n_head, c.n_kv_head, c.n_embd // c.n_head
        g = nh // nkv
        qkv = self.qkv(x).view(B, T, nkv, g + 2, hs)
        q = qkv[:, :, :, :g].reshape(B, T, nh, hs)
        k, v = qkv[:, :, :, g], qkv[:, :, :, g + 1]
        if c.position == "rotary":
            rd = int(hs * c.rotary_pct) // 2 * 2
            q, k = rotate(q, pos, rd, c.rotary_base), rotate(k, pos, rd, c.rotary_base)
        k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)  # kv head j serves q heads j*g..j*g+g-1
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hs)
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        allowed = (j <= i) & (doc[:, :, None] == doc[:, None, :])  # (B, T, T): causal, inside one document
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(B, T, nh * hs)
        return self.proj(out)


class RefMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.swiglu, self.exact = config.activation == "swiglu", config.activation == "gelu_exact"
        self.fc = nn.Linear(config.n_embd, config.ffn_hidden * (2 if self.swiglu else 1), bias=config.bias)
        self.proj = nn.Linear(config.ffn_hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        h = self.fc(x)
        if self.swiglu:
            gate, up = h[..., 0::2], h[..., 1::2]
            h = F.silu(gate) * up
        elif self.exact:
            h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
        else:
            h = 0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
        return self.proj(h)


class RefBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn_norm, self.attn = RefNorm(config), RefAttention(config)
        self.mlp_norm, self.mlp = RefNorm(config), RefMLP(config)
        self.parallel = config.parallel_residual

    def forward(self, x, pos, doc):
        if self.parallel:  # GPT-NeoX: both branches read the block's input
            return x + self.attn(self.attn_norm(x), pos, doc) + self.mlp(self.mlp_norm(x))
        x = x + self.attn(self.attn_norm(x), pos, doc)
        return x + self.mlp(self.mlp_norm(x))


class RefGPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        V = config.padded_vocab
        self.wte = nn.Embedding(V, config.n_embd)
        self.wpe = nn.Embedding(config.max_seqlen, config.n_embd) if config.position == "learned" else None
        self.blocks = nn.ModuleDict({str(i): RefBlock(config) for i in range(config.n_layer)})
        self.norm_f = RefNorm(config)
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.n_embd, V, bias=False)

    def forward(self, idx, targets=None, *, doc_lengths=None, reduction="mean"):
        """``doc_lengths``: the packed documents' lengths over the flattened B * T tokens (positions restart and
        attention stops at each boundary), or None (one document per row)."""
        B, T = idx.shape
        if doc_lengths is None:
            doc = torch.arange(B)[:, None].expand(B, T)
            pos = torch.arange(T)[None].expand(B, T)
        else:
            doc = torch.repeat_interleave(torch.arange(len(doc_lengths)), torch.tensor(doc_lengths)).view(B, T)
            pos = torch.cat([torch.arange(n) for n in doc_lengths]).view(B, T)
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(pos)
        for block in self.blocks.values():
            x = block(x, pos, doc)
        x = self.norm_f(x)
        logits = x @ (self.wte.weight if self.lm_head is None else self.lm_head.weight).t()
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction=reduction)
