"""A GPT-2 style model in plain PyTorch, laid out as nanoGPT's model.py lays it out: the baseline of
bench_train's ``plain-eager`` / ``plain-compile`` providers (nanoGPT's training loop is this model under
torch.compile, fp32 weights under bf16 autocast, fused AdamW, the gradient norm clipped to 1).

Pre-norm blocks of LayerNorm, causal self-attention through F.scaled_dot_product_attention (one fused qkv
projection), a 4x GELU MLP; learned positions; the output projection tied to the token embedding. ``bias`` applies
to every linear layer and LayerNorm, as nanoGPT's flag does. The embedding holds ``vocab`` rows (callers pass the
padded vocabulary of the model they compare with, so both hold the same parameters).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be a multiple of n_head ({n_head})")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, bias=bias)
        self.attn = Attention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd, bias=bias)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PlainGPT(nn.Module):
    def __init__(self, n_layer: int, n_embd: int, n_head: int, vocab: int, max_seqlen: int, bias: bool):
        super().__init__()
        self.max_seqlen = max_seqlen
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(max_seqlen, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of ``idx`` (B, T) against ``targets`` (B, T)."""
        t = idx.shape[1]
        if t > self.max_seqlen:
            raise ValueError(f"sequence length {t} exceeds max_seqlen {self.max_seqlen}")
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
