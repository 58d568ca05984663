"""Triton kernels of megakern.fp8: casts of high-precision tensors to scaled FP8 (megakern/fp8.py has the math).

Every kernel sees its input as a 2-D (M, N) matrix with arbitrary strides (the last dim of the tensor is N) and
reads it once per pass in (BLOCK_M, BLOCK_N) tiles, computing in fp32:

- ``_cast_kernel``: y = sat(x * scale) with one scale for the tensor (delayed scaling: the scale comes from the amax
  history; current scaling: from this tensor's amax, made on the device by ``_amax_kernel`` first). It can write the
  transposed copy (N, M) from the same tile (the weight-gradient GEMM's operand) and this tensor's amax in the same
  pass (delayed scaling's point: no second read).
- ``_amax_kernel``: max |x| of the tensor.
- ``_rows_kernel``: a scale per row (row-wise scaling) or per (row, block of BLOCK_N columns) (1 x 128 block
  scaling): the amax of the group, then the cast; the group is one tile wide, so the second pass re-reads from L2.
- ``_tiles_kernel``: a scale per (BLOCK_M x BLOCK_N) tile (128 x 128 block scaling).

amax maps NaN to +inf, so a non-finite input always shows as a non-finite amax (the skip-step signal); saturation
clamps finite values to +-FMAX before the cast (round to nearest even), so only NaN stays NaN.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._cuda import sm_count
from megakern._intmath import cdiv, next_power_of_2


@triton.jit
def _abs_nan_inf(x):
    """|x| with NaN mapped to +inf (so that a max over it is non-finite whenever an input is)."""
    return tl.where(x == x, tl.abs(x), float("inf"))


@triton.jit
def _to_fp8(y, FMAX: tl.constexpr, E4M3: tl.constexpr):
    y = tl.minimum(tl.maximum(y, -FMAX), FMAX)  # saturate (NaN passes through)
    if E4M3:
        return y.to(tl.float8e4nv)
    else:
        return y.to(tl.float8e5)


@triton.jit
def _tile(X, M, N, stride_xm, stride_xn, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows.to(tl.int64)[:, None] * stride_xm + cols.to(tl.int64)[None, :] * stride_xn, mask=mask,
                other=0.0).to(tl.float32)
    return x, rows, cols, mask


@triton.jit
def _amax_kernel(X, AMAX, M, N, stride_xm, stride_xn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # persistent: a program walks tiles pid, pid + programs, ... and adds its max to AMAX once
    tiles_n = tl.cdiv(N, BLOCK_N)
    amax = tl.full([], 0.0, tl.float32)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        amax = tl.maximum(amax, tl.max(tl.max(tl.where(mask, _abs_nan_inf(x), 0.0), 1), 0))
    tl.atomic_max(AMAX, amax)


@triton.jit
def _cast_kernel(X, Y, YT, SCALE, SCALE_INV, AMAX, AMAX_OUT, M, N, stride_xm, stride_xn,
                 FMAX: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr, CURRENT: tl.constexpr,
                 WRITE_AMAX: tl.constexpr, ACCUMULATE: tl.constexpr, MARGIN_SCALE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # the scale: given (delayed scaling), or from this tensor's amax in AMAX (current scaling: FMAX / amax /
    # 2^margin, 1 where the amax is 0 or not finite, as scale_from_amax); program 0 writes its inverse
    if CURRENT:
        a = tl.load(AMAX)
        ok = (a > 0.0) & (a < float("inf"))
        scale = tl.where(ok, tl.math.div_rn(FMAX, tl.where(ok, a, 1.0)) * MARGIN_SCALE, 1.0)
    else:
        scale = tl.load(SCALE)
    if tl.program_id(0) == 0:
        tl.store(SCALE_INV, tl.math.div_rn(1.0, scale))
    # persistent: a program walks tiles pid, pid + programs, ...; with WRITE_AMAX (delayed scaling) it keeps the max
    # of what it read and adds it once to this tensor's AMAX and to the step's running AMAX_OUT (ACCUMULATE)
    tiles_n = tl.cdiv(N, BLOCK_N)
    amax = tl.full([], 0.0, tl.float32)
    for t in range(tl.program_id(0), tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
        x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, t // tiles_n, t % tiles_n, BLOCK_M, BLOCK_N)
        if WRITE_AMAX:
            amax = tl.maximum(amax, tl.max(tl.max(tl.where(mask, _abs_nan_inf(x), 0.0), 1), 0))
        xs = x * scale
        y = _to_fp8(xs, FMAX, E4M3)
        r64 = rows.to(tl.int64)
        c64 = cols.to(tl.int64)
        tl.store(Y + r64[:, None] * N + c64[None, :], y, mask=mask)
        if TRANSPOSE:  # the (N, M) copy from the same tile, transposed in the SM so that its rows store contiguously
            # The fp32 values are transposed, then cast (the same bytes: the cast is elementwise), and the mask is
            # built in the transposed layout: transposing the FP8 tile and the boolean mask left elements of ragged
            # tiles unwritten on sm_90 (Triton 3.6).
            mask_t = (cols < N)[:, None] & (rows < M)[None, :]
            tl.store(YT + c64[:, None] * M + r64[None, :], _to_fp8(tl.trans(xs), FMAX, E4M3), mask=mask_t)
    if WRITE_AMAX:
        tl.atomic_max(AMAX, amax)
        if ACCUMULATE:
            tl.atomic_max(AMAX_OUT, amax)


@triton.jit
def _scale_of(amax, FMAX: tl.constexpr):
    """Quantizing scale of a group: FMAX / amax; 1 for an all-zero group; 0 for a non-finite amax (its scale_inv is
    then inf, which the caller reports). Correctly rounded division (div_rn): Triton's fp32 ``/`` is the
    approximate one on GPUs, whose last-bit differences change cast bytes against the reference."""
    return tl.where(amax > 0.0, tl.math.div_rn(FMAX, tl.where(amax > 0.0, amax, 1.0)), 1.0)


@triton.jit
def _rows_kernel(X, Y, SCALE_INV, M, N, stride_xm, stride_xn, stride_sm,
                 FMAX: tl.constexpr, E4M3: tl.constexpr, GROUPS_PER_ROW: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # GROUPS_PER_ROW: one scale per row (False: the program walks the whole row twice) or one per BLOCK_N columns
    pid_m = tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r64 = rows.to(tl.int64)
    if GROUPS_PER_ROW:
        pid_n = tl.program_id(1)
        x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, pid_m, pid_n, BLOCK_M, BLOCK_N)
        amax = tl.max(tl.where(mask, _abs_nan_inf(x), 0.0), 1)
        scale = _scale_of(amax, FMAX)
        y = _to_fp8(x * scale[:, None], FMAX, E4M3)
        tl.store(Y + r64[:, None] * N + cols.to(tl.int64)[None, :], y, mask=mask)
        tl.store(SCALE_INV + r64 * stride_sm + pid_n, tl.math.div_rn(amax, FMAX), mask=rows < M)
    else:
        amax = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, N, BLOCK_N):
            x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, pid_m, n0 // BLOCK_N, BLOCK_M, BLOCK_N)
            amax = tl.maximum(amax, tl.max(tl.where(mask, _abs_nan_inf(x), 0.0), 1))
        scale = _scale_of(amax, FMAX)
        for n0 in range(0, N, BLOCK_N):
            x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, pid_m, n0 // BLOCK_N, BLOCK_M, BLOCK_N)
            y = _to_fp8(x * scale[:, None], FMAX, E4M3)
            tl.store(Y + r64[:, None] * N + cols.to(tl.int64)[None, :], y, mask=mask)
        tl.store(SCALE_INV + r64 * stride_sm, tl.math.div_rn(amax, FMAX), mask=rows < M)


@triton.jit
def _tiles_kernel(X, Y, SCALE_INV, M, N, stride_xm, stride_xn, stride_sm,
                  FMAX: tl.constexpr, E4M3: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    x, rows, cols, mask = _tile(X, M, N, stride_xm, stride_xn, pid_m, pid_n, BLOCK_M, BLOCK_N)
    amax = tl.max(tl.max(tl.where(mask, _abs_nan_inf(x), 0.0), 1), 0)
    y = _to_fp8(x * _scale_of(amax, FMAX), FMAX, E4M3)
    tl.store(Y + rows.to(tl.int64)[:, None] * N + cols.to(tl.int64)[None, :], y, mask=mask)
    tl.store(SCALE_INV + pid_m * stride_sm + pid_n, tl.math.div_rn(amax, FMAX))


# ---- launchers: 2-D views in, tensors out ----------------------------------------------------------------------
def _tiles_for(x: torch.Tensor, transpose: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) for the per-tensor kernels; small tiles under the interpreter. On sm_90a the cast
    with its transposed copy and amax takes 196 registers at 64 x 128 and 8 warps, no spills (4 warps spill)."""
    if x.device.type != "cuda":
        return 16, 32, 4
    return TILES_TRANSPOSE if transpose else TILES


# Per-tensor kernels on GPUs: (BLOCK_M, BLOCK_N, warps) and the persistent grid's programs per SM (0: one program
# per tile), the best of profiles/tune_fp8.py on the H200 (figures in docs/tuning.md, FP8 casts).
TILES = (16, 256, 4)  # delayed scaling's best
TILES_TRANSPOSE = (64, 128, 8)  # with the transposed copy (16 x 256 tiles would store it 16 bytes wide)
PROGRAMS_PER_SM = 8  # persistent: one program per tile queues its amax atomics on one address
PROGRAMS_PER_SM_TRANSPOSE = 16


def _programs(x: torch.Tensor, tiles: int, per_sm: int) -> int:
    if x.device.type != "cuda" or not per_sm:
        return tiles
    return min(tiles, per_sm * sm_count(x.device.index if x.device.index is not None else
                                        torch.cuda.current_device()))


def amax(x2: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """max |x| (NaN -> inf) of the 2-D view ``x2`` into the fp32 scalar tensor ``out`` (which must hold 0)."""
    m, n = x2.shape
    bm, bn, warps = _tiles_for(x2)
    if m and n:
        _amax_kernel[(_programs(x2, cdiv(m, bm) * cdiv(n, bn), PROGRAMS_PER_SM),)](x2, out, m, n, *x2.stride(), BLOCK_M=bm,
                                                                   BLOCK_N=bn, num_warps=warps)
    return out


def cast(x2: torch.Tensor, scale: torch.Tensor | None, fp8_dtype: torch.dtype, fmax: float, *, transpose: bool,
         amax: torch.Tensor, amax_out: torch.Tensor | None = None, margin: int = 0):
    """(y (M, N), y^T (N, M) or None, scale_inv (1,)) = sat(x2 * scale) in ``fp8_dtype``, for x2 with elements
    (megakern/fp8.py makes the results of an empty tensor without a launch).

    ``scale`` given (delayed scaling): x2's amax is maxed into ``amax`` (an fp32 (1,) tensor holding 0) in the same
    pass, and into ``amax_out`` too when given (the step's running max). ``scale`` None (current scaling): ``amax``
    holds x2's amax already (from ``amax``), and the scale FMAX / amax / 2^margin is made in the kernel."""
    m, n = x2.shape
    if not (m and n):
        raise ValueError("fp8 cast: x2 is empty; megakern.fp8.quantize makes an empty tensor's results itself")
    y = torch.empty((m, n), dtype=fp8_dtype, device=x2.device)
    yt = torch.empty((n, m), dtype=fp8_dtype, device=x2.device) if transpose else None
    scale_inv = torch.empty(1, dtype=torch.float32, device=x2.device)
    current = scale is None
    # fp32 sources on GPUs: the in-kernel transposed copy miscompiles (Triton 3.6, sm_90: rows 1, 5, 9, ... of each
    # transposed tile wrong, bf16 and fp16 sources exact), so it is a byte transpose of y instead: the same bytes by
    # construction, one more pass over 1 byte per element (fp32 sources are mostly master weights, cast once per
    # optimizer step)
    fused_t = transpose and not (x2.dtype == torch.float32 and x2.device.type == "cuda")
    bm, bn, warps = _tiles_for(x2, fused_t)
    programs = _programs(x2, cdiv(m, bm) * cdiv(n, bn), PROGRAMS_PER_SM_TRANSPOSE if fused_t else PROGRAMS_PER_SM)
    _cast_kernel[(programs,)](
        x2, y, yt if fused_t else y, amax if current else scale, scale_inv, amax,
        amax_out if amax_out is not None else amax, m, n, *x2.stride(),
        FMAX=fmax, E4M3=fp8_dtype == torch.float8_e4m3fn, TRANSPOSE=fused_t, CURRENT=current,
        WRITE_AMAX=not current, ACCUMULATE=amax_out is not None, MARGIN_SCALE=2.0 ** -margin,
        BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
    )
    if transpose and not fused_t:
        yt.view(torch.uint8).copy_(y.view(torch.uint8).t())
    return y, yt, scale_inv


def cast_rows(x2: torch.Tensor, fp8_dtype: torch.dtype, fmax: float, group: int | None):
    """(y (M, N), scale_inv): a scale per row (``group`` None; scale_inv (M, 1)) or per row and group of ``group``
    columns (scale_inv (M, ceil(N / group)))."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=fp8_dtype, device=x2.device)
    groups = 1 if group is None else cdiv(n, group)
    scale_inv = torch.empty((m, groups), dtype=torch.float32, device=x2.device)
    if m and n:
        # sm_90a registers (Triton 3.6, bf16): whole rows 8 x 1024 at 8 warps fit without spills (32 x 1024 at 4
        # warps spilled 952 bytes); 1 x 128 blocks 32 rows at 8 warps: 40 registers
        cpu = x2.device.type != "cuda"
        bm = 16 if cpu else (32 if group is not None else 8)
        bn = group if group is not None else (32 if cpu else min(1024, next_power_of_2(n)))
        grid = (cdiv(m, bm), groups) if group is not None else (cdiv(m, bm),)
        _rows_kernel[grid](x2, y, scale_inv, m, n, *x2.stride(), scale_inv.stride(0), FMAX=fmax,
                           E4M3=fp8_dtype == torch.float8_e4m3fn, GROUPS_PER_ROW=group is not None,
                           BLOCK_M=bm, BLOCK_N=bn, num_warps=4 if cpu else 8)
    return y, scale_inv


def cast_tiles(x2: torch.Tensor, fp8_dtype: torch.dtype, fmax: float, block: int):
    """(y (M, N), scale_inv (ceil(M / block), ceil(N / block))): a scale per block x block tile."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=fp8_dtype, device=x2.device)
    scale_inv = torch.empty((cdiv(m, block), cdiv(n, block)), dtype=torch.float32, device=x2.device)
    if m and n:
        _tiles_kernel[scale_inv.shape](x2, y, scale_inv, m, n, *x2.stride(), scale_inv.stride(0), FMAX=fmax,
                                       E4M3=fp8_dtype == torch.float8_e4m3fn, BLOCK_M=block, BLOCK_N=block,
                                       num_warps=8 if x2.device.type == "cuda" else 4)
    return y, scale_inv
