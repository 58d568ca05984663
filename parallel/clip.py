"""Gradient clipping across every parallel dimension.

The total norm is that of the single model's gradient: ||g|| = (sum_p ||g_p||^q)^(1/q). Each rank holds parts of
it; a part's contribution is summed over exactly the groups across which its gradient is split (disjoint
shards), and counted once where it is replicated:

    tensor-parallel shards: over tp          (replicated norms, biases: not)
    FSDP shards:            over dp_cp       (DDP gradients are replicated: not)
    pipeline stages:        over pp          (a tied head copy is skipped: its stage-0 twin counts)
    expert weights (ep):    over ep          (each ep rank's experts; their replicas over edp and tp: not)
    FSDP2 expert shards:    over edp too     (each ep rank's experts sharded over their edp ranks)

``clip_grad_norm_`` takes the gradients in sets, each with its groups, reduces each set's local sum of |g|^q
(max for q = inf) over its groups, adds the sets, and scales every gradient by min(1, max_norm / (norm + 1e-6)),
as torch.nn.utils.clip_grad_norm_. DTensor gradients (FSDP2) contribute their local shards.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """Each gradient's norm in fp32, one multi-tensor launch per (device, dtype) (a launch per gradient costs the
    host more than the GPU's work)."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    return torch.cat([torch.stack(torch._foreach_norm(gs, norm_type, dtype=torch.float32)).to(grads[0].device)
                      for gs in groups.values()])


def grad_norm(grad_sets: Sequence[tuple[Iterable[torch.Tensor | None], Sequence]], norm_type: float = 2.0,
              device=None, sum_of_squares=None) -> torch.Tensor:
    """The total norm (fp32 0-d tensor, equal on every rank) of gradients given in sets: [(gradients, groups)], each
    set's gradients disjoint shards across each group in ``groups`` (None gradients, None groups and groups of one
    rank are skipped). Every rank passes the same structure (the collectives match by position). ``device``: where
    the norm is reduced (needed when this rank holds no gradient). ``sum_of_squares``: for the 2-norm, what sums a
    list of local gradients' squares (a ``megakern.optim.SumOfSquares``: one launch per dtype; default: torch's
    per-tensor norms)."""
    norm_type = float(norm_type)
    if not (norm_type == math.inf or norm_type > 0):
        raise ValueError(f"grad_norm: norm_type must be > 0 or inf, got {norm_type}")
    inf = norm_type == math.inf
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = None
    for grads, groups in grad_sets:
        grads = [_local(g) for g in grads if g is not None]
        device = device if device is not None else (grads[0].device if grads else None)
        if grads and sum_of_squares is not None and norm_type == 2.0:
            part = sum_of_squares(grads).to(device)
        elif grads:
            norms = _norms(grads, norm_type)
            part = norms.max() if inf else norms.pow(norm_type).sum()
        else:
            part = torch.zeros((), dtype=torch.float32, device=device)
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(part, op=op, group=group)
        total = part if total is None else (torch.maximum(total, part) if inf else total + part)
    if total is None:
        return torch.zeros((), dtype=torch.float32, device=device)
    return total if inf else total.pow(1.0 / norm_type)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """min(1, max_norm / (norm + 1e-6)): what clipping multiplies every gradient by (torch's rule)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def clip_grad_norm_(param_sets: Sequence[tuple[Iterable[torch.Tensor], Sequence]], max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False, device=None) -> torch.Tensor:
    """Clip in place; returns the total norm (fp32 0-d tensor, equal on every rank).

    param_sets: [(parameters, groups)]: each set's gradients are disjoint shards across each group in ``groups``
    (None entries and groups of one rank are skipped). Every rank must pass the same structure (the collectives
    match by position). ``device``: where the norm is reduced (the gradients' device; needed when this rank holds
    no gradient).
    """
    if not (isinstance(max_norm, (int, float)) and max_norm > 0):
        raise ValueError(f"clip_grad_norm_: max_norm must be a number > 0, got {max_norm!r}")
    param_sets = [(list(params), groups) for params, groups in param_sets]
    norm = grad_norm([([p.grad for p in params], groups) for params, groups in param_sets], norm_type, device)
    if error_if_nonfinite and not torch.isfinite(norm):
        raise RuntimeError(f"clip_grad_norm_: the total gradient norm ({float(norm_type):g}-norm) is {norm.item()}; "
                           "pass error_if_nonfinite=False to clip anyway")
    all_grads = [_local(p.grad) for params, _ in param_sets for p in params if p.grad is not None]
    if all_grads:
        torch._foreach_mul_(all_grads, clip_coefficient(norm, max_norm).to(all_grads[0].device))
    return norm
