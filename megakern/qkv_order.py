"""The two row orders of a fused qkv projection with grouped queries (nkv kv heads, g query heads each, hs rows a
head), and ``qkv_rows``, which moves a tensor's rows from one to the other.

- Grouped: per kv head, [its g query heads, its k head, its v head]. Tensor-parallel shards (a row block per group of
  kv heads) and checkpoints keep this order.
- Heads-major: [every query head, every k head, every v head]. One product with a weight in this order gives q, k and
  v as views with one head stride each (grouped-query attention then needs no copy of q).

``qkv_rows(w, nkv, g, hs, heads_major=True)``: a new tensor with ``w``'s leading rows (a weight, a bias, or their
gradients; any trailing shape) in the heads-major order, or with ``heads_major=False`` back in the grouped one.
``backend`` as for every megakern op (op "qkv_order"): 'triton', one pass of megakern/_qkv_order_triton.py (each
element read and written once); 'torch', two strided copies (``qkv_rows_ref``).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from megakern import _backend, _nvtx


def _check(w, nkv: int, g: int, hs: int) -> None:
    if not isinstance(w, torch.Tensor) or w.dim() == 0:
        raise TypeError(f"qkv_rows: w must be a tensor of at least one dim, got {type(w).__name__}"
                        + (" of shape ()" if isinstance(w, torch.Tensor) else ""))
    if min(nkv, g, hs) < 1:
        raise ValueError(f"qkv_rows: nkv, g and hs must be positive, got {nkv}, {g}, {hs}")
    if w.shape[0] != nkv * (g + 2) * hs:
        raise ValueError(f"qkv_rows: w has {w.shape[0]} rows, but nkv * (g + 2) * hs = {nkv} * {g + 2} * {hs} = "
                         f"{nkv * (g + 2) * hs}")


def qkv_rows_ref(w: torch.Tensor, nkv: int, g: int, hs: int, heads_major: bool = True) -> torch.Tensor:
    """``qkv_rows`` in torch: two strided copies (the query heads, then k and v together)."""
    _check(w, nkv, g, hs)
    w = w.contiguous()
    out = torch.empty_like(w)
    grouped = (w if heads_major else out).view(nkv, g + 2, hs, -1)
    major = (out if heads_major else w).view(nkv * (g + 2) * hs, -1)
    nq = nkv * g * hs
    for part, block in ((major[:nq].view(nkv, g, hs, -1), grouped[:, :g]),
                        (major[nq:].view(2, nkv, hs, -1), grouped[:, g:].transpose(0, 1))):
        if heads_major:
            part.copy_(block)
        else:
            block.copy_(part)
    return out


def qkv_order_backend(w: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``qkv_rows(w, backend=backend)`` takes: 'torch' | 'triton'."""
    return _backend.resolve("qkv_order", w.device, backend, size=w.numel() // max(w.shape[0], 1) if w.dim() else 0)


def qkv_rows(w: torch.Tensor, nkv: int, g: int, hs: int, heads_major: bool = True, *,
             backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """``w``'s rows in the heads-major order (``heads_major=True``) or back in the grouped one; see the module doc.
    No autograd (a caller's backward applies the other direction to the gradient)."""
    _check(w, nkv, g, hs)
    name = qkv_order_backend(w, backend)
    with _nvtx.annotate(f"megakern.qkv_rows[{name}]"):
        if name == "torch" or w.numel() == 0:
            return qkv_rows_ref(w, nkv, g, hs, heads_major)
        from megakern import _qkv_order_triton

        src = w.contiguous()
        out = torch.empty_like(src)
        rows = src.shape[0]
        _qkv_order_triton.reorder(src.view(rows, -1), out.view(rows, -1), nkv, g, hs, heads_major)
        return out
