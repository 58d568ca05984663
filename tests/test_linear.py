"""megakern.linear: y = x W^T + b with the bias gradient by a Triton column sum, against torch.nn.functional.linear:
outputs and all three gradients under the 2x rule (fp64 truth), odd sizes, 3-D input, non-contiguous dy; under
autocast the same dtypes as F.linear's; the column sum alone on strided rows; bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, require_triton, seed

import megakern
from megakern import _linear_triton

DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())
SHAPES = [((5, 33), 17), ((2, 3, 40), 24), ((1, 16), 1)]
if HAS_CUDA:
    SHAPES += [((4, 1000, 1024), 3072), ((16383, 512), 1000)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + f"-{s[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference(dtype, shape):
    require_triton()
    seed("linear", dtype, shape)
    xs, n = shape
    x = torch.randn(xs, device=DEVICE, dtype=dtype, requires_grad=True)
    w = (torch.randn(n, xs[-1], device=DEVICE, dtype=dtype) / xs[-1] ** 0.5).requires_grad_()
    b = torch.randn(n, device=DEVICE, dtype=dtype, requires_grad=True)
    y = megakern.linear(x, w, b, backend="triton")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w, b), dy)
    t64 = [t.detach().double().requires_grad_() for t in (x, w, b)]
    truth = F.linear(*t64)
    truth_grads = torch.autograd.grad(truth, t64, dy.double())
    lo = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    lowp = F.linear(*lo)
    lowp_grads = torch.autograd.grad(lowp, lo, dy)
    assert y.dtype == dtype and y.shape == (*xs[:-1], n)
    assert_close_to_ref("y", y, truth, lowp, ATOL[dtype])
    for name, g, t, l, leaf in zip(("dx", "dw", "db"), grads, truth_grads, lowp_grads, (x, w, b)):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        assert_close_to_ref(name, g, t, l, ATOL[dtype] * max(1.0, t.abs().max().item()))


def test_autocast_gives_f_linear_dtypes_and_values():
    """Under bf16 autocast (fp32 weights and input): y in bf16, gradients in fp32, as F.linear under autocast."""
    require_triton()
    seed("autocast")
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(48, 32, device=DEVICE, requires_grad=True)
    b = torch.randn(48, device=DEVICE, requires_grad=True)
    dev = DEVICE.type
    with torch.autocast(dev, dtype=torch.bfloat16):
        y = megakern.linear(x, w, b, backend="triton")
        ref = F.linear(x, w, b)
    assert y.dtype == ref.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    got, want = torch.autograd.grad(y, (x, w, b), dy), torch.autograd.grad(ref, (x, w, b), dy)
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for name, g, r in zip(("dx", "dw", "db"), got, want):
        assert g.dtype == r.dtype == torch.float32, name
        torch.testing.assert_close(g, r, rtol=1e-2, atol=1e-2, msg=name)


def test_colsum_of_strided_rows_and_empty():
    require_triton()
    seed("colsum")
    base = torch.randn(37, 2 * 70, device=DEVICE)
    x = base[:, 5:75]  # row stride 140, unit column stride
    torch.testing.assert_close(_linear_triton.colsum(x), x.double().sum(0).float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(_linear_triton.colsum(torch.empty(0, 9, device=DEVICE)), torch.zeros(9, device=DEVICE))


@pytest.mark.parametrize("shape", [(1, 5), (37, 70), (130, 33), (2, 257, 40), (3, 1, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sum_rows_matches_fp64_and_is_deterministic(shape, dtype):
    """megakern._reduce_triton.sum_rows (the partial sums' last step of linear, bias_gelu and the norms): the fp64
    sum over the row dimension, rounded to ``dtype``; bit-identical on a second run."""
    from megakern._reduce_triton import sum_rows

    require_triton()
    seed("sum_rows", shape, dtype)
    part = torch.randn(shape, device=DEVICE) * 10
    got = sum_rows(part, dtype)
    assert got.dtype == dtype and got.shape == (*shape[:-2], shape[-1])
    want = part.double().sum(-2)
    # bf16: half an ulp on a GPU; the interpreter's fp32 -> bf16 cast truncates (an ulp)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** (-8 if part.is_cuda else -7),
                                                                           atol=1e-3)
    torch.testing.assert_close(got.double(), want, **tol)
    assert torch.equal(sum_rows(part, dtype), got)
    assert torch.equal(sum_rows(torch.empty(0, 7, device=DEVICE)), torch.zeros(7, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous float32"):
        sum_rows(part.double())
    with pytest.raises(ValueError, match="not contiguous"):
        sum_rows(torch.randn(9, 4, device=DEVICE).t())


@pytest.mark.parametrize("shape", [(1056, 384), (2, 528, 1024), (132, 4100), (3, 1000, 24)])
def test_sum_rows_at_the_backward_kernels_shapes_and_overrides(shape):
    """sum_rows at the partial-sum shapes of the norms' and biases' backward (hundreds of rows), with its default
    geometry and with overrides: every geometry sums to the fp64 sum; an override that is not a power of two is
    refused."""
    from megakern._reduce_triton import sum_rows

    require_triton()
    seed("sum_rows_big", shape)
    part = torch.randn(shape, device=DEVICE)
    want = part.double().sum(-2)
    for geometry in ({}, dict(block_g=64, block_n=8), dict(block_g=16, block_n=64, num_warps=2)):
        torch.testing.assert_close(sum_rows(part, **geometry).double(), want, rtol=1e-5, atol=1e-3,
                                   msg=str(geometry))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        sum_rows(part, block_n=24)


@pytest.mark.parametrize("g,n,lead", [(1, 1, 1), (1056, 384, 1), (528, 1024, 2), (132, 8192, 2), (128, 65536, 1),
                                      (100000, 7, 1)])
@pytest.mark.parametrize("sms", [1, 132])
def test_sum_rows_geometry_bounds(g, n, lead, sms):
    """The default geometry: powers of two, 8 to 32 columns a program (a 32-byte sector a row at least), BLOCK_G no
    larger than the rows call for, at most 64 values a thread."""
    from megakern._reduce_triton import sum_rows_geometry

    block_g, block_n, warps = sum_rows_geometry(g, n, lead, sms)
    assert all(v & (v - 1) == 0 for v in (block_g, block_n, warps))
    assert 8 <= block_n <= 32 and warps in (4, 8)
    assert 16 <= block_g <= max(16, 1 << (g - 1).bit_length())
    assert block_g * block_n <= 64 * 32 * warps


def compile_for_sm90():
    """sum_rows' kernel lowered for sm_90 (bf16 output: the norms' and biases' gradients)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _reduce_triton as kern

    constexprs = {"BLOCK_G": 64, "BLOCK_N": 32}
    signature = {"PART": "*fp32", "OUT": "*bf16", "G": "i32", "N": "i32", **{k: "constexpr" for k in constexprs}}
    compiled = triton.compile(ASTSource(fn=kern._sum_rows_kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 64), options=dict(num_warps=4))
    return ["sum_rows"] if "st.global" in compiled.asm["ptx"] else []


def test_sum_rows_compiles_for_sm90():
    from conftest import sm90_lowering

    assert sm90_lowering("test_linear", "compile_for_sm90()") == ["sum_rows"]


def test_no_bias_torch_backend_and_bad_input():
    x, w, b = torch.randn(3, 8, device=DEVICE), torch.randn(5, 8, device=DEVICE), torch.randn(5, device=DEVICE)
    assert torch.equal(megakern.linear(x, w), F.linear(x, w))
    assert torch.equal(megakern.linear(x, w, b, backend="torch"), F.linear(x, w, b))
    with pytest.raises(ValueError, match=r"shapes do not fit: x \(3, 8\), weight \(5, 7\)"):
        megakern.linear(x, torch.randn(5, 7, device=DEVICE), b)
    with pytest.raises(ValueError, match="bias"):
        megakern.linear(x, w, torch.randn(4, device=DEVICE))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        megakern.linear(x, w, b, backend="cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_bias_grad_matches_fp64(dtype):
    from megakern.linear import bias_grad

    seed("bias_grad", dtype)
    dy = torch.randn(3, 37, 50, device=DEVICE, dtype=dtype)[:, :, 1:]  # rows of unit column stride, strided rows
    truth = dy.double().sum((0, 1))
    lowp = dy.sum((0, 1))
    got = bias_grad(dy)
    assert got.dtype == dtype and got.shape == (49,)
    assert_close_to_ref("db", got, truth, lowp, ATOL[dtype])
    assert bias_grad(dy, torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match="bias_grad: dy must be a tensor of at least one dim"):
        bias_grad(torch.tensor(1.0))
