"""Triton kernels of megakern.activation: bias + GELU (tanh approximation) forward, and its backward with the bias
gradient's column sums made in the same pass; SwiGLU on interleaved (gate, up) pairs, forward and backward.

GELU in its sigmoid form: 0.5 (1 + tanh(u)) = s = 1 / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3), so
gelu(x) = x s and gelu'(x) = s + 2 x s (1 - s) u': one exp2 and one division an element, no tanh.
Forward: h (M, N) contiguous, flat blocks of BLOCK elements, y = gelu(h + b[col]) in fp32, stored in h's dtype.
Backward with a bias: a program per (BLOCK_M x BLOCK_N) tile writes dh = dy * gelu'(h + b) and the column sums of
its tile of dh (as stored, in fp32) to its row of an (M / BLOCK_M, N) fp32 buffer, which the launcher sums. The
separate bias-gradient pass over dh (a read of M x N) is gone; the partial sums add 1/64 of dh's bytes (bf16,
BLOCK_M 128). The programs run in column order (a row of tiles, then the next), so that those in flight together
read whole rows. Without a bias: flat blocks, as the forward (faster than the tiles, which only the sums need).

SwiGLU: h (..., 2F) contiguous holds unit i's gate at column 2i and its up at 2i + 1, so output element o of y
(..., F) reads the pair at flat offsets 2o, 2o + 1: a program loads a (BLOCK, 2) tile (contiguous bytes) and splits
it. Forward y = silu(g) u; backward dg = dy u s (1 + g (1 - s)), du = dy silu(g) with s = sigmoid(g), written
back interleaved as one (BLOCK, 2) tile. Math in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from megakern._reduce_triton import sum_rows

from megakern._intmath import cdiv

# the constants are literals in the kernels (Triton kernels read module globals only as constexprs, which the
# interpreter does not multiply with tensors): -2 u log2(e) = x (-2.3022... - 0.10294... x^2), 2 u' = 1.5957... +
# 0.21406... x^2


@triton.jit
def _sigmoid_2u(x):
    """1 / (1 + exp(-2u)), the exponent of 2 capped at 126: there s is about 1e-38 (its true value is smaller
    still, and x s rounds to 0 or to a few 1e-37) and the fast division is still within its range"""
    z = tl.minimum(x * (-2.302208198144325 - 0.1029432395800235 * x * x), 126.0)
    return 1.0 / (1.0 + tl.exp2(z))


@triton.jit
def _gelu_grad(x):
    s = _sigmoid_2u(x)
    return s + (x - x * s) * s * (1.5957691216057308 + 0.21406444881780073 * x * x)


@triton.jit
def _bias_gelu_fwd_kernel(H, B, Y, numel, N, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        x += tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (x * _sigmoid_2u(x)).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(DY, H, DH, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(DH + offs, (dy * _gelu_grad(x)).to(DH.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(DY, H, B, DH, PART, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          COLS_FAST: tl.constexpr = True):
    """dh of one (BLOCK_M, BLOCK_N) tile, and its column sums as a row of PART. COLS_FAST: the grid is (column
    tiles, row tiles), so that the programs in flight together cover whole rows; else (row tiles, column tiles)."""
    if COLS_FAST:
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    else:
        pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    col_ok = cols < N
    mask = (rows < M)[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    x = tl.load(H + offs, mask=mask, other=0.0).to(tl.float32)
    x += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    dh = (dy * _gelu_grad(x)).to(DH.dtype.element_ty)
    tl.store(DH + offs, dh, mask=mask)
    tl.store(PART + pid_m.to(tl.int64) * N + cols, tl.sum(dh.to(tl.float32), axis=0), mask=col_ok)


# a CUDA grid's second and third axes hold at most 65535 programs
_GRID_Y_MAX = 65535


def _bias_bwd_tile(h: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, warps) of the backward with a bias (docs/tuning.md, bias + GELU)."""
    return (128, 64, 8) if h.is_cuda else (8, 32, 4)


def _flat_block(h: torch.Tensor) -> tuple[int, int]:
    """(BLOCK, warps) of the flat kernels (docs/tuning.md, bias + GELU)."""
    return (2048, 4) if h.is_cuda else (256, 4)


def fwd(h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = torch.empty_like(h)
    numel, n = h.numel(), h.shape[-1]
    if numel == 0:
        return y
    block, warps = _flat_block(h)
    _bias_gelu_fwd_kernel[(cdiv(numel, block),)](h, bias if bias is not None else h, y, numel, n,
                                                 HAS_BIAS=bias is not None, BLOCK=block, num_warps=warps)
    return y


def bwd(dy: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None,
        tile: tuple[int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dh, dbias): dh like h, dbias the column sums of dh summed in fp32, in the bias's dtype (None without a
    bias). ``tile``: (BLOCK_M, BLOCK_N, warps) of the backward with a bias in place of ``_bias_bwd_tile``'s
    (tuning)."""
    n = h.shape[-1]
    m = h.numel() // max(n, 1)
    dh = torch.empty_like(h)
    if h.numel() == 0:
        return dh, (torch.zeros(n, dtype=torch.float32, device=h.device) if bias is not None else None)
    if bias is None:
        block, warps = _flat_block(h)
        _gelu_bwd_kernel[(cdiv(h.numel(), block),)](dy, h, dh, h.numel(), BLOCK=block, num_warps=warps)
        return dh, None
    # a tile per program, its column sums to a row of part: (M / BLOCK_M) x N fp32, 1/64 of dh's bytes in bf16;
    # the programs in column order where the row tiles fit the grid's second axis (docs/tuning.md, bias + GELU)
    block_m, block_n, warps = tile or _bias_bwd_tile(h)
    row_tiles, col_tiles = cdiv(m, block_m), cdiv(n, block_n)
    cols_fast = row_tiles <= _GRID_Y_MAX
    grid = (col_tiles, row_tiles) if cols_fast else (row_tiles, col_tiles)
    part = torch.empty((row_tiles, n), dtype=torch.float32, device=h.device)
    _bias_gelu_bwd_kernel[grid](dy, h, bias, dh, part, m, n, BLOCK_M=block_m, BLOCK_N=block_n, COLS_FAST=cols_fast,
                                num_warps=warps)
    return dh, sum_rows(part, bias.dtype)


@triton.jit
def _swiglu_fwd_kernel(H, Y, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pair = 2 * offs[:, None] + tl.arange(0, 2)[None, :]
    g, u = tl.split(tl.load(H + pair, mask=mask[:, None], other=0.0).to(tl.float32))
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(Y + offs, (g * s * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, H, DH, numel, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    pair = 2 * offs[:, None] + tl.arange(0, 2)[None, :]
    g, u = tl.split(tl.load(H + pair, mask=mask[:, None], other=0.0).to(tl.float32))
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    du = dy * g * s
    dg = dy * u * s * (1.0 + g * (1.0 - s))
    tl.store(DH + pair, tl.join(dg, du).to(DH.dtype.element_ty), mask=mask[:, None])


def _swiglu_block(h: torch.Tensor) -> tuple[int, int]:
    """(BLOCK, warps): output elements a program."""
    return (2048, 8) if h.is_cuda else (128, 4)


def swiglu_fwd(h: torch.Tensor) -> torch.Tensor:
    """y (..., F) in h's dtype from contiguous h (..., 2F)."""
    y = torch.empty((*h.shape[:-1], h.shape[-1] // 2), dtype=h.dtype, device=h.device)
    numel = y.numel()
    if numel:
        block, warps = _swiglu_block(h)
        _swiglu_fwd_kernel[(cdiv(numel, block),)](h, y, numel, BLOCK=block, num_warps=warps)
    return y


def swiglu_bwd(dy: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """dh like contiguous h from contiguous dy (..., F)."""
    dh = torch.empty_like(h)
    numel = dy.numel()
    if numel:
        block, warps = _swiglu_block(h)
        _swiglu_bwd_kernel[(cdiv(numel, block),)](dy, h, dh, numel, BLOCK=block, num_warps=warps)
    return dh
