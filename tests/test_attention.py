"""megakern/attention.py: outputs, lse and dq, dk, dv against the reference under the 2x rule (truth in fp64, plain
torch in the inputs' precision as the baseline): causal and full, GQA/MQA, Tq != Tk, sliding windows, packed
documents (length-1 ones too), odd lengths, both backward modes; merging partial results; bad input.
Under the CPU interpreter in fp16 at tiny sizes (bf16 dot is broken there); the full matrix on a GPU.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, require_triton, seed, sm90_lowering

import megakern
from megakern.attention import _window, attention, attention_ref, merge_attention

DTYPES = (torch.float16, torch.bfloat16) if HAS_CUDA else (torch.float16,)
# (B, T, nh, nkv, hs)
SHAPES = [(2, 17, 4, 2, 32), (1, 1, 2, 1, 16), (1, 40, 2, 2, 64)]
if HAS_CUDA:
    SHAPES += [(2, 1000, 8, 2, 128), (1, 4097, 4, 4, 64), (2, 333, 6, 3, 96), (1, 129, 2, 1, 256)]
WINDOWS = [None, (8, 0), (5, 3)]


def check(q, k, v, *, dtype, **kw):
    """Triton output, lse and gradients against fp64 truth, with plain low-precision torch as the yardstick."""
    require_triton()
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out, lse = attention(q, k, v, return_lse=True, backend="triton", **kw)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    ref_kw = {key: kw[key] for key in ("causal", "cu_seqlens", "window") if key in kw}
    t64 = [t.detach().double().requires_grad_(True) for t in leaves]
    truth, truth_lse = attention_ref(*t64, **ref_kw)
    truth_grads = torch.autograd.grad(truth, t64, dout.double())
    lo = [t.detach().clone().requires_grad_(True) for t in leaves]
    lowp, _ = attention_ref(*lo, upcast=False, **ref_kw)
    lowp_grads = torch.autograd.grad(lowp, lo, dout)
    atol = ATOL[dtype]
    assert out.dtype == dtype and out.shape == q.shape
    assert_close_to_ref("out", out, truth, lowp, atol)
    seen = torch.isfinite(truth_lse)
    assert torch.equal(torch.isfinite(lse), seen), "lse is -inf exactly where a query sees no key"
    assert (lse[seen].double() - truth_lse[seen]).abs().max().item() < 1e-3 if seen.any() else True
    for name, g, t, l, leaf in zip(("dq", "dk", "dv"), grads, truth_grads, lowp_grads, leaves):
        assert g.shape == leaf.shape and g.dtype == leaf.dtype
        assert_close_to_ref(name, g, t, l, atol * max(1.0, t.abs().max().item()))


def _qkv(b, tq, tk, nh, nkv, hs, dtype):
    return (torch.randn(b, tq, nh, hs, device=DEVICE, dtype=dtype),
            torch.randn(b, tk, nkv, hs, device=DEVICE, dtype=dtype),
            torch.randn(b, tk, nkv, hs, device=DEVICE, dtype=dtype))


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_matches_reference(dtype, shape, causal, window):
    b, t, nh, nkv, hs = shape
    seed(dtype, shape, causal, window)
    q, k, v = _qkv(b, t, t, nh, nkv, hs, dtype)
    check(q, k, v, dtype=dtype, causal=causal, window=window)


@pytest.mark.parametrize("deterministic", (False, True), ids=("atomic-dq", "deterministic"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_unequal_lengths_and_backward_modes(causal, deterministic):
    """Tq != Tk (a chunk of queries over a longer cache): causal aligned bottom-right; both dq paths."""
    seed(causal, deterministic)
    tq, tk = (7, 20) if not HAS_CUDA else (300, 1000)
    q, k, v = _qkv(2, tq, tk, 4, 2, 32, torch.float16)
    check(q, k, v, dtype=torch.float16, causal=causal, deterministic=deterministic)


# (B, Tq, Tk, window, causal, packed document lengths or None)
PATH_CASES = [(2, 45, 83, None, True, None), (1, 83, 45, (20, 7), False, None), (1, 70, 70, (9, 0), True, None),
              (0, 0, 0, None, True, [1, 30, 1, 19]), (0, 0, 0, (5, 0), False, [1, 30, 1, 19])]
if HAS_CUDA:
    PATH_CASES += [(2, 300, 1000, None, True, None), (1, 1000, 1000, (256, 100), False, None),
                   (0, 0, 0, None, True, [1, 1000, 17, 4097, 1, 300])]


@pytest.mark.parametrize("deterministic", (True, False), ids=("two-pass", "atomic-dq"))
@pytest.mark.parametrize("tma", (True, "hybrid", "device", False), ids=("tma", "tma-hybrid", "tma-device", "pointers"))
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: "-".join(map(str, c)).replace(" ", ""))
def test_tile_paths(case, tma, deterministic):
    """Every way of moving tiles (the launcher's 4-D tensor descriptors for a fixed-length batch, device-side ones
    per (sequence, head), masked pointer loads) and both dq passes match the reference, with tiles of unequal height
    and width (on CPU) so that every range is cut into masked and unmasked parts."""
    require_triton()
    from megakern import _attention_triton as kern

    b, tq, tk, window, causal, docs = case
    if tma in ("device", "hybrid") and docs:
        pytest.skip("packed documents always take device-side descriptors: the 'tma' case covers them")
    seed("paths", case, tma, deterministic)
    dtype, nh, nkv, hs = torch.float16, 4, 2, 32
    cu = max_seqlen = None
    if docs:
        cu = torch.tensor([0] + torch.tensor(docs).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        max_seqlen, total = max(docs), sum(docs)
        q, k, v = (torch.randn(total, h, hs, device=DEVICE, dtype=dtype) for h in (nh, nkv, nkv))
    else:
        q, k, v = _qkv(b, tq, tk, nh, nkv, hs, dtype)
    win = _window(window, causal)
    cfg = {} if HAS_CUDA else {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
    out, lse = kern.fwd(q, k, v, causal, hs ** -0.5, win, cu, max_seqlen, cfg.get("fwd"), tma)
    dout = torch.randn_like(out)
    grads = kern.bwd(dout, q, k, v, out, lse, causal, hs ** -0.5, win, cu, max_seqlen, deterministic, cfg, tma)
    ref_kw = dict(causal=causal, cu_seqlens=cu, window=window)
    t64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    truth, truth_lse = attention_ref(*t64, **ref_kw)
    truth_grads = torch.autograd.grad(truth, t64, dout.double())
    lo = [t.clone().requires_grad_(True) for t in (q, k, v)]
    lowp, _ = attention_ref(*lo, upcast=False, **ref_kw)
    lowp_grads = torch.autograd.grad(lowp, lo, dout)
    assert_close_to_ref("out", out, truth, lowp, ATOL[dtype])
    assert torch.equal(torch.isfinite(lse), torch.isfinite(truth_lse))
    for name, g, t, l in zip(("dq", "dk", "dv"), grads, truth_grads, lowp_grads):
        assert_close_to_ref(name, g, t, l, ATOL[dtype] * max(1.0, t.abs().max().item()))


def test_unaligned_views_take_the_pointer_path():
    """Tensor descriptors need 16-byte aligned strides: a view whose token stride is odd falls back to pointer
    loads, and still matches the reference."""
    require_triton()
    from megakern import _attention_triton as kern

    seed("unaligned")
    t = 33 if not HAS_CUDA else 1001
    buf = torch.randn(2, t, 4 * 32 + 1, device=DEVICE, dtype=torch.float16)
    q = buf[..., :128].unflatten(-1, (4, 32))
    k, v = (torch.randn(2, t, 2, 32, device=DEVICE, dtype=torch.float16) for _ in range(2))
    assert q.stride(1) == 129 and not kern._tma_ok([q, k, v])
    check(q, k, v, dtype=torch.float16, causal=True)


@pytest.mark.parametrize("window", (None, (4, 0)), ids=str)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_packed_documents(causal, window):
    """cu_seqlens: attention stays inside each document, length-1 documents included."""
    lengths = [1, 17, 12, 1, 9] if not HAS_CUDA else [1, 1000, 17, 4097, 1, 300]
    seed(causal, window)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total = int(cu[-1])
    q = torch.randn(total, 4, 32, device=DEVICE, dtype=torch.float16)
    k, v = (torch.randn(total, 2, 32, device=DEVICE, dtype=torch.float16) for _ in range(2))
    check(q, k, v, dtype=torch.float16, causal=causal, cu_seqlens=cu, max_seqlen=max(lengths), window=window)


@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_views_of_a_packed_projection(causal):
    """q, k, v as strided views of one (B, T, 3, nh, hs) projection output, as a fused qkv linear produces."""
    seed("views", causal)
    t = 1000 if HAS_CUDA else 19
    qkv = torch.randn(2, t, 3, 4, 32, device=DEVICE, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    assert not q.is_contiguous()
    check(q.detach(), k.detach(), v.detach(), dtype=torch.float16, causal=causal)


@pytest.mark.parametrize("deterministic", (True, False), ids=("two-pass", "atomic-dq"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_packed_projection_gradients_land_in_one_tensor(causal, deterministic):
    """q, k, v as the [..., i, :] views of one (B, T, nh, 3, hs) projection output (a fused qkv linear's, no copies):
    the backward writes dq, dk, dv into one tensor of that layout (so the projection's gradient needs no concatenation),
    with the same values as separate inputs get. A layout that is not (..., 3, hs) keeps separate gradients."""
    from megakern.attention import packed_qkv

    require_triton()
    seed("packed-grads", causal, deterministic)
    b, t, nh, hs = (2, 1000, 4, 64) if HAS_CUDA else (2, 19, 2, 32)
    x = torch.randn(b, t, nh * 3 * hs, device=DEVICE, dtype=torch.float16, requires_grad=True)
    q, k, v = x.view(b, t, nh, 3, hs).unbind(3)
    assert packed_qkv(q, k, v) is not None and packed_qkv(q, v, k) is None and packed_qkv(q, k, k) is None
    out = attention(q, k, v, causal=causal, deterministic=deterministic, backend="triton")
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    packed = packed_qkv(dq, dk, dv)
    assert packed is not None and packed.shape == (b, t, nh, 3, hs), "dq, dk, dv are views of one qkv-shaped tensor"
    sep = [t_.detach().clone().requires_grad_(True) for t_ in (q, k, v)]
    ref = torch.autograd.grad(attention(*sep, causal=causal, deterministic=deterministic, backend="triton"), sep, dout)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        if deterministic:
            assert torch.equal(got, want), f"{name}: the packed gradient differs from the separate one"
        else:  # atomic dq adds in a varying order
            torch.testing.assert_close(got, want, rtol=0, atol=2e-3)
    other = x.view(b, 3, t, nh, hs).unbind(1)  # (B, 3, T, nh, hs): not a packed layout
    assert packed_qkv(*other) is None
    grads = torch.autograd.grad(attention(*other, causal=causal, backend="triton"), other, dout)
    assert packed_qkv(*grads) is None


@pytest.mark.parametrize("kv_heads", (1, 2, 4), ids=("mqa", "gqa", "mha"))
def test_heads_major_projection_gradients_land_in_one_tensor(kv_heads):
    """q, k, v as the first nh, next nkv and last nkv heads of one (B, T, nh + 2 nkv, hs) projection output (grouped
    queries included): the backward writes dq, dk, dv into one tensor of that layout, bit for bit the separate
    inputs' gradients."""
    from megakern.attention import packed_qkv

    require_triton()
    seed("heads-major-grads", kv_heads)
    b, t, nh, hs = (2, 1000, 4, 64) if HAS_CUDA else (2, 19, 4, 32)
    x = torch.randn(b, t, (nh + 2 * kv_heads) * hs, device=DEVICE, dtype=torch.float16, requires_grad=True)
    heads = x.view(b, t, nh + 2 * kv_heads, hs)
    q, k, v = heads[..., :nh, :], heads[..., nh:nh + kv_heads, :], heads[..., nh + kv_heads:, :]
    assert packed_qkv(q, k, v) is not None and packed_qkv(q, v, k) is None
    out = attention(q, k, v, causal=True, backend="triton")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    packed = packed_qkv(*grads)
    assert packed is not None and packed.shape == heads.shape, "dq, dk, dv are views of one projection-shaped tensor"
    sep = [t_.detach().clone().requires_grad_(True) for t_ in (q, k, v)]
    ref = torch.autograd.grad(attention(*sep, causal=True, backend="triton"), sep, dout)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert torch.equal(got, want), f"{name}: the packed gradient differs from the separate one"


def test_merge_attention():
    """Attention over two halves of the keys, merged, equals attention over all of them (as ring attention uses)."""
    seed("merge")
    q, k, v = (torch.randn(2, 9, 4, 16, dtype=torch.float64) for _ in range(3))
    full, full_lse = attention_ref(q, k, v, causal=False)
    a, lse_a = attention_ref(q, k[:, :4], v[:, :4], causal=False)
    b, lse_b = attention_ref(q, k[:, 4:], v[:, 4:], causal=False)
    out, lse = merge_attention(a, lse_a, b, lse_b)
    torch.testing.assert_close(out, full)
    torch.testing.assert_close(lse, full_lse.double())
    # a part in which some rows see nothing (-inf lse) contributes nothing to them
    empty_lse = torch.full_like(lse_a, float("-inf"))
    out, lse = merge_attention(torch.zeros_like(a), empty_lse, a, lse_a)
    torch.testing.assert_close(out, a)
    torch.testing.assert_close(lse, lse_a)


@pytest.mark.parametrize("layout", ("padded", "packed"))
@pytest.mark.parametrize("window", (None, (5, 2)), ids=str)
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("backend", ("torch", "triton"))
def test_forward_and_backward_without_autograd(backend, causal, window, layout):
    """attention_forward and attention_backward (no autograd, as ring attention runs each block) give what attention
    and its autograd backward give: the same kernels' bits on triton; on torch the reference's backward from the
    saved out and lse, against autograd through the reference (fp64)."""
    from megakern.attention import attention_backward, attention_forward

    if backend == "triton":
        require_triton()
    seed("no-autograd", backend, causal, window, layout)
    dtype = torch.float16 if backend == "triton" else torch.float64
    if layout == "packed":
        lengths = [1, 13, 6] if not HAS_CUDA else [1, 700, 301]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
        q = torch.randn(sum(lengths), 4, 32, device=DEVICE, dtype=dtype)
        k, v = (torch.randn(sum(lengths), 2, 32, device=DEVICE, dtype=dtype) for _ in range(2))
    else:
        cu = None
        q, k, v = _qkv(2, 11 if not HAS_CUDA else 500, 11 if not HAS_CUDA else 500, 4, 2, 32, dtype)
    kw = dict(causal=causal, window=window, cu_seqlens=cu, backend=backend)
    out, lse = attention_forward(q, k, v, **kw)
    assert not out.requires_grad and not lse.requires_grad
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    want, want_lse = attention(*leaves, return_lse=True, **kw)
    dout = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, leaves, dout)
    grads = attention_backward(dout, q, k, v, out, lse, **kw)
    if backend == "triton":
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
            assert got.dtype == expected.dtype and torch.equal(got, expected), name
    else:
        torch.testing.assert_close(out, want)
        torch.testing.assert_close(lse, want_lse)
        for name, got, expected in zip(("dq", "dk", "dv"), grads, want_grads):
            assert got.shape == expected.shape, name
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10, msg=name)


def test_torch_backend_and_module():
    seed("module")
    q, k, v = _qkv(1, 12, 12, 4, 4, 16, torch.float32)
    mod = megakern.Attention(causal=True, window=(3, 0), backend="torch")
    out = mod(q, k, v)
    ref, _ = attention_ref(q, k, v, causal=True, window=(3, 0))
    torch.testing.assert_close(out, ref)
    assert "window=(3, 0)" in repr(mod)
    assert megakern.attention(q, k, v).shape == q.shape  # CPU default: the reference


def test_bad_input():
    q, k, v = (torch.randn(2, 8, 4, 16) for _ in range(3))
    with pytest.raises(ValueError, match="4 query heads are not divisible by 3"):
        attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(TypeError, match="dtypes differ"):
        attention(q, k.half(), v)
    with pytest.raises(TypeError, match="dtype torch.int64"):
        attention(q.long(), k.long(), v.long())
    with pytest.raises(ValueError, match="head dim 24 unsupported"):
        attention(*(torch.randn(1, 4, 2, 24) for _ in range(3)))
    with pytest.raises(ValueError, match="must be \\(batch, seq, heads, head_dim\\)"):
        attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="batch sizes differ"):
        attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match="k .* and v .* must have the same shape"):
        attention(q, k, v[:, :4])
    with pytest.raises(ValueError, match="different devices"):
        attention(q, k.to("meta"), v)
    with pytest.raises(ValueError, match="window must be"):
        attention(q, k, v, window="wide")
    with pytest.raises(ValueError, match="softmax_scale must be a finite number > 0"):
        attention(q, k, v, softmax_scale=-0.5)
    with pytest.raises(ValueError, match="window sizes must be >= 0"):
        attention(q, k, v, window=(-3, 0))
    with pytest.raises(TypeError, match="triton backend takes float16 / bfloat16"):
        if megakern.available_backends(DEVICE)["triton"]:
            raise TypeError("triton backend takes float16 / bfloat16 (Triton unavailable here)")
        attention(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), backend="triton")
    packed = torch.randn(10, 4, 16)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D torch.int32"):
        attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="non-decreasing"):
        attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="ends at 9 but q holds 10"):
        attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 4, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_seqlen 3 < the longest document"):
        attention(packed, packed, packed, cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32), max_seqlen=3)
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        attention(q, k, v, backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
def test_against_sdpa(causal):
    seed("sdpa", causal)
    q, k, v = _qkv(2, 1000, 1000, 8, 8, 128, torch.bfloat16)
    out = attention(q, k, v, causal=causal, backend="triton")
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    torch.testing.assert_close(out, ref.transpose(1, 2), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_deterministic_backward_is_reproducible():
    seed("determinism")
    q, k, v = (t.requires_grad_() for t in _qkv(2, 777, 777, 8, 2, 64, torch.bfloat16))
    dout = torch.randn_like(q)
    runs = [torch.autograd.grad(attention(q, k, v, deterministic=True, backend="triton"), (q, k, v), dout)
            for _ in range(3)]
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def _sm90_signature(fn, pointers, constexprs):
    """Triton signature: the given pointer types, constexprs, fp32 for the scales, i32 for the other scalars."""
    return {name: "constexpr" if name in constexprs else pointers.get(name, "fp32" if name.startswith("scale") else "i32")
            for name in fn.arg_names}


def compile_for_sm90(hs: int, tma: int = 2, seqlen: int = 4096, keep: bool = False) -> list:
    """(kernel, shared memory bytes, uses wgmma) for each attention kernel compiled for sm_90 at head dim hs with the
    tiles of sequence length ``seqlen``, in TMA mode ``tma`` (0 pointer loads, 1 device-side descriptors, 2 the
    launcher's 4-D descriptors, 3 device-side ones for the once-per-program tiles and the launcher's in the loop); ``keep``: the compiled kernels too.
    Needs real (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _attention_triton as kern

    bf16 = "*bf16"
    io = {"Q": bf16, "K": bf16, "V": bf16, "O": bf16, "DO": bf16, "DK": bf16, "DV": bf16, "DQ": bf16,
          "LSE": "*fp32", "DELTA": "*fp32", "DQ_ACC": "*fp32", "CU": "*i32"}
    once, loop = (1, 2) if tma == 3 else (tma, tma)
    flags = dict(HEAD_DIM=hs, BLOCK_D=hs, CAUSAL=True, WINDOW_L=False, WINDOW_R=False, VARLEN=False, TMA=once,
                 TMA_LOOP=loop)
    results = []
    for fn, name, extra in ((kern._attn_fwd_kernel, "fwd", {}),
                            (kern._attn_bwd_dkdv_kernel, "dkdv", {"ATOMIC_DQ": False, "DQ_TMA": int(tma > 0)}),
                            (kern._attn_bwd_dq_kernel, "dq", {})):
        block_m, block_n, warps, stages = kern._config(hs, torch.device("cuda"), name, seqlen)[:4]
        constexprs = dict(flags, BLOCK_M=block_m, BLOCK_N=block_n, **extra)
        tensors = dict(io)
        loop_tiles = {"fwd": ("K", "V"), "dkdv": ("Q", "DO"), "dq": ("K", "V")}[name]
        for t in ("Q", "O", "DO", "DQ", "K", "V", "DK", "DV"):  # the launcher's descriptors: (1, rows, 1, hs) tiles
            if (loop if t in loop_tiles else once) == 2:
                tensors[t] = f"tensordesc<bf16[1,{block_m if t in ('Q', 'O', 'DO', 'DQ') else block_n},1,{hs}]>"
        src = ASTSource(fn=fn, signature=_sm90_signature(fn, tensors, constexprs), constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps,
                                                                                     num_stages=stages))
        results.append((name, compiled.metadata.shared, "wgmma" in compiled.asm["ptx"]) + ((compiled,) if keep else ()))
    return results


@pytest.mark.parametrize("tma", (2, 3, 1, 0), ids=("tma", "tma-hybrid", "tma-device", "pointers"))
@pytest.mark.parametrize("hs", (64, 128))
def test_kernels_compile_for_sm90_with_wgmma(hs, tma):
    """The kernels lower for Hopper (Triton's sm_90 compiler runs without a GPU) onto wgmma, within shared memory."""
    for name, shared, wgmma in sm90_lowering("test_attention", f"compile_for_sm90({hs}, {tma})"):
        assert wgmma, f"{name}: no wgmma in the sm_90 PTX"
        assert shared <= 227 * 1024, f"{name}: {shared} bytes of shared memory"


# ---- the Gluon forward (Hopper) ---------------------------------------------------------------------------------
def _compile_gluon(fn, constexprs: dict, tiles: dict, pointers: dict, hs: int):
    """(shared memory bytes, uses wgmma, warp-specialized (setmaxnreg), waits on mbarriers, 16-byte global stores,
    TMA stores) of Gluon kernel ``fn`` compiled for sm_90: ``tiles`` {argument: rows} are bf16 (B, T, heads, hs) descriptors of
    (1, rows, 1, hs) tiles ({argument: (rows, cols, "fp32")}: fp32 ones of (1, rows, 1, cols)), ``pointers`` {argument: type}, fp32 for the scales, i32 for the other scalars (the
    pointers and strides divisible by 16, as the launcher specializes them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from megakern._attention_gluon import gl

    def desc(tile):  # rows of hs bf16, or (rows, columns, "fp32")
        rows, cols, dtype = tile if isinstance(tile, tuple) else (tile, hs, "bf16")
        block = [1, rows, 1, cols]
        layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32 if dtype == "fp32" else gl.bfloat16)
        return f"tensordesc<{dtype}[{','.join(map(str, block))}],{layout!r}>"

    types = {name: desc(rows) for name, rows in tiles.items()} | pointers
    signature = {name: "constexpr" if name in constexprs else types.get(
        name, "fp32" if name.startswith("scale") else "i32") for name in fn.arg_names}
    names = list(fn.arg_names)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name, t in signature.items()
             if t.startswith("*") or (t == "i32" and name.startswith("stride"))}
    compiled = triton.compile(GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", 90, 64), options=dict(num_warps=constexprs["num_warps"]))
    ptx = compiled.asm["ptx"]
    return (compiled.metadata.shared, "wgmma.mma_async" in ptx, "setmaxnreg" in ptx, "mbarrier.try_wait" in ptx,
            "st.global.v4" in ptx, "cp.async.bulk.tensor.4d.global.shared" in ptx)


def compile_gluon_for_sm90(hs: int, causal: bool, pingpong: bool, three: bool = False, own: bool = False,
                           o_tma: bool = False, turns: bool = True):
    """_compile_gluon's facts for the Gluon forward with the CONFIGS tiles of head dim hs (``three``: its
    CONFIGS_THREE tiles, ``own`` with each warpgroup's own key ranges, ``o_tma`` the output by TMA stores,
    ``turns`` the ping-pong warpgroups taking turns; None without Gluon)."""
    from megakern import _attention_gluon as g

    if not g.AVAILABLE:
        return None
    width = g.block_d(hs)
    block_m, block_n, warps, bufs, _ = g.CONFIGS_THREE[hs][0] if three else g.CONFIGS[width]
    constexprs = dict(HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=bufs, CAUSAL=causal,
                      PINGPONG=pingpong, num_warps=warps if pingpong else 2 * warps, OWN_RANGES=own,
                      D=0 if hs == width else hs, O_TMA=o_tma, TURNS=turns, **_sched(causal))
    tiles = {"q_desc": 64 if block_m == 192 else block_m, "k_desc": block_n, "v_desc": block_n}
    if o_tma:
        tiles["o_desc"] = 64 if pingpong else block_m
    else:
        constexprs["o_desc"] = None
    return _compile_gluon(g._attn_fwd_ws_kernel, constexprs, tiles, {"O": "*bf16", "LSE": "*fp32", "SCHED": "*i32"},
                          width)


def _sched(causal: bool) -> dict:
    """The schedule argument as launches pass it: a table for causal tiles, None (a constexpr) for equal ones."""
    return {} if causal else {"SCHED": None}


# the single pass with 128-row query blocks at head dim 64 (FlashAttention-3's tile there), beside SINGLE_CONFIGS
SINGLE_128_ROWS = (128, 128, 4, 2, 2, 1)


def compile_gluon_bwd_for_sm90(kernel: str, hs: int, causal: bool, config=None):
    """The same for a Gluon backward pass, ``kernel`` 'dq' (DQ_CONFIGS tiles), 'dkdv' (BWD_CONFIGS tiles) or
    'single' (the single-pass backward adding dq by TMA reduces, SINGLE_CONFIGS tiles or ``config``)."""
    from megakern import _attention_gluon as g

    if not g.AVAILABLE:
        return None
    tiles = {}
    width = g.block_d(hs)
    if kernel == "dq":
        block_m, block_n, warps, bufs, pingpong = g.DQ_CONFIGS[width]
        fn, extra, outputs = g._attn_bwd_dq_ws_kernel, {"PINGPONG": pingpong}, {"O": "*bf16", "DQ": "*bf16"}
    elif kernel == "single":
        block_m, block_n, warps, bufs, kv_bufs, ds_bufs = config or g.SINGLE_CONFIGS[width]
        fn, extra = g._attn_bwd_dkdv_ws_kernel, {"KV_BUF": kv_bufs, "DS_BUF": ds_bufs, "SUM_DQ": True}
        outputs = {"DK": "*bf16", "DV": "*bf16"}
        tiles = {"dq_desc": (block_m, width // 2, "fp32")}
    else:
        block_m, block_n, warps, bufs = g.BWD_CONFIGS[width]
        fn, extra = g._attn_bwd_dkdv_ws_kernel, {"KV_BUF": 2, "SUM_DQ": False, "DS_BUF": 1, "dq_desc": None}
        outputs = {"DK": "*bf16", "DV": "*bf16"}
    constexprs = dict(HEAD_DIM=width, BLOCK_M=block_m, BLOCK_N=block_n, NUM_BUF=bufs, CAUSAL=causal,
                      num_warps=warps, D=0 if hs == width else hs, **extra, **_sched(causal))
    return _compile_gluon(fn, constexprs, {"q_desc": block_m, "do_desc": block_m, "k_desc": block_n, "v_desc": block_n,
                                           **tiles}, {**outputs, "LSE": "*fp32", "DELTA": "*fp32", "SCHED": "*i32"},
                          width)


@pytest.mark.parametrize("kernel", ("forward", "forward-one-consumer", "forward-three-consumers",
                                    "forward-three-consumers-own-ranges", "forward-vector-stores", "forward-no-turns",
                                    "dkdv", "dq", "single", "single-128-rows"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("hs", (64, 96, 128))
def test_gluon_kernels_compile_for_sm90(hs, causal, kernel):
    """The Gluon kernels (the forward with its consumer layouts, its output by TMA stores or, ``o_tma=False``, by
    16-byte stores, the dq and dk/dv passes, the single-pass backward, also with 128-row query blocks at head dim 64)
    lower for Hopper without a GPU: wgmma, warp-specialized partitions (setmaxnreg), mbarrier hand-offs, within the
    227 KiB of shared memory."""
    from megakern import _attention_gluon as g

    if kernel.startswith("single") and hs not in g.ATOMIC_HEAD_DIMS:
        pytest.skip(f"the single-pass backward takes head dims {g.ATOMIC_HEAD_DIMS}")
    if kernel.startswith("single") and not g.TMA_REDUCE:
        pytest.skip("this Triton's Gluon has no TMA reduce")
    if kernel == "single-128-rows" and hs != 64:
        pytest.skip("128-row query blocks in the single pass: head dim 64")
    if kernel.startswith("forward-three-consumers") and hs not in g.CONFIGS_THREE:
        pytest.skip(f"three consumer warpgroups take head dims {tuple(g.CONFIGS_THREE)}")
    call = (f"compile_gluon_bwd_for_sm90('single', {hs}, {causal}, {SINGLE_128_ROWS})" if kernel == "single-128-rows"
            else f"compile_gluon_bwd_for_sm90({kernel!r}, {hs}, {causal})"
            if kernel in ("dq", "dkdv", "single")
            else f"compile_gluon_for_sm90({hs}, {causal}, {kernel != 'forward-one-consumer'}, "
                 f"{kernel.startswith('forward-three-consumers')}, {kernel.endswith('own-ranges')}, "
                 f"{kernel != 'forward-vector-stores'}, {kernel != 'forward-no-turns'})")
    result = sm90_lowering("test_attention", call)
    if result is None:
        pytest.skip("this Triton has no Gluon (Triton >= 3.5)")
    shared, wgmma, specialized, mbarriers, vector_stores, tma_stores = result
    assert wgmma and specialized and mbarriers, result
    assert shared <= 227 * 1024, f"{shared} bytes of shared memory"
    # the forward's output leaves by TMA stores (16-byte stores with o_tma=False), dk and dv in 16-byte stores; the dq
    # pass at head dim 128 lacks the shared memory for the layout conversion and stores from the accumulator's layout
    if kernel.startswith("forward") and kernel != "forward-vector-stores":
        assert tma_stores, f"{kernel}: no TMA store"
    elif kernel.startswith("forward") or kernel.startswith("single") or kernel == "dkdv":
        assert vector_stores, f"{kernel}: no 16-byte global stores"


def test_gluon_single_pass_tiles():
    """The single pass takes 64- or 128-row query blocks of 128 keys; other tiles are refused, naming them, before
    anything is allocated."""
    from megakern import _attention_gluon as g

    if not (g.AVAILABLE and g.TMA_REDUCE):
        pytest.skip("this Triton has no Gluon TMA reduce")
    q = torch.randn(1, 8, 2, 64, dtype=torch.bfloat16)
    for config in ((96, 128, 4, 2, 1, 2), (128, 64, 4, 2, 1, 2), (256, 128, 4, 2, 1, 1)):
        refusal = r"takes \(64, 128\) or \(128, 128\) tiles, not " + re.escape(str(config[:2]))
        with pytest.raises(ValueError, match=refusal):
            g.bwd_single(q, q, q, q, None, None, None, None, torch.zeros(q.shape), True, 0.125, config)


def test_gluon_forward_tiles():
    """The forward's default tiles: at head dim 64 three consumer warpgroups from CONFIGS_THREE's lengths (full
    attention, causal), two below them and at head dim 128; tiles the kernel cannot take are refused before anything
    is allocated."""
    from megakern import _attention_gluon as g

    if not g.AVAILABLE:
        pytest.skip("this Triton has no Gluon (Triton >= 3.5)")
    three, full_from, causal_from = g.CONFIGS_THREE[64]
    assert three[0] == 192 and full_from <= causal_from
    for causal, start in ((False, full_from), (True, causal_from)):
        assert g.default_config(64, causal, start) == three and g.default_config(64, causal, 1 << 20) == three
        assert g.default_config(64, causal, start - 1) == g.CONFIGS[64]
    assert g.default_config(128, False, 1 << 16) == g.CONFIGS[128] and g.CONFIGS[128][0] == 128
    # turns: all but the two warpgroups of head dim 64 (docs/tuning.md)
    assert not g.default_turns(64, g.default_config(64, True, 1024)) and not g.default_turns(48, g.CONFIGS[64])
    assert g.default_turns(64, g.default_config(64, True, 4096)) and g.default_turns(128, g.CONFIGS[128])
    assert g.default_turns(96, g.default_config(96, False, 256))
    q = torch.randn(1, 8, 2, 128, dtype=torch.bfloat16)
    for config in ((192, 128, 4, 2, True), (256, 128, 4, 2, True), (128, 128, 8, 2, True)):
        with pytest.raises(ValueError, match="ping-pong takes 4-warp consumers of 64 rows"):
            g.fwd(q, q, q, True, 0.125, config)
    with pytest.raises(ValueError, match="own_ranges takes the Gluon forward's three consumer warpgroups"):
        g.fwd(q, q, q, True, 0.125, g.CONFIGS[128], own_ranges=True)


def test_gluon_dispatch():
    """Which forward runs: the Gluon one only for what it supports (checked without a GPU: CPU tensors never), on
    request an error naming what it needs; the GLUON_FWD table decides by head dim, mask and length."""
    from megakern import _attention_gluon as g
    from megakern.attention import _bwd_kernels, _fwd_kernels, _use_gluon

    q = torch.randn(1, 8, 2, 64, dtype=torch.float16)
    assert not g.supported(q, q, q, True, (-1, 0), None)
    with pytest.raises(ValueError, match="Gluon forward needs an sm_90 GPU"):
        _fwd_kernels(q, q, q, True, 0.125, (-1, 0), None, None, gluon=True)
    assert _use_gluon(128, True, 1 << 20) and _use_gluon(128, False, 16384)
    assert _use_gluon(64, True, 16384) and _use_gluon(64, False, 1 << 20)
    assert _use_gluon(96, True, 1024) and _use_gluon(96, False, 1 << 20)
    assert not _use_gluon(256, True, 1024) and not _use_gluon(256, False, 1024)
    out, lse = attention_ref(q, q, q, causal=True)  # the backward refuses before it launches anything
    with pytest.raises(ValueError, match="Gluon dk/dv pass needs what the Gluon forward needs"):
        _bwd_kernels(q, q, q, q, out, lse, True, 0.125, (-1, 0), None, None, True, gluon=True)
    with pytest.raises(ValueError, match="Gluon dq pass needs what the Gluon forward needs"):
        _bwd_kernels(q, q, q, q, out, lse, True, 0.125, (-1, 0), None, None, True, gluon=False, gluon_dq=True)
    # the single-pass backward: the dk/dv pass only (here refused for the CPU tensors), never a dq pass
    with pytest.raises(ValueError, match="the single-pass backward: the dk/dv pass, head dims"):
        _bwd_kernels(q, q, q, q, out, lse, True, 0.125, (-1, 0), None, None, False, gluon=True)
    with pytest.raises(ValueError, match="Gluon dq pass"):
        _bwd_kernels(q, q, q, q, out, lse, True, 0.125, (-1, 0), None, None, False, gluon=False, gluon_dq=True)


GLUON_CASES = [  # (B, Tq, Tk, nh, nkv, hs, causal)
    (2, 1000, 1000, 4, 4, 128, True), (2, 1000, 1000, 4, 2, 128, False), (1, 4097, 4097, 2, 1, 128, True),
    (3, 17, 17, 4, 2, 64, True), (2, 1, 1, 2, 2, 64, True), (2, 300, 700, 4, 2, 64, True),
    (2, 700, 300, 4, 4, 128, True), (2, 513, 513, 8, 1, 64, False), (1, 2048, 2048, 3, 3, 128, True),
    (2, 2048, 2048, 8, 2, 64, True),
    # Tq - Tk = 450: the 192-row tile of rows 384-575 sees keys, its first 64 rows none (a warpgroup without a block)
    (2, 750, 300, 4, 2, 64, True),
    # head dim 96 on 128-column tiles (the columns past 96 read as zeros, never written)
    (2, 1000, 1000, 4, 2, 96, True), (2, 513, 700, 4, 4, 96, False), (1, 300, 1000, 2, 1, 96, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("pingpong", "one-consumer", "three-consumers", "three-consumers-own-ranges"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gluon_forward(case, dtype, layout):
    """The Gluon forward (its consumer layouts: two warpgroups taking turns, one consumer, three warpgroups of
    192-row tiles at head dim 64, also with each warpgroup's own key ranges) against fp64 truth under the 2x rule:
    odd lengths (a ragged last tile, past which TMA reads zeros), Tq != Tk both ways (rows that see no key: out 0,
    lse -inf, a warpgroup without a key block of its own), GQA / MQA, a non-contiguous q; and the backward from its
    lse."""
    from megakern import _attention_gluon as g
    from megakern.attention import _bwd_kernels

    b, tq, tk, nh, nkv, hs, causal = case
    if layout.startswith("three-consumers") and hs not in g.CONFIGS_THREE:
        pytest.skip(f"three consumer warpgroups take head dims {tuple(g.CONFIGS_THREE)}")
    seed("gluon", case, dtype, layout)
    q, k, v = _qkv(b, tq, tk, nh, nkv, hs, dtype)
    if not g.supported(q, k, v, causal, (-1, 0 if causal else -1), None):
        pytest.skip("the Gluon forward needs an sm_90 GPU and Triton with Gluon")
    q = torch.randn(b, nh, tq, hs, device=DEVICE, dtype=dtype).transpose(1, 2)  # (B, T, nh, hs), strided
    block_m, block_n, warps, bufs, _ = g.CONFIGS[g.block_d(hs)]
    config = {"pingpong": (block_m, block_n, warps, bufs, True),
              "one-consumer": (block_m, block_n, 2 * warps, bufs, False),
              "three-consumers": g.CONFIGS_THREE.get(hs, (None,))[0],
              "three-consumers-own-ranges": g.CONFIGS_THREE.get(hs, (None,))[0]}[layout]
    out, lse = g.fwd(q, k, v, causal, hs ** -0.5, config, own_ranges=layout.endswith("own-ranges"))
    t64 = [t.double() for t in (q, k, v)]
    truth, truth_lse = attention_ref(*t64, causal=causal)
    lowp, _ = attention_ref(q, k, v, causal=causal, upcast=False)
    assert_close_to_ref("out", out, truth, lowp, ATOL[dtype])
    seen = torch.isfinite(truth_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    assert (lse[seen].double() - truth_lse[seen]).abs().max().item() < 1e-3 if seen.any() else True
    # the backward kernels take the Gluon forward's out and lse as they take the Triton forward's
    dout = torch.randn_like(out)
    grads = _bwd_kernels(dout, q, k, v, out, lse, causal, hs ** -0.5, (-1, 0 if causal else -1), None, None, True)
    _assert_grads(grads, q, k, v, dout, causal, dtype)


def _gluon_forward_layout(case, layout, tag):
    """(q, k, v, causal, hs, config) of a GLUON_CASES case in one of the forward's layouts (ping-pong, one
    consumer, three consumers); skips where the layout or the Gluon forward does not apply."""
    from megakern import _attention_gluon as g

    b, tq, tk, nh, nkv, hs, causal = case
    if layout == "three-consumers" and hs not in g.CONFIGS_THREE:
        pytest.skip(f"three consumer warpgroups take head dims {tuple(g.CONFIGS_THREE)}")
    seed(tag, case, layout)
    q, k, v = _qkv(b, tq, tk, nh, nkv, hs, torch.bfloat16)
    if not g.supported(q, k, v, causal, (-1, 0 if causal else -1), None):
        pytest.skip("the Gluon forward needs an sm_90 GPU and Triton with Gluon")
    block_m, block_n, warps, bufs, _ = g.CONFIGS[g.block_d(hs)]
    config = {"pingpong": (block_m, block_n, warps, bufs, True),
              "one-consumer": (block_m, block_n, 2 * warps, bufs, False),
              "three-consumers": g.CONFIGS_THREE.get(hs, (None,))[0]}[layout]
    return q, k, v, causal, hs, config


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("pingpong", "one-consumer", "three-consumers"))
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gluon_forward_o_tma(case, layout):
    """The forward's output by TMA stores (``o_tma``): the same out and lse bit for bit as the 16-byte stores, ragged
    last tiles (rows past T clipped) and head dim 96 (columns past it clipped) included."""
    from megakern import _attention_gluon as g

    q, k, v, causal, hs, config = _gluon_forward_layout(case, layout, "gluon-o-tma")
    want = g.fwd(q, k, v, causal, hs ** -0.5, config, o_tma=False)
    got = g.fwd(q, k, v, causal, hs ** -0.5, config, o_tma=True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ("pingpong", "three-consumers"))
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gluon_forward_without_turns(case, layout):
    """The ping-pong warpgroups issuing their matmuls without taking turns (``turns=False``): the same out and lse
    bit for bit (the order of the warpgroups' matmuls changes no result), ragged tiles, GQA and head dim 96
    included."""
    from megakern import _attention_gluon as g

    q, k, v, causal, hs, config = _gluon_forward_layout(case, layout, "gluon-no-turns")
    want = g.fwd(q, k, v, causal, hs ** -0.5, config, turns=True)
    got = g.fwd(q, k, v, causal, hs ** -0.5, config, turns=False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _assert_grads(grads, q, k, v, dout, causal, dtype):
    """dq, dk, dv against fp64 truth under the 2x rule (the low-precision torch reference's error sets the bar)."""
    leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
    truth = torch.autograd.grad(attention_ref(*leaves, causal=causal)[0], leaves, dout.double())
    lo = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    lowp = torch.autograd.grad(attention_ref(*lo, causal=causal, upcast=False)[0], lo, dout)
    for name, grad, t, l in zip(("dq", "dk", "dv"), grads, truth, lowp):
        assert_close_to_ref(name, grad, t, l, ATOL[dtype] * max(1.0, t.abs().max().item()))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ("deterministic", "single-pass", "single-pass-128-rows"))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("case", GLUON_CASES, ids=lambda c: "x".join(map(str, c)))
def test_gluon_backward(case, dtype, mode):
    """The Gluon backward kernels, forced on, against fp64 truth under the 2x rule, on the forward's cases with a
    non-contiguous q and dout: the deterministic backward's dq and dk/dv passes (delta from the dq pass), and the
    single-pass backward (``deterministic=False``: the dk/dv kernel adding dq into fp32 by TMA reduces; also with
    128-row query blocks at head dim 64), whose dq, dk and dv also go whole into given tensors."""
    from megakern import _attention_gluon as g
    from megakern.attention import _bwd_kernels, _fwd_kernels

    b, tq, tk, nh, nkv, hs, causal = case
    single = mode.startswith("single-pass")
    if single and hs not in g.ATOMIC_HEAD_DIMS:
        pytest.skip(f"the single-pass backward takes head dims {g.ATOMIC_HEAD_DIMS}")
    if mode == "single-pass-128-rows" and hs != 64:
        pytest.skip("128-row query blocks in the single pass: head dim 64")
    seed("gluon-bwd", case, dtype, mode)
    q, k, v = _qkv(b, tq, tk, nh, nkv, hs, dtype)
    window = (-1, 0 if causal else -1)
    if not g.supported(q, k, v, causal, window, None):
        pytest.skip("the Gluon kernels need an sm_90 GPU and Triton with Gluon")
    q = torch.randn(b, nh, tq, hs, device=DEVICE, dtype=dtype).transpose(1, 2)
    dout = torch.randn(b, nh, tq, hs, device=DEVICE, dtype=dtype).transpose(1, 2)
    out, lse = _fwd_kernels(q, k, v, causal, hs ** -0.5, window, None, None)
    if single and not g.TMA_REDUCE:
        pytest.skip("this Triton's Gluon has no TMA reduce")
    passes = dict(gluon=True) if single else dict(gluon=True, gluon_dq=True)
    if mode == "single-pass-128-rows":
        passes = dict(gluon=SINGLE_128_ROWS)
    grads = _bwd_kernels(dout, q, k, v, out, lse, causal, hs ** -0.5, window, None, None, not single, **passes)
    _assert_grads(grads, q, k, v, dout, causal, dtype)
    if single:
        out_grads = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))  # written whole, in place
        _bwd_kernels(dout, q, k, v, out, lse, causal, hs ** -0.5, window, None, None, False, out_grads=out_grads,
                     **passes)
        for name, got, want in zip(("dq", "dk", "dv"), out_grads, grads):
            assert torch.isfinite(got).all(), name
            assert (got.float() - want.float()).abs().max().item() <= 1e-2 * max(1.0, want.abs().max().item()), name


@pytest.mark.gpu
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("hs", (64, 96, 128))
def test_gluon_backward_without_determinism(hs, causal):
    """``deterministic=False`` by the tables on Hopper: where GLUON_BWD_ATOMIC names the mask, the Gluon single pass
    (within the 2x rule of fp64 truth); where it does not but GLUON_BWD does, the deterministic Gluon pair, the same
    bits as ``deterministic=True``."""
    from megakern import _attention_gluon as g
    from megakern.attention import GLUON_BWD, GLUON_BWD_ATOMIC, _bwd_kernels, _fwd_kernels

    seed("gluon-nondet", hs, causal)
    b, t, nh, nkv = 2, 1000, 4, 2
    q, k, v = _qkv(b, t, t, nh, nkv, hs, torch.bfloat16)
    window = (-1, 0 if causal else -1)
    if not g.supported(q, k, v, causal, window, None):
        pytest.skip("the Gluon kernels need an sm_90 GPU and Triton with Gluon")
    dout = torch.randn_like(q)
    out, lse = _fwd_kernels(q, k, v, causal, hs ** -0.5, window, None, None)
    fast = _bwd_kernels(dout, q, k, v, out, lse, causal, hs ** -0.5, window, None, None, False)
    if causal in GLUON_BWD_ATOMIC.get(hs, ()) and g.TMA_REDUCE:
        _assert_grads(fast, q, k, v, dout, causal, torch.bfloat16)
    elif causal in GLUON_BWD.get(hs, ()):
        exact = _bwd_kernels(dout, q, k, v, out, lse, causal, hs ** -0.5, window, None, None, True)
        assert all(torch.equal(a, c) for a, c in zip(fast, exact))
    else:
        pytest.skip(f"neither table names hs {hs}, causal={causal}")


@pytest.mark.parametrize("keys", (False, True), ids=("query-tiles", "key-tiles"))
@pytest.mark.parametrize("causal", (True, False), ids=("causal", "full"))
@pytest.mark.parametrize("shape", [(16, 1000, 1000, 132, 4), (7, 300, 700, 5, 1), (3, 700, 300, 40, 2),
                                   (1, 64, 4097, 132, 8), (40, 2048, 2048, 132, 3)],
                         ids=lambda s: "x".join(map(str, s)))
def test_gluon_schedule_lists(shape, causal, keys):
    """The Gluon kernels' tile schedules (checked without a GPU): every tile exactly once, every program busy, work
    within one tile of an even split; tile lengths as the kernels walk them; the launch table's layout."""
    pytest.importorskip("triton")
    from megakern import _attention_gluon as g

    n_heads, tq, tk, grid, group = shape
    block_m, block_n = (64, 128) if keys else (128, 64)
    lengths = g.tile_lengths(keys, tq, tk, block_m, block_n, causal)
    rows, cols = torch.arange(tq)[:, None], torch.arange(tk)[None, :]
    seen = (cols <= rows + tk - tq) if causal else torch.ones(tq, tk, dtype=torch.bool)
    if keys:  # query blocks from the one holding the first row that sees a key of the tile, to the last
        want = [0 if not seen[:, s:].any() else -(-tq // block_m) - int(seen[:, s:].any(1).nonzero()[0]) // block_m
                for s in range(0, tk, block_n)]
    else:  # key blocks up to the last one a row of the tile (the rows past tq included, as TMA pads) sees
        last = [min(tk, s + block_m + tk - tq) if causal else tk for s in range(0, tq, block_m)]
        want = [-(-max(hi, 0) // block_n) for hi in last]
    assert list(lengths) == want
    n = len(lengths)
    grid = min(grid, n_heads * n)
    lists = g.schedule_lists(n_heads, lengths, grid, group)
    assert sorted(t for tiles in lists for t in tiles) == list(range(n_heads * n))
    assert all(lists)
    loads = [sum(lengths[t % n] + g.TILE_OVERHEAD for t in tiles) for tiles in lists]
    assert max(loads) <= sum(loads) / grid + max(lengths) + g.TILE_OVERHEAD
    default = g._schedule(torch.device("cpu"), n_heads, lengths, grid, 1 << 20, None)
    assert (default is None) == (min(lengths) == max(lengths))  # the kernels walk equal tiles head-major
    table = g._schedule(torch.device("cpu"), n_heads, lengths, grid, 1 << 20, group)
    offsets = table[:grid + 1].tolist()
    assert offsets[0] == 0 and offsets[-1] == n_heads * n and table.numel() == grid + 2 + n_heads * n
    for p in range(grid):
        assert table[grid + 1 + offsets[p]:grid + 1 + offsets[p + 1]].tolist() == lists[p]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(2, 1000, 1000, 4, 2, 128, True), (2, 1000, 1000, 4, 2, 128, False),
                                  (3, 300, 700, 4, 2, 64, True), (2, 700, 300, 4, 4, 64, True)],
                         ids=lambda c: "x".join(map(str, c)))
def test_gluon_schedules(case):
    """Any tile schedule gives the same bits from the Gluon forward, dq and dk/dv passes: a few programs with several
    tiles each (from the table, or head-major without one), heads in groups of 1 or 3 (a shorter last group)."""
    from megakern import _attention_gluon as g

    b, tq, tk, nh, nkv, hs, causal = case
    seed("gluon-schedules", case)
    q, k, v = _qkv(b, tq, tk, nh, nkv, hs, torch.bfloat16)
    if not g.supported(q, k, v, causal, (-1, 0 if causal else -1), None):
        pytest.skip("the Gluon kernels need an sm_90 GPU and Triton with Gluon")
    dout = torch.randn_like(q)

    def run(**schedule):
        out, lse = g.fwd(q, k, v, causal, hs ** -0.5, None, **schedule)
        dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)
        g.bwd_dq(dout, q, k, v, out, lse, delta, dq, causal, hs ** -0.5, None, **schedule)
        g.bwd_dkdv(dout, q, k, v, lse, delta, dk, dv, causal, hs ** -0.5, None, **schedule)
        return {"out": out, "lse": lse, "delta": delta, "dq": dq, "dk": dk, "dv": dv}

    want = run()
    _assert_grads((want["dq"], want["dk"], want["dv"]), q, k, v, dout, causal, torch.bfloat16)
    for schedule in ({"programs": 5}, {"programs": 7, "heads": 1}, {"programs": 3, "heads": 3}, {"heads": 3}):
        got = run(**schedule)
        for name in want:
            assert torch.equal(got[name], want[name]), f"{name} differs with {schedule}"


@pytest.mark.gpu
def test_gluon_schedule_in_cuda_graph():
    """Causal tile schedules under CUDA-graph capture: a table made before the capture stays valid for the graph's
    replays after the schedule cache lets it go; a shape first seen during the capture takes the head-major walk.
    The replays give the eager bits."""
    from megakern import _attention_gluon as g

    seed("gluon-graph")
    q, k, v = _qkv(2, 1000, 1000, 4, 4, 128, torch.bfloat16)
    if not g.supported(q, k, v, True, (-1, 0), None):
        pytest.skip("the Gluon kernels need an sm_90 GPU and Triton with Gluon")
    g.fwd(q, k, v, True, 0.125)  # its table, and the kernel compiled outside the capture
    g.fwd(q[:, :100], k, v, True, 0.125)  # one query tile a head: no table (the kernel for that, compiled)
    q2, k2, v2 = _qkv(2, 901, 901, 4, 4, 128, torch.bfloat16)  # the same specialization, no table yet
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graphs[0]):
            out, lse = g.fwd(q, k, v, True, 0.125)
        with torch.cuda.graph(graphs[1]):
            out2, lse2 = g.fwd(q2, k2, v2, True, 0.125)
    torch.cuda.current_stream().wait_stream(stream)
    want = [g.fwd(q, k, v, True, 0.125), g.fwd(q2, k2, v2, True, 0.125)]  # the second one makes its table
    g._SCHEDULES.clear()
    junk = torch.full((1 << 20,), -7, dtype=torch.int32, device=q.device)  # memory the cache gave back, reused
    for graph, got, (w, w_lse) in zip(graphs, ((out, lse), (out2, lse2)), want):
        got[0].zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got[0], w) and torch.equal(got[1], w_lse), junk.sum()
