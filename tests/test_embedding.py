"""megakern.embedding: the lookup bit for bit F.embedding's; the table's gradient by the Triton pass against the fp64
sum of the gradient rows (the 2x rule, plain torch's backward in the same dtype as the low-precision side), every
dtype, odd table widths and vocabularies, ids of every shape, repeated, skewed and missing ids, a table row taken by
every token, int32 ids, non-contiguous gradients, the kernel's other geometries; the same bits on every run; empty
inputs; bad input; the kernel lowers for sm_90. Under the CPU interpreter at small sizes in fp32 / fp16; bf16 and
larger sizes on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import (DEVICE, HAS_CUDA, assert_close_to_ref, poison_cuda_allocator, require_triton, seed,
                      skip_interpreter_faults)

import megakern
from megakern.embedding import embedding, embedding_grad, embedding_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (vocabulary V, width C, ids shape, how ids are drawn)
CASES = [(11, 7, (3, 5), "uniform"), (50, 33, (2, 17), "skewed"), (5, 16, (40,), "uniform"),
         (9, 20, (4, 6), "one"), (300, 3, (2, 9), "uniform"), (6, 1, (1, 1), "uniform")]
if HAS_CUDA:
    CASES += [(128256, 1040, (2, 512), "uniform"), (50304, 1024, (8, 1024), "skewed"), (65, 384, (64, 256), "uniform"),
              (32000, 2051, (3, 333), "skewed"), (1000, 4096, (2, 4096), "one")]
# the kernel's geometries besides the default (rows, tok, block_c, warps)
GEOMETRIES = [dict(rows=1, tok=1, block_c=16, warps=1), dict(rows=8, tok=32, block_c=64, warps=2),
              dict(rows=2, tok=4, block_c=2048, warps=8)]


def make_ids(V: int, shape: tuple, how: str, dtype=torch.int64) -> torch.Tensor:
    """uniform over [0, V); skewed: most tokens among a few ids (a frequent token), some ids never drawn; one: every
    token the same id."""
    n = 1
    for s in shape:
        n *= s
    if how == "uniform":
        ids = torch.randint(0, V, (n,))
    elif how == "skewed":
        ids = torch.where(torch.rand(n) < 0.7, torch.randint(0, min(3, V), (n,)), torch.randint(0, V, (n,)))
    else:
        ids = torch.full((n,), V // 2)
    return ids.view(shape).to(dtype).to(DEVICE)


def truth(grad: torch.Tensor, ids: torch.Tensor, V: int) -> torch.Tensor:
    out = torch.zeros(V, grad.shape[-1], dtype=torch.float64, device=grad.device)
    return out.index_add_(0, ids.reshape(-1).long(), grad.reshape(-1, grad.shape[-1]).double())


def torch_grad(grad: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Plain torch's backward of the lookup in weight's dtype."""
    w = weight.detach().clone().requires_grad_(True)
    F.embedding(ids, w).backward(grad)
    return w.grad


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"V{c[0]}-C{c[1]}-{'x'.join(map(str, c[2]))}-{c[3]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_fp64(dtype, case):
    require_triton()
    skip_interpreter_faults("triton", dtype)
    V, C, shape, how = case
    seed("embedding", dtype, case)
    ids = make_ids(V, shape, how)
    weight = torch.randn(V, C, device=DEVICE, dtype=dtype, requires_grad=True)
    out = embedding(ids, weight, backend="triton")
    assert out.dtype == dtype and out.shape == (*shape, C)
    assert torch.equal(out, F.embedding(ids, weight))
    grad = torch.randn_like(out)
    poison_cuda_allocator(2 * V * C * weight.element_size() + 4096)
    out.backward(grad)
    assert weight.grad.dtype == dtype
    assert_close_to_ref(f"embedding dW {dtype}", weight.grad, truth(grad, ids, V), torch_grad(grad, ids, weight),
                        atol=1e-6)
    used = torch.zeros(V, dtype=torch.bool, device=DEVICE)
    used[ids.reshape(-1)] = True
    assert not weight.grad[~used].any(), "rows no token took must be zeros"


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "-".join(f"{k}{v}" for k, v in g.items()))
def test_geometries(geometry):
    require_triton()
    seed("embedding geometry", geometry)
    for V, C, shape, how in ((37, 45, (3, 7), "skewed"), (8, 130, (50,), "one")):
        ids = make_ids(V, shape, how)
        grad = torch.randn(*shape, C, device=DEVICE)
        out = embedding_grad(grad, ids, V, backend="triton", **geometry)
        torch.testing.assert_close(out.double(), truth(grad, ids, V), rtol=1e-6, atol=1e-5)


def test_same_bits_every_run_and_int32_ids():
    require_triton()
    seed("embedding bits")
    V, C = 23, 40
    ids64 = make_ids(V, (6, 11), "skewed")
    grad = torch.randn(6, 11, C, device=DEVICE, dtype=torch.bfloat16)
    first = embedding_grad(grad, ids64, V, backend="triton")
    for _ in range(3):
        assert torch.equal(embedding_grad(grad, ids64, V, backend="triton"), first)
    assert torch.equal(embedding_grad(grad, ids64.int(), V, backend="triton"), first)
    # the autograd path hands on the same tensor
    weight = torch.zeros(V, C, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    embedding(ids64.int(), weight, backend="triton").backward(grad)
    assert torch.equal(weight.grad, first)


def test_non_contiguous_gradient_and_scalar_ids():
    require_triton()
    seed("embedding views")
    V, C = 19, 24
    ids = make_ids(V, (5, 4), "uniform")
    wide = torch.randn(5, 4, 2 * C, device=DEVICE)
    grad = wide[..., ::2]  # strided columns
    assert not grad.is_contiguous()
    out = embedding_grad(grad, ids, V, backend="triton")
    torch.testing.assert_close(out.double(), truth(grad, ids, V), rtol=1e-6, atol=1e-6)
    batch_major = torch.randn(4, 5, C, device=DEVICE).transpose(0, 1)  # row-strided
    out = embedding_grad(batch_major, ids, V, backend="triton")
    torch.testing.assert_close(out.double(), truth(batch_major, ids, V), rtol=1e-6, atol=1e-6)
    weight = torch.randn(V, C, device=DEVICE, requires_grad=True)
    one = torch.tensor(3, device=DEVICE)
    row = embedding(one, weight, backend="triton")
    assert row.shape == (C,) and torch.equal(row, weight[3])
    row.sum().backward()
    expected = torch.zeros(V, C, device=DEVICE)
    expected[3] = 1
    assert torch.equal(weight.grad, expected)


def test_empty_and_no_grad():
    require_triton()
    weight = torch.randn(7, 5, device=DEVICE, requires_grad=True)
    ids = torch.empty(0, 3, dtype=torch.int64, device=DEVICE)
    out = embedding(ids, weight, backend="triton")
    assert out.shape == (0, 3, 5)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(7, 5, device=DEVICE))
    assert embedding_grad(torch.empty(2, 0, device=DEVICE), torch.zeros(2, dtype=torch.int64, device=DEVICE), 4,
                          backend="triton").shape == (4, 0)
    with torch.no_grad():
        assert torch.equal(embedding(torch.tensor([1, 2], device=DEVICE), weight, backend="triton"), weight[1:3])


def test_reference_backend_and_ops():
    seed("embedding torch")
    weight = torch.randn(10, 6, requires_grad=True)
    ids = torch.randint(0, 10, (3, 4))
    out = embedding(ids, weight, backend="torch")
    assert torch.equal(out, embedding_ref(ids, weight))
    grad = torch.randn(3, 4, 6)
    torch.testing.assert_close(embedding_grad(grad, ids, 10, backend="torch").double(), truth(grad, ids, 10))
    assert set(megakern.op_backends("embedding")) == {"triton", "torch"}
    from megakern import _backend  # torch's backward to width 2048 on a GPU, the Triton pass above

    assert [_backend.default_order("embedding", c)[0] for c in (384, 2048, 2049, 4096)] == [
        "torch", "torch", "triton", "triton"]


def test_bad_input():
    weight = torch.randn(10, 4)
    with pytest.raises(TypeError, match="ids must be int32 or int64, got torch.float32"):
        embedding(torch.zeros(3), weight)
    with pytest.raises(ValueError, match=r"weight must be a 2-D floating-point table \(V, C\), got torch.float32 of "
                                         r"shape \(10,\)"):
        embedding(torch.zeros(3, dtype=torch.int64), torch.randn(10))
    with pytest.raises(ValueError, match="2-D floating-point table"):
        embedding(torch.zeros(3, dtype=torch.int64), torch.zeros(10, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="ids and weight must be tensors"):
        embedding([1, 2], weight)
    with pytest.raises(IndexError):
        embedding(torch.tensor([10]), weight)  # the lookup refuses ids outside [0, V)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        embedding(torch.tensor([1]), weight, backend="cuda")
    with pytest.raises(ValueError, match=r"grad must be floating point of shape \(\*ids.shape, C\) = \(2, 3, C\), "
                                         r"got torch.float32 of shape \(2, 4, 5\)"):
        embedding_grad(torch.randn(2, 4, 5), torch.zeros(2, 3, dtype=torch.int64), 10)
    with pytest.raises(TypeError, match="ids must be int32 or int64, got torch.float32"):
        embedding_grad(torch.randn(2, 5), torch.zeros(2), 10)
    with pytest.raises(ValueError, match="num_rows must be >= 0, got -1"):
        embedding_grad(torch.randn(2, 5), torch.zeros(2, dtype=torch.int64), -1)
    if HAS_CUDA:
        with pytest.raises(ValueError, match="ids on cpu but weight on cuda:0"):
            embedding(torch.tensor([1]), weight.cuda())


def compile_for_sm90() -> list:
    """(kernel, registers spilled) for the kernel compiled for sm_90 at its default geometry and a wide one, bf16
    gradients. Needs real (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _embedding_triton as kern

    fn = kern._embedding_grad_kernel
    results = []
    for rows, tok, block, warps in ((kern.ROWS, kern.TOK, kern.BLOCK_C, kern.WARPS), (8, 32, 2048, 8)):
        constexprs = {"ROWS": rows, "TOK": tok, "BLOCK_C": block}
        types = {"ORDER": "*i64", "STARTS": "*i32", "V": "i32", "C": "i32", "stride_g": "i32", "stride_w": "i32"}
        signature = {a: "constexpr" if a in constexprs else types.get(a, "*bf16") for a in fn.arg_names}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps))
        results.append((f"grad {rows}x{tok}x{block}", getattr(compiled.metadata, "n_spills", 0)))
    return results


def test_kernel_compiles_for_sm90():
    """The kernel lowers for Hopper without a GPU (Triton's sm_90 compiler), without spills."""
    from conftest import sm90_lowering

    from megakern import _embedding_triton as kern

    assert sm90_lowering("test_embedding", "compile_for_sm90()") == [
        (f"grad {kern.ROWS}x{kern.TOK}x{kern.BLOCK_C}", 0), ("grad 8x32x2048", 0)]
