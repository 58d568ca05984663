"""megakern.activation: bias_gelu, gelu(h + bias) (tanh approximation) and its gradients (dh and the bias gradient
made in the same pass), and swiglu, silu(gate) * up over interleaved (gate, up) columns, and its gradient, against
the fp64 reference under the 2x rule; odd sizes, no bias, an fp32 bias beside low-precision h, non-contiguous h,
empty input; bad input. Under the CPU interpreter in fp32 / fp16 at small sizes; bf16 and larger sizes on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, poison_cuda_allocator, require_triton,
                      seed, skip_interpreter_faults)

from megakern.activation import bias_gelu, bias_gelu_ref, swiglu, swiglu_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = [(5, 33), (2, 3, 40), (1, 1), (16, 130)]
if HAS_CUDA:
    SHAPES += [(4, 1000, 3072), (8193, 4096), (3, 7, 5000)]


def check(h, bias, dtype):
    """Output, dh and dbias of the Triton backend against fp64 truth, plain torch in h's dtype as the yardstick."""
    require_triton()
    poison_cuda_allocator(4 * h.numel() + 4096)
    leaves = [h.requires_grad_(True)] + ([bias.requires_grad_(True)] if bias is not None else [])
    y = bias_gelu(h, bias, backend="triton")
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    t64 = [t.detach().double().requires_grad_(True) for t in leaves]
    truth = bias_gelu_ref(t64[0], t64[1] if bias is not None else None)
    truth_grads = torch.autograd.grad(truth, t64, dy.double())
    lo = [t.detach().clone().requires_grad_(True) for t in leaves]
    lowp = F.gelu(lo[0] + (lo[1].to(dtype) if bias is not None else 0), approximate="tanh")
    lowp_grads = torch.autograd.grad(lowp, lo, dy)
    assert y.dtype == dtype and y.shape == h.shape
    assert_close_to_ref("y", y, truth, lowp, ATOL[dtype])
    for name, g, t, l, leaf in zip(("dh", "dbias"), grads, truth_grads, lowp_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype, name
        # the bias gradient sums a column of M rows: scale the allowance by the column's magnitude
        scale = max(1.0, t.abs().max().item())
        assert_close_to_ref(name, g, t, l, ATOL[dtype] * scale)


@pytest.mark.parametrize("bias_dtype", ("same", "fp32", None), ids=("bias", "fp32-bias", "no-bias"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference(dtype, shape, bias_dtype):
    skip_interpreter_faults("triton", dtype)
    seed("bias_gelu", dtype, shape, bias_dtype)
    h = 2 * torch.randn(shape, device=DEVICE, dtype=dtype)
    bias = None if bias_dtype is None else torch.randn(
        shape[-1], device=DEVICE, dtype=dtype if bias_dtype == "same" else torch.float32)
    check(h, bias, dtype)


def test_non_contiguous_input_and_large_values():
    seed("views")
    base = torch.randn(9, 2 * 48, device=DEVICE, dtype=torch.float16)
    h = (base * 6)[:, ::2]  # strided, values out to where tanh saturates
    assert not h.is_contiguous()
    check(h.detach(), torch.randn(48, device=DEVICE, dtype=torch.float16), torch.float16)


def test_backward_program_orders_agree(monkeypatch):
    """The backward with a bias runs its tiles in column order; where the row tiles would overflow the grid's second
    axis (65535 programs) in row order. Both orders give the same dh and dbias bits (the grid limit lowered to force
    the second), and a tile given for tuning gives the same dh."""
    require_triton()
    from megakern import _activation_triton as kern

    seed("bias_gelu orders")
    dtype = torch.float32 if DEVICE.type == "cpu" else torch.bfloat16
    m = 3 * kern._bias_bwd_tile(torch.empty(0, device=DEVICE))[0] + 5  # four row tiles, the last partial
    h = 2 * torch.randn(m, 70, device=DEVICE, dtype=dtype)
    b, dy = torch.randn(70, device=DEVICE, dtype=dtype), torch.randn_like(h)
    dh, db = kern.bwd(dy, h, b)
    monkeypatch.setattr(kern, "_GRID_Y_MAX", 3)
    dh_rows, db_rows = kern.bwd(dy, h, b)
    assert torch.equal(dh, dh_rows) and torch.equal(db, db_rows)
    dh_tile, db_tile = kern.bwd(dy, h, b, tile=(16, 32, 4))
    assert torch.equal(dh, dh_tile) and db_tile.shape == db.shape


def test_empty_and_torch_backend():
    require_triton()
    h = torch.randn(0, 12, device=DEVICE, requires_grad=True)
    b = torch.randn(12, device=DEVICE, requires_grad=True)
    y = bias_gelu(h, b, backend="triton")
    y.sum().backward()
    assert y.shape == (0, 12) and torch.equal(b.grad, torch.zeros(12, device=DEVICE))
    x = torch.randn(3, 12, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(bias_gelu(x, b.detach().double()), F.gelu(x + b.detach().double(), approximate="tanh"))


def test_bad_input():
    h = torch.randn(4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"bias has shape \(7,\), expected \(8,\)"):
        bias_gelu(h, torch.zeros(7, device=DEVICE))
    with pytest.raises(TypeError, match="h must be a float32/float16/bfloat16 tensor"):
        bias_gelu(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
        bias_gelu(h, torch.zeros(8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="at least one dimension"):
        bias_gelu(torch.tensor(1.0))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        bias_gelu(h, backend="cuda")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="bias is on"):
            bias_gelu(h, torch.zeros(8, device="meta"))


# ---- swiglu ---------------------------------------------------------------------------------------------------------
SWIGLU_SHAPES = [(5, 66), (2, 3, 10), (1, 2), (7, 258)]
if HAS_CUDA:
    SWIGLU_SHAPES += [(4, 1000, 2 * 2816), (8193, 2 * 1408), (3, 7, 2 * 5001)]


def check_swiglu(h, dtype):
    """y and dh of the Triton backend against fp64 truth, plain torch in h's dtype (strided views) the yardstick."""
    require_triton()
    poison_cuda_allocator(4 * h.numel() + 4096)
    h = h.requires_grad_(True)
    y = swiglu(h, backend="triton")
    dy = torch.randn_like(y)
    (dh,) = torch.autograd.grad(y, h, dy)
    h64 = h.detach().double().requires_grad_(True)
    truth = swiglu_ref(h64)
    (truth_dh,) = torch.autograd.grad(truth, h64, dy.double())
    lo = h.detach().clone().requires_grad_(True)
    lowp = F.silu(lo[..., 0::2]) * lo[..., 1::2]
    (lowp_dh,) = torch.autograd.grad(lowp, lo, dy)
    assert y.dtype == dtype and y.shape == (*h.shape[:-1], h.shape[-1] // 2)
    assert dh.dtype == dtype and dh.shape == h.shape
    assert_close_to_ref("y", y, truth, lowp, ATOL[dtype])
    assert_close_to_ref("dh", dh, truth_dh, lowp_dh, ATOL[dtype])


@pytest.mark.parametrize("shape", SWIGLU_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_swiglu_matches_reference(dtype, shape):
    skip_interpreter_faults("triton", dtype)
    seed("swiglu", dtype, shape)
    check_swiglu(3 * torch.randn(shape, device=DEVICE, dtype=dtype), dtype)


def test_swiglu_non_contiguous_and_saturated():
    seed("swiglu views")
    base = torch.randn(2 * 48, 9, device=DEVICE, dtype=torch.float16)
    h = (base * 12).t()  # transposed: rows strided; gates far into silu's tails
    assert not h.is_contiguous()
    check_swiglu(h.detach(), torch.float16)


def test_swiglu_empty_torch_backend_and_bad_input():
    require_triton()
    h = torch.randn(0, 12, device=DEVICE, requires_grad=True)
    y = swiglu(h, backend="triton")
    y.sum().backward()
    assert y.shape == (0, 6) and h.grad.shape == (0, 12)
    x = torch.randn(3, 12, device=DEVICE, dtype=torch.float64)
    torch.testing.assert_close(swiglu(x), F.silu(x[:, 0::2]) * x[:, 1::2])
    with pytest.raises(ValueError, match=r"must be even, got shape \(4, 7\)"):
        swiglu(torch.randn(4, 7, device=DEVICE))
    with pytest.raises(TypeError, match="h must be a float32/float16/bfloat16 tensor"):
        swiglu(torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        swiglu(torch.randn(4, 8, device=DEVICE), backend="cuda")


def compile_for_sm90() -> list:
    """(kernel, registers spilled) for both kernels compiled for sm_90 with the GPU launch's parameters. Needs real
    (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _activation_triton as kern

    results = []
    for fn, name, constexprs, warps in (
            (kern._bias_gelu_fwd_kernel, "fwd", {"HAS_BIAS": True, "BLOCK": 2048}, 4),
            (kern._bias_gelu_bwd_kernel, "bwd", {"BLOCK_M": 128, "BLOCK_N": 64, "COLS_FAST": True}, 8),
            (kern._gelu_bwd_kernel, "bwd without bias", {"BLOCK": 2048}, 4),
            (kern._swiglu_fwd_kernel, "swiglu fwd", {"BLOCK": 2048}, 8),
            (kern._swiglu_bwd_kernel, "swiglu bwd", {"BLOCK": 2048}, 8)):
        types = {"PART": "*fp32", "numel": "i32", "N": "i32", "M": "i32"}
        signature = {a: constexprs.get(a) and "constexpr" or types.get(a, "*bf16") for a in fn.arg_names}
        signature.update({a: "constexpr" for a in constexprs})
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps))
        results.append((name, compiled.metadata.n_spills if hasattr(compiled.metadata, "n_spills") else 0))
    return results


def test_kernels_compile_for_sm90():
    """The kernels lower for Hopper without a GPU (Triton's sm_90 compiler): no interpreter-only constructs."""
    from conftest import sm90_lowering

    assert [name for name, _ in sm90_lowering("test_activation", "compile_for_sm90()")] == [
        "fwd", "bwd", "bwd without bias", "swiglu fwd", "swiglu bwd"]
