"""Token embeddings whose backward writes the table's gradient in one pass: ``embedding(ids, weight)``.

The forward is ``F.embedding``'s row gather. Its backward in torch (``aten::embedding_dense_backward`` on CUDA) fills
a zero gradient the size of the table, sorts the ids, sums each id's rows in partial segments and adds them into the
table: four kinds of launch, and the table's bytes written twice, which at a vocabulary of 128256 and a hidden size
of 4096 is 1 GiB each time. Here (backend 'triton', op "embedding") the ids are sorted (``torch.sort``, stable), each
table row's range found in them (``torch.searchsorted``), and one Triton pass (megakern/_embedding_triton.py) writes
every row of the gradient once: the fp32 sum of the gradient rows of the tokens that took it, in token order (zeros
where none did). The same bits every run, as torch's.

``embedding(ids, weight, backend=None)``: ids an int32 / int64 tensor of any shape with values in [0, V), weight
(V, C) floating point on the same device; returns (*ids.shape, C) in weight's dtype. Only the plain lookup: no
padding_idx, max_norm, scale_grad_by_freq or sparse gradient (``torch.nn.functional.embedding`` has them). Ids
outside [0, V) are refused by the lookup (an IndexError on the CPU, a device-side assert on CUDA); GPT's input check
(``check_values``) names them first. ``embedding_grad(grad, ids, num_rows)``: the table's gradient alone.
``embedding_ref``: the reference, ``F.embedding`` and torch's backward.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from megakern import _backend, _nvtx


def _check_ids(who: str, ids: torch.Tensor) -> None:
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{who}: ids must be int32 or int64, got {ids.dtype}")


def _check(ids, weight) -> None:
    if not isinstance(ids, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"embedding: ids and weight must be tensors, got {type(ids).__name__} and "
                        f"{type(weight).__name__}")
    _check_ids("embedding", ids)
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"embedding: weight must be a 2-D floating-point table (V, C), got {weight.dtype} of shape "
                         f"{tuple(weight.shape)}")
    if ids.device != weight.device:
        raise ValueError(f"embedding: ids on {ids.device} but weight on {weight.device}")


def embedding_ref(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: ``F.embedding`` (torch's backward)."""
    _check(ids, weight)
    return F.embedding(ids, weight)


def embedding_backend(weight: torch.Tensor, backend: str | Mapping[str, str] | None = None) -> str:
    """The backend ``embedding(ids, weight, backend=backend)`` takes: 'torch' | 'triton'."""
    return _backend.resolve("embedding", weight.device, backend, size=weight.shape[-1] if weight.dim() else 0)


def embedding_grad(grad: torch.Tensor, ids: torch.Tensor, num_rows: int, dtype: torch.dtype | None = None, *,
                   backend: str | Mapping[str, str] | None = None, **launch) -> torch.Tensor:
    """The (num_rows, C) gradient of an embedding table from the gradient of its lookup, ``grad`` (*ids.shape, C):
    row v the sum of grad's rows where ids is v. ``dtype``: the table's (grad's by default). ``launch``: the Triton
    kernel's geometry (rows, tok, block_c, warps; megakern/_embedding_triton.py)."""
    if not isinstance(grad, torch.Tensor) or not isinstance(ids, torch.Tensor):
        raise TypeError("embedding_grad: grad and ids must be tensors")
    _check_ids("embedding_grad", ids)
    if grad.dim() < 1 or tuple(grad.shape[:-1]) != tuple(ids.shape) or not grad.is_floating_point():
        raise ValueError(f"embedding_grad: grad must be floating point of shape (*ids.shape, C) = "
                         f"({', '.join(map(str, ids.shape))}{', ' if ids.dim() else ''}C), got {grad.dtype} of "
                         f"shape {tuple(grad.shape)}")
    if grad.device != ids.device:
        raise ValueError(f"embedding_grad: grad on {grad.device} but ids on {ids.device}")
    if num_rows < 0:
        raise ValueError(f"embedding_grad: num_rows must be >= 0, got {num_rows}")
    dtype = grad.dtype if dtype is None else dtype
    cols = grad.shape[-1]
    name = _backend.resolve("embedding", grad.device, backend, size=cols)
    with _nvtx.annotate(f"megakern.embedding_grad[{name}]"):
        if ids.numel() == 0 or num_rows == 0 or cols == 0:
            return torch.zeros(num_rows, cols, dtype=dtype, device=grad.device)
        flat_ids, flat = ids.reshape(-1), grad.reshape(-1, cols)
        if name == "torch":  # fp32 sums, as the kernel's
            return torch.zeros(num_rows, cols, dtype=torch.float32, device=grad.device).index_add_(
                0, flat_ids, flat.float()).to(dtype)
        from megakern import _embedding_triton

        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        sorted_ids, order = torch.sort(flat_ids, stable=True)
        bounds = torch.arange(num_rows + 1, dtype=sorted_ids.dtype, device=grad.device)
        starts = torch.searchsorted(sorted_ids, bounds, out_int32=True)
        out = torch.empty(num_rows, cols, dtype=dtype, device=grad.device)
        _embedding_triton.table_grad(flat, order, starts, out, **launch)
        return out


class _EmbeddingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.num_rows, ctx.dtype = weight.shape[0], weight.dtype
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None
        return None, embedding_grad(grad, ids, ctx.num_rows, ctx.dtype, backend="triton")


def embedding(ids: torch.Tensor, weight: torch.Tensor, *,
              backend: str | Mapping[str, str] | None = None) -> torch.Tensor:
    """``weight``'s rows at ``ids``: (*ids.shape, C); the table's gradient in one pass on the 'triton' backend. See
    the module doc."""
    _check(ids, weight)
    name = embedding_backend(weight, backend)
    with _nvtx.annotate(f"megakern.embedding[{name}]"):
        if name == "torch" or not (weight.requires_grad and torch.is_grad_enabled()):
            return F.embedding(ids, weight)
        return _EmbeddingFunction.apply(ids, weight)
