"""megakern.embedding / megakern.Embedding: the forward is the row gather; the weight gradient of the Triton backward
against fp64 truth (the 2x rule against torch's own backward in the weight's dtype), with repeated ids, ids no token
has (zero rows, written whole into poisoned memory), every id the same, int32 ids, odd column counts, a
non-contiguous output gradient, idx of any shape; the same bits on every call; a CUDA-graph capture (no host sync);
the module as nn.Embedding's drop-in; bad input. Under the CPU interpreter at small sizes; larger ones on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE, HAS_CUDA, assert_close_to_ref, poison_cuda_allocator, require_triton, seed

import megakern
from megakern.embedding import Embedding, embedding

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (vocabulary, columns, idx shape)
CASES = [(17, 24, (3, 5)), (5, 33, (40,)), (64, 7, (2, 3, 4)), (1, 16, (9,)), (300, 1, (2, 50))]
if HAS_CUDA:
    CASES += [(128256, 4096, (2, 4096)), (50304, 1000, (3, 1111)), (32000, 2048, (8192,))]


def _grads(idx, weight, grad_out, backend):
    w = weight.detach().clone().requires_grad_(True)
    out = embedding(idx, w, backend=backend)
    out.backward(grad_out)
    return out, w.grad


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"V{c[0]}xC{c[1]}-" + "x".join(map(str, c[2])))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_weight_grad_against_fp64(dtype, case):
    require_triton()
    vocab, cols, shape = case
    seed("embedding", dtype, case)
    weight = torch.randn(vocab, cols, device=DEVICE, dtype=dtype)
    # few distinct ids, so that runs are long and many rows get no token
    idx = torch.randint(0, max(1, vocab // 3), shape, device=DEVICE)
    grad_out = torch.randn(*shape, cols, device=DEVICE, dtype=dtype)
    poison_cuda_allocator(2 * vocab * cols * weight.element_size() + 4096)
    out, got = _grads(idx, weight, grad_out, "triton")
    assert torch.equal(out, F.embedding(idx, weight))
    assert got.dtype == dtype and got.shape == weight.shape
    truth = torch.zeros(vocab, cols, dtype=torch.float64, device=DEVICE).index_add_(
        0, idx.reshape(-1), grad_out.reshape(-1, cols).double())
    _, lowp = _grads(idx, weight, grad_out, "torch")
    assert_close_to_ref("dweight", got, truth, lowp, atol=1e-6)
    seen = torch.zeros(vocab, dtype=torch.bool, device=DEVICE)
    seen[idx.reshape(-1)] = True
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))  # rows no token has: zeros, written
    _, again = _grads(idx, weight, grad_out, "triton")
    assert torch.equal(again, got)  # deterministic


def test_one_id_int32_and_views():
    require_triton()
    seed("embedding one id")
    weight = torch.randn(9, 20, device=DEVICE)
    idx = torch.full((4, 6), 3, device=DEVICE, dtype=torch.int32)
    base = torch.randn(6, 4, 40, device=DEVICE)
    grad_out = base.transpose(0, 1)[..., ::2]  # (4, 6, 20), non-contiguous
    assert not grad_out.is_contiguous()
    _, got = _grads(idx, weight, grad_out, "triton")
    want = torch.zeros(9, 20, dtype=torch.float64, device=DEVICE)
    want[3] = grad_out.double().reshape(-1, 20).sum(0)
    assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-5)
    _, empty = _grads(idx[:0], weight, grad_out[:0], "triton")  # no tokens: a zero gradient
    assert torch.equal(empty, torch.zeros_like(weight))


def test_module_is_nn_embedding():
    require_triton()
    seed("embedding module")
    ref = torch.nn.Embedding(11, 8).to(DEVICE)
    mod = Embedding(11, 8, backend="triton", device=DEVICE)
    mod.load_state_dict(ref.state_dict())
    assert isinstance(mod, torch.nn.Embedding) and set(mod.state_dict()) == {"weight"}
    idx = torch.randint(0, 11, (3, 7), device=DEVICE)
    g = torch.randn(3, 7, 8, device=DEVICE)
    mod(idx).backward(g)
    ref(idx).backward(g)
    assert torch.allclose(mod.weight.grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # no autograd: the plain gather
        assert torch.equal(mod(idx), ref(idx))


@pytest.mark.gpu
def test_cuda_graph_capture():
    """The Triton backward needs no host sync: a forward and backward captured in a CUDA graph replays to the eager
    gradient."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA device")
    require_triton()
    seed("embedding graph")
    w = torch.randn(1000, 64, device=DEVICE, requires_grad=True)
    idx = torch.randint(0, 1000, (4, 256), device=DEVICE)
    g = torch.randn(4, 256, 64, device=DEVICE)
    embedding(idx, w, backend="triton").backward(g)  # warm-up: compile
    eager = w.grad.clone()
    w.grad = None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            embedding(idx, w, backend="triton").backward(g)
    torch.cuda.current_stream().wait_stream(stream)
    w.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(w.grad, eager)


def test_bad_input():
    w = torch.randn(5, 4, device=DEVICE)
    with pytest.raises(TypeError, match="int32 or int64"):
        embedding(torch.zeros(3, device=DEVICE), w)
    with pytest.raises(ValueError, match="floating"):
        embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="backend"):
        embedding(torch.zeros(3, dtype=torch.long, device=DEVICE), w, backend="cuda")
    for option in ({"padding_idx": 0}, {"max_norm": 1.0}, {"scale_grad_by_freq": True}, {"sparse": True}):
        with pytest.raises(ValueError, match=next(iter(option))):
            Embedding(5, 4, **option)
    assert megakern.op_backends("embedding") == ("triton", "torch")
