"""Triton grouped GEMM of megakern.moe.grouped_mm: the experts' GEMMs over rows sorted by expert, fp32 accumulation.

    forward   out[rows of e] = x[rows of e] @ w[e]           x (M, K), w (E, K, N) -> (M, N); rows from offsets[E]: 0
    dX        the same kernel with w[e]^T                    dout (M, N), w^T (E, N, K) -> (M, K)
    dW        dw[e] = x[rows of e]^T @ dout[rows of e]       -> (E, K, N); an expert without rows gets 0

Expert e owns rows offsets[e] .. offsets[e + 1] (``offsets`` (E + 1,) on the device, never read on the host).

The tile schedule. Every program loads the E + 1 offsets once as one vector and derives the schedule from it: the
row tiles of expert e are cdiv(rows_e, BLOCK_M), their prefix sums number the row tiles of all experts in order,
and the zero tail (rows from offsets[E] on) follows as more row tiles; times cdiv(N, BLOCK_N) column tiles. A tile
finds its expert by counting the prefix sums at or below its row tile. The grid is sized by an upper bound known on
the host, cdiv(M, BLOCK_M) + E + 1 row tiles: persistent (one program per SM walking tiles with a stride) or one
program per tile slot (slots past the real count do nothing). Row tiles are ordered in groups of GROUP_M so that
neighbouring programs share w[e]'s tiles in L2.

Tile moves. On Hopper (sm_90+) tiles are loaded by TMA through tensor descriptors made on the device: x (M, K),
w as a 3-D (E, K, N) descriptor (so the K edge of one expert reads zeros, never the next expert's rows), and full
output tiles stored through an (M, N) descriptor; a tile that ends inside its expert's rows is stored by a masked
pointer store. Elsewhere, and for strides TMA cannot take, masked pointer loads. The dW kernel walks each expert's
rows in BLOCK_K steps (TMA for whole steps, a masked step for the remainder, whose loads may be issued first) and
stores each (BLOCK_M, BLOCK_N) tile of dw[e] through an (E, K, N) descriptor.

fp32 inputs multiply in IEEE fp32 (no TF32); under the interpreter 16-bit tiles are upcast before the product.
Launchers take tensors and return tensors; no autograd.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from megakern._cuda import sm_count
from megakern._intmath import cdiv, next_power_of_2
from megakern._gemm_shared_triton import (device_index, ensure_allocator, mma, pointer_k_loop, tma_strides_ok,
                                          tma_usable)


class Config(NamedTuple):
    """Launch parameters: tile (BLOCK_M rows, BLOCK_N columns, BLOCK_K reduction), GROUP_M row tiles per L2 group,
    pipeline stages, warps, persistent (``occupancy`` programs per SM) or one program per tile slot; ``prefetch_tail``
    (dW): the masked loads of an expert's last rows (fewer than BLOCK_K) are issued before its whole steps and used
    after them, so that their latency hides under the whole steps."""
    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    stages: int = 3
    warps: int = 8
    persistent: bool = True
    occupancy: int = 1
    prefetch_tail: bool = False


INTERPRETER_CONFIG = Config(32, 32, 32, 2, 1, 4, True)


# ---- kernels ---------------------------------------------------------------------------------------------------
@triton.jit
def _store_masked(C, tile, row0, row_end, col0, N, stride_cm, stride_cn, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr):
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    ptrs = C + rows.to(tl.int64)[:, None] * stride_cm + cols.to(tl.int64)[None, :] * stride_cn
    tl.store(ptrs, tile, mask=(rows < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def _store_rows(C, c_desc, tile, row0, row_end, col0, N, stride_cm, stride_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr):
    """Rows row0 .. min(row0 + BLOCK_M, row_end) - 1 of the tile into C; by TMA when the tile lies whole in them."""
    if TMA:
        if row0 + BLOCK_M <= row_end:
            c_desc.store([row0, col0], tile)
        else:
            _store_masked(C, tile, row0, row_end, col0, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)
    else:
        _store_masked(C, tile, row0, row_end, col0, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N)


@triton.jit
def _swizzle(t, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Tile number t of a tiles_m x tiles_n grid -> (row tile, column tile), GROUP_M row tiles at a time: neighbouring
    tiles share their column tile's operand in L2."""
    per_group = GROUP_M * tiles_n
    first_m = (t // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (t % per_group) % group_m, (t % per_group) // group_m


@triton.jit
def _grouped_mm_kernel(A, B, C, OFFSETS, M, N, K, E,
                       stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
                       NUM_PROGRAMS,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       E_POW2: tl.constexpr, STAGES: tl.constexpr, TMA: tl.constexpr, TRANS_B: tl.constexpr,
                       UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    # the schedule: row tiles per expert, their prefix sums, then the zero tail
    e = tl.arange(0, E_POW2)
    starts = tl.load(OFFSETS + e, mask=e < E, other=0).to(tl.int32)
    ends = tl.load(OFFSETS + 1 + e, mask=e < E, other=0).to(tl.int32)
    m_tiles = (tl.maximum(ends - starts, 0) + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(m_tiles, 0)
    group_tiles = tl.sum(m_tiles, 0)
    total = tl.load(OFFSETS + E).to(tl.int32)
    tiles_m = group_tiles + (M - total + BLOCK_M - 1) // BLOCK_M
    tiles_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tiles_m * tiles_n
    k_steps = tl.cdiv(K, BLOCK_K)
    if TMA:
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
        if TRANS_B:  # B's (E, N, K) storage has unit stride along K
            b_desc = tl.make_tensor_descriptor(B, shape=[E, N, K], strides=[stride_be, stride_bn, 1],
                                               block_shape=[1, BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(B, shape=[E, K, N], strides=[stride_be, stride_bk, 1],
                                               block_shape=[1, BLOCK_K, BLOCK_N])
        c_desc = tl.make_tensor_descriptor(C, shape=[M, N], strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N])
    else:
        c_desc = C
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        pid_m, pid_n = _swizzle(tile, tiles_m, tiles_n, GROUP_M)
        col0 = pid_n * BLOCK_N
        if pid_m < group_tiles:
            # the expert whose row tiles hold pid_m, and the tile's first row within its rows
            g = tl.sum((tile_ends <= pid_m).to(tl.int32), 0)
            row_end = tl.load(OFFSETS + g + 1).to(tl.int32)
            row0 = tl.load(OFFSETS + g).to(tl.int32) + (pid_m - tl.sum(tl.where(e < g, m_tiles, 0), 0)) * BLOCK_M
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if TMA:
                for kb in tl.range(0, k_steps, num_stages=STAGES):
                    a = a_desc.load([row0, kb * BLOCK_K])
                    if TRANS_B:
                        b = tl.trans(b_desc.load([g, col0, kb * BLOCK_K]).reshape(BLOCK_N, BLOCK_K))
                    else:
                        b = b_desc.load([g, kb * BLOCK_K, col0]).reshape(BLOCK_K, BLOCK_N)
                    if UPCAST:
                        a, b = a.to(tl.float32), b.to(tl.float32)
                    acc = mma(a, b, acc, PRECISION)
            else:
                # rows past the expert's end (< M) are read and never stored: a row's product is its own
                acc = pointer_k_loop(A, B + g.to(tl.int64) * stride_be, row0 + tl.arange(0, BLOCK_M),
                                     col0 + tl.arange(0, BLOCK_N), M, N, K, stride_am, stride_ak, stride_bk,
                                     stride_bn, acc, BLOCK_K, STAGES, UPCAST, PRECISION)
            _store_rows(C, c_desc, acc.to(C.dtype.element_ty), row0, row_end, col0, N, stride_cm, stride_cn,
                        BLOCK_M, BLOCK_N, TMA)
        else:
            # the tail past offsets[E]: zeros
            row0 = total + (pid_m - group_tiles) * BLOCK_M
            zero = tl.zeros([BLOCK_M, BLOCK_N], C.dtype.element_ty)
            _store_rows(C, c_desc, zero, row0, M, col0, N, stride_cm, stride_cn, BLOCK_M, BLOCK_N, TMA)


@triton.jit
def _grouped_mm_dw_kernel(A, B, C, OFFSETS, M, K, N, E,
                          stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
                          NUM_PROGRAMS,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          STAGES: tl.constexpr, TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                          PREFETCH_TAIL: tl.constexpr):
    # C[e] (K, N) = A[rows of e]^T (K, rows) @ B[rows of e] (rows, N); tiles of BLOCK_M over K, BLOCK_N over N, and
    # the expert's rows walked in BLOCK_K steps
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(K, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_expert = tiles_k * tiles_n
    num_tiles = E * per_expert
    if TMA:
        a_desc = tl.make_tensor_descriptor(A, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_K, BLOCK_M])
        b_desc = tl.make_tensor_descriptor(B, shape=[M, N], strides=[stride_bm, 1], block_shape=[BLOCK_K, BLOCK_N])
        c_desc = tl.make_tensor_descriptor(C, shape=[E, K, N], strides=[stride_ce, stride_ck, 1],
                                           block_shape=[1, BLOCK_M, BLOCK_N])
    for tile in range(pid, num_tiles, NUM_PROGRAMS):
        g = tile // per_expert
        pid_m, pid_n = _swizzle(tile % per_expert, tiles_k, tiles_n, GROUP_M)
        k0 = pid_m * BLOCK_M
        col0 = pid_n * BLOCK_N
        row_start = tl.load(OFFSETS + g).to(tl.int32)
        row_end = tl.load(OFFSETS + g + 1).to(tl.int32)
        whole = tl.maximum(row_end - row_start, 0) // BLOCK_K
        kcols = k0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        rs = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        # the remaining rows past the whole steps, masked (all masked off when there are none)
        r_tail = row_start + whole * BLOCK_K
        t_rows = r_tail + rs
        in_tail = t_rows < row_end
        if PREFETCH_TAIL:
            ta = tl.load(A + t_rows.to(tl.int64)[:, None] * stride_am + kcols[None, :] * stride_ak,
                         mask=in_tail[:, None] & (kcols < K)[None, :], other=0.0)
            tb = tl.load(B + t_rows.to(tl.int64)[:, None] * stride_bm + cols[None, :] * stride_bn,
                         mask=in_tail[:, None] & (cols < N)[None, :], other=0.0)
        # whole steps of BLOCK_K rows
        if TMA:
            for i in tl.range(0, whole, num_stages=STAGES):
                r0 = row_start + i * BLOCK_K
                a = a_desc.load([r0, k0])
                b = b_desc.load([r0, col0])
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = mma(tl.trans(a), b, acc, PRECISION)
        else:
            for i in tl.range(0, whole, num_stages=STAGES):
                rows = (row_start + i * BLOCK_K + rs).to(tl.int64)
                a = tl.load(A + rows[:, None] * stride_am + kcols[None, :] * stride_ak,
                            mask=(kcols < K)[None, :], other=0.0)
                b = tl.load(B + rows[:, None] * stride_bm + cols[None, :] * stride_bn,
                            mask=(cols < N)[None, :], other=0.0)
                if UPCAST:
                    a, b = a.to(tl.float32), b.to(tl.float32)
                acc = mma(tl.trans(a), b, acc, PRECISION)
        if PREFETCH_TAIL:
            if r_tail < row_end:
                if UPCAST:
                    ta, tb = ta.to(tl.float32), tb.to(tl.float32)
                acc = mma(tl.trans(ta), tb, acc, PRECISION)
        elif r_tail < row_end:
            a = tl.load(A + t_rows.to(tl.int64)[:, None] * stride_am + kcols[None, :] * stride_ak,
                        mask=in_tail[:, None] & (kcols < K)[None, :], other=0.0)
            b = tl.load(B + t_rows.to(tl.int64)[:, None] * stride_bm + cols[None, :] * stride_bn,
                        mask=in_tail[:, None] & (cols < N)[None, :], other=0.0)
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = mma(tl.trans(a), b, acc, PRECISION)
        out = acc.to(C.dtype.element_ty)
        if TMA:
            c_desc.store([g, k0, col0], out.reshape(1, BLOCK_M, BLOCK_N))
        else:
            ptrs = (C + g.to(tl.int64) * stride_ce + kcols.to(tl.int64)[:, None] * stride_ck
                    + cols.to(tl.int64)[None, :] * stride_cn)
            tl.store(ptrs, out, mask=(kcols < K)[:, None] & (cols < N)[None, :])


# ---- launch helpers --------------------------------------------------------------------------------------------
def default_config(m: int, n: int, k: int, experts: int, dtype: torch.dtype, device: torch.device,
                   dw: bool = False) -> Config:
    """The tile of a launch (``dw``: of the weight-gradient kernel, whose tile is (K, N) and whose reduction runs
    over each expert's rows)."""
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    if dtype == torch.float32:
        return Config(64, 64, 32, 8, 3, 4, False)
    # the best or within 2% of the best of profiles/tune_grouped_gemm.py's sweep at E = 8, 64 and 128
    # (profiles/h100/tune_grouped_gemm.txt, profiles/h200/tune_grouped_gemm_dw.txt)
    if dw:
        if m < 2048 * experts:  # short reductions: two programs per SM, the last step's loads issued first
            return Config(128, 128, 32, 8, 4, 4, True, occupancy=2, prefetch_tail=True)
        return Config(128, 256, 32, 8, 4, 8, True)
    return Config(128, 256, 64, 8, 3, 8, True)


def _programs(tiles: int, cfg: Config, device: torch.device) -> int:
    if not cfg.persistent:
        return max(1, tiles)
    sms = sm_count(device_index(device)) \
        if device.type == "cuda" else 4
    return max(1, min(tiles, sms * cfg.occupancy))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


# ---- launchers -------------------------------------------------------------------------------------------------
def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, *, config: Config | None = None,
               tma: bool | None = None) -> torch.Tensor:
    """out (M, N) in x's dtype: rows offsets[e] .. offsets[e + 1] of x (M, K) times w[e] (w (E, K, N), any strides;
    w.transpose(1, 2) of an (E, N, K) tensor for dX); rows from offsets[E] on are 0. ``config`` overrides the tile,
    ``tma`` forces tensor descriptors on or off (tests, tuning)."""
    m, k = x.shape
    experts, _, n = w.shape
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    cfg = config or default_config(m, n, k, experts, x.dtype, x.device)
    use_tma = tma_usable(x.device, tma, "grouped_mm")
    trans_b = w.stride(2) != 1 and w.stride(1) == 1
    if use_tma:
        b_unit = 1 if trans_b else 2
        if not (tma_strides_ok(x, 1) and tma_strides_ok(w, b_unit) and tma_strides_ok(out, 1)):
            if tma:
                raise ValueError("grouped_mm: tma=True needs 16-byte aligned tensors with a unit inner stride")
            use_tma = False
    if use_tma:
        ensure_allocator()
    tile_slots = (cdiv(m, cfg.block_m) + experts + 1) * cdiv(n, cfg.block_n)
    programs = _programs(tile_slots, cfg, x.device)
    _grouped_mm_kernel[(programs,)](
        x, w, out, offsets, m, n, k, experts,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
        E_POW2=max(2, next_power_of_2(experts)), STAGES=cfg.stages, TMA=use_tma, TRANS_B=trans_b and use_tma,
        UPCAST=x.device.type != "cuda", PRECISION=_precision(x.dtype),
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out


def grouped_mm_dw(x: torch.Tensor, dout: torch.Tensor, offsets: torch.Tensor, experts: int, *,
                  out_dtype: torch.dtype | None = None, config: Config | None = None,
                  tma: bool | None = None) -> torch.Tensor:
    """dw (E, K, N) in ``out_dtype`` (default x's): dw[e] = x[rows of e]^T @ dout[rows of e], accumulated in fp32;
    experts without rows get 0. x (M, K), dout (M, N)."""
    m, k = x.shape
    n = dout.shape[1]
    out = torch.empty((experts, k, n), dtype=out_dtype or x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if m == 0:
        return out.zero_()
    x = x if x.stride(1) == 1 else x.contiguous()
    dout = dout if dout.stride(1) == 1 else dout.contiguous()
    cfg = config or default_config(m, n, k, experts, x.dtype, x.device, dw=True)
    use_tma = tma_usable(x.device, tma, "grouped_mm")
    if use_tma and not (tma_strides_ok(x, 1) and tma_strides_ok(dout, 1) and tma_strides_ok(out, 2)):
        if tma:
            raise ValueError("grouped_mm: tma=True needs 16-byte aligned tensors with a unit inner stride")
        use_tma = False
    if use_tma:
        ensure_allocator()
    tiles = experts * cdiv(k, cfg.block_m) * cdiv(n, cfg.block_n)
    programs = _programs(tiles, cfg, x.device)
    _grouped_mm_dw_kernel[(programs,)](
        x, dout, out, offsets, m, k, n, experts,
        x.stride(0), x.stride(1), dout.stride(0), dout.stride(1), out.stride(0), out.stride(1), out.stride(2),
        programs,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, STAGES=cfg.stages,
        TMA=use_tma, UPCAST=x.device.type != "cuda", PRECISION=_precision(x.dtype),
        PREFETCH_TAIL=cfg.prefetch_tail,
        num_warps=cfg.warps, num_stages=cfg.stages,
    )
    return out
