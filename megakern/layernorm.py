"""LayerNorm: y = (x - mean(x)) / sqrt(var(x) + eps) * w + b, over the last dim, optionally after a fused
residual add.

Shapes: x (..., C) with any leading dims (B, T, C in a transformer), any strides; w, b (C,). With ``residual``
(same shape as x) the op computes h = x + residual, stores h rounded to the residual's dtype, and returns
``(norm(h), h)``: the pre-norm transformer's residual stream in one pass.

Dtypes: x fp32 / fp16 / bf16; w, b x's dtype or fp32 (the same); residual x's dtype or fp32. All math in fp32
(biased variance, as torch.nn.LayerNorm); y in x's dtype. Hidden size up to 65536.

Backends (``megakern._backend``): ``torch`` (``layer_norm_ref`` under autograd), ``triton``, ``cuda``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from megakern import _norm


def layer_norm_ref(x, weight=None, bias=None, eps: float = 1e-5, residual=None, *, upcast: bool = True):
    """The torch reference. ``upcast``: compute in fp32 (fp64 for fp64 inputs); else in x's dtype."""
    out_dtype = x.dtype
    xf, h, compute = _norm.ref_input(x, residual, upcast)
    xc = xf - xf.mean(-1, keepdim=True)
    y = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    y = y.to(out_dtype)
    return y if residual is None else (y, h)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5, *, residual: torch.Tensor | None = None,
               backend: str | Mapping[str, str] | None = None):
    """LayerNorm of x over its last dim; ``(y, x + residual)`` when ``residual`` is given.

    ``backend``: 'torch' | 'triton' | 'cuda', or a config's kernel table {op: backend}; None picks the fastest
    available on x's device.
    """
    return _norm.norm("layer_norm", layer_norm_ref, x, weight, bias, residual, eps, backend, is_rms=False)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim, with learned scale and shift (``elementwise_affine``, ``bias``).

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` with a residual. Parameters held in another
    low precision than x (bf16 parameters with fp32 activations, as under FSDP2 mixed precision) are read in fp32.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, elementwise_affine: bool = True, bias: bool = True,
                 backend: str | Mapping[str, str] | None = None, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps, self.backend = hidden_size, eps, backend
        factory = dict(device=device, dtype=dtype)
        self.weight = nn.Parameter(torch.ones(hidden_size, **factory)) if elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(hidden_size, **factory)) if elementwise_affine and bias else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight, bias = _norm.module_params(x, self.weight, self.bias)
        return layer_norm(x, weight, bias, self.eps, residual=residual, backend=self.backend)

    def extra_repr(self) -> str:
        return (f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}, "
                f"bias={self.bias is not None}, backend={self.backend}")
