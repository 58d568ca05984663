"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, over the last dim, optionally after a fused residual add.

Shapes: x (..., C) with any leading dims (B, T, C in a transformer), any strides; w (C,). With ``residual``
(same shape as x) the op computes h = x + residual, stores h rounded to the residual's dtype, and returns
``(norm(h), h)``: the pre-norm transformer's residual stream in one pass.

Dtypes: x fp32 / fp16 / bf16; w x's dtype or fp32; residual x's dtype or fp32 (an fp32 residual stream).
All math in fp32; y in x's dtype. Hidden size up to 65536.

Backends (``megakern._backend``): ``torch`` (``rms_norm_ref`` under autograd), ``triton``, ``cuda``.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from megakern import _norm


def rms_norm_ref(x, weight=None, eps: float = 1e-6, residual=None, *, upcast: bool = True):
    """The torch reference. ``upcast``: compute in fp32 (fp64 for fp64 inputs); else in x's dtype."""
    out_dtype = x.dtype
    xf, h, compute = _norm.ref_input(x, residual, upcast)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    y = y.to(out_dtype)
    return y if residual is None else (y, h)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6, *,
             residual: torch.Tensor | None = None, backend: str | Mapping[str, str] | None = None):
    """RMSNorm of x over its last dim; ``(y, x + residual)`` when ``residual`` is given.

    ``backend``: 'torch' | 'triton' | 'cuda', or a config's kernel table {op: backend}; None picks the fastest
    available on x's device.
    """
    return _norm.norm("rms_norm", lambda x, w, b, eps, r: rms_norm_ref(x, w, eps, r), x, weight, None, residual,
                      eps, backend, is_rms=True)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, with a learned scale (unless ``elementwise_affine=False``).

    ``forward(x, residual=None)`` returns y, or ``(y, x + residual)`` with a residual. A weight held in another
    low precision than x (bf16 with fp32 activations, as under FSDP2 mixed precision) is read in fp32.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, elementwise_affine: bool = True,
                 backend: str | Mapping[str, str] | None = None, device=None, dtype=None):
        super().__init__()
        self.hidden_size, self.eps, self.backend = hidden_size, eps, backend
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype)) if elementwise_affine else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        weight, _ = _norm.module_params(x, self.weight, None)
        return rms_norm(x, weight, self.eps, residual=residual, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}, backend={self.backend}"
