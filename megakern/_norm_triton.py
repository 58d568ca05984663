"""Triton kernels for LayerNorm and RMSNorm (one kernel pair, ``IS_RMS`` switches the math).

Forward: one program per row; the row is read once (with the residual, if fused), the statistics reduced in
registers, y written once. Backward: a persistent grid; each program walks a contiguous run of rows, reads x and
dy once, writes dx, and keeps its dweight / dbias partial sums in registers until one final store, so the
column reduction costs one small (programs, N) sum afterwards instead of a second pass over x and dy. Rows too wide
for registers have two-pass kernels (``wide``) that walk each row in chunks, the second pass reading from L2 (the
backward's partial sums kept there too).

Launchers take validated 2-D views (rows, N) with unit stride along N; tensors in, tensors out, no autograd.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megakern._cuda import sm_count
from megakern._intmath import cdiv, next_power_of_2
from megakern._reduce_triton import sum_rows

MAX_BLOCK = 65536


@triton.jit
def _row_starts(rows, stride, ALIGN: tl.constexpr):
    """The rows' first elements' offsets, (BLOCK_M, 1); ALIGN > 1: a multiple of ALIGN, told to the compiler (the
    launcher checked the stride), so that a row's loads and stores stay vectors where Triton cannot see it."""
    starts = rows * stride
    if ALIGN > 1:
        starts = tl.multiple_of(starts, ALIGN)
    return starts[:, None]


@triton.jit
def _below(cols, limit, ALIGN: tl.constexpr):
    """cols < limit; ALIGN > 1 (``limit`` a multiple of it): compared by groups of ALIGN columns, so that the mask is
    constant over each group and masked loads of a row whose width Triton cannot see divided by 16 stay vectors."""
    if ALIGN > 1:
        return (cols // ALIGN) < (limit // ALIGN)
    return cols < limit


@triton.jit
def _fwd_part(X, RES, RES_OUT, rows, cols, mask, stride_xm, stride_resm, stride_resoutm, HAS_RES: tl.constexpr,
              ALIGN: tl.constexpr = 1):
    """The rows' columns ``cols`` in fp32, plus the residual rounded to the residual's dtype and stored: what is
    normalized is what is kept."""
    x = tl.load(X + _row_starts(rows, stride_xm, ALIGN) + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(RES + _row_starts(rows, stride_resm, ALIGN) + cols[None, :], mask=mask, other=0.0)
        h = (x + r.to(tl.float32)).to(RES_OUT.dtype.element_ty)
        tl.store(RES_OUT + _row_starts(rows, stride_resoutm, ALIGN) + cols[None, :], h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _row_sum(v, BLOCK_M: tl.constexpr):
    """The sums of the rows of a (BLOCK_M, n) tile; of one row, a scalar. A scalar has no layout: the sums of a
    row's two tiles (whose layouts differ where the tail tile is narrower than the threads' 16-byte groups) add,
    and broadcast back over both, without conversions through shared memory and their barriers."""
    if BLOCK_M == 1:
        return tl.sum(v)
    else:
        return tl.sum(v, axis=1)


@triton.jit
def _col(v, BLOCK_M: tl.constexpr):
    """A statistic of ``_row_sum`` made to broadcast over the rows' tile: (BLOCK_M, 1), or the scalar as it is."""
    if BLOCK_M == 1:
        return v
    else:
        return v[:, None]


@triton.jit
def _fwd_out(Y, W, B, xc, rstd, rows, cols, col_mask, mask, stride_ym, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
             ALIGN: tl.constexpr = 1):
    """y = xc * rstd (* w) (+ b) of the rows' columns ``cols``, stored; ``rstd`` as ``_col`` makes it."""
    y = xc * rstd
    if HAS_W:
        y = y * tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)[None, :]
    tl.store(Y + _row_starts(rows, stride_ym, ALIGN) + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_fwd_kernel(
    X, RES, W, B, Y, RES_OUT, MEAN, RSTD,
    stride_xm, stride_resm, stride_ym, stride_resoutm,
    M, N, eps,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr = 0, EVEN_N: tl.constexpr = False,
    BLOCK_U: tl.constexpr = 0, ALIGN: tl.constexpr = 1,
):
    """BLOCK_M rows per program, as a (BLOCK_M, BLOCK_N) tile; BLOCK_T > 0: the columns past BLOCK_N as a second
    (BLOCK_M, BLOCK_T) tile (a row of 12288 as 8192 + 4096 columns, where one power-of-two tile would hold 16384);
    BLOCK_U > 0 (with BLOCK_T): the columns past both as a third (BLOCK_M, BLOCK_U) tile (13312 as 8192 + 4096 +
    1024). EVEN_N: N == BLOCK_N (no tail), or with three tiles N == BLOCK_N + BLOCK_T + BLOCK_U, so no column is
    masked. ALIGN > 1: N and the row strides are multiples of it (``_row_starts``, ``_below``)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    # the head tile's columns are all < N where N == BLOCK_N or a tail tile follows: no column mask there
    HEAD_FULL: tl.constexpr = EVEN_N or BLOCK_T > 0
    col_mask = _below(cols, BLOCK_N if HEAD_FULL else N, ALIGN)
    mask = row_mask[:, None] & col_mask[None, :]
    x = _fwd_part(X, RES, RES_OUT, rows, cols, mask, stride_xm, stride_resm, stride_resoutm, HAS_RES, ALIGN)
    if BLOCK_T > 0:
        cols_t = BLOCK_N + tl.arange(0, BLOCK_T)
        # the middle tile of three lies below N as the head does
        col_mask_t = _below(cols_t, BLOCK_N + BLOCK_T if BLOCK_U > 0 else N, ALIGN)
        mask_t = row_mask[:, None] & col_mask_t[None, :]
        x_t = _fwd_part(X, RES, RES_OUT, rows, cols_t, mask_t, stride_xm, stride_resm, stride_resoutm, HAS_RES,
                        ALIGN)
    if BLOCK_U > 0:
        cols_u = BLOCK_N + BLOCK_T + tl.arange(0, BLOCK_U)
        col_mask_u = _below(cols_u, BLOCK_N + BLOCK_T + BLOCK_U if EVEN_N else N, ALIGN)
        mask_u = row_mask[:, None] & col_mask_u[None, :]
        x_u = _fwd_part(X, RES, RES_OUT, rows, cols_u, mask_u, stride_xm, stride_resm, stride_resoutm, HAS_RES,
                        ALIGN)
    # statistics in fp32 (scalars for one row: _row_sum)
    if IS_RMS:
        xc = x
        ss = _row_sum(xc * xc, BLOCK_M)
        if BLOCK_T > 0:
            xc_t = x_t
            ss += _row_sum(xc_t * xc_t, BLOCK_M)
        if BLOCK_U > 0:
            xc_u = x_u
            ss += _row_sum(xc_u * xc_u, BLOCK_M)
    else:
        total = _row_sum(x, BLOCK_M)
        if BLOCK_T > 0:
            total += _row_sum(x_t, BLOCK_M)
        if BLOCK_U > 0:
            total += _row_sum(x_u, BLOCK_M)
        # the quotient corrected by its exact remainder (fma): a row of one value has that value as its mean
        n_f = N.to(tl.float32)
        mean = total / n_f
        mean += tl.fma(-mean, n_f, total) / n_f
        if HEAD_FULL:  # no masked column in the head tile (a row past M loads zeros: mean 0, xc 0)
            xc = x - _col(mean, BLOCK_M)
        else:
            xc = tl.where(mask, x - _col(mean, BLOCK_M), 0.0)
        ss = _row_sum(xc * xc, BLOCK_M)
        if BLOCK_T > 0:
            if BLOCK_U > 0:  # the middle tile: no masked column
                xc_t = x_t - _col(mean, BLOCK_M)
            else:
                xc_t = tl.where(mask_t, x_t - _col(mean, BLOCK_M), 0.0)
            ss += _row_sum(xc_t * xc_t, BLOCK_M)
        if BLOCK_U > 0:
            if EVEN_N:
                xc_u = x_u - _col(mean, BLOCK_M)
            else:
                xc_u = tl.where(mask_u, x_u - _col(mean, BLOCK_M), 0.0)
            ss += _row_sum(xc_u * xc_u, BLOCK_M)
        tl.store(MEAN + rows, mean, mask=row_mask)
    rstd = 1.0 / tl.sqrt(ss / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    _fwd_out(Y, W, B, xc, _col(rstd, BLOCK_M), rows, cols, col_mask, mask, stride_ym, HAS_W, HAS_B, ALIGN)
    if BLOCK_T > 0:
        _fwd_out(Y, W, B, xc_t, _col(rstd, BLOCK_M), rows, cols_t, col_mask_t, mask_t, stride_ym, HAS_W, HAS_B,
                 ALIGN)
    if BLOCK_U > 0:
        _fwd_out(Y, W, B, xc_u, _col(rstd, BLOCK_M), rows, cols_u, col_mask_u, mask_u, stride_ym, HAS_W, HAS_B,
                 ALIGN)


@triton.jit
def _wide_load(ptr, m, EVEN_N: tl.constexpr, POLICY: tl.constexpr):
    """A chunk's columns as fp32: unmasked where the chunks fill the row (EVEN_N), else zeros past its end."""
    if EVEN_N:
        v = tl.load(ptr, eviction_policy=POLICY)
    else:
        v = tl.load(ptr, mask=m, other=0.0, eviction_policy=POLICY)
    return v.to(tl.float32)


@triton.jit
def _wide_store(ptr, v, m, EVEN_N: tl.constexpr):
    """A chunk's columns stored in ``ptr``'s dtype: unmasked where the chunks fill the row (EVEN_N), else up to its
    end."""
    if EVEN_N:
        tl.store(ptr, v.to(ptr.dtype.element_ty))
    else:
        tl.store(ptr, v.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _wide_fwd_x(x_ptrs, res_ptrs, res_out_ptrs, start, m, HAS_RES: tl.constexpr, EVEN_N: tl.constexpr):
    """A chunk of the row for pass 1 of the wide forward (columns ``start + offs``; the pointers are the row's at
    ``offs``), in fp32, zeros past its end: x, or x plus the residual, that sum stored."""
    x = _wide_load(x_ptrs + start, m, EVEN_N, "evict_last")
    if HAS_RES:
        h = (x + _wide_load(res_ptrs + start, m, EVEN_N, "evict_first")).to(res_out_ptrs.dtype.element_ty)
        _wide_store(res_out_ptrs + start, h, m, EVEN_N)
        x = h.to(tl.float32)
    return x


@triton.jit
def _wide_fwd_stats(x_ptrs, res_ptrs, res_out_ptrs, offs, start, N, i, lane_mean, lane_m2, shift,
                    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, EVEN_N: tl.constexpr):
    """Pass 1 of the wide forward over the chunk ``i`` (columns ``start + offs``; the pointers are the row's at
    ``offs``): the lanes' statistics updated (LayerNorm's of the columns less ``shift``)."""
    m = start + offs < N
    x = _wide_fwd_x(x_ptrs, res_ptrs, res_out_ptrs, start, m, HAS_RES, EVEN_N)
    if IS_RMS:
        lane_m2 += x * x
    else:  # a lane that holds a column in this chunk held one in each chunk before: its count is i + 1
        x = x - shift
        delta = x - lane_mean
        if not EVEN_N:
            delta = tl.where(m, delta, 0.0)
        lane_mean += delta * (1.0 / (i + 1.0))  # one reciprocal a chunk, not a division a column
        lane_m2 += delta * (x - lane_mean)
    return lane_mean, lane_m2


@triton.jit
def _wide_fwd_out(x_ptrs, w_ptrs, b_ptrs, y_ptrs, offs, start, N, mean, rstd,
                  HAS_W: tl.constexpr, HAS_B: tl.constexpr, EVEN_N: tl.constexpr):
    """Pass 2 of the wide forward over the columns ``start + offs``: y from the row read again (from L2; ``x_ptrs``
    the residual sum's where there is one)."""
    m = start + offs < N
    x = _wide_load(x_ptrs + start, m, EVEN_N, "evict_first")
    y = (x - mean) * rstd
    if HAS_W:
        y = y * _wide_load(w_ptrs + start, m, EVEN_N, "evict_last")
    if HAS_B:
        y = y + _wide_load(b_ptrs + start, m, EVEN_N, "evict_last")
    _wide_store(y_ptrs + start, y, m, EVEN_N)


@triton.jit
def _norm_fwd_wide_kernel(
    X, RES, W, B, Y, RES_OUT, MEAN, RSTD,
    stride_xm, stride_resm, stride_ym, stride_resoutm,
    M, N, eps,
    IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    CHUNK: tl.constexpr, STAGES: tl.constexpr, CHUNKS: tl.constexpr = 0, EVEN_N: tl.constexpr = False,
    SUMS: tl.constexpr = False, WIDTH: tl.constexpr = 0,
):
    """The forward for rows too wide for registers: a row a program, in CHUNK-column pieces, twice. The first pass
    reads the row (and the residual, storing their sum) from memory for its statistics, kept per lane of the chunk
    (RMSNorm: the sum of squares; LayerNorm, of the row less its first column: Welford's mean and squared
    deviations, or unrolled with SUMS, the sums of the lane's columns less its first column and of their squares;
    the lanes' counts one more for the lanes of a partial last chunk) and combined across the lanes once, after
    the loop, so that no chunk waits on a reduction; the second reads the row again from L2 (loaded to stay there
    the first time, to leave it the second) and writes y.
    CHUNKS > 0: the row's chunk count known when compiling (cdiv(N, CHUNK)), both passes unrolled so that all of a
    pass's loads can be in flight at once; EVEN_N (with it): N == CHUNKS * CHUNK, no column masked; WIDTH (with
    it): N itself compiled in, so that no chunk the row fills is masked (the compiler sees which they are)."""
    if WIDTH > 0:
        N = WIDTH
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    x_ptrs = X + row * stride_xm + offs
    res_ptrs, res_out_ptrs = x_ptrs, x_ptrs  # unused without a residual (RES, RES_OUT are None then)
    if HAS_RES:
        res_ptrs = RES + row * stride_resm + offs
        res_out_ptrs = RES_OUT + row * stride_resoutm + offs
    lane_mean = tl.zeros([CHUNK], dtype=tl.float32)
    lane_m2 = tl.zeros([CHUNK], dtype=tl.float32)
    lane_n = tl.maximum(N - offs + CHUNK - 1, 0) // CHUNK  # chunks in which the lane held a column
    lane_n = lane_n.to(tl.float32)
    # LayerNorm's statistics are of the row less its first column, so that the lanes' means, and their spread
    # about the row's, keep their digits on rows whose mean is far from zero beside their spread
    row_shift = 0.0
    if not IS_RMS:
        row_shift = tl.load(X + row * stride_xm).to(tl.float32)
        if HAS_RES:
            row_shift = row_shift + tl.load(RES + row * stride_resm).to(tl.float32)
            row_shift = row_shift.to(RES_OUT.dtype.element_ty).to(tl.float32)
    if CHUNKS > 0:
        if IS_RMS or not SUMS:
            for i in tl.static_range(CHUNKS):
                lane_mean, lane_m2 = _wide_fwd_stats(x_ptrs, res_ptrs, res_out_ptrs, offs, i * CHUNK, N, i,
                                                     lane_mean, lane_m2, row_shift, IS_RMS, HAS_RES, EVEN_N)
        else:  # LayerNorm: sums of the lane's columns less its first one, no chain of means from chunk to chunk
            shift = _wide_fwd_x(x_ptrs, res_ptrs, res_out_ptrs, 0, offs < N, HAS_RES, EVEN_N)
            lane_s1 = tl.zeros([CHUNK], dtype=tl.float32)
            for i in tl.static_range(1, CHUNKS):
                m = i * CHUNK + offs < N
                d = _wide_fwd_x(x_ptrs, res_ptrs, res_out_ptrs, i * CHUNK, m, HAS_RES, EVEN_N) - shift
                if not EVEN_N:
                    d = tl.where(m, d, 0.0)
                lane_s1 += d
                lane_m2 += d * d
            count = tl.maximum(lane_n, 1.0)
            lane_mean = (shift - row_shift) + lane_s1 / count
            lane_m2 = tl.maximum(lane_m2 - lane_s1 * (lane_s1 / count), 0.0)
    else:
        for i in tl.range(0, tl.cdiv(N, CHUNK), num_stages=STAGES):
            lane_mean, lane_m2 = _wide_fwd_stats(x_ptrs, res_ptrs, res_out_ptrs, offs, i * CHUNK, N, i, lane_mean,
                                                 lane_m2, row_shift, IS_RMS, HAS_RES, False)
    if IS_RMS:
        mean = 0.0
        m2 = tl.sum(lane_m2, axis=0)
    else:  # the lanes' statistics combined: M2 = sum of the lanes' M2 + n_lane (mean_lane - mean)^2
        mean = tl.sum(lane_mean * lane_n, axis=0) / N
        spread = lane_mean - mean
        m2 = tl.sum(lane_m2 + lane_n * spread * spread, axis=0)
        mean = row_shift + mean
    rstd = 1.0 / tl.sqrt(m2 / N + eps)
    tl.store(RSTD + row, rstd)
    if not IS_RMS:
        tl.store(MEAN + row, mean)
    y_ptrs = Y + row * stride_ym + offs
    w_ptrs, b_ptrs = y_ptrs, y_ptrs  # unused without a weight or bias (W, B are None then)
    if HAS_W:
        w_ptrs = W + offs
    if HAS_B:
        b_ptrs = B + offs
    if CHUNKS > 0:
        for i in tl.static_range(CHUNKS):
            _wide_fwd_out(res_out_ptrs if HAS_RES else x_ptrs, w_ptrs, b_ptrs, y_ptrs, offs, i * CHUNK, N, mean,
                          rstd, HAS_W, HAS_B, EVEN_N)
    else:
        for c0 in tl.range(0, N, CHUNK, num_stages=STAGES):
            _wide_fwd_out(res_out_ptrs if HAS_RES else x_ptrs, w_ptrs, b_ptrs, y_ptrs, offs, c0, N, mean, rstd,
                          HAS_W, HAS_B, False)


@triton.jit
def _load_bwd_tile(X, DY, rows, row_end, cols, col_mask, stride_xm, stride_dym, ALIGN: tl.constexpr = 1):
    """One step's rows of x and dy (as stored) in the columns ``cols``; rows past ``row_end`` read as zeros."""
    rows64 = rows.to(tl.int64)
    mask = (rows < row_end)[:, None] & col_mask[None, :]
    x = tl.load(X + _row_starts(rows64, stride_xm, ALIGN) + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + _row_starts(rows64, stride_dym, ALIGN) + cols[None, :], mask=mask, other=0.0)
    return x, dy


@triton.jit
def _load_bwd_rows(X, DY, MEAN, RSTD, row0, row_end, cols, col_mask, stride_xm, stride_dym, IS_RMS: tl.constexpr,
                   BLOCK_M: tl.constexpr, ALIGN: tl.constexpr = 1):
    """The step's rows row0 .. + BLOCK_M - 1 of x and dy (as stored), and their statistics (one row's as scalars,
    see _row_sum); rows past ``row_end`` read as zeros."""
    x, dy = _load_bwd_tile(X, DY, row0 + tl.arange(0, BLOCK_M), row_end, cols, col_mask, stride_xm, stride_dym,
                           ALIGN)
    if BLOCK_M == 1:
        at = row0  # a row index: int32 is enough for the statistics
        live = row0 < row_end
    else:
        at = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        live = row0 + tl.arange(0, BLOCK_M) < row_end
    rstd = tl.load(RSTD + at, mask=live, other=0.0)
    if IS_RMS:
        mean = rstd
    else:
        mean = tl.load(MEAN + at, mask=live, other=0.0)
    return x, dy, mean, rstd


@triton.jit
def _bwd_columns(W, first, N, BLOCK: tl.constexpr, HAS_W: tl.constexpr, ALIGN: tl.constexpr = 1):
    """(columns first .. + BLOCK - 1, their mask, the weight there in fp32, zeroed dweight and dbias sums) of one
    tile of the backward's rows. Without a weight, zeros in its place (unused: a returned tuple cannot hold None
    once compiled)."""
    cols = first + tl.arange(0, BLOCK)
    col_mask = _below(cols, N, ALIGN)
    zeros = tl.zeros([BLOCK], dtype=tl.float32)
    w = zeros
    if HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    return cols, col_mask, w, zeros, zeros


@triton.jit
def _bwd_xhat_g(x, dy, w, mean, rstd, mask, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, MASKED: tl.constexpr = True):
    """(dy, xhat, g = dy * w) in fp32 of one tile of a step's rows; ``mean`` and ``rstd`` as ``_col`` makes them.
    MASKED False: no column of the tile is masked (a row past the end loads zeros and statistics of 0: xhat 0)."""
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if IS_RMS:
        xhat = x * rstd
    elif MASKED:
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
    else:
        xhat = (x - mean) * rstd
    g = dy * w[None, :] if HAS_W else dy
    return dy, xhat, g


@triton.jit
def _rms_gx(x, dy, w, HAS_W: tl.constexpr):
    """dy * w * x in fp32 of one tile (RMSNorm's sum(g * xhat) is rstd times its row sums)."""
    wx = x.to(tl.float32) * w[None, :] if HAS_W else x.to(tl.float32)
    return dy.to(tl.float32) * wx


@triton.jit
def _bwd_dx_out(DRES_OUT, DX, DRES, g, xhat, mean_gx, mean_g, rstd, rows64, cols, mask,
                stride_dresoutm, stride_dxm, stride_dresm, IS_RMS: tl.constexpr, HAS_DRES_OUT: tl.constexpr,
                HAS_DRES: tl.constexpr, ALIGN: tl.constexpr = 1):
    """dx = rstd * (g - xhat * mean(g * xhat) - mean(g)) (RMSNorm: no mean(g)) of one tile, plus the residual's
    gradient, stored (and in fp32 to DRES); the statistics as ``_col`` makes them."""
    dx = g - xhat * mean_gx
    if not IS_RMS:
        dx = dx - mean_g
    dx = dx * rstd
    if HAS_DRES_OUT:
        dx = dx + tl.load(DRES_OUT + _row_starts(rows64, stride_dresoutm, ALIGN) + cols[None, :], mask=mask,
                          other=0.0).to(tl.float32)
    tl.store(DX + _row_starts(rows64, stride_dxm, ALIGN) + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DRES:
        tl.store(DRES + _row_starts(rows64, stride_dresm, ALIGN) + cols[None, :], dx, mask=mask)


@triton.jit
def _norm_bwd_kernel(
    X, DY, DRES_OUT, W, MEAN, RSTD, DX, DRES, DW_PARTIAL, DB_PARTIAL,
    stride_xm, stride_dym, stride_dresoutm, stride_dxm, stride_dresm,
    M, N, rows_per_program,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
    HAS_DRES_OUT: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr, BLOCK_T: tl.constexpr = 0, EVEN_N: tl.constexpr = False, ALIGN: tl.constexpr = 1,
):
    """A program's rows, BLOCK_M a step as a (BLOCK_M, BLOCK_N) tile (more loads in flight per program); BLOCK_T >
    0: the columns past BLOCK_N as a second (BLOCK_M, BLOCK_T) tile, as the forward's. EVEN_N: N == BLOCK_N.
    ALIGN > 1: N and the row strides are multiples of it (``_row_starts``, ``_below``)."""
    pid = tl.program_id(0)
    # the head tile's columns are all < N where N == BLOCK_N or a tail tile follows: no column mask there, except
    # in LayerNorm's row of two without the rows loaded ahead, whose masked head measured faster (docs/results.md)
    HEAD_FULL: tl.constexpr = EVEN_N or (BLOCK_T > 0 and (IS_RMS or PREFETCH))
    cols, col_mask, w, dw, db = _bwd_columns(W, 0, BLOCK_N if HEAD_FULL else N, BLOCK_N, HAS_W, ALIGN)
    if BLOCK_T > 0:
        cols_t, col_mask_t, w_t, dw_t, db_t = _bwd_columns(W, BLOCK_N, N, BLOCK_T, HAS_W, ALIGN)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    if PREFETCH:  # the next step's rows are loaded before this step's math: their latency hides under it
        x_next, dy_next, mean_next, rstd_next = _load_bwd_rows(
            X, DY, MEAN, RSTD, row_start, row_end, cols, col_mask, stride_xm, stride_dym, IS_RMS, BLOCK_M, ALIGN)
        if BLOCK_T > 0:
            x_next_t, dy_next_t = _load_bwd_tile(X, DY, row_start + tl.arange(0, BLOCK_M), row_end, cols_t,
                                                 col_mask_t, stride_xm, stride_dym, ALIGN)
    for row0 in range(row_start, row_end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        if PREFETCH:
            x, dy, mean, rstd = x_next, dy_next, mean_next, rstd_next
            x_next, dy_next, mean_next, rstd_next = _load_bwd_rows(
                X, DY, MEAN, RSTD, row0 + BLOCK_M, row_end, cols, col_mask, stride_xm, stride_dym, IS_RMS, BLOCK_M,
                ALIGN)
            if BLOCK_T > 0:
                x_t, dy_t = x_next_t, dy_next_t
                x_next_t, dy_next_t = _load_bwd_tile(X, DY, rows + BLOCK_M, row_end, cols_t, col_mask_t, stride_xm,
                                                     stride_dym, ALIGN)
        else:
            x, dy, mean, rstd = _load_bwd_rows(X, DY, MEAN, RSTD, row0, row_end, cols, col_mask, stride_xm,
                                               stride_dym, IS_RMS, BLOCK_M, ALIGN)
            if BLOCK_T > 0:
                x_t, dy_t = _load_bwd_tile(X, DY, rows, row_end, cols_t, col_mask_t, stride_xm, stride_dym, ALIGN)
        row_mask = rows < row_end
        rows64 = rows.to(tl.int64)
        mask = row_mask[:, None] & col_mask[None, :]
        # the statistics broadcast over the tiles (scalars for one row: no layout conversions between two tiles)
        mean_c = _col(mean, BLOCK_M)
        rstd_c = _col(rstd, BLOCK_M)
        if BLOCK_T > 0:
            mask_t = row_mask[:, None] & col_mask_t[None, :]
        if IS_RMS and not PREFETCH:  # sum(g * xhat) from x and dy as loaded, xhat and g formed after it: fewer
            # values held across the reduction (sm_90 at 16384, 16 warps: 168 -> 40 bytes spilled; with the next
            # rows loaded ahead it spills more, so those keep the sum of g * xhat)
            sum_gx = _row_sum(_rms_gx(x, dy, w, HAS_W), BLOCK_M)
            if BLOCK_T > 0:
                sum_gx += _row_sum(_rms_gx(x_t, dy_t, w_t, HAS_W), BLOCK_M)
            sum_gx = sum_gx * rstd
            sum_g = sum_gx  # unused
            dy, xhat, g = _bwd_xhat_g(x, dy, w, mean_c, rstd_c, mask, IS_RMS, HAS_W, not HEAD_FULL)
            if BLOCK_T > 0:
                dy_t, xhat_t, g_t = _bwd_xhat_g(x_t, dy_t, w_t, mean_c, rstd_c, mask_t, IS_RMS, HAS_W)
        else:  # (this order of the sums spills least at LayerNorm 12288)
            dy, xhat, g = _bwd_xhat_g(x, dy, w, mean_c, rstd_c, mask, IS_RMS, HAS_W, not HEAD_FULL)
            sum_gx = _row_sum(g * xhat, BLOCK_M)
            sum_g = sum_gx  # RMSNorm: unused
            if not IS_RMS:
                sum_g = _row_sum(g, BLOCK_M)
            if BLOCK_T > 0:
                dy_t, xhat_t, g_t = _bwd_xhat_g(x_t, dy_t, w_t, mean_c, rstd_c, mask_t, IS_RMS, HAS_W)
                sum_gx += _row_sum(g_t * xhat_t, BLOCK_M)
                if not IS_RMS:
                    sum_g += _row_sum(g_t, BLOCK_M)
        # dx = rstd * (g - xhat * mean(g * xhat) - mean(g))   (RMSNorm: no mean(g))
        mean_gx = _col(sum_gx / N, BLOCK_M)
        mean_g = _col(sum_g / N, BLOCK_M)
        _bwd_dx_out(DRES_OUT, DX, DRES, g, xhat, mean_gx, mean_g, rstd_c, rows64, cols, mask, stride_dresoutm,
                    stride_dxm, stride_dresm, IS_RMS, HAS_DRES_OUT, HAS_DRES, ALIGN)
        if BLOCK_T > 0:
            _bwd_dx_out(DRES_OUT, DX, DRES, g_t, xhat_t, mean_gx, mean_g, rstd_c, rows64, cols_t, mask_t,
                        stride_dresoutm, stride_dxm, stride_dresm, IS_RMS, HAS_DRES_OUT, HAS_DRES, ALIGN)
        # partial dweight / dbias stay in registers across this program's rows
        if HAS_DW:
            dw += tl.sum(dy * xhat, axis=0)
            if BLOCK_T > 0:
                dw_t += tl.sum(dy_t * xhat_t, axis=0)
        if HAS_DB:
            db += tl.sum(dy, axis=0)
            if BLOCK_T > 0:
                db_t += tl.sum(dy_t, axis=0)
    part = pid * N
    if ALIGN > 1:
        part = tl.multiple_of(part, ALIGN)
    if HAS_DW:
        tl.store(DW_PARTIAL + part + cols, dw, mask=col_mask)
        if BLOCK_T > 0:
            tl.store(DW_PARTIAL + part + cols_t, dw_t, mask=col_mask_t)
    if HAS_DB:
        tl.store(DB_PARTIAL + part + cols, db, mask=col_mask)
        if BLOCK_T > 0:
            tl.store(DB_PARTIAL + part + cols_t, db_t, mask=col_mask_t)


@triton.jit
def _wide_bwd_masks(row_mask, cols, N, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EVEN_N: tl.constexpr,
                    ALIGN: tl.constexpr = 1):
    """(column mask, tile mask) of a step's rows over the columns ``cols``; EVEN_N: no column masked, the tile's
    mask the rows' alone, constant along a row (so its loads stay vectors); ALIGN as ``_below``'s."""
    if EVEN_N:
        return cols < N, tl.broadcast_to(row_mask[:, None], (BLOCK_M, CHUNK))
    col_mask = _below(cols, N, ALIGN)
    return col_mask, row_mask[:, None] & col_mask[None, :]


@triton.jit
def _wide_bwd_chunk(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w, IS_RMS: tl.constexpr,
                    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EVEN_N: tl.constexpr,
                    POLICY: tl.constexpr, ALIGN: tl.constexpr = 1):
    """A step's rows of x and dy over the columns ``c0 + offs`` (loaded with the eviction ``POLICY``), and the
    weight's: (columns, column mask, tile mask, dy, xhat, g) in fp32."""
    cols = c0 + offs
    col_mask, m = _wide_bwd_masks(row_mask, cols, N, BLOCK_M, CHUNK, EVEN_N, ALIGN)
    x = tl.load(x_rows + cols[None, :], mask=m, other=0.0, eviction_policy=POLICY)
    dy = tl.load(dy_rows + cols[None, :], mask=m, other=0.0, eviction_policy=POLICY)
    if HAS_W:
        if EVEN_N:
            w = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32)
        else:
            w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    dy, xhat, g = _bwd_xhat_g(x, dy, w, mean[:, None], rstd[:, None], m, IS_RMS, HAS_W, not EVEN_N)
    return cols, col_mask, m, dy, xhat, g


@triton.jit
def _wide_bwd_sums(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w, lane_gx, lane_g,
                   IS_RMS: tl.constexpr, HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                   EVEN_N: tl.constexpr, ALIGN: tl.constexpr = 1, KEEP: tl.constexpr = True):
    """Pass 1 of the wide backward over the columns ``c0 + offs``: the lanes' sums of g * xhat (and g) updated; x and
    dy loaded to stay in L2 for pass 2 (KEEP; without it, where no pass 2 follows, to leave it)."""
    if KEEP:
        _, _, _, _, xhat, g = _wide_bwd_chunk(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w, IS_RMS, HAS_W,
                                              BLOCK_M, CHUNK, EVEN_N, "evict_last", ALIGN)
    else:
        _, _, _, _, xhat, g = _wide_bwd_chunk(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w, IS_RMS, HAS_W,
                                              BLOCK_M, CHUNK, EVEN_N, "evict_first", ALIGN)
    lane_gx += g * xhat
    if not IS_RMS:
        lane_g += g
    return lane_gx, lane_g


@triton.jit
def _wide_bwd_out(x_rows, dy_rows, W, DRES_OUT, DX, DRES, DW_PARTIAL, DB_PARTIAL, offs, c0, N, rows, row_mask, mean,
                  rstd, w, mean_gx, mean_g, part_row, stride_dresoutm, stride_dxm, stride_dresm,
                  IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
                  HAS_DRES_OUT: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  EVEN_N: tl.constexpr, ALIGN: tl.constexpr = 1):
    """Pass 2 of the wide backward over the columns ``c0 + offs``: dx (x and dy read again, from L2), and the
    step's column sums added to this program's partial rows of dweight (and dbias)."""
    cols, col_mask, m, dy, xhat, g = _wide_bwd_chunk(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w,
                                                     IS_RMS, HAS_W, BLOCK_M, CHUNK, EVEN_N, "evict_first", ALIGN)
    _bwd_dx_out(DRES_OUT, DX, DRES, g, xhat, mean_gx[:, None], mean_g[:, None], rstd[:, None], rows, cols, m,
                stride_dresoutm, stride_dxm, stride_dresm, IS_RMS, HAS_DRES_OUT, HAS_DRES, ALIGN)
    if HAS_DW:
        dw_at = DW_PARTIAL + part_row + cols
        if EVEN_N:
            tl.store(dw_at, tl.load(dw_at) + tl.sum(dy * xhat, axis=0))
        else:
            tl.store(dw_at, tl.load(dw_at, mask=col_mask, other=0.0) + tl.sum(dy * xhat, axis=0), mask=col_mask)
    if HAS_DB:
        db_at = DB_PARTIAL + part_row + cols
        if EVEN_N:
            tl.store(db_at, tl.load(db_at) + tl.sum(dy, axis=0))
        else:
            tl.store(db_at, tl.load(db_at, mask=col_mask, other=0.0) + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def _norm_bwd_wide_kernel(
    X, DY, DRES_OUT, W, MEAN, RSTD, DX, DRES, DW_PARTIAL, DB_PARTIAL,
    stride_xm, stride_dym, stride_dresoutm, stride_dxm, stride_dresm,
    M, N, rows_per_program,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr,
    HAS_DRES_OUT: tl.constexpr, HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
    STAGES: tl.constexpr, CHUNKS: tl.constexpr = 0, EVEN_N: tl.constexpr = False, ALIGN: tl.constexpr = 1,
    ROW_SUMS=None, SUMS_ONLY: tl.constexpr = False,
):
    """The backward for rows too wide for registers: BLOCK_M rows a step, in CHUNK-column pieces, twice. The first
    pass reads x and dy from memory for each row's two sums (kept per lane of the chunk, summed across the lanes once
    after the loop, so that no chunk waits on a reduction); the second reads them again (from L2, where the first
    pass left them), writes dx and adds the step's column sums of dy * xhat (and dy) into this program's partial rows
    of dweight (and dbias), zeroed by the launcher, which stay in L2 across the program's rows: one read-modify-write
    of them a step, so more rows a step means less L2 traffic per row. CHUNKS > 0: the row's chunk count known when
    compiling (cdiv(N, CHUNK)), both passes unrolled; EVEN_N (with it): N == CHUNKS * CHUNK, no column masked.
    ALIGN > 1: N and the row strides are multiples of it (``_row_starts``, ``_below``). SUMS_ONLY: the first pass
    alone, each row's mean(g * xhat) and mean(g) stored to ROW_SUMS (2 x M: rows, then M on) for the strips kernel
    that writes dx (``_norm_bwd_dwdb_kernel`` with HAS_DX)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    row_start = pid.to(tl.int64) * rows_per_program  # int64 bounds: the row loop's offsets are 64-bit
    row_end = tl.minimum(row_start + rows_per_program, M)
    part_row = pid.to(tl.int64) * N
    if ALIGN > 1:
        part_row = tl.multiple_of(part_row, ALIGN)
    for row0 in range(row_start, row_end, BLOCK_M):
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        x_rows = X + _row_starts(rows, stride_xm, ALIGN)
        dy_rows = DY + _row_starts(rows, stride_dym, ALIGN)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        mean = rstd  # RMSNorm: unused
        if not IS_RMS:
            mean = tl.load(MEAN + rows, mask=row_mask, other=0.0)
        w = tl.zeros([CHUNK], dtype=tl.float32)  # without a weight: unused
        # pass 1: sum(g * xhat) and sum(g) over each row (g = dy * w; zero where masked, so no masking of the sums)
        lane_gx = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
        lane_g = tl.zeros([BLOCK_M, CHUNK], dtype=tl.float32)
        if CHUNKS > 0:
            for i in tl.static_range(CHUNKS):
                lane_gx, lane_g = _wide_bwd_sums(x_rows, dy_rows, W, offs, i * CHUNK, N, row_mask, mean, rstd, w,
                                                 lane_gx, lane_g, IS_RMS, HAS_W, BLOCK_M, CHUNK, EVEN_N, ALIGN,
                                                 not SUMS_ONLY)
        else:
            for c0 in tl.range(0, N, CHUNK, num_stages=STAGES):
                lane_gx, lane_g = _wide_bwd_sums(x_rows, dy_rows, W, offs, c0, N, row_mask, mean, rstd, w, lane_gx,
                                                 lane_g, IS_RMS, HAS_W, BLOCK_M, CHUNK, False, ALIGN, not SUMS_ONLY)
        mean_gx = tl.sum(lane_gx, axis=1) / N
        mean_g = tl.sum(lane_g, axis=1) / N
        if SUMS_ONLY:
            tl.store(ROW_SUMS + rows, mean_gx, mask=row_mask)
            if not IS_RMS:
                tl.store(ROW_SUMS + M + rows, mean_g, mask=row_mask)
        # pass 2: dx, and the step's column sums added to this program's partial rows (zeroed by the launcher)
        elif CHUNKS > 0:
            for i in tl.static_range(CHUNKS):
                _wide_bwd_out(x_rows, dy_rows, W, DRES_OUT, DX, DRES, DW_PARTIAL, DB_PARTIAL, offs, i * CHUNK, N,
                              rows, row_mask, mean, rstd, w, mean_gx, mean_g, part_row, stride_dresoutm, stride_dxm,
                              stride_dresm, IS_RMS, HAS_W, HAS_DW, HAS_DB, HAS_DRES_OUT, HAS_DRES, BLOCK_M, CHUNK,
                              EVEN_N, ALIGN)
        else:
            for c0 in tl.range(0, N, CHUNK, num_stages=STAGES):
                _wide_bwd_out(x_rows, dy_rows, W, DRES_OUT, DX, DRES, DW_PARTIAL, DB_PARTIAL, offs, c0, N, rows,
                              row_mask, mean, rstd, w, mean_gx, mean_g, part_row, stride_dresoutm, stride_dxm,
                              stride_dresm, IS_RMS, HAS_W, HAS_DW, HAS_DB, HAS_DRES_OUT, HAS_DRES, BLOCK_M, CHUNK,
                              False, ALIGN)


@triton.jit
def _norm_bwd_dwdb_kernel(
    X, DY, MEAN, RSTD, DW_PARTIAL, DB_PARTIAL, stride_xm, stride_dym, M, N, rows_per_program,
    IS_RMS: tl.constexpr, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
    W=None, DRES_OUT=None, DX=None, DRES=None, ROW_SUMS=None, stride_dresoutm=0, stride_dxm=0, stride_dresm=0,
    HAS_DX: tl.constexpr = False, HAS_W: tl.constexpr = False, HAS_DRES_OUT: tl.constexpr = False,
    HAS_DRES: tl.constexpr = False,
):
    """The split backward's weight (and bias) gradient: a strip of BLOCK_C columns over this program's share of the
    rows, BLOCK_M rows a step, the column sums of dy * xhat (and dy) kept per row of the step until the end, then
    written as this program's partial row (every column of it: an empty share writes zeros). HAS_DX: the strip's dx
    too (and the residual's gradient, as ``_bwd_dx_out``), from each row's mean(g * xhat) and mean(g) in ROW_SUMS
    (the wide kernel's SUMS_ONLY pass), so that x and dy are read once here and once there."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < N
    part = tl.program_id(1).to(tl.int64)
    row_start = part * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    dw = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_C], dtype=tl.float32)
    w = tl.zeros([BLOCK_C], dtype=tl.float32)  # without a weight (or dx): unused
    if HAS_DX and HAS_W:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    for row0 in range(row_start, row_end, BLOCK_M):
        x, dy, mean, rstd = _load_bwd_rows(X, DY, MEAN, RSTD, row0, row_end, cols, col_mask, stride_xm, stride_dym,
                                           IS_RMS, BLOCK_M)
        if HAS_DX:
            rows = row0 + tl.arange(0, BLOCK_M)
            live = rows < row_end
            mask = live[:, None] & col_mask[None, :]
            mean_gx = tl.load(ROW_SUMS + rows, mask=live, other=0.0)
            mean_g = mean_gx  # RMSNorm: unused
            if not IS_RMS:
                mean_g = tl.load(ROW_SUMS + M + rows, mask=live, other=0.0)
            # unmasked xhat: a masked column's dx is not stored, and its dy of zero adds nothing below
            _, xhat, g = _bwd_xhat_g(x, dy, w, _col(mean, BLOCK_M), _col(rstd, BLOCK_M), mask, IS_RMS, HAS_W, False)
            _bwd_dx_out(DRES_OUT, DX, DRES, g, xhat, mean_gx[:, None], mean_g[:, None], _col(rstd, BLOCK_M),
                        rows.to(tl.int64), cols, mask, stride_dresoutm, stride_dxm, stride_dresm, IS_RMS,
                        HAS_DRES_OUT, HAS_DRES)
        dy = dy.to(tl.float32)
        if HAS_DW:  # rows past the end read x, dy and rstd as zeros: they add nothing
            if IS_RMS:
                dw += dy * (x.to(tl.float32) * _col(rstd, BLOCK_M))
            else:
                dw += dy * ((x.to(tl.float32) - _col(mean, BLOCK_M)) * _col(rstd, BLOCK_M))
        if HAS_DB:
            db += dy
    if HAS_DW:
        tl.store(DW_PARTIAL + part * N + cols, tl.sum(dw, axis=0), mask=col_mask)
    if HAS_DB:
        tl.store(DB_PARTIAL + part * N + cols, tl.sum(db, axis=0), mask=col_mask)


def _block(n: int) -> int:
    block = next_power_of_2(n)
    if block > MAX_BLOCK:
        raise ValueError(f"hidden size {n} exceeds the Triton kernels' limit of {MAX_BLOCK}")
    return block


def row_alignment(n: int, *strides: int) -> int:
    """The kernels' ``ALIGN``: the largest power of two up to 16 that divides ``n`` and every row stride, told to
    the compiler where it cannot see it; 1 where all are multiples of 16 (Triton specializes those itself)."""
    if n % 16 == 0 and all(s % 16 == 0 for s in strides):
        return 1
    align = 16
    while align > 1 and (n % align or any(s % align for s in strides)):
        align //= 2
    return align


def tail_split(n: int) -> tuple[int, int] | None:
    """(head, tail) columns of the kernels' two tiles for a row of ``n``: the largest power of two below n and the
    power of two that holds the rest, where the two hold fewer columns than one power-of-two tile (12288: 8192 +
    4096 in place of 16384; 9216: 8192 + 1024); None where they would not (powers of two, 14336)."""
    block = _block(n)
    head = block // 2
    if n <= head or n == block:
        return None
    tail = next_power_of_2(n - head)
    return (head, tail) if head + tail < block else None


def three_split(n: int) -> tuple[int, int, int] | None:
    """(head, middle, tail) columns of the forward's three tiles for a row of ``n`` that ``tail_split`` leaves whole:
    half, a quarter and the power of two that holds the rest of the one power-of-two tile's columns, where the three
    hold fewer columns than that tile (13312: 8192 + 4096 + 1024, 14336: 8192 + 4096 + 2048, 7168: 4096 + 2048 +
    1024); None elsewhere (tail_split's widths, powers of two, 15360)."""
    block = _block(n)
    head = block // 2
    if n <= head or n == block or tail_split(n):
        return None
    middle = head // 2
    tail = next_power_of_2(n - head - middle)
    return (head, middle, tail) if head + middle + tail < block else None


# Launch geometry, measured on the H200 with profiles/tune_norm.py (figures in docs/tuning.md, norms).
class FwdConfig(NamedTuple):
    """The forward's launch geometry: rows a program and warps; for the register kernel the power-of-two tiles a row
    takes (``tiles``: 1, 2 as ``tail_split``, 3 as ``three_split``) and a bound on a thread's registers
    (``maxnreg``, ptxas ``.maxnreg``; None: ptxas's choice; the two-pass kernel's too); ``wide``: the two-pass
    kernel, ``chunk`` columns at a time, ``unrolled`` over the row's chunk count (compiled in, with the row's width);
    ``sums``: LayerNorm's unrolled two-pass statistics as shifted sums (True) or Welford's chain (False), None as
    ``wide_fwd_sums`` has it."""
    rows: int
    warps: int
    tiles: int = 1
    maxnreg: int | None = None
    wide: bool = False
    chunk: int = 4096
    unrolled: bool = False
    sums: bool | None = None


def _register_fwd_config(n: int, is_rms: bool, itemsize: int = 2) -> FwdConfig:
    """The register kernel's geometry for rows of ``n``: below hidden 2048, rows enough for 2048 elements a program
    at 4 warps (8192 at 8 below 1024); from 2048 one row a program, 4 warps to 2048, 8 to 16384 (LayerNorm 4 at 4096
    and 16 at 16384), 32 above; one power-of-two tile a row. Between 2048 and 16384 a row that ``tail_split`` takes
    as two power-of-two tiles as those tiles (``tiles`` 2): at 4 warps, or where the tail is at most a quarter of the
    head of 4096 or more (5120, 9216, 10240), a warp for every 512 of the head's columns (RMSNorm) or 1024
    (LayerNorm); LayerNorm's head of 8192 takes 8 warps whatever its tail (11264, 12288 too), and beside a tail of
    512-2048 (8449-10240) of 16-bit rows, 64 registers a thread (``maxnreg``) so that 4 programs fit an SM in place
    of 3 (fp32 rows spill there; from 10752 the bound lost). A row that ``three_split`` takes as three tiles as those
    (``tiles`` 3) where they won: RMSNorm 12800 and 13312 (8192 + 4096 + a full 512 or 1024) at 4 warps, LayerNorm
    6657-7168 (4096 + 2048 + 1024) at 4 and 14336 (8192 + 4096 + 2048) at 8; elsewhere they were level or lost, most
    where the last tile is a small or a partly masked one. docs/tuning.md, norms, has the measurements."""
    block = _block(n)
    if block < 1024:
        return FwdConfig(8192 // block, 8)
    if block <= 2048:
        return FwdConfig(2048 // block, 4)
    if block <= 16384:
        split = tail_split(n)
        if split:
            head, tail = split
            short_tail = head >= 4096 and 4 * tail <= head
            if is_rms:
                return FwdConfig(1, head // 512 if short_tail else 4, 2)
            bound = 64 if head == 8192 and 512 <= tail <= 2048 and itemsize == 2 else None
            return FwdConfig(1, head // 1024 if short_tail or head >= 8192 else 4, 2, bound)
        thirds = three_split(n)
        if thirds:
            head, middle, tail = thirds
            full = n == head + middle + tail  # no masked column in the last tile
            if is_rms and head == 8192 and full and tail in (512, 1024):
                return FwdConfig(1, 4, 3)
            if not is_rms and head == 4096 and tail == 1024:
                return FwdConfig(1, 4, 3)
            if not is_rms and head == 8192 and full and tail == 2048:
                return FwdConfig(1, 8, 3)
        if not is_rms and block in (4096, 16384):
            return FwdConfig(1, block // 1024)
        return FwdConfig(1, 8)
    return FwdConfig(1, 32)


def _fwd_config(n: int, is_rms: bool, itemsize: int = 2) -> FwdConfig:
    """The forward's launch table for rows of ``n`` elements, ``itemsize`` the widest of x's, the residual's, the
    weight's and the bias's elements in bytes. Where the rows are all 16-bit and ``n`` a multiple of 16 (so that
    Triton knows their alignment), the two-pass kernel unrolled over the row's chunks (``wide``, ``unrolled``), which
    keeps all of a pass's loads in flight with few registers, where it beat the register kernel (docs/tuning.md,
    norms): RMSNorm 4096-7168, 2048-column chunks at 8 warps, from 8192, 4096-column chunks at 16 warps to 16384
    and 32 above; LayerNorm 12289-13312, 2048
    at 8 warps, above 13312, 4096 as shifted sums at 8 warps to 15360 and 16 above. Elsewhere
    ``_register_fwd_config``."""
    _block(n)  # refuses rows wider than the kernels take
    if is_rms and itemsize == 2 and n % 16 == 0 and 4096 <= n <= 7168:
        return FwdConfig(1, 8, wide=True, chunk=2048, unrolled=True)
    if is_rms and itemsize == 2 and n % 16 == 0 and n >= 8192:
        return FwdConfig(1, 16 if n <= 16384 else 32, wide=True, chunk=4096, unrolled=True)
    if itemsize == 2 and n % 16 == 0 and n > 8192:
        if 12288 < n <= 13312:
            return FwdConfig(1, 8, wide=True, chunk=2048, unrolled=True)
        if 13312 < n <= 16384:
            return FwdConfig(1, 8 if n <= 15360 else 16, wide=True, chunk=4096, unrolled=True, sums=True)
        if n > 16384:
            return FwdConfig(1, 16, wide=True, chunk=4096, unrolled=True, sums=True)
    return _register_fwd_config(n, is_rms, itemsize)


class BwdConfig(NamedTuple):
    """The backward's launch geometry: rows a step, warps, programs per SM, the next step's rows loaded before this
    step's math (``prefetch``), and for rows too wide for registers the two-pass kernel (``wide``) with ``chunk``
    columns at a time and ``stages`` of them in flight. ``split``: dx by that kernel alone, without the dweight /
    dbias sums that crowd its registers or its L2, and those sums by a second kernel over strips of columns
    (``_norm_bwd_dwdb_kernel``, ``split_geometry``: columns a strip, rows a step, warps, programs per SM), which
    reads x and dy once more. ``tail``: the register kernel's rows as two power-of-two tiles where ``tail_split`` has
    them, as the forward's. ``unrolled``: the two-pass kernel's loops unrolled over the row's chunk count, compiled
    in (a kernel per count; ``stages`` then has no effect). ``strip_dx`` (with ``split`` and ``wide``): the two-pass
    kernel takes only each row's two sums (its first pass, x and dy read once), and the strips kernel writes dx
    beside the column sums, so that no pass depends on rows staying in L2."""
    rows: int
    warps: int
    per_sm: int
    prefetch: bool = False
    wide: bool = False
    chunk: int = 4096
    stages: int = 2
    split: bool = False
    split_geometry: tuple = (256, 16, 4, 4)
    tail: bool = False
    unrolled: bool = False
    strip_dx: bool = False


def _bwd_config(n: int, is_rms: bool, itemsize: int = 2) -> BwdConfig:
    """Rows in registers up to hidden 8192 (RMSNorm 16384): 16 elements of a step's rows a thread, 16 warps an SM,
    the next step's rows loaded before this step's math. Between 8192 and 16384 a row that ``tail_split`` takes as
    two power-of-two tiles, as those tiles in registers (LayerNorm too, without loading ahead). LayerNorm's other
    rows below 16384, whose dweight and dbias sums beside dx overflow the registers: dx in registers alone and the
    sums by the strips kernel (``split``). Wider rows, the two-pass kernel; RMSNorm's 16-bit rows
    (``itemsize``: the widest element of x, dy, the residual's gradient and the weight) of 16385-20480 columns, a
    multiple of 16, unrolled over 4096-column chunks, 2 rows a step at 16 warps, where it won (docs/tuning.md).
    LayerNorm's rows from 16384 and RMSNorm's other rows above 16384: ``strip_dx``, each row's two sums by the
    two-pass kernel's first pass (one row a step, unrolled over 4096-column chunks),
    then dx with the column sums by strips of 128 columns, 32 rows a step: no pass reads rows back from L2
    (RMSNorm's 16-bit rows of 20481-24576, a multiple of 16: the sums at 8 warps, 8 programs an SM, and strips of
    1024 columns, 4 rows a step, 8 warps, 2 programs an SM)."""
    block = _block(n)
    if is_rms and itemsize == 2 and n % 16 == 0 and 16384 < n <= 24576:
        if n <= 20480:
            return BwdConfig(2, 16, 1, wide=True, chunk=4096, unrolled=True)
        return BwdConfig(1, 8, 8, wide=True, chunk=4096, unrolled=True, split=True, split_geometry=(1024, 4, 8, 2),
                         strip_dx=True)
    if block <= 4096:
        warps = max(2, min(16, block // 256))
        return BwdConfig(2, warps, 16 // warps, True)
    if block <= 8192:
        return BwdConfig(1, 16, 1, True)
    if block <= 16384 and tail_split(n):
        return BwdConfig(1, 16, 1, prefetch=is_rms, tail=True)
    if block <= 16384 and is_rms:
        return BwdConfig(1, 16, 1)
    if block <= 16384 and n < 16384:
        return BwdConfig(1, 16, 1, split=True, split_geometry=(1024, 4, 8, 2))
    warps, per_sm = (16, 2) if is_rms else (8, 8)
    return BwdConfig(1, warps, per_sm, wide=True, chunk=4096, unrolled=True, split=True,
                     split_geometry=(128, 32, 4, 4), strip_dx=True)


def resolve_bwd_config(n: int, is_rms: bool, overrides: dict, itemsize: int = 2) -> BwdConfig:
    """The launch table's BwdConfig with ``overrides`` (fields of BwdConfig; None keeps the table's) in its place;
    naming ``wide`` against the table's kernel, its unrolled two-pass kernel or its ``strip_dx``, starts from that
    kernel's own defaults (one row a step, chunk 4096, 2 stages, looped, fused) before the other overrides apply;
    ``split=False`` against the table's ``strip_dx`` names the fused two-pass kernel."""
    unknown = set(overrides) - set(BwdConfig._fields)
    if unknown:
        raise TypeError(f"unknown backward launch options {sorted(unknown)}; known: {BwdConfig._fields}")
    overrides = {k: v for k, v in overrides.items() if v is not None}
    table = _bwd_config(n, is_rms, itemsize)
    if "wide" in overrides and (bool(overrides["wide"]) != table.wide or table.unrolled or table.strip_dx):
        table = BwdConfig(1, table.warps, table.per_sm, wide=bool(overrides["wide"]))
    if table.strip_dx and "strip_dx" not in overrides and not overrides.get("split", True):
        table = table._replace(strip_dx=False)  # split=False alone names the fused two-pass kernel
    config = table._replace(**overrides)
    if config.strip_dx and not (config.split and config.wide):
        raise ValueError("norm backward: strip_dx has the split backward's strips write dx after the two-pass "
                         f"kernel's row sums (split=True, wide=True); this launch has split={config.split}, "
                         f"wide={config.wide}")
    return config


WIDE_PIPELINE_BYTES = 160 * 1024  # shared memory the wide backward's loads in flight may take (228 KiB an SM)


def _wide_pipeline(config: BwdConfig, block: int, loaded: list[torch.Tensor]) -> tuple[int, int]:
    """(chunk, stages) of the wide backward within WIDE_PIPELINE_BYTES: ``stages`` chunks of ``config.rows`` rows of
    every tensor in ``loaded`` in flight; the chunk halves (down to 256 columns), then the stages drop, until they
    fit (fp32 inputs and the residual's gradient take more than bf16 x and dy)."""
    chunk, stages = min(next_power_of_2(config.chunk), block), config.stages
    per_column = config.rows * sum(t.element_size() for t in loaded)
    while stages * chunk * per_column > WIDE_PIPELINE_BYTES and (chunk > 256 or stages > 1):
        if chunk > 256:
            chunk //= 2
        else:
            stages -= 1
    return chunk, stages


def _programs(rows: int, device: torch.device, per_sm: int = 1) -> int:
    """Persistent backward grid: ``per_sm`` programs per SM on a GPU; few under the CPU interpreter."""
    target = per_sm * sm_count(device.index) if device.type == "cuda" else 4
    return max(1, min(rows, target))


def resolve_fwd_config(n: int, is_rms: bool, itemsize: int = 2, num_warps: int | None = None,
                       rows_per_program: int | None = None, wide: bool | None = None, chunk: int | None = None,
                       tiles: int | None = None, unrolled: bool | None = None,
                       maxnreg: int | None = None, sums: bool | None = None) -> FwdConfig:
    """The forward's geometry for rows of ``n``: ``_fwd_config``'s with the overrides (tuning; None keeps the
    table's) in its place. ``wide``: True, the two-pass kernel from its own defaults (a row a program, the register
    table's warps, chunk 4096, not unrolled); False, the register kernel (``_register_fwd_config``); None, the
    table's kernel, or the register kernel where ``rows_per_program``, ``tiles`` or ``maxnreg`` is named. The
    table's ``maxnreg`` belongs to its geometry: it holds only where neither ``num_warps``, ``rows_per_program`` nor
    ``tiles`` is named. With ``wide`` True, ``maxnreg`` bounds the two-pass kernel's registers. ``sums``: LayerNorm's
    unrolled two-pass statistics (FwdConfig.sums)."""
    if tiles is not None and tiles not in (1, 2, 3):
        raise ValueError(f"norm forward: tiles must be 1, 2 or 3, got {tiles!r}")
    if maxnreg is not None and not (isinstance(maxnreg, int) and 24 <= maxnreg <= 255):
        raise ValueError(f"norm forward: maxnreg must be an int in [24, 255], got {maxnreg!r}")
    table = _fwd_config(n, is_rms, itemsize)
    explicit = wide is not None
    if not explicit:
        wide = table.wide and rows_per_program is None and tiles is None and maxnreg is None
    if explicit and (wide or table.wide):  # the named kernel from its own defaults, the register table's warps
        registers = _register_fwd_config(n, is_rms, itemsize)
        table = FwdConfig(1, registers.warps, wide=True) if wide else registers
    elif not wide and table.wide:  # register-kernel overrides named at a width the two-pass kernel has
        table = _register_fwd_config(n, is_rms, itemsize)
    if maxnreg is None and num_warps is None and rows_per_program is None and tiles is None:
        maxnreg = table.maxnreg
    config = FwdConfig(rows_per_program or table.rows, num_warps or table.warps,
                       table.tiles if tiles is None else tiles, maxnreg, table.wide, chunk or table.chunk,
                       table.unrolled if unrolled is None else unrolled, table.sums if sums is None else sums)
    if config.sums is not None and not (config.wide and config.unrolled and not is_rms):
        raise ValueError("norm forward: sums chooses LayerNorm's statistics in the unrolled two-pass kernel "
                         "(wide=True, unrolled=True); this launch takes "
                         f"{'RMSNorm' if is_rms else 'the register kernel' if not config.wide else 'it looped'}")
    return config


def wide_fwd_sums(is_rms: bool, unrolled: bool, chunk: int) -> bool:
    """Whether the wide forward takes LayerNorm's lane statistics as shifted sums (SUMS) rather than Welford's
    chain: unrolled, at chunks of up to 2048 columns, where it measured faster (docs/tuning.md)."""
    return bool(unrolled) and not is_rms and chunk <= 2048


def fwd(x, residual, weight, bias, eps: float, is_rms: bool, num_warps: int | None = None,
        rows_per_program: int | None = None, wide: bool | None = None, chunk: int | None = None, stages: int = 1,
        tiles: int | None = None, unrolled: bool | None = None, maxnreg: int | None = None,
        sums: bool | None = None):
    """(y, residual_out | None, mean | None, rstd) for 2-D ``x``, launched as ``_fwd_config`` says for its width
    and the widest of its tensors' elements; the other arguments override the table as ``resolve_fwd_config`` has
    it (tuning). ``num_warps``: warps a program; ``rows_per_program``: the register kernel's rows a program.
    ``wide``: the two-pass kernel for rows too wide for registers, a row a program, ``chunk`` columns at a time;
    ``stages`` > 1 has Triton pipeline its loops through shared memory (cp.async, barriers), measured slower;
    ``unrolled``: its loops unrolled over the row's chunk count, compiled in (a kernel per count; ``stages`` then has
    no effect). ``tiles``: 1, a row as one power-of-two tile; 2, as two where ``tail_split`` has them; 3, as three
    where ``three_split`` has them (2 and 3 fall back to fewer tiles elsewhere). ``maxnreg``: a bound on the
    registers a thread may hold (ptxas ``.maxnreg``), so that more programs fit an SM. ``sums``: LayerNorm's
    statistics in the unrolled two-pass kernel as shifted sums or Welford's chain (``FwdConfig.sums``).
    """
    rows, n = x.shape
    block = _block(n)
    itemsize = max(t.element_size() for t in (x, residual, weight, bias) if t is not None)
    config = resolve_fwd_config(n, is_rms, itemsize, num_warps, rows_per_program, wide, chunk, tiles, unrolled,
                                maxnreg, sums)
    rows_per_program, warps, tiles, maxnreg, wide, chunk, unrolled, sums = config
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty((rows, n), dtype=residual.dtype, device=x.device)
    mean = None if is_rms else torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y, res_out, mean, rstd
    args = (x, residual, weight, bias, y, res_out, mean, rstd,
            x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
            res_out.stride(0) if res_out is not None else 0, rows, n, eps)
    flags = dict(IS_RMS=is_rms, HAS_RES=residual is not None, HAS_W=weight is not None, HAS_B=bias is not None,
                 num_warps=warps)
    if maxnreg is not None:
        flags["maxnreg"] = maxnreg
    if wide:
        chunk = min(next_power_of_2(chunk), block)
        chunks = cdiv(n, chunk) if unrolled else 0
        _norm_fwd_wide_kernel[(rows,)](*args, CHUNK=chunk, STAGES=stages, CHUNKS=chunks,
                                       EVEN_N=unrolled and n == chunks * chunk,
                                       SUMS=wide_fwd_sums(is_rms, unrolled, chunk) if sums is None else sums,
                                       WIDTH=n if unrolled else 0, **flags)
    else:
        thirds = three_split(n) if tiles == 3 else None
        if thirds:
            head, tail_cols, third_cols = thirds
        else:
            head, tail_cols = (tail_split(n) if tiles >= 2 else None) or (block, 0)
            third_cols = 0
        align = row_alignment(n, x.stride(0), residual.stride(0) if residual is not None else 0, y.stride(0),
                              res_out.stride(0) if res_out is not None else 0)
        _norm_fwd_kernel[(cdiv(rows, rows_per_program),)](*args, BLOCK_M=rows_per_program, BLOCK_N=head,
                                                          BLOCK_T=tail_cols, BLOCK_U=third_cols,
                                                          EVEN_N=n == head + tail_cols + third_cols
                                                          if thirds else n == head, ALIGN=align, **flags)
    return y, res_out, mean, rstd


def bwd(dy, x, dres_out, weight, mean, rstd, is_rms: bool, residual_dtype, need_dw: bool, need_db: bool,
        **overrides):
    """(dx, dresidual | None, dweight | None, dbias | None); arguments as megakern._norm_cuda.bwd. ``overrides``:
    fields of BwdConfig (tuning; unnamed ones from the launch table, ``wide`` switching kernels leaves its other
    fields as named or at their defaults)."""
    rows, n = dy.shape
    block = _block(n)
    itemsize = max(t.element_size() for t in (dy, x, dres_out, weight) if t is not None)
    config = resolve_bwd_config(n, is_rms, overrides, itemsize)
    programs = _programs(rows, dy.device, config.per_sm)
    rows_per_program = math.ceil(rows / programs) if rows else 0
    split_cols, split_rows, split_warps, split_per_sm = config.split_geometry
    strips = cdiv(n, split_cols)
    # the split backward's partial rows: one a share of the rows, enough shares for split_per_sm programs an SM
    shares = max(1, min(rows, cdiv(_programs(rows * strips, dy.device, split_per_sm), strips))) if config.split \
        else programs
    rows_per_share = math.ceil(rows / shares) if rows else 0
    dx = torch.empty((rows, n), dtype=dy.dtype, device=dy.device)
    separate_dres = residual_dtype is not None and residual_dtype != dy.dtype
    dres = torch.empty((rows, n), dtype=torch.float32, device=dy.device) if separate_dres else None
    has_db = need_db and not is_rms
    # the per-program partial sums of dweight and dbias in one buffer, reduced by one launch
    zeros_or_empty = torch.zeros if config.wide and not config.split else torch.empty
    parts = zeros_or_empty((int(need_dw) + int(has_db), shares, n), dtype=torch.float32,
                           device=dy.device) if need_dw or has_db else None
    dw_partial = parts[0] if need_dw else None
    db_partial = parts[-1] if has_db else None
    args = (x, dy, dres_out, weight, mean, rstd, dx, dres, dw_partial, db_partial,
            x.stride(0), dy.stride(0), dres_out.stride(0) if dres_out is not None else 0, dx.stride(0),
            dres.stride(0) if dres is not None else 0, rows, n, rows_per_program)
    flags = dict(IS_RMS=is_rms, HAS_W=weight is not None, HAS_DW=need_dw and not config.split,
                 HAS_DB=has_db and not config.split, HAS_DRES_OUT=dres_out is not None, HAS_DRES=separate_dres,
                 num_warps=config.warps)
    align = row_alignment(n, x.stride(0), dy.stride(0), dres_out.stride(0) if dres_out is not None else 0,
                          dx.stride(0), dres.stride(0) if dres is not None else 0)
    row_sums = None
    if config.strip_dx and rows:  # the rows' sums by the two-pass kernel's first pass (dx by the strips below)
        row_sums = torch.empty((1 if is_rms else 2, rows), dtype=torch.float32, device=dy.device)
        chunk, stages = _wide_pipeline(config, block, [x, dy])
        chunks = cdiv(n, chunk) if config.unrolled else 0
        _norm_bwd_wide_kernel[(programs,)](
            x, dy, None, weight, mean, rstd, None, None, None, None, x.stride(0), dy.stride(0), 0, 0, 0, rows, n,
            rows_per_program, IS_RMS=is_rms, HAS_W=weight is not None, HAS_DW=False, HAS_DB=False,
            HAS_DRES_OUT=False, HAS_DRES=False, BLOCK_M=config.rows, CHUNK=chunk, STAGES=stages, CHUNKS=chunks,
            EVEN_N=config.unrolled and n == chunks * chunk, ALIGN=align, ROW_SUMS=row_sums, SUMS_ONLY=True,
            num_warps=config.warps)
    if config.split and rows and (parts is not None or row_sums is not None):
        # the column sums by strips; with strip_dx, dx (and the residual's gradient) beside them
        dx_args = dict(W=weight, DRES_OUT=dres_out, DX=dx, DRES=dres, ROW_SUMS=row_sums,
                       stride_dresoutm=dres_out.stride(0) if dres_out is not None else 0, stride_dxm=dx.stride(0),
                       stride_dresm=dres.stride(0) if dres is not None else 0, HAS_DX=True, HAS_W=weight is not None,
                       HAS_DRES_OUT=dres_out is not None, HAS_DRES=separate_dres) if row_sums is not None else {}
        _norm_bwd_dwdb_kernel[(strips, shares)](
            x, dy, mean, rstd, dw_partial, db_partial, x.stride(0), dy.stride(0), rows, n, rows_per_share,
            IS_RMS=is_rms, HAS_DW=need_dw, HAS_DB=has_db, BLOCK_M=split_rows, BLOCK_C=split_cols,
            num_warps=split_warps, **dx_args)
    elif config.split and parts is not None:
        parts.zero_()
    if config.wide and not config.strip_dx:
        chunk, stages = _wide_pipeline(config, block, [t for t in (x, dy, dres_out) if t is not None])
        chunks = cdiv(n, chunk) if config.unrolled else 0
        _norm_bwd_wide_kernel[(programs,)](*args, BLOCK_M=config.rows, CHUNK=chunk, STAGES=stages, CHUNKS=chunks,
                                           EVEN_N=config.unrolled and n == chunks * chunk, ALIGN=align, **flags)
    elif not config.wide:
        head, tail_cols = (tail_split(n) if config.tail else None) or (block, 0)
        _norm_bwd_kernel[(programs,)](*args, BLOCK_M=config.rows, BLOCK_N=head, PREFETCH=config.prefetch,
                                      BLOCK_T=tail_cols, EVEN_N=n == head, ALIGN=align, **flags)
    sums = sum_rows(parts, weight.dtype) if parts is not None else None  # summed and cast in one launch
    dw = sums[0] if need_dw else None
    db = sums[-1] if has_db else None
    if residual_dtype is None:
        return dx, None, dw, db
    return dx, (dres if separate_dres else dx), dw, db
