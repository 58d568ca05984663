"""Token embedding with a deterministic weight gradient: ``embedding(idx, weight)`` and the module ``Embedding``.

The forward is a row gather (``F.embedding``). The backward's weight gradient is the (V, C) sum, per id, of the output
gradients of the tokens with that id. torch writes it as a zero fill of the whole table, a sort of the ids and a sum
per run: four launches and two passes over the (V, C) table. ``backend`` as for every megakern op (op
"embedding"): 'triton' sorts the ids (stable), finds each id's run by a binary search (no host sync, so the step can
be a CUDA graph), and one pass of megakern/_embedding_triton.py writes every row once: the sum in fp32 over the
run's tokens in their order, rounded once, or zeros; 'torch', F.embedding's own backward. Both are deterministic.

``Embedding`` is an ``nn.Embedding`` (same parameter, same state dict) whose forward is ``embedding``; the options
the Triton backward does not implement (``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, ``sparse``) are
refused by name.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from megakern import _backend, _nvtx


def _check(idx, weight) -> None:
    if not isinstance(idx, torch.Tensor) or idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"embedding: idx must be an int32 or int64 tensor, got "
                        f"{idx.dtype if isinstance(idx, torch.Tensor) else type(idx).__name__}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"embedding: weight must be a floating (V, C) tensor, got "
                         f"{tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__}")
    if idx.device != weight.device:
        raise ValueError(f"embedding: idx is on {idx.device} and weight on {weight.device}")


def embedding_backend(weight: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``embedding(idx, weight, backend=backend)`` takes for its weight gradient: 'torch' | 'triton'."""
    return _backend.resolve("embedding", weight.device, backend, size=weight.shape[-1] if weight.dim() else 0)


def _sorted_runs(ids: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions of ``ids`` sorted by id, stable; (rows + 1,) offsets of each id's run in that order), on the device,
    without a host sync."""
    sorted_ids, order = torch.sort(ids, stable=True)
    bounds = torch.arange(rows + 1, device=ids.device, dtype=sorted_ids.dtype)
    return order, torch.searchsorted(sorted_ids, bounds)


def weight_grad(grad_out: torch.Tensor, idx: torch.Tensor, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The Triton backward: the (rows, C) gradient of the weight in ``dtype`` from the output gradient (..., C) of
    the tokens ``idx`` (...)."""
    from megakern import _embedding_triton

    cols = grad_out.shape[-1]
    grad = grad_out.reshape(-1, cols)
    if grad.stride(-1) != 1:
        grad = grad.contiguous()
    order, offsets = _sorted_runs(idx.reshape(-1).long(), rows)
    out = torch.empty((rows, cols), dtype=dtype, device=grad.device)
    _embedding_triton.weight_grad(grad, order, offsets, out)
    return out


class EmbeddingFunction(torch.autograd.Function):
    """Rows of ``weight`` gathered by ``idx``; the weight's gradient by the Triton pass (``weight_grad``)."""

    @staticmethod
    def forward(ctx, idx, weight):
        ctx.save_for_backward(idx)
        ctx.rows, ctx.dtype = weight.shape[0], weight.dtype
        return F.embedding(idx, weight)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        (idx,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        return None, weight_grad(grad_out, idx, ctx.rows, ctx.dtype)


def embedding(idx: torch.Tensor, weight: torch.Tensor, *,
              backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """``weight[idx]`` (idx of any shape, int32 / int64 ids in 0 .. V - 1; weight (V, C)), with the weight's
    gradient by ``backend`` (see the module doc)."""
    _check(idx, weight)
    name = embedding_backend(weight, backend)
    with _nvtx.annotate(f"megakern.embedding[{name}]"):
        if name == "torch" or not (torch.is_grad_enabled() and weight.requires_grad):
            return F.embedding(idx, weight)
        return EmbeddingFunction.apply(idx, weight)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose forward is ``megakern.embedding`` (``backend``: an op backend or a kernel table)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, backend: str | Mapping[str, str] | None = None,
                 **kwargs):
        for name in ("padding_idx", "max_norm", "_weight"):
            if kwargs.get(name) is not None:
                raise ValueError(f"megakern.Embedding: {name} is not supported (use torch.nn.Embedding)")
        for name in ("sparse", "scale_grad_by_freq", "_freeze"):
            if kwargs.get(name):
                raise ValueError(f"megakern.Embedding: {name} is not supported (use torch.nn.Embedding)")
        super().__init__(num_embeddings, embedding_dim, **kwargs)
        self.backend = backend

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return embedding(idx, self.weight, backend=self.backend)
