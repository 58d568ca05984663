"""Triton FP8 GEMM of megakern.fp8.gemm: out (M, N) = A (M, K) . B (N, K)^T with the operands' scales, fp32 accumulation,
bf16 / fp16 / fp32 output and an optional bias.

Scales (dequantizing, ``scale_inv`` of megakern.fp8.Quantized):
- TENSOR: one for A and one for B, applied to the accumulator once at the end;
- ROW: one per row of A and one per row of B (the output's rows and columns), at the end;
- BLOCK: A per (row, run of BLOCK_K columns), B per (BLOCK_K x BLOCK_K tile), DeepSeek-V3 style: each K step's
  product is scaled as it is added (BLOCK_K is the scale block, and a program's BLOCK_N columns sit in one tile);
- BLOCK_ROWS: A and B both per (row, run of BLOCK_K columns) (the weight-gradient GEMM of block scaling, whose K is
  the token dimension): each K step's product scaled by the outer product of the two scale columns.
On GPUs TENSOR runs as ROW with zero scale strides (one scale for every row): the same result, and the faster code
(profiles/tune_fp8.py; docs/tuning.md, FP8 GEMM).

A program computes one (BLOCK_M, BLOCK_N) output tile, walking K; tiles move by masked pointer loads (ragged M,
N, K edges read zeros). Programs are ordered in groups of GROUP_M row-tiles so that neighbours share B's tiles in
L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._intmath import cdiv

TENSOR, ROW, BLOCK, BLOCK_ROWS = 0, 1, 2, 3


@triton.jit
def _fp8_gemm_kernel(A, B, C, SA, SB, BIAS, M, N, K,
                     stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn, stride_sam, stride_sbn,
                     SCALING: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # program -> (row tile, column tile), grouped along M for L2 reuse of B
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    r64 = rows.to(tl.int64)
    c64 = cols.to(tl.int64)
    a_ptrs = A + r64[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + c64[:, None] * stride_bn + ks[None, :] * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = (kb * BLOCK_K + ks) < K
        a = tl.load(a_ptrs, mask=(rows < M)[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(cols < N)[:, None] & k_ok[None, :], other=0.0)
        if SCALING == 2:  # block scales: this K step's product, scaled by A's row-run and B's tile scales
            sa = tl.load(SA + r64 * stride_sam + kb, mask=rows < M, other=0.0)
            sb = tl.load(SB + (pid_n * BLOCK_N // BLOCK_K) * stride_sbn + kb)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb)
        elif SCALING == 3:  # both per (row, K run): the outer product of this K step's scale columns
            sa = tl.load(SA + r64 * stride_sam + kb, mask=rows < M, other=0.0)
            sb = tl.load(SB + c64 * stride_sbn + kb, mask=cols < N, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if SCALING == 0:
        acc = acc * (tl.load(SA) * tl.load(SB))
    elif SCALING == 1:
        sa = tl.load(SA + r64 * stride_sam, mask=rows < M, other=0.0)
        sb = tl.load(SB + c64 * stride_sbn, mask=cols < N, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    tl.store(C + r64[:, None] * stride_cm + c64[None, :] * stride_cn, acc.to(C.dtype.element_ty), mask=mask)


def gemm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, scaling: int,
         out_dtype: torch.dtype, bias: torch.Tensor | None = None, block: int = 128,
         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """out (M, N) for fp8 a (M, K), b (N, K) and their dequantizing scales (shapes per ``scaling``: TENSOR (1,),
    (1,); ROW (M, 1), (N, 1); BLOCK (M, ceil(K / block)), (ceil(N / block), ceil(K / block)); BLOCK_ROWS
    (M, ceil(K / block)), (N, ceil(K / block))). ``config``:
    (BLOCK_M, BLOCK_N, warps, stages), a tuning override."""
    m, k = a.shape
    n = b.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    blocked = scaling in (BLOCK, BLOCK_ROWS)
    stride_sa = scale_a.stride(0) if scale_a.dim() > 1 else 0
    stride_sb = scale_b.stride(0) if scale_b.dim() > 1 else 0
    if a.device.type != "cuda":
        bm, bn, warps, stages = 16, 16, 4, 1
        bk = block if blocked else 32
    else:
        # the best tiles of profiles/tune_fp8.py on the H200, per row and block scales (docs/tuning.md, FP8 GEMM)
        bm, bn, warps, stages = config or ((64, 128, 4, 4) if blocked else (128, 256, 8, 3))
        bk = block if blocked else 128
        if scaling == TENSOR:  # as ROW, every row reading the one scale
            scaling = ROW
    if scaling == BLOCK:  # a program's columns must sit in one scale tile of B
        bn = min(bn, bk)
        if bk % bn:
            raise ValueError(f"fp8 gemm: BLOCK_N {bn} must divide the scale block {bk}")
    grid = (cdiv(m, bm) * cdiv(n, bn),)
    _fp8_gemm_kernel[grid](
        a, b, out, scale_a, scale_b, bias if bias is not None else out, m, n, k,
        *a.stride(), *b.stride(), *out.stride(),
        stride_sa, stride_sb,
        SCALING=scaling, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
        num_warps=warps, num_stages=stages,
    )
    return out
