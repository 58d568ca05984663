"""LayerNorm and RMSNorm (megakern/_norm.py, rmsnorm.py, layernorm.py) on every implementation.

Outputs and every gradient are held to the 2x rule against the fp64 reference (see conftest), on fresh random
inputs, odd and strided shapes, fused residuals of both dtypes, fp32 weights, no weights. On a CPU the Triton
kernels run under the interpreter on small shapes; on a GPU, also both CUDA paths and large and long rows.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from conftest import (ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, cuda_path_problem, kernel_variants,
                      launchers_for, poison_cuda_allocator, seed, skip_interpreter_faults)

import megakern
from megakern import _norm
from megakern.layernorm import layer_norm_ref
from megakern.rmsnorm import rms_norm_ref

OPS = ("rms_norm", "layer_norm")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# odd sizes (scalar path), 16-byte multiples (vector path), short rows (a warp per row), long rows (streaming)
SHAPES = [(5, 123, 123), (4, 333, 1024), (2, 300, 8192), (64, 16384), (3, 4097), (2, 3, 65536), (7, 33), (6, 3072),
          (3, 5, 9216), (5, 14000)] if HAS_CUDA \
    else [(5, 7, 123), (3, 64), (2, 1)]
SETUPS = ("affine", "residual", "fp32-residual-fp32-weight", "no-affine")


def _ref(op, x, w, b, eps, residual):
    if op == "rms_norm":
        return rms_norm_ref(x, w, eps, residual)
    return layer_norm_ref(x, w, b, eps, residual)


def _lowp(op, x, w, b, eps, residual):
    """Plain torch in the inputs' precision: torch's own rms_norm / layer_norm, weights in the input's dtype."""
    h = None if residual is None else (x + residual).to(residual.dtype)
    inp = x if h is None else h
    w, b = (None if t is None else t.to(inp.dtype) for t in (w, b))
    if op == "rms_norm":
        y = F.rms_norm(inp, (inp.shape[-1],), w, eps)
    else:
        y = F.layer_norm(inp, (inp.shape[-1],), w, b, eps)
    y = y.to(x.dtype)
    return y if h is None else (y, h)


def run(variant, op, x, w, b, eps, residual, launchers=None):
    """One implementation: the public op for 'torch' / 'triton', the autograd Function for a CUDA path (or for the
    given ``launchers``)."""
    if launchers is not None:
        return _norm.NormFunction.apply(x, w, b, residual, eps, op == "rms_norm", launchers)
    if variant in ("torch", "triton"):
        launchers_for(variant)  # skips when unavailable
        fn = getattr(megakern, op)
        args = (x, w) if op == "rms_norm" else (x, w, b)
        return fn(*args, eps, residual=residual, backend=variant)
    return _norm.NormFunction.apply(x, w, b, residual, eps, op == "rms_norm", launchers_for(variant))


def make_inputs(op, dtype, shape, setup, device=DEVICE):
    n = shape[-1]
    wdtype = torch.float32 if setup == "fp32-residual-fp32-weight" else dtype
    x = torch.randn(shape, dtype=dtype, device=device)
    w = b = r = None
    if setup != "no-affine":
        w = 1 + 0.5 * torch.randn(n, dtype=wdtype, device=device)
        b = 0.5 * torch.randn(n, dtype=wdtype, device=device) if op == "layer_norm" else None
    if setup in ("residual", "no-affine"):
        r = torch.randn(shape, dtype=dtype, device=device)
    elif setup == "fp32-residual-fp32-weight":
        r = torch.randn(shape, dtype=torch.float32, device=device)
    return x, w, b, r


def assert_outputs_close(expected, actual, atol=1e-5):
    """Two launches' outputs (None where a launch has none) equal to rounding: fp32 to 1e-5, 16-bit to 1e-2."""
    for a, c in zip(expected, actual, strict=True):
        assert (a is None) == (c is None)
        if a is not None:
            torch.testing.assert_close(c, a, rtol=1e-5 if a.dtype == torch.float32 else 1e-2, atol=atol)


def check_fwd_bwd(variant, op, dtype, x, w, b, r, eps=1e-5, dy_fn=torch.randn_like, launchers=None):
    """Run one implementation and the two references, compare outputs and all gradients, check inputs intact."""
    skip_interpreter_faults(variant, dtype)
    leaves = [t for t in (x, w, b, r) if t is not None]
    saved = [t.clone() for t in leaves]
    for t in leaves:
        t.requires_grad_(True)
    poison_cuda_allocator(8 * x.numel() * 4)
    out = run(variant, op, x, w, b, eps, r, launchers)
    outs = out if isinstance(out, tuple) else (out,)
    douts = [dy_fn(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, douts)

    truth_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    lowp_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]

    def unpack(ls):
        it = iter(ls)
        return [next(it) if t is not None else None for t in (x, w, b, r)]

    tx, tw, tb, tr = unpack(truth_leaves)
    truth = _ref(op, tx, tw, tb, eps, tr)
    lx, lw, lb, lr = unpack(lowp_leaves)
    lowp = _lowp(op, lx, lw, lb, eps, lr)
    truth, lowp = (truth if isinstance(truth, tuple) else (truth,)), (lowp if isinstance(lowp, tuple) else (lowp,))
    truth_grads = torch.autograd.grad(truth, truth_leaves, [d.double() for d in douts])
    lowp_grads = torch.autograd.grad(lowp, lowp_leaves, douts)

    atol = ATOL[dtype]
    for name, o, t, lo in zip(("y", "residual_out"), outs, truth, lowp):
        assert o.dtype == lo.dtype, f"{name}: dtype {o.dtype}, expected {lo.dtype}"
        assert_close_to_ref(f"{variant} {op} {name}", o, t, lo, atol)
    names = [n for n, t in zip(("dx", "dweight", "dbias", "dresidual"), (x, w, b, r)) if t is not None]
    for name, g, t, lo, leaf in zip(names, grads, truth_grads, lowp_grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"{name}: {g.dtype} {tuple(g.shape)} for {leaf.dtype}"
        assert_close_to_ref(f"{variant} {op} {name}", g, t, lo, atol * max(1.0, t.abs().max().item()))
    for t, s in zip(leaves, saved):
        assert torch.equal(t.detach(), s), "an input was modified"


@pytest.mark.parametrize("setup", SETUPS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", kernel_variants())
@pytest.mark.parametrize("op", OPS)
def test_matches_reference(op, variant, dtype, shape, setup):
    seed(op, variant, dtype, shape, setup)
    x, w, b, r = make_inputs(op, dtype, shape, setup)
    check_fwd_bwd(variant, op, dtype, x, w, b, r)


GEOMETRIES = {"1-row": dict(rows=1), "2-rows": dict(rows=2), "1-row-prefetch": dict(prefetch=True),
              "2-rows-prefetch": dict(rows=2, prefetch=True),
              "wide": dict(wide=True, chunk=32),
              "wide-1-stage": dict(wide=True, chunk=64, stages=1),
              "wide-4-rows": dict(wide=True, rows=4, chunk=32),
              "split": dict(split=True), "split-2-rows-prefetch": dict(split=True, rows=2, prefetch=True),
              "split-wide": dict(split=True, wide=True, rows=2, chunk=32),
              "split-narrow-strips": dict(split=True, split_geometry=(32, 4, 2, 2)),
              "split-strip-dx": dict(split=True, wide=True, strip_dx=True, rows=2, chunk=32),
              "split-strip-dx-unrolled": dict(split=True, wide=True, strip_dx=True, rows=1, chunk=32, unrolled=True,
                                              split_geometry=(32, 4, 2, 2)),
              "split-strip-dx-wide-strips": dict(split=True, wide=True, strip_dx=True, rows=1, chunk=32, unrolled=True,
                                                 warps=8, split_geometry=(1024, 4, 8, 2))}


@pytest.mark.parametrize("rows", (1, 2))
@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_tail(op, setup, rows):
    """The forward and the backward with a row as two power-of-two tiles (the forward's ``tiles=2``, the
    backward's ``tail``): hidden sizes whose tail tile is partly masked or full, one and several rows a program or
    step (the backward with and without the next step loaded ahead), against the references; the forward's
    statistics and output equal to the one-tile forward's to rounding."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    for n in ((1536, 5120, 12288) if HAS_CUDA else (20, 24)):
        assert nt.tail_split(n) is not None
        seed(op, setup, rows, n)
        x, w, b, r = make_inputs(op, dtype, (2, 5, n), setup)
        if op == "layer_norm":  # rows far from zero mean: the mean must come from both tiles
            x.add_(torch.linspace(-8, 8, n, dtype=dtype, device=x.device))
        tail = functools.partial(fwd, tiles=2, rows_per_program=rows)
        for prefetch in (False, True):  # the backward as two tiles as well
            tail_bwd = functools.partial(bwd, tail=True, rows=rows, prefetch=prefetch, per_sm=3)
            check_fwd_bwd("triton", op, dtype, x, w, b, r, launchers=(tail, tail_bwd))
        args = (x.reshape(-1, n), None if r is None else r.reshape(-1, n), w, b, 1e-5, op == "rms_norm")
        one, two = nt.fwd(*args, rows_per_program=rows, tiles=1), nt.fwd(*args, rows_per_program=rows, tiles=2)
        assert_outputs_close(one, two)


@pytest.mark.parametrize("rows", (1, 2))
@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_three_tiles(op, setup, rows):
    """The forward with a row as three power-of-two tiles (``tiles=3``): hidden sizes whose last tile is partly masked
    or full (every column in a tile), one and several rows a program, against the references (the backward as the
    launch table has it); its statistics and output equal to the one-tile forward's to rounding."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    for n in ((3584, 13000, 13312) if HAS_CUDA else (27, 28)):
        assert nt.three_split(n) is not None
        seed(op, setup, rows, n, "three")
        x, w, b, r = make_inputs(op, dtype, (2, 5, n), setup)
        if op == "layer_norm":  # rows far from zero mean: the mean must come from all three tiles
            x.add_(torch.linspace(-8, 8, n, dtype=dtype, device=x.device))
        check_fwd_bwd("triton", op, dtype, x, w, b, r,
                      launchers=(functools.partial(fwd, tiles=3, rows_per_program=rows), bwd))
        args = (x.reshape(-1, n), None if r is None else r.reshape(-1, n), w, b, 1e-5, op == "rms_norm")
        one = nt.fwd(*args, rows_per_program=rows, tiles=1)
        three = nt.fwd(*args, rows_per_program=rows, tiles=3)
        assert_outputs_close(one, three)


@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_wide_forward_unrolled(op, setup):
    """The two-pass forward with the row's chunk count compiled in (``unrolled``): a partial last chunk and a row
    its chunks fill (no mask), against the references and equal to the looped kernel's output and statistics to
    rounding."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    chunk = 2048 if HAS_CUDA else 32
    for n in ((9000, 12288) if HAS_CUDA else (100, 128)):
        seed(op, setup, n, "wide-unrolled")
        x, w, b, r = make_inputs(op, dtype, (2, 7, n), setup)
        if op == "layer_norm":  # rows far from zero mean: the lanes' Welford statistics must not cancel
            x.add_(torch.linspace(-8, 8, n, dtype=dtype, device=x.device))
        unrolled = functools.partial(fwd, wide=True, chunk=chunk, unrolled=True)
        check_fwd_bwd("triton", op, dtype, x, w, b, r, launchers=(unrolled, bwd))
        args = (x.reshape(-1, n), None if r is None else r.reshape(-1, n), w, b, 1e-5, op == "rms_norm")
        looped = nt.fwd(*args, wide=True, chunk=chunk)
        assert_outputs_close(looped, nt.fwd(*args, wide=True, chunk=chunk, unrolled=True))


def test_triton_layer_norm_rows_of_one_value():
    """A row of one value has that value as its mean, a variance of zero and y equal to the bias, exactly, in every
    LayerNorm forward: the register kernel (one tile; three), the wide one looped, unrolled as shifted sums and as
    Welford's chain. (On a GPU a mean divided approximately would miss the value by an ulp, and rstd = eps^-1/2
    would scale that to a visible y.)"""
    from megakern import _norm_triton as nt

    values = torch.tensor([0.0, 1.0, -3.5, 100.5, 1e4, -12480.0, 3e5, 2.0**-10], device=DEVICE)
    launches = ((1000, {}), (13312, dict(wide=False, tiles=3)), (12800, dict(wide=True, chunk=2048)),
                (12800, dict(wide=True, chunk=2048, unrolled=True)),
                (20000, dict(wide=True, chunk=4096, unrolled=True)),
                (13312, dict(wide=True, chunk=4096, unrolled=True, sums=True)),
                (13312, dict(wide=True, chunk=4096, unrolled=True, sums=False)))
    if not HAS_CUDA:
        launches = ((100, {}), (100, dict(wide=True, chunk=32)), (100, dict(wide=True, chunk=32, unrolled=True)),
                    (4100, dict(wide=True, chunk=4096, unrolled=True)),
                    (100, dict(wide=True, chunk=32, unrolled=True, sums=False)))
    for n, kwargs in launches:
        seed(n, "one-value")
        x = values[:, None].expand(-1, n).to(torch.bfloat16)
        w = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        b = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        y, _, mean, rstd = nt.fwd(x, None, w, b, 1e-5, False, **kwargs)
        assert torch.equal(mean, values.to(torch.bfloat16).float()), (n, kwargs, mean)
        torch.testing.assert_close(rstd, torch.full_like(rstd, 1e-5 ** -0.5), rtol=1e-6, atol=0)
        assert torch.equal(y, b.expand_as(y)), (n, kwargs, (y.float() - b.float()).abs().max())


@pytest.mark.parametrize("residual", (False, True))
@pytest.mark.parametrize("offset", (0.0, 100.0, 1e4))
def test_triton_wide_forward_statistics_far_from_zero(offset, residual):
    """LayerNorm's two-pass forward, looped (Welford's lanes) and unrolled (the lanes' sums less their first
    column, or Welford's lanes), on rows whose mean is far from zero beside their spread, with a partial last chunk and without, x alone
    or x plus a residual: mean and rstd against float64's of the same rows. The rows are bf16 values, so that at an
    offset of 1e4 most rows are one value repeated: a variance of zero that a mean rounded in fp32 would not give."""
    from megakern import _norm_triton as nt

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    chunk = 2048 if HAS_CUDA else 32
    for n in ((12800, 14336) if HAS_CUDA else (100, 128)):
        seed(offset, n, residual, "wide-far")
        h = (torch.randn(9, n, device=DEVICE) * 0.5 + offset
             + torch.linspace(-1, 1, 9, device=DEVICE)[:, None] * offset).to(torch.bfloat16).to(dtype)
        x, res = h, None
        if residual:  # x + res == h exactly: res is x's bf16 half, and h - res is a bf16 value too
            res = (h / 2).to(torch.bfloat16).to(dtype)
            x = h - res
            assert torch.equal(x + res, h)
        ref = h.double()
        mean, var = ref.mean(dim=1), ref.var(dim=1, unbiased=False)
        rstd = torch.rsqrt(var + 1e-5)
        for unrolled, sums in ((False, None), (True, True), (True, False)):
            _, res_out, got_mean, got_rstd = nt.fwd(x, res, None, None, 1e-5, False, wide=True, chunk=chunk,
                                                    unrolled=unrolled, sums=sums)
            if residual:
                assert torch.equal(res_out, h)
            torch.testing.assert_close(got_mean.double(), mean, rtol=1e-6, atol=1e-6 * max(offset, 1.0))
            # the statistics are of the row less its first column: fp32 keeps the spread's digits, not the mean's
            torch.testing.assert_close(got_rstd.double(), rstd, rtol=1e-4, atol=0)


@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_widths_not_multiples_of_16(op, setup):
    """Rows whose width (or stride) is not a multiple of 16, where the launchers tell the kernels the power of two
    that divides them (ALIGN 8, 4, 2) or nothing (odd), forward and backward against the references, one tile and
    two (9000 = 8192 + 1024 on a GPU) and the two-pass backward (20008), and rows padded to a stride 8 past the
    width."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    widths = (9000, 5000, 4100, 2050, 1001, 20008) if HAS_CUDA else (40, 100, 50, 27)
    for n in widths:
        seed(op, setup, n, "odd-width")
        x, w, b, r = make_inputs(op, dtype, (3, 7, n), setup)
        check_fwd_bwd("triton", op, dtype, x, w, b, r, launchers=(fwd, bwd))
        padded = torch.randn(3, 7, n + 8, dtype=dtype, device=DEVICE)[..., :n]
        assert nt.row_alignment(n, padded.stride(1)) == nt.row_alignment(n, n + 8) > 1 or n % 2
        check_fwd_bwd("triton", op, dtype, padded, w, b, None, launchers=(fwd, bwd))


@pytest.mark.parametrize("rows", (1, 2))
@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_wide_backward_unrolled(op, setup, rows):
    """The two-pass backward with the row's chunk count compiled in (``unrolled``): a partial last chunk and a row
    its chunks fill (no column mask), one and two rows a step over row counts that leave a step partial, against the
    references, and its dx, dweight and dbias equal to the looped kernel's to rounding."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    chunk = 2048 if HAS_CUDA else 32
    for n in ((9000, 12288) if HAS_CUDA else (100, 128)):
        seed(op, setup, rows, n, "wide-bwd-unrolled")
        x, w, b, r = make_inputs(op, dtype, (3, 7, n), setup)
        if op == "layer_norm":
            x.add_(torch.linspace(-8, 8, n, dtype=dtype, device=x.device))
        unrolled = functools.partial(bwd, wide=True, rows=rows, chunk=chunk, unrolled=True)
        check_fwd_bwd("triton", op, dtype, x, w, b, r, launchers=(fwd, unrolled))
        x2 = x.detach().reshape(-1, n)
        r2 = None if r is None else r.detach().reshape(-1, n)
        is_rms = op == "rms_norm"
        w2, b2 = (None if t is None else t.detach() for t in (w, b))
        _, res_out, mean, rstd = nt.fwd(x2, r2, w2, b2, 1e-5, is_rms)
        dy = torch.randn_like(x2)
        dres_out = None if r2 is None else torch.randn_like(x2)
        residual_dtype = None if r2 is None else r2.dtype
        args = (dy, x2 if res_out is None else res_out, dres_out, w2, mean, rstd, is_rms, residual_dtype,
                w2 is not None, b2 is not None)
        looped = nt.bwd(*args, wide=True, rows=rows, chunk=chunk)
        assert_outputs_close(looped, nt.bwd(*args, wide=True, rows=rows, chunk=chunk, unrolled=True), atol=1e-4)


@pytest.mark.parametrize("op", OPS)
def test_triton_forward_register_bound(op):
    """The forward with its registers bounded (``maxnreg``, tuning) gives the unbounded kernel's output and
    statistics bit for bit (three tiles at 8 warps on a GPU, where the bound lets a third program onto an SM; the
    two-pass kernel unrolled, LayerNorm's statistics as shifted sums and as Welford's chain, each close to the
    register kernel's); a bound outside [24, 255] is refused by name."""
    from megakern import _norm_triton as nt

    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    n = 13312 if HAS_CUDA else 28
    seed(op, n, "maxnreg")
    # (the interpreter runs a program at a time: 13 rows there)
    x, w, b, _ = make_inputs(op, dtype, (3, 67, n) if HAS_CUDA else (13, n), "affine")
    args = (x.reshape(-1, n), None, w, None if op == "rms_norm" else b, 1e-5, op == "rms_norm")
    free = nt.fwd(*args, num_warps=8, tiles=3)
    bound = nt.fwd(*args, num_warps=8, tiles=3, maxnreg=80)
    for a, c in zip(free, bound):
        if a is not None:
            assert torch.equal(a, c)
    # the two-pass kernel unrolled (a partial last chunk) under a bound that leaves it 32 registers, LayerNorm's
    # statistics either way
    wide = dict(num_warps=8, wide=True, unrolled=True, chunk=2048 if HAS_CUDA else 8)
    for sums in (None,) if op == "rms_norm" else (True, False):
        free = nt.fwd(*args, sums=sums, **wide)
        for a, c in zip(free, nt.fwd(*args, sums=sums, maxnreg=32, **wide)):
            if a is not None:
                assert torch.equal(a, c), sums
        for a, c in zip(free, bound):
            if a is not None:
                torch.testing.assert_close(a, c, rtol=2e-2 if a.dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    for bad in (16, 256, 80.0):
        with pytest.raises(ValueError, match="maxnreg must be an int in \\[24, 255\\]"):
            nt.fwd(*args, maxnreg=bad)


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("setup", ("affine", "residual", "fp32-residual-fp32-weight", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_geometries(op, setup, geometry):
    """Each backward geometry the launch table picks from (rows a step, the next step's rows loaded ahead or not, the
    two-pass kernels for wide rows, forward and backward, the split backward's dx kernels and its column kernel, the
    latter also writing dx after the two-pass kernel's row sums), on
    row counts that leave programs a partial last step, one row, or none, and on a hidden size that leaves the last
    chunk of a wide row partial."""
    fwd, bwd = launchers_for("triton")
    if geometry.startswith("wide"):  # the wide forward with it
        fwd = functools.partial(fwd, wide=True, chunk=GEOMETRIES[geometry]["chunk"])
    dtype = torch.bfloat16 if HAS_CUDA else torch.float32
    shape = (5, 333, 1000) if HAS_CUDA else (3, 5, 100)
    for rows, per_sm in ((shape[1], 3), (2, 1)):
        seed(op, setup, geometry, rows)
        x, w, b, r = make_inputs(op, dtype, (shape[0], rows, shape[2]), setup)
        if op == "layer_norm":  # rows far from zero mean: the statistics must not cancel (the wide kernel merges
            x.add_(torch.linspace(-8, 8, x.shape[-1], dtype=dtype, device=x.device))  # chunk means that differ)
        launchers = (fwd, functools.partial(bwd, per_sm=per_sm, **GEOMETRIES[geometry]))
        check_fwd_bwd("triton", op, dtype, x, w, b, r, launchers=launchers)


def compile_for_sm90() -> list:
    """(kernel, shared memory bytes) for the forward and backward kernels of both ops, for rows in registers (the
    backward with prefetch; both also as two tiles, the forward as three) and for wide rows, with and without the
    fused residual, compiled for sm_90 (TRITON_INTERPRET=0)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _norm_triton as nt

    pointers = {"X", "RES", "W", "B", "Y", "RES_OUT", "MEAN", "RSTD", "DY", "DRES_OUT", "DX", "DRES", "DW_PARTIAL",
                "DB_PARTIAL", "ROW_SUMS"}
    fp32 = {"MEAN", "RSTD", "DRES", "DW_PARTIAL", "DB_PARTIAL", "ROW_SUMS"}
    results = []
    for is_rms, residual in ((True, False), (False, True)):
        flags = dict(IS_RMS=is_rms, HAS_W=True)
        cases = [("fwd", nt._norm_fwd_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms, BLOCK_M=1,
                                                   BLOCK_N=8192, BLOCK_T=0, BLOCK_U=0, EVEN_N=False), 8),
                 ("fwd even", nt._norm_fwd_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms, BLOCK_M=1,
                                                        BLOCK_N=8192, BLOCK_T=0, BLOCK_U=0, EVEN_N=True), 8),
                 ("fwd tail", nt._norm_fwd_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms, BLOCK_M=1,
                                                        BLOCK_N=8192, BLOCK_T=4096, BLOCK_U=0, EVEN_N=False), 8),
                 ("fwd three", nt._norm_fwd_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms, BLOCK_M=1,
                                                         BLOCK_N=8192, BLOCK_T=4096, BLOCK_U=1024, EVEN_N=True), 8),
                 ("fwd aligned by 8", nt._norm_fwd_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms,
                                                                BLOCK_M=2, BLOCK_N=8192, BLOCK_T=1024, BLOCK_U=0,
                                                                EVEN_N=False, ALIGN=8), 8),
                 ("bwd", nt._norm_bwd_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms, HAS_DRES_OUT=residual,
                                                   HAS_DRES=False, BLOCK_M=1, BLOCK_N=8192, PREFETCH=True,
                                                   BLOCK_T=0, EVEN_N=True), 16),
                 ("bwd tail", nt._norm_bwd_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms,
                                                        HAS_DRES_OUT=residual, HAS_DRES=False, BLOCK_M=1,
                                                        BLOCK_N=8192, PREFETCH=True, BLOCK_T=4096,
                                                        EVEN_N=False), 16),
                 ("bwd tail no weight", nt._norm_bwd_kernel, dict(flags, HAS_W=False, HAS_DW=False, HAS_DB=False,
                                                                  HAS_DRES_OUT=residual, HAS_DRES=False, BLOCK_M=1,
                                                                  BLOCK_N=8192, PREFETCH=True, BLOCK_T=4096,
                                                                  EVEN_N=False), 16),
                 ("bwd aligned by 8", nt._norm_bwd_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms,
                                                                HAS_DRES_OUT=residual, HAS_DRES=False, BLOCK_M=1,
                                                                BLOCK_N=8192, PREFETCH=True, BLOCK_T=1024,
                                                                EVEN_N=False, ALIGN=8), 16),
                 ("fwd wide", nt._norm_fwd_wide_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms, CHUNK=4096,
                                                             STAGES=2, CHUNKS=0, EVEN_N=False), 8),
                 ("fwd wide unrolled", nt._norm_fwd_wide_kernel, dict(flags, HAS_RES=residual, HAS_B=not is_rms,
                                                                      CHUNK=2048, STAGES=1, CHUNKS=6, EVEN_N=True,
                                                                      SUMS=not is_rms, WIDTH=12288), 16),
                 ("fwd wide unrolled chain", nt._norm_fwd_wide_kernel, dict(flags, HAS_RES=residual,
                                                                            HAS_B=not is_rms, CHUNK=4096, STAGES=1,
                                                                            CHUNKS=5, EVEN_N=False, SUMS=False,
                                                                            WIDTH=18000), 16),
                 ("fwd wide unrolled sums 4096", nt._norm_fwd_wide_kernel, dict(flags, HAS_RES=residual,
                                                                                HAS_B=not is_rms, CHUNK=4096,
                                                                                STAGES=1, CHUNKS=4, EVEN_N=False,
                                                                                SUMS=not is_rms, WIDTH=14336), 8),
                 ("bwd wide", nt._norm_bwd_wide_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms,
                                                             HAS_DRES_OUT=residual, HAS_DRES=residual, BLOCK_M=2,
                                                             CHUNK=2048, STAGES=2, CHUNKS=0, EVEN_N=False), 8),
                 ("bwd wide aligned by 8", nt._norm_bwd_wide_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms,
                                                                         HAS_DRES_OUT=residual, HAS_DRES=residual,
                                                                         BLOCK_M=4, CHUNK=2048, STAGES=3, CHUNKS=0,
                                                                         EVEN_N=False, ALIGN=8), 8),
                 ("bwd wide unrolled", nt._norm_bwd_wide_kernel, dict(flags, HAS_DW=True, HAS_DB=not is_rms,
                                                                      HAS_DRES_OUT=residual, HAS_DRES=residual,
                                                                      BLOCK_M=2, CHUNK=4096, STAGES=1, CHUNKS=5,
                                                                      EVEN_N=True), 16),
                 ("bwd dwdb", nt._norm_bwd_dwdb_kernel, dict(IS_RMS=is_rms, HAS_DW=True, HAS_DB=not is_rms,
                                                            BLOCK_M=16, BLOCK_C=256, HAS_DX=False, HAS_W=False,
                                                            HAS_DRES_OUT=False, HAS_DRES=False), 4),
                 ("bwd wide row sums", nt._norm_bwd_wide_kernel, dict(flags, HAS_DW=False, HAS_DB=False,
                                                                      HAS_DRES_OUT=False, HAS_DRES=False, BLOCK_M=1,
                                                                      CHUNK=4096, STAGES=1, CHUNKS=8, EVEN_N=True,
                                                                      SUMS_ONLY=True), 16),
                 ("bwd strips dx", nt._norm_bwd_dwdb_kernel, dict(IS_RMS=is_rms, HAS_DW=True, HAS_DB=not is_rms,
                                                                 BLOCK_M=16, BLOCK_C=256, HAS_DX=True, HAS_W=True,
                                                                 HAS_DRES_OUT=residual, HAS_DRES=residual), 4)]
        for name, kernel, constexprs, warps in cases:
            # the constexprs a case leaves out at their defaults, as a launch leaves them
            constexprs = {p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default} | constexprs
            signature = {a: "constexpr" if a in constexprs else
                         ("*fp32" if a in fp32 else "*bf16") if a in pointers else
                         "fp32" if a == "eps" else "i32" for a in kernel.arg_names}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                      target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
            results.append((f"{'rms' if is_rms else 'ln'} {name}{' residual' if residual else ''}",
                            compiled.metadata.shared))
    return results


def test_kernels_compile_for_sm90():
    """Every norm kernel lowers for Hopper (the interpreter runs the rest of this file on a CPU)."""
    from conftest import sm90_lowering

    results = sm90_lowering("test_norm", "compile_for_sm90()")
    assert len(results) == 38, results


def test_sass_profile_reads_resources():
    """profiles/sass_sm90.py compiles the forward as its launcher would (aligned, so vectorized) for sm_90 and reads
    registers, spills and instructions from the cubin: the 1024-wide RMSNorm forward holds a few dozen registers
    and spills nothing, in well under the ~360 instructions of the same kernel with scalar (unaligned) loads."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton.backends.compiler")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(root))
    run = subprocess.run([sys.executable, str(root / "profiles" / "sass_sm90.py"), "norm", "--ops", "rms",
                          "--hidden", "1024", "--warps", "4", "--rows", "2"], capture_output=True, text=True,
                         env=env, timeout=600)
    if run.returncode and "GPUTarget" in run.stderr:
        pytest.skip("this Triton cannot compile for sm_90 without a GPU")
    assert run.returncode == 0, run.stderr[-2000:]
    row = re.search(r"rms fwd  1024 warps  4 rows 2 .*regs +(\d+) spilled +(\d+) B +instructions +(\d+)", run.stdout)
    assert row, run.stdout
    regs, spilled, instructions = map(int, row.groups())
    assert 16 <= regs <= 64 and spilled == 0 and 50 < instructions < 320, run.stdout
    # the two-pass kernel, unrolled over a row of 6 chunks, with its SASS order of loads and math
    run = subprocess.run([sys.executable, str(root / "profiles" / "sass_sm90.py"), "norm", "--ops", "ln",
                          "--hidden", "12288", "--warps", "8", "--wide", "2048", "--unrolled", "--order"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"ln  fwd 12288 warps  8 wide chunk 2048 unrolled +regs +\d+ spilled +0 B", run.stdout), run.stdout
    order = re.search(r"order ([LSFB]+)", run.stdout)
    assert order and order.group(1).count("L") >= 3 and "F" in order.group(1), run.stdout


LAYOUTS = ("padded-rows", "strided-leading", "transposed", "misaligned")


def _strided(layout, shape, dtype):
    """x of ``shape`` laid out as a non-contiguous view of a larger buffer."""
    *lead, n = shape
    if layout == "padded-rows":  # rows 16-byte aligned, gaps between them
        return torch.randn(*lead, n + 16, dtype=dtype, device=DEVICE)[..., 8:n + 8]
    if layout == "strided-leading":  # every other row
        return torch.randn(lead[0], 2 * lead[1], n, dtype=dtype, device=DEVICE)[:, ::2]
    if layout == "transposed":  # hidden dim not unit-stride
        return torch.randn(lead[0], n, lead[1], dtype=dtype, device=DEVICE).transpose(1, 2)
    return torch.randn(lead[0] * lead[1] * n + 1, dtype=dtype, device=DEVICE)[1:].view(shape)  # misaligned start


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", kernel_variants())
@pytest.mark.parametrize("op", OPS)
def test_non_contiguous(op, variant, dtype, layout):
    shape = (3, 50, 1024) if HAS_CUDA else (2, 5, 64)
    seed(op, variant, dtype, layout)
    x = _strided(layout, shape, dtype)
    _, w, b, _ = make_inputs(op, dtype, shape, "affine")
    r = _strided(layout, shape, dtype)
    # dy broadcast along rows: stride 0 between rows
    check_fwd_bwd(variant, op, dtype, x, w, b, r, dy_fn=lambda o: torch.randn_like(o[..., :1, :]).expand_as(o))


@pytest.mark.parametrize("variant", kernel_variants())
@pytest.mark.parametrize("op", OPS)
def test_empty_rows(op, variant):
    x = torch.randn(0, 3, 64, device=DEVICE, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    y = run(variant, op, x, w, None, 1e-5, None)
    assert y.shape == x.shape
    dx, dw = torch.autograd.grad(y, (x, w), torch.randn_like(y))
    assert dx.shape == x.shape and torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("op", OPS)
def test_modules(op):
    """The nn.Module forms: same as the functional, parameters trained, kernel table honoured."""
    n = 96
    mod = megakern.RMSNorm(n, backend={op: "torch"}) if op == "rms_norm" else megakern.LayerNorm(n, backend="torch")
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x, r = torch.randn(4, 5, n), torch.randn(4, 5, n)
    y, h = mod(x, r)
    fn = getattr(megakern, op)
    args = (x, mod.weight) if op == "rms_norm" else (x, mod.weight, mod.bias)
    y_fn, h_fn = fn(*args, mod.eps, residual=r, backend="torch")
    assert torch.equal(y, y_fn) and torch.equal(h, h_fn)
    y.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mod.parameters())
    assert "backend=" in repr(mod)


@pytest.mark.parametrize("op", OPS)
def test_bad_input(op):
    fn = getattr(megakern, op)
    x = torch.randn(4, 8)
    w = torch.randn(8)

    def call(x=x, w=w, **kw):
        return fn(x, w, **kw)

    with pytest.raises(TypeError, match="dtype torch.int64"):
        call(x=torch.ones(4, 8, dtype=torch.long))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        call(x=[[1.0] * 8])
    with pytest.raises(ValueError, match=r"weight has shape \(7,\)"):
        call(w=torch.randn(7))
    with pytest.raises(TypeError, match="weight has dtype torch.float16"):
        call(w=torch.randn(8, dtype=torch.float16))
    with pytest.raises(ValueError, match="hidden size .* 65537"):
        call(x=torch.randn(1, 65537), w=None)
    with pytest.raises(ValueError, match="at least one dimension"):
        call(x=torch.tensor(1.0), w=None)
    with pytest.raises(ValueError, match=r"residual has shape \(4, 9\)"):
        call(residual=torch.randn(4, 9))
    with pytest.raises(TypeError, match="residual has dtype torch.float16"):
        call(residual=torch.randn(4, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match="weight is on meta"):
        call(w=torch.randn(8, device="meta"))
    with pytest.raises(ValueError, match="eps must be"):
        call(eps=-1.0)
    with pytest.raises(ValueError, match="eps must be"):
        call(eps=float("nan"))
    with pytest.raises(ValueError, match="unknown backend 'fast'"):
        call(backend="fast")
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="backend 'cuda' is not available: the CUDA kernels need a CUDA tensor"):
            call(backend="cuda")
    if op == "layer_norm":
        with pytest.raises(TypeError, match="bias has dtype torch.float32 but weight has torch.bfloat16"):
            fn(x.bfloat16(), w.bfloat16(), torch.randn(8))


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=lambda d: str(d).removeprefix("torch."))
def test_triton_cuda_parity(op, dtype):
    """Triton and both CUDA paths agree closely (same fp32 math, different reduction orders), and the public
    'cuda' backend is the runtime's path exactly."""
    seed(op, dtype)
    x, w, b, r = make_inputs(op, dtype, (8, 1000, 4096), "residual")
    outs = {v: run(v, op, x, w, b, 1e-5, r) for v in ("triton", "cuda-extension", "cuda-nvrtc")
            if not (v.startswith("cuda-") and cuda_path_problem(v[5:]))}
    assert len(outs) >= 2, f"need Triton and a CUDA path, have {list(outs)}"
    base_y, base_h = outs.pop("triton")
    for v, (y, h) in outs.items():
        assert torch.equal(h, base_h), f"{v}: residual_out differs from triton"
        ulp = torch.finfo(dtype).eps * base_y.float().abs().clamp_min(1.0)
        assert ((y.float() - base_y.float()).abs() <= ulp).all(), f"{v}: y differs from triton by more than an ulp"
    fn = getattr(megakern, op)
    args = (x, w) if op == "rms_norm" else (x, w, b)
    y_public, _ = fn(*args, 1e-5, residual=r, backend="cuda")
    path = megakern.cuda_runtime()[0]
    assert torch.equal(y_public, run(f"cuda-{path}", op, x, w, b, 1e-5, r)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_torch_compile_with_cuda_ops(op):
    """torch.compile runs models that use the CUDA backend (traced as the megakern:: custom ops) and gives the
    eager outputs and gradients; the ops' schemas and fake implementations pass torch.library.opcheck."""
    from megakern import _norm_cuda

    seed(op, "compile")
    x, w, b, r = make_inputs(op, torch.bfloat16, (4, 64, 1024), "residual")
    fn = getattr(megakern, op)

    def loss(x, w, b, r):
        args = (x, w) if op == "rms_norm" else (x, w, b)
        y, h = fn(*args, 1e-5, residual=r, backend="cuda")
        return y.float().square().sum() + h.float().sum()

    leaves = [t.requires_grad_() for t in (x, w, r)] + ([b.requires_grad_()] if b is not None else [])
    eager = torch.autograd.grad(loss(x, w, b, r), leaves)
    torch.compiler.reset()
    compiled = torch.autograd.grad(torch.compile(loss)(x, w, b, r), leaves)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c, e, rtol=1e-2, atol=1e-2)

    x2, r2 = x.detach().view(-1, 1024), r.detach().view(-1, 1024)
    is_rms = op == "rms_norm"
    torch.library.opcheck(_norm_cuda.norm_fwd_op, (x2, r2, w.detach(), None if is_rms else b.detach(), 1e-5, is_rms))
    y, res_out, mean, rstd = _norm_cuda.norm_fwd_op(x2, r2, w.detach(), None if is_rms else b.detach(), 1e-5, is_rms)
    dy = torch.randn_like(y)
    torch.library.opcheck(_norm_cuda.norm_bwd_op, (dy, res_out, torch.randn_like(res_out), w.detach(),
                                                   None if is_rms else mean, rstd, is_rms, r2.dtype, True, not is_rms))


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32))
@pytest.mark.parametrize("residual", (False, True))
def test_wide_backward_pipeline_fits_shared_memory(dtype, residual):
    """The wide backward's loads in flight (stages x rows x chunk of x, dy and the residual's gradient) stay within
    the shared-memory budget for every input dtype, and bf16 without the residual keeps the launch table's pipeline;
    an unknown launch option is refused by name."""
    from megakern import _norm_triton as nt

    config = nt._bwd_config(32768, False)
    assert config.wide
    loaded = [torch.empty(0, dtype=dtype)] * (3 if residual else 2)
    chunk, stages = nt._wide_pipeline(config, 32768, loaded)
    assert stages >= 1 and chunk >= 256
    assert stages * chunk * config.rows * sum(t.element_size() for t in loaded) <= nt.WIDE_PIPELINE_BYTES
    if dtype == torch.bfloat16 and not residual:
        assert (chunk, stages) == (config.chunk, config.stages)
    x = torch.zeros(2, 8)
    with pytest.raises(TypeError, match="unknown backward launch options.*'warp'"):
        nt.bwd(x, x, None, None, None, torch.ones(2), True, None, False, False, warp=4)


CUDA_VARIANTS = [v for v in kernel_variants() if v.startswith("cuda-")]  # the extension and NVRTC paths
BF16_SETUPS = ("affine", "residual", "no-affine", "fp32-weight")  # what bf16_inputs makes


def bf16_inputs(op, shape, setup):
    """make_inputs' bf16 tensors for ``setup``, where "fp32-weight" is "affine" with the weight and bias in fp32."""
    x, w, b, r = make_inputs(op, torch.bfloat16, shape, "affine" if setup == "fp32-weight" else setup)
    if setup == "fp32-weight":
        w = w.float()
        b = b.float() if b is not None else None
    return x, w, b, r


STAGED = [((3, 77, 1024), 1, 128), ((3, 77, 1024), 4, 32), ((2, 61, 4096), 2, 256), ((130, 8192), 2, 512),
          ((67, 16384), 4, 512), ((5, 37, 4096), 4, 128)]  # the last: LayerNorm's 48 KiB of shared memory exactly


def staged_cases(test):
    """A GPU test over every staged-backward geometry (STAGED), bf16 setup, norm and CUDA path."""
    for mark in (pytest.mark.parametrize("op", OPS),
                 pytest.mark.parametrize("case", STAGED, ids=lambda c: f"{'x'.join(map(str, c[0]))}-nv{c[1]}-t{c[2]}"),
                 pytest.mark.parametrize("setup", BF16_SETUPS), pytest.mark.parametrize("variant", CUDA_VARIANTS),
                 pytest.mark.gpu):
        test = mark(test)
    return test


@staged_cases
def test_cuda_staged_backward(op, case, setup, variant):
    """The staged CUDA backward (the next row copied into shared memory; dweight / dbias sums in registers up to 2
    groups a thread, in shared memory above), through both CUDA paths, on row counts that leave some blocks
    without a row and others with several, against the fp64 reference (2x rule)."""
    from megakern import _norm_cuda

    shape, nv, threads = case
    check_launch_override(op, shape, setup, variant, bwd_config=_norm_cuda.LaunchConfig(nv, threads, 1, staged=True))


def check_launch_override(op, shape, setup, variant, fwd_config=None, bwd_config=None):
    """The CUDA kernels of ``variant`` with a launch geometry forced on the forward and / or the backward, on bf16
    inputs of ``shape``, against the fp64 reference (2x rule)."""
    fwd, bwd = launchers_for(variant)
    seed(op, shape, fwd_config, bwd_config, setup, variant)
    x, w, b, r = bf16_inputs(op, shape, setup)
    launchers = (fwd if fwd_config is None else functools.partial(fwd, config=fwd_config),
                 bwd if bwd_config is None else functools.partial(bwd, config=bwd_config))
    check_fwd_bwd(variant, op, torch.bfloat16, x, w, b, r, launchers=launchers)


# (shape, nv, threads, rows_per_block, row_batch): row counts that end in a partial batch; 1001 columns take the
# kernels' unaligned loads
ROW_BATCH = [((3, 77, 1024), 1, 128, 1, 2), ((3, 77, 1024), 1, 128, 1, 4), ((45, 1001), 1, 128, 1, 4),
             ((3, 7, 256), 1, 32, 4, 4), ((3, 41, 4096), 2, 256, 1, 2), ((130, 2048), 1, 256, 1, 4),
             ((37, 512), 2, 32, 4, 2), ((3, 77, 1024), 2, 64, 1, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
@pytest.mark.parametrize("setup", BF16_SETUPS)
@pytest.mark.parametrize("case", ROW_BATCH, ids=lambda c: f"{'x'.join(map(str, c[0]))}-nv{c[1]}-t{c[2]}x{c[3]}-b{c[4]}")
@pytest.mark.parametrize("op", OPS)
def test_cuda_forward_row_batches(op, case, setup, variant):
    """The CUDA forward taking several rows at once (every row's loads in flight, the reductions' barriers shared),
    through both CUDA paths, against the fp64 reference (2x rule); the backward is the table's."""
    from megakern import _norm_cuda

    shape, nv, threads, rows_per_block, batch = case
    check_launch_override(op, shape, setup, variant,
                          fwd_config=_norm_cuda.LaunchConfig(nv, threads, rows_per_block, row_batch=batch))


# (shape, nv, threads, rows_per_block, row_batch, register cap): the forward compiled by NVRTC under a cap in place of
# its launch bounds (a tuning switch); 40 makes the 2-group instance spill
REGISTER_CAPS = [((3, 41, 4096), 2, 256, 1, 1, 40), ((45, 1001), 1, 128, 1, 1, 32), ((130, 2048), 1, 256, 1, 2, 48)]


@pytest.mark.gpu
@pytest.mark.parametrize("setup", BF16_SETUPS)
@pytest.mark.parametrize("case", REGISTER_CAPS, ids=lambda c: f"{'x'.join(map(str, c[0]))}-nv{c[1]}-r{c[5]}")
@pytest.mark.parametrize("op", OPS)
def test_cuda_forward_under_a_register_cap(op, case, setup):
    """The forward with MEGAKERN_NORM_FWD_MAXNREG (NVRTC) against the fp64 reference (2x rule); its outputs equal
    the uncapped kernel's bit for bit (the same arithmetic, other registers)."""
    from megakern import _norm_cuda

    if problem := cuda_path_problem("nvrtc"):
        pytest.skip(f"the NVRTC path is unavailable: {problem}")
    shape, nv, threads, rows_per_block, batch, cap = case
    config = _norm_cuda.LaunchConfig(nv, threads, rows_per_block, row_batch=batch, max_registers=cap)
    check_launch_override(op, shape, setup, "cuda-nvrtc", fwd_config=config)
    x, w, b, r = bf16_inputs(op, shape, setup)
    x2, r2 = x.reshape(-1, x.shape[-1]), None if r is None else r.reshape(-1, r.shape[-1])
    capped = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", config=config)
    plain = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", path="nvrtc",
                           config=dataclasses.replace(config, max_registers=0))
    for got, want in zip(capped, plain):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
@pytest.mark.parametrize("setup", BF16_SETUPS)
@pytest.mark.parametrize("shape", [(3, 41, 4096), (130, 1024), (7, 16384), (5, 20000)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("op", OPS)
def test_cuda_forward_specializations_equal_the_generic_kernel(op, shape, setup, variant):
    """The forward's specialized instances (flags as compile-time constants, csrc/norm/norm.h NORM_FWD_SPECS) give
    the run-time-flags kernel's outputs bit for bit, through both CUDA paths; setups without a specialization take
    the generic kernel either way."""
    from megakern import _norm_cuda

    path = variant.removeprefix("cuda-")
    if problem := cuda_path_problem(path):
        pytest.skip(f"the {path} path is unavailable: {problem}")
    seed("spec", op, shape, setup, variant)
    x, w, b, r = bf16_inputs(op, shape, setup)
    x2, r2 = x.reshape(-1, x.shape[-1]), None if r is None else r.reshape(-1, r.shape[-1])
    table = _norm_cuda.launch_config(shape[-1], x.dtype, False)
    fast = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", path=path, config=table)
    slow = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", path=path,
                          config=dataclasses.replace(table, specialize=False))
    for got, want in zip(fast, slow):
        assert (got is None) == (want is None) and (got is None or torch.equal(got, want))


# (shape, nv, threads, rows_per_block): the team kernel's geometries, on row counts that leave some teams without a
# row and others with several; widths that fill the team's chunks, and widths that leave chunks past the row's end
TEAM = [((3, 77, 1024), 4, 32, 4), ((3, 77, 1024), 1, 128, 1), ((45, 1000), 2, 64, 1), ((37, 512), 2, 32, 8),
        ((3, 41, 4096), 4, 128, 1), ((130, 2048), 2, 128, 1), ((7, 16384), 4, 512, 1), ((5, 12296), 4, 512, 1),
        ((9, 5120), 4, 160, 1), ((2, 2, 8), 1, 32, 16)]


def team_cases(test):
    """A GPU test over every team geometry (TEAM), with and without the next row in flight and the weight in
    registers, and the row read again from L1 (``mode``: LaunchConfig fields), each norm and CUDA path."""
    from megakern import _norm_cuda

    modes = [dict(prefetch=p, weight_regs=w, reload=r) for p, w, r in _norm_cuda.TEAM_MODES]
    for mark in (pytest.mark.parametrize("op", OPS),
                 pytest.mark.parametrize("mode", modes, ids=lambda m: f"pf{int(m['prefetch'])}-w{int(m['weight_regs'])}"
                                                                      f"-r{int(m['reload'])}"),
                 pytest.mark.parametrize("case", TEAM, ids=lambda c: f"{'x'.join(map(str, c[0]))}-nv{c[1]}-t{c[2]}"
                                                                     f"x{c[3]}"),
                 pytest.mark.parametrize("variant", CUDA_VARIANTS), pytest.mark.gpu):
        test = mark(test)
    return test


@team_cases
@pytest.mark.parametrize("setup", ("affine", "residual"))
def test_cuda_forward_team(op, case, mode, setup, variant):
    """The forward's team kernel (persistent row teams, the next row's loads in flight) through both CUDA paths,
    against the fp64 reference (2x rule); the backward is the table's."""
    from megakern import _norm_cuda

    shape, nv, threads, rows_per_block = case
    config = _norm_cuda.LaunchConfig(nv, threads, rows_per_block, team=True, **mode)
    check_launch_override(op, shape, setup, variant, fwd_config=config)


@team_cases
def test_cuda_forward_team_launches_agree(op, case, mode, variant):
    """One team shape gives the same bits with or without the next row in flight, the weight in registers or the row
    read again from L1, on a grid of one block an SM, of as many as fit or of a team a row, and (NVRTC) under a
    register cap: the same arithmetic in the same order."""
    from megakern import _norm_cuda

    path = variant.removeprefix("cuda-")
    if problem := cuda_path_problem(path):
        pytest.skip(f"the {path} path is unavailable: {problem}")
    seed("team-bits", op, case, str(mode), variant)
    shape, nv, threads, rows_per_block = case
    x, w, b, r = bf16_inputs(op, shape, "residual")
    x2, r2 = x.reshape(-1, x.shape[-1]), r.reshape(-1, r.shape[-1])
    config = _norm_cuda.LaunchConfig(nv, threads, rows_per_block, team=True)
    want = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", path=path, config=config)
    changes = [dict(mode, per_sm=1), dict(mode, persistent=False)] + (
        [dict(mode, max_registers=64)] if path == "nvrtc" else [])
    for change in changes:
        got = _norm_cuda.fwd(x2, r2, w, b, 1e-5, op == "rms_norm", path=path,
                             config=dataclasses.replace(config, **change))
        for name, g, e in zip(("y", "residual_out", "mean", "rstd"), got, want):
            assert (g is None) == (e is None) and (g is None or torch.equal(g, e)), (name, change)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
def test_cuda_forward_team_refuses_what_it_cannot_take(variant):
    """A team launch on tensors it was not built for (no weight, an fp32 weight, rows off 16-byte boundaries, a
    row wider than the team) is refused by name before any launch."""
    from megakern import _norm_cuda

    path = variant.removeprefix("cuda-")
    if problem := cuda_path_problem(path):
        pytest.skip(f"the {path} path is unavailable: {problem}")
    config = _norm_cuda.LaunchConfig(4, 32, 4, team=True)
    x = torch.randn(6, 1024, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(1024, device=DEVICE, dtype=torch.bfloat16)
    for xs, ws, message in ((x, None, "one of the flags"), (x, w.float(), "one of the flags"),
                            (x[:, 4:1020], w[4:1020], "16-byte boundaries"),
                            (torch.cat([x, x], 1), torch.cat([w, w]), "do not cover a row")):
        with pytest.raises(ValueError, match=message):
            _norm_cuda.fwd(xs, None, ws, None, 1e-5, True, path=path, config=config)


@staged_cases
def test_cuda_staged_backward_specializations_equal_the_generic_kernel(op, case, setup, variant):
    """The staged backward's specialized instances (csrc/norm/norm.h NORM_BWD_SPECS: flags as constants, a 16-bit
    weight kept in registers) give the run-time-flags kernel's dx, dresidual, dweight and dbias bit for bit,
    through both CUDA paths; setups without a specialization take the generic kernel either way."""
    from megakern import _norm_cuda

    path = variant.removeprefix("cuda-")
    if problem := cuda_path_problem(path):
        pytest.skip(f"the {path} path is unavailable: {problem}")
    seed("bwd-spec", op, case, setup, variant)
    shape, nv, threads = case
    is_rms = op == "rms_norm"
    x, w, b, r = bf16_inputs(op, shape, setup)
    x2, r2 = x.reshape(-1, x.shape[-1]), None if r is None else r.reshape(-1, r.shape[-1])
    y, res_out, mean, rstd = _norm_cuda.fwd(x2, r2, w, b, 1e-5, is_rms, path=path)
    dy = torch.randn_like(y)
    dres_out = None if res_out is None else torch.randn_like(res_out)
    args = (dy, x2 if res_out is None else res_out, dres_out, w, mean, rstd, is_rms, None if r2 is None else r2.dtype,
            w is not None, b is not None)
    config = _norm_cuda.LaunchConfig(nv, threads, 1, staged=True)
    fast = _norm_cuda.bwd(*args, path=path, config=config)
    slow = _norm_cuda.bwd(*args, path=path, config=dataclasses.replace(config, specialize=False))
    for name, got, want in zip(("dx", "dresidual", "dweight", "dbias"), fast, slow):
        assert (got is None) == (want is None), name
        assert got is None or torch.equal(got, want), f"{name}: the specialized instance differs from the generic one"


@pytest.mark.gpu
@pytest.mark.parametrize("variant", CUDA_VARIANTS)
def test_cuda_layer_norm_rows_of_one_value(variant):
    """The CUDA LayerNorm forward keeps a row of one value exact, as the Triton forwards do: its mean is the value,
    its variance zero and y the bias, in rows held in registers (one and several rows a block) and streamed rows.
    (A mean taken as sum * (1 / cols) misses the value by an ulp at some widths, and rstd = eps^-1/2 scales that
    to a visible y.)"""
    from megakern import _norm_cuda

    path = variant.removeprefix("cuda-")
    if problem := cuda_path_problem(path):
        pytest.skip(f"the {path} path is unavailable: {problem}")
    values = torch.tensor([0.0, 1.0, -3.5, 100.5, 1e4, -12480.0, 3e5, 2.0**-10], device=DEVICE)
    for n in (1000, 4100, 13312, 65536):
        seed(n, variant, "cuda-one-value")
        x = values[:, None].expand(-1, n).to(torch.bfloat16).contiguous()
        w = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        b = torch.randn(n, device=DEVICE).to(torch.bfloat16)
        y, _, mean, rstd = _norm_cuda.fwd(x, None, w, b, 1e-5, False, path=path)
        assert torch.equal(mean, values.to(torch.bfloat16).float()), (n, mean)
        torch.testing.assert_close(rstd, torch.full_like(rstd, 1e-5 ** -0.5), rtol=1e-6, atol=0)
        assert torch.equal(y, b.expand_as(y)), (n, (y.float() - b.float()).abs().max())


def test_cuda_forward_refuses_a_launch_it_cannot_take():
    """A forward launch override the kernels were not built for is refused by name before any launch."""
    from megakern import _norm_cuda

    LC = _norm_cuda.LaunchConfig
    for config, message in ((LC(1, 128, 1, row_batch=3), "row_batch must be one of"),
                            (LC(0, 256, 1, row_batch=2), "streaming"),
                            (LC(1, 512, 1, row_batch=4), "launch bounds"),
                            (LC(1, 128, 1, staged=True), "staged kernel is a backward"),
                            (LC(2, 256, 1, max_registers=80), "max_registers must be 0 or in \\[24, 64\\]"),
                            (LC(2, 256, 1, max_registers=8), "max_registers must be 0 or in"),
                            (LC(8, 32, 4, team=True), "chunks a thread"),
                            (LC(4, 64, 2, team=True), "whole warps"),
                            (LC(4, 1024, 1, team=True), "at most 512 threads"),
                            (LC(4, 128, 1, team=True, row_batch=2), "no row_batch"),
                            (LC(4, 128, 1, team=True, max_registers=200), "max_registers must be 0 or in \\[24, 128\\]"),
                            (LC(2, 256, 1, prefetch=False), "the team kernel's"),
                            (LC(2, 256, 1, per_sm=2), "the team kernel's"),
                            (LC(2, 256, 1, persistent=False), "the team kernel's"),
                            (LC(2, 256, 1, team=True, per_sm=2, persistent=False), "per_sm caps a persistent grid"),
                            (LC(2, 256, 1, weight_regs=True), "the team kernel's"),
                            (LC(2, 256, 1, prefetch=False, reload=True), "the team kernel's"),
                            (LC(2, 256, 1, team=True, reload=True), "reload holds nothing"),
                            (LC(2, 256, 1, team=True, prefetch=False, weight_regs=True, reload=True),
                             "reload holds nothing")):
        with pytest.raises(ValueError, match=message):
            _norm_cuda.check_fwd_config(config)
    _norm_cuda.check_fwd_config(_norm_cuda.launch_config(1024, torch.bfloat16, False))
    _norm_cuda.check_fwd_config(_norm_cuda.team_geometry(1024, torch.bfloat16))


@pytest.mark.gpu
def test_cuda_staged_backward_refuses_what_it_cannot_take():
    """fp32 rows, an fp32 residual stream (x in fp32), rows off 16-byte boundaries and a geometry that leaves part
    of a row uncovered are refused by name, not computed wrong."""
    from megakern import _norm_cuda

    if cuda_path_problem("nvrtc") and cuda_path_problem("extension"):
        pytest.skip("no CUDA path")
    config = _norm_cuda.LaunchConfig(1, 128, 1, staged=True)
    x = torch.randn(4, 1024, device=DEVICE, dtype=torch.bfloat16)
    stats = _norm_cuda.fwd(x, None, None, None, 1e-5, True)[3]
    cases = [(x.float(), x.float(), "16-bit rows"), (x, x.float(), "must have dy's dtype"),
             (torch.randn(4, 1028, device=DEVICE, dtype=torch.bfloat16)[:, 1:1025],) * 2 + ("16-byte boundaries",)]
    for dy, xx, message in cases:
        with pytest.raises(ValueError, match=message):
            _norm_cuda.bwd(dy, xx, None, None, None, stats, True, None, False, False, config=config)
    with pytest.raises(ValueError, match="do not cover a row"):
        _norm_cuda.bwd(x, x, None, None, None, stats, True, None, False, False,
                       config=_norm_cuda.LaunchConfig(1, 64, 1, staged=True))


def test_launch_table_tail():
    """The launch table takes a row as two power-of-two tiles between hidden 2048 and 16384 where ``tail_split`` has
    them, forward and backward (LayerNorm's backward in registers then, not the two-pass kernel), the forward's as
    three where ``three_split`` has them and they won, and one tile for powers of two, below 2048 and at 15360; an
    explicit ``tail`` wins; a forward of four tiles is refused."""
    from megakern import _norm_triton as nt

    for n in (2560, 3072, 5120, 6144, 9216, 10240, 12288):
        tables = (nt._register_fwd_config(n, False), nt._register_fwd_config(n, True))
        assert nt.tail_split(n) and all((t.rows, t.tiles) == (1, 2) for t in tables)
        for is_rms in (True, False):
            config = nt._bwd_config(n, is_rms)
            assert config.tail == (n > 8192) and not config.wide
            if n > 8192:
                assert nt.resolve_bwd_config(n, is_rms, dict(tail=False)).tail is False
    assert not nt._bwd_config(9216, False).prefetch and nt._bwd_config(9216, True).prefetch
    # the forward's warps: more where the tail is short beside a head of 4096 or more; LayerNorm 8 beside a head of 8192
    sizes = (3072, 5120, 6144, 9216, 10240, 11264, 12288)
    warps = {n: (nt._register_fwd_config(n, True)[1], nt._register_fwd_config(n, False)[1]) for n in sizes}
    assert warps == {3072: (4, 4), 5120: (8, 4), 6144: (4, 4), 9216: (16, 8), 10240: (16, 8), 11264: (4, 8),
                     12288: (4, 8)}
    assert [nt._register_fwd_config(n, False)[1] for n in (2048, 4096, 8192, 16384)] == [4, 4, 8, 16]
    assert [nt._register_fwd_config(n, True)[1] for n in (2048, 4096, 8192, 16384)] == [4, 8, 8, 8]
    for n in (768, 1536, 2048, 4096, 8192, 15360, 16384, 32768):
        assert nt._register_fwd_config(n, True)[2] == 1 == nt._register_fwd_config(n, False)[2]
        assert not nt._bwd_config(n, True).tail and not nt._bwd_config(n, False).tail
    # three tiles where they won: RMSNorm 12800 and 13312 at 4 warps; LayerNorm 6657-7168 at 4, 14336 at 8; one
    # tile at the other widths three_split takes
    sizes = (3584, 6656, 6912, 7168, 12544, 12800, 13056, 13312, 13824, 14336)
    three = {n: (nt._register_fwd_config(n, True)[:3], nt._register_fwd_config(n, False)[:3]) for n in sizes}
    assert all(nt.three_split(n) for n in sizes)
    assert three == {3584: ((1, 8, 1), (1, 4, 1)), 6656: ((1, 8, 1), (1, 8, 1)), 6912: ((1, 8, 1), (1, 4, 3)),
                     7168: ((1, 8, 1), (1, 4, 3)), 12544: ((1, 8, 1), (1, 16, 1)), 12800: ((1, 4, 3), (1, 16, 1)),
                     13056: ((1, 8, 1), (1, 16, 1)), 13312: ((1, 4, 3), (1, 16, 1)),
                     13824: ((1, 8, 1), (1, 16, 1)), 14336: ((1, 8, 1), (1, 8, 3))}
    with pytest.raises(ValueError, match="tiles must be 1, 2 or 3"):
        nt.fwd(torch.ones(2, 64), None, None, None, 1e-5, True, tiles=4)
    # LayerNorm's rows of 13313-16383 (not two tiles): dx in registers, the dweight / dbias sums by the strips kernel
    assert all(nt._bwd_config(n, False).split and not nt._bwd_config(n, False).wide for n in (14336, 15360, 16376))
    # from 16384 (RMSNorm above, beside its unrolled rows): the row sums alone, then dx by the strips kernel
    for n, is_rms in ((16384, False), (20480, False), (32768, False), (32768, True), (20008, True)):
        config = nt._bwd_config(n, is_rms)
        assert config.strip_dx and config.split and config.wide and config.unrolled and config.rows == 1
        assert config.split_geometry == (128, 32, 4, 4)
    assert not nt._bwd_config(16384, True).strip_dx
    assert nt._bwd_config(nt.MAX_BLOCK, False).strip_dx and nt._bwd_config(nt.MAX_BLOCK - 8, True).strip_dx


def test_forward_launch_table_wide_and_bound():
    """The forward's table: the two-pass kernel unrolled over the row's chunks for 16-bit rows whose width is a
    multiple of 16 where it won (RMSNorm 4096-7168 and from 8192, LayerNorm above 12288), LayerNorm's register
    kernel bounded to 64 registers beside a tail of 512-2048; fp32 tensors, odd widths and the other widths keep
    the register table. Overrides: the named kernel from its own defaults, register-kernel options select the
    register kernel, the table's register bound only with the table's geometry, a bound on the two-pass kernel
    refused by name."""
    from megakern import _norm_triton as nt

    for n, warps in ((8192, 16), (8448, 16), (9216, 16), (12288, 16), (14336, 16), (16384, 16), (20480, 32), (65536, 32)):
        assert nt._fwd_config(n, True) == nt.FwdConfig(1, warps, wide=True, chunk=4096, unrolled=True)
    for n in (12800, 13312):
        assert nt._fwd_config(n, False) == nt.FwdConfig(1, 8, wide=True, chunk=2048, unrolled=True)
    for n, warps in ((13328, 8), (14336, 8), (15360, 8), (16384, 16), (20480, 16), (32768, 16), (65536, 16)):
        # 4096-column chunks, the shifted sums
        assert nt._fwd_config(n, False) == nt.FwdConfig(1, warps, wide=True, chunk=4096, unrolled=True, sums=True)
    for n in (4096, 6144, 7168):  # RMSNorm's 16-bit rows of 4096-7168: 2048-column chunks at 8 warps
        assert nt._fwd_config(n, True) == nt.FwdConfig(1, 8, wide=True, chunk=2048, unrolled=True)
    for n, is_rms in ((4080, True), (7184, True), (8176, True), (8192, False), (9000, True), (13000, False),
                      (12288, False), (15000, False), (16383, False)):
        assert nt._fwd_config(n, is_rms) == nt._register_fwd_config(n, is_rms) and not nt._fwd_config(n, is_rms).wide
    for n in (9216, 20480):
        assert not nt._fwd_config(n, True, itemsize=4).wide
    assert {n: nt._fwd_config(n, False).maxnreg for n in (8448, 8704, 9216, 10240, 10752, 12288)} == {
        8448: None, 8704: 64, 9216: 64, 10240: 64, 10752: None, 12288: None}
    assert nt._fwd_config(9216, False, itemsize=4).maxnreg is None and nt._fwd_config(9216, True).maxnreg is None
    with pytest.raises(ValueError, match="exceeds the Triton kernels' limit of 65536"):
        nt._fwd_config(65536 + 16, True)

    resolve = nt.resolve_fwd_config
    assert resolve(12288, True) == nt._fwd_config(12288, True)
    assert resolve(12288, True, num_warps=32) == nt._fwd_config(12288, True)._replace(warps=32)
    assert resolve(12288, True, wide=True) == nt.FwdConfig(1, 4, wide=True)  # not unrolled, chunk 4096
    assert resolve(12288, True, wide=True, unrolled=True, chunk=2048) == nt.FwdConfig(1, 4, wide=True, chunk=2048,
                                                                                       unrolled=True)
    for overrides in (dict(wide=False), dict(tiles=1), dict(rows_per_program=1), dict(maxnreg=64)):
        config = resolve(12288, True, **overrides)
        assert not config.wide and not config.unrolled and config.warps == 4
    assert resolve(12288, True, tiles=1).tiles == 1 and resolve(12288, True, wide=False).tiles == 2
    assert resolve(9216, False).maxnreg == 64 and resolve(9216, False, wide=False).maxnreg == 64
    assert resolve(9216, False, num_warps=16).maxnreg is None and resolve(9216, False, tiles=2).maxnreg is None
    assert resolve(9216, False, maxnreg=72).maxnreg == 72
    assert resolve(4096, True, wide=True) == nt.FwdConfig(1, 8, wide=True)
    assert resolve(4096, True, wide=True, maxnreg=64) == nt.FwdConfig(1, 8, maxnreg=64, wide=True)
    assert resolve(13312, False, sums=False) == nt._fwd_config(13312, False)._replace(sums=False)
    assert resolve(13312, False, maxnreg=40).wide is False  # a bound alone names the register kernel
    for overrides, message in ((dict(is_rms=True), "RMSNorm"), (dict(wide=False), "the register kernel"),
                               (dict(unrolled=False), "it looped")):
        is_rms = overrides.pop("is_rms", False)
        with pytest.raises(ValueError, match=f"sums chooses .* takes {message}"):
            resolve(13312, is_rms, sums=True, **overrides)


@pytest.mark.skipif(not HAS_CUDA, reason="the two-pass rows of the table are 16-bit; CPU runs test fp32")
@pytest.mark.parametrize("setup", ("affine", "residual", "no-affine"))
@pytest.mark.parametrize("op", OPS)
def test_triton_forward_table_wide_rows(op, setup):
    """The launch table's forward where it takes the two-pass kernel unrolled, or LayerNorm's bounded register kernel
    (bf16 rows, a partial last chunk at 12800 and 20000), RMSNorm's unrolled backward at 20000 and the backward's
    row sums then dx by strips (LayerNorm from 16384, RMSNorm at 22528 and 24592), against the references, and the
    forward
    equal to the register kernel's output and statistics to rounding."""
    from megakern import _norm_triton as nt

    fwd, bwd = launchers_for("triton")
    for n in (4096, 6160, 9216, 12800, 14336, 16384, 20000, 22528, 24592):
        seed(op, setup, n, "table-wide")
        x, w, b, r = make_inputs(op, torch.bfloat16, (3, 5, n), setup)
        if op == "layer_norm":
            x.add_(torch.linspace(-8, 8, n, dtype=x.dtype, device=x.device))
        check_fwd_bwd("triton", op, torch.bfloat16, x, w, b, r, launchers=(fwd, bwd))
        args = (x.reshape(-1, n), None if r is None else r.reshape(-1, n), w, b, 1e-5, op == "rms_norm")
        assert_outputs_close(nt.fwd(*args, wide=False), nt.fwd(*args))


def test_backward_launch_overrides():
    """Tuning overrides replace the launch table's fields one by one (None keeps the table's); naming the other
    kernel starts from its own defaults; unknown names are refused."""
    from megakern import _norm_triton as nt

    table = nt._bwd_config(1024, True)
    assert nt.resolve_bwd_config(1024, True, {}) == table
    assert nt.resolve_bwd_config(1024, True, dict(warps=None, wide=None, rows=None)) == table
    assert nt.resolve_bwd_config(1024, True, dict(warps=8)) == table._replace(warps=8)
    wide = nt.resolve_bwd_config(1024, True, dict(wide=True, chunk=256))
    assert wide.wide and wide.rows == 1 and wide.chunk == 256 and wide.stages == 2
    assert not nt.resolve_bwd_config(32768, False, dict(wide=False)).wide
    fused = nt.resolve_bwd_config(32768, False, dict(wide=True))
    assert fused == nt.BwdConfig(1, 8, 8, wide=True) and not fused.strip_dx
    not_split = nt.resolve_bwd_config(32768, False, dict(split=False))
    assert not_split.wide and not not_split.split and not not_split.strip_dx
    assert not nt.resolve_bwd_config(nt.MAX_BLOCK, True, dict(wide=True)).strip_dx
    with pytest.raises(TypeError, match="unknown backward launch options"):
        nt.resolve_bwd_config(1024, True, dict(num_warps=4))
    strips = nt.resolve_bwd_config(32768, False, dict(split=True, strip_dx=True))
    assert strips.split and strips.wide and strips.strip_dx
    for n, overrides in ((8192, dict(strip_dx=True)), (32768, dict(split=True, wide=False, strip_dx=True)),
                         (32768, dict(split=False, strip_dx=True))):
        with pytest.raises(ValueError, match="strip_dx has the split backward's strips write dx"):
            nt.resolve_bwd_config(n, False, overrides)
    # RMSNorm's 16-bit rows of 16385-20480 (a multiple of 16): the two-pass kernel unrolled, 2 rows a step; of
    # 20481-24576, the row sums at 8 warps, 8 an SM, then dx by strips of 1024 columns
    unrolled = nt.BwdConfig(2, 16, 1, wide=True, chunk=4096, unrolled=True)
    assert all(nt._bwd_config(n, True) == unrolled for n in (16400, 20000, 20480))
    wide_strips = nt.BwdConfig(1, 8, 8, wide=True, chunk=4096, unrolled=True, split=True,
                               split_geometry=(1024, 4, 8, 2), strip_dx=True)
    assert all(nt._bwd_config(n, True) == wide_strips for n in (20496, 22528, 24576))
    assert nt._bwd_config(22528, True, 4).split_geometry == (128, 32, 4, 4)
    strips = nt._bwd_config(32768, True)
    assert strips.strip_dx and (strips.warps, strips.per_sm) == (16, 2)
    for n, is_rms, itemsize in ((20008, True, 2), (24592, True, 2), (20480, True, 4)):
        assert nt._bwd_config(n, is_rms, itemsize) == strips
    assert nt._bwd_config(20480, False) == strips._replace(warps=8, per_sm=8)
    assert nt.resolve_bwd_config(20480, True, dict(wide=True)) == nt.BwdConfig(1, 16, 1, wide=True)
    assert nt.resolve_bwd_config(20480, True, dict(unrolled=False)) == unrolled._replace(unrolled=False)


def test_team_table():
    """The team kernel's geometry covers a row with whole warps within its bounds at every width it takes, holds the
    weight in registers only at 2 chunks a thread (at 4 it spills), and is the default only where the table says:
    16-bit rows up to TEAM_DEFAULT_COLS, LayerNorm's within TEAM_LN_WIDE."""
    from megakern import _norm_cuda as nc

    assert nc.team_geometry(1024, torch.float32) is None and nc.team_config(1024, torch.float32, True) is None
    top = nc.TEAM_MAX_THREADS * nc.TEAM_CHUNKS[-1] * 8
    assert nc.team_geometry(top + 8, torch.bfloat16) is None
    for dtype in (torch.bfloat16, torch.float16):
        for cols in (8, 1000, 1024, 1032, 2048, 3072, 4096, 5120, 8192, 8200, 12288, 14336, top):
            g = nc.team_geometry(cols, dtype)
            nc.check_fwd_config(g)
            assert g.team and g.threads * g.nv * 8 >= cols and g.threads % 32 == 0, (cols, g)
            assert g.threads * g.rows_per_block <= nc.TEAM_MAX_THREADS and (g.rows_per_block == 1 or g.threads == 32)
            assert not g.weight_regs or g.nv <= 2, (cols, g)
            for is_rms in (True, False):
                default = cols <= nc.TEAM_DEFAULT_COLS or (not is_rms and nc.TEAM_LN_WIDE[0] <= cols
                                                           <= nc.TEAM_LN_WIDE[1])
                assert nc.team_config(cols, dtype, is_rms) == (g if default else None), (cols, is_rms)
