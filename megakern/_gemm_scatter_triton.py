"""Triton GEMM whose output tiles go straight to the ranks that own them: the two launches of a GEMM + reduce-scatter
over a sequence split into n chunks (megakern.parallel.overlap's symmetric-memory path).

    x (P, S, Q, K) viewed as (P, n, L, K), L = S / n * Q rows of chunk c per index p; w (N, K) (any strides)
    partial sums y_c = x[:, c] @ w^T (P, L, N) for every chunk c; rank c keeps sum over ranks of y_c

- ``scatter_partials`` (launch 1, on rank r): every chunk c != r, each output tile stored (plain global stores over
  NVLink) into slot r of rank c's buffer, whose address is ``dest_ptrs[c]`` (a pointer per rank, mapped into this
  process: symmetric memory). Rank c's slots are (n, P * L, N) contiguous in the output dtype.
- ``reduce_own`` (launch 2, on rank r, once every peer's launch 1 has finished): chunk r's GEMM, its epilogue adding
  the n - 1 partial sums the peers left in this rank's slots (fp32 sum, one rounding) -> out (P * L, N).

The communication runs inside launch 1: a tile leaves for its owner as soon as its GEMM is done, while the other
tiles' GEMMs run; nothing is copied afterwards and no separate summing pass reads the partial sums again. Ordering
between the launches (signals after launch 1, waits before launch 2) and buffer reuse are the caller's.

Tiles: a persistent grid walks (chunk, row tile of (P, L), column tile) in GROUP_M-swizzled order. On Hopper (sm_90+)
x and w are read by TMA through device-made tensor descriptors: x as a 4-D (P, n, L, K) descriptor, so a tile never
reads the next chunk's rows (zeros past L); elsewhere (and for strides TMA cannot take) masked pointer loads. Stores
are masked pointer stores (the destination may be another GPU's memory), in 16-byte vectors: every
``dest_ptrs`` address must be 16-byte aligned (symmetric-memory buffers are; megakern.parallel's workspace checks).
fp32 inputs multiply in IEEE fp32 (no TF32); under the interpreter 16-bit tiles are upcast before the product.
Launchers take tensors; no autograd.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megakern._cuda import sm_count
from megakern._intmath import cdiv
from megakern._gemm_shared_triton import (device_index, ensure_allocator, mma, pointer_k_loop, tma_strides_ok,
                                          tma_usable)


class Config(NamedTuple):
    """Tile (BLOCK_M rows, BLOCK_N columns, BLOCK_K reduction), GROUP_M row tiles per L2 group, pipeline stages,
    warps."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    stages: int = 3
    warps: int = 8


INTERPRETER_CONFIG = Config(16, 16, 16, 2, 1, 4)


@triton.jit
def _tile_gemm(X, W, x_desc, w_desc, p, c, row0, col0, L, N, K,
               stride_xp, stride_xc, stride_xl, stride_xk, stride_wn, stride_wk,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
               TMA: tl.constexpr, W_KN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 (BLOCK_M, BLOCK_N) tile of x[p, c, row0:, :] @ w^T at columns col0:; rows past L read as zeros."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_steps = tl.cdiv(K, BLOCK_K)
    if TMA:
        for kb in tl.range(0, k_steps, num_stages=STAGES):
            a = x_desc.load([p, c, row0, kb * BLOCK_K]).reshape(BLOCK_M, BLOCK_K)
            if W_KN:  # w's storage is (K, N) with unit stride along N (w is a transposed view)
                b = w_desc.load([kb * BLOCK_K, col0])
            else:
                b = tl.trans(w_desc.load([col0, kb * BLOCK_K]))
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = mma(a, b, acc, PRECISION)
    else:
        acc = pointer_k_loop(X + tl.cast(p, tl.int64) * stride_xp + tl.cast(c, tl.int64) * stride_xc, W,
                             row0 + tl.arange(0, BLOCK_M), col0 + tl.arange(0, BLOCK_N), L, N, K,
                             stride_xl, stride_xk, stride_wk, stride_wn, acc, BLOCK_K, STAGES, UPCAST, PRECISION)
    return acc


# sizes and the rank stay runtime values (Triton would make a 1 a constant): one compiled kernel for all of them
@triton.jit(do_not_specialize=["P", "L", "N", "K", "RANK", "NCHUNK", "CHUNKS"])
def _gemm_scatter_kernel(X, W, DEST_PTRS, OUT, P, L, N, K, RANK, NCHUNK, CHUNKS,
                         stride_xp, stride_xc, stride_xl, stride_xk, stride_wn, stride_wk, NUM_PROGRAMS,
                         REDUCE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr,
                         W_KN: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """REDUCE False: the CHUNKS = NCHUNK - 1 peer chunks RANK+1, RANK+2, ... into slot RANK of their owners' buffers.
    REDUCE True: chunk RANK plus this rank's other slots (OUT's buffer: DEST_PTRS[RANK]) -> OUT."""
    pid = tl.program_id(0)
    l_tiles = tl.cdiv(L, BLOCK_M)
    tiles_m = P * l_tiles
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_chunk = tiles_m * tiles_n
    slot = tl.cast(P, tl.int64) * L * N  # elements of one slot
    if TMA:
        x_desc = tl.make_tensor_descriptor(X, shape=[P, NCHUNK, L, K], strides=[stride_xp, stride_xc, stride_xl, 1],
                                           block_shape=[1, 1, BLOCK_M, BLOCK_K])
        if W_KN:
            w_desc = tl.make_tensor_descriptor(W, shape=[K, N], strides=[stride_wk, 1], block_shape=[BLOCK_K, BLOCK_N])
        else:
            w_desc = tl.make_tensor_descriptor(W, shape=[N, K], strides=[stride_wn, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        x_desc = X
        w_desc = W
    # the buffers' addresses come from a table, which tells the compiler nothing of their alignment: declared 16-byte
    # aligned (as the callers guarantee), so that a thread's run of a tile row moves in 16-byte vectors rather than
    # element by element (over NVLink, for the peers' stores)
    own = tl.multiple_of(tl.load(DEST_PTRS + RANK).to(tl.pointer_type(OUT.dtype.element_ty)), 16)
    for tile in range(pid, CHUNKS * per_chunk, NUM_PROGRAMS):
        j = tile // per_chunk
        t = tile % per_chunk
        # GROUP_M row tiles at a time share w's column tile in L2
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        group_m = tl.minimum(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (t % per_group) % group_m
        pid_n = (t % per_group) // group_m
        p = pid_m // l_tiles
        row0 = (pid_m % l_tiles) * BLOCK_M
        col0 = pid_n * BLOCK_N
        if REDUCE:
            c = RANK
        else:
            c = (RANK + 1 + j) % NCHUNK
        acc = _tile_gemm(X, W, x_desc, w_desc, p, c, row0, col0, L, N, K,
                         stride_xp, stride_xc, stride_xl, stride_xk, stride_wn, stride_wk,
                         BLOCK_M, BLOCK_N, BLOCK_K, STAGES, TMA, W_KN, UPCAST, PRECISION)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_offs = (tl.cast(p, tl.int64) * L + rows)[:, None] * N
        if REDUCE:
            # the peers' partial sums of this tile added half a tile at a time (a whole tile's fp32 loads beside the
            # accumulator would spill registers), in slot order from RANK + 1
            HALF: tl.constexpr = BLOCK_N // 2
            lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
            cols_lo = col0 + tl.arange(0, HALF)
            cols_hi = cols_lo + HALF
            mask_lo = (rows < L)[:, None] & (cols_lo < N)[None, :]
            mask_hi = (rows < L)[:, None] & (cols_hi < N)[None, :]
            for s in range(1, NCHUNK):
                q = (RANK + s) % NCHUNK
                lo += tl.load(own + q * slot + row_offs + cols_lo[None, :], mask=mask_lo, other=0.0).to(tl.float32)
            tl.store(OUT + row_offs + cols_lo[None, :], lo.to(OUT.dtype.element_ty), mask=mask_lo)
            for s in range(1, NCHUNK):
                q = (RANK + s) % NCHUNK
                hi += tl.load(own + q * slot + row_offs + cols_hi[None, :], mask=mask_hi, other=0.0).to(tl.float32)
            tl.store(OUT + row_offs + cols_hi[None, :], hi.to(OUT.dtype.element_ty), mask=mask_hi)
        else:
            cols = col0 + tl.arange(0, BLOCK_N)
            mask = (rows < L)[:, None] & (cols < N)[None, :]
            offs = row_offs + cols[None, :]
            dest = tl.multiple_of(tl.load(DEST_PTRS + c).to(tl.pointer_type(OUT.dtype.element_ty)), 16)
            tl.store(dest + RANK * slot + offs, acc.to(OUT.dtype.element_ty), mask=mask)


def default_config(dtype: torch.dtype, device: torch.device, reduce: bool = False) -> Config:
    """The tile of launch 1 (``reduce`` False) or launch 2."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return Config(64, 64, 32, 8, 3, 4)
    return Config(256, 128, 64, 8, 3, 8)


def _launch(x4: torch.Tensor, w: torch.Tensor, dest_ptrs: torch.Tensor, out: torch.Tensor, rank: int,
            reduce: bool, config: Config | None, tma: bool | None) -> None:
    p, n, length, k = x4.shape
    cols = w.shape[0]
    chunks = 1 if reduce else n - 1
    if chunks == 0 or p * length * cols == 0:
        return
    if x4.stride(3) != 1:
        x4 = x4.contiguous()
    cfg = config or default_config(x4.dtype, x4.device, reduce)
    w_kn = w.stride(1) != 1 and w.stride(0) == 1
    cuda = x4.device.type == "cuda"
    use_tma = tma_usable(x4.device, tma, "gemm_scatter")
    if use_tma and not (tma_strides_ok(x4, 3) and tma_strides_ok(w, 0 if w_kn else 1)):
        if tma:
            raise ValueError("gemm_scatter: tma=True needs 16-byte aligned tensors with a unit inner stride")
        use_tma = False
    if use_tma:
        ensure_allocator()
    tiles = chunks * p * cdiv(length, cfg.block_m) * cdiv(cols, cfg.block_n)
    programs = max(1, min(tiles, sm_count(device_index(x4.device)) if cuda else 4))
    precision = "ieee" if x4.dtype == torch.float32 else "tf32"
    _gemm_scatter_kernel[(programs,)](
        x4, w, dest_ptrs, out, p, length, cols, k, rank, n, chunks,
        x4.stride(0), x4.stride(1), x4.stride(2), x4.stride(3), w.stride(0), w.stride(1), programs,
        REDUCE=reduce, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        STAGES=cfg.stages, TMA=use_tma, W_KN=w_kn and use_tma, UPCAST=not cuda, PRECISION=precision,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )


def scatter_partials(x4: torch.Tensor, w: torch.Tensor, dest_ptrs: torch.Tensor, rank: int, dtype: torch.dtype, *,
                     config: Config | None = None, tma: bool | None = None) -> None:
    """Launch 1 (see the module doc): x4 (P, n, L, K) @ w^T for every chunk but ``rank``'s, each into slot ``rank`` of
    its owner's buffer (``dest_ptrs[c]``: the address of rank c's slots, (n, P * L, N) in ``dtype``, 16-byte
    aligned)."""
    marker = torch.empty(0, dtype=dtype, device=x4.device)  # the stores' element type
    _launch(x4, w, dest_ptrs, marker, rank, False, config, tma)


def reduce_own(x4: torch.Tensor, w: torch.Tensor, dest_ptrs: torch.Tensor, rank: int, out: torch.Tensor, *,
               config: Config | None = None, tma: bool | None = None) -> torch.Tensor:
    """Launch 2: out (P * L, N) = x4[:, rank] @ w^T plus the other ranks' partial sums in this rank's slots
    (``dest_ptrs[rank]``, laid out as for scatter_partials in out's dtype)."""
    _launch(x4, w, dest_ptrs, out, rank, True, config, tma)
    return out
