"""GEMM + reduce-scatter as two kernel launches whose output tiles go straight to the ranks that own them (the
kernel behind megakern.parallel.overlap's fused GEMM + reduce-scatter on symmetric memory).

n ranks each hold x (P, S, Q, K) and w (N, K); the sequence dim S splits into n chunks, so x is viewed as
(P, n, L, K), L = S / n * Q. Rank c keeps out_c = sum over ranks of x[:, c] @ w^T, (P * L, N) (that is, the
(P, S / n, Q, N) chunk). Every rank owns a buffer of n slots, (n, P * L, N) in x's dtype, mapped into every rank's
address space (symmetric memory); ``addresses`` (n,) int64 on the device says where each rank's buffer lies.

    scatter_partials(x, w, addresses, rank)      launch 1: for each chunk c != rank, x[:, c] @ w^T into slot ``rank``
                                                 of rank c's buffer, tile by tile as the GEMM produces them
    (the caller: signal every peer, wait for every peer's signal)
    reduce_own(x, w, addresses, rank, out)       launch 2: out = x[:, rank] @ w^T + the n - 1 partial sums in this
                                                 rank's slots (fp32 sum, rounded once)
    gemm_reduce_scatter_ref(xs, ws, n)           the result of every rank, from all ranks' operands (tests)

x (P, n, L, K): 16-bit or fp32 on a CUDA device, any strides with a unit inner one (else copied); w (N, K) any
strides (a transposed view is read as such). fp32 multiplies in IEEE fp32. Triton: megakern/_gemm_scatter_triton.py
(TMA loads on Hopper; on a CPU only under TRITON_INTERPRET=1, where ``addresses`` may name ordinary CPU tensors,
as the tests do). No autograd: overlap.py's autograd functions call these.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check(op: str, x: torch.Tensor, w: torch.Tensor, addresses: torch.Tensor, rank: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"{op}: x must be 4-D (P, n, L, K); got shape {tuple(x.shape)}")
    if w.dim() != 2 or w.shape[1] != x.shape[3]:
        raise ValueError(f"{op}: w must be (N, K) with K = {x.shape[3]} (x's last dim); got shape {tuple(w.shape)}")
    if x.dtype not in FLOAT_DTYPES or w.dtype != x.dtype:
        raise ValueError(f"{op}: x and w must share one of {FLOAT_DTYPES}; got {x.dtype} and {w.dtype}")
    n = x.shape[1]
    if addresses.shape != (n,) or addresses.dtype != torch.int64:
        raise ValueError(f"{op}: addresses must be ({n},) int64, one per rank (x's dim 1 is the rank count {n}); "
                         f"got {tuple(addresses.shape)} {addresses.dtype}")
    if not (x.device == w.device == addresses.device):
        raise ValueError(f"{op}: x, w and addresses must be on one device; got {x.device}, {w.device}, "
                         f"{addresses.device}")
    if not 0 <= rank < n:
        raise ValueError(f"{op}: rank {rank} is not in 0..{n - 1}")


def scatter_partials(x: torch.Tensor, w: torch.Tensor, addresses: torch.Tensor, rank: int) -> None:
    """Launch 1 (module doc): x[:, c] @ w^T for every chunk c but ``rank``'s, into slot ``rank`` of rank c's buffer."""
    from megakern._gemm_scatter_triton import scatter_partials as launch

    _check("scatter_partials", x, w, addresses, rank)
    launch(x, w, addresses, rank, x.dtype)


def reduce_own(x: torch.Tensor, w: torch.Tensor, addresses: torch.Tensor, rank: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Launch 2 (module doc): x[:, rank] @ w^T plus the partial sums the other ranks left in this rank's slots;
    ``out`` (P * L, N) contiguous in x's dtype, allocated when None."""
    from megakern._gemm_scatter_triton import reduce_own as launch

    _check("reduce_own", x, w, addresses, rank)
    rows = x.shape[0] * x.shape[2]
    if out is None:
        out = torch.empty(rows, w.shape[0], dtype=x.dtype, device=x.device)
    elif out.shape != (rows, w.shape[0]) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"reduce_own: out must be contiguous ({rows}, {w.shape[0]}) {x.dtype}; got "
                         f"{tuple(out.shape)} {out.dtype}")
    return launch(x, w, addresses, rank, out)


def gemm_reduce_scatter_ref(xs: list[torch.Tensor], ws: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's out_c, (P * L, N) in fp64, from all ranks' x (P, n, L, K) and w (N, K)."""
    total = sum(x.double().transpose(0, 1) @ w.double().t() for x, w in zip(xs, ws))  # (n, P, L, N)
    return [total[c].reshape(-1, total.shape[-1]) for c in range(total.shape[0])]
