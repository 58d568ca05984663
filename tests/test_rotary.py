"""Rotary position embeddings (megakern/rotary.py) on every implementation.

Outputs and the gradients of q and k are held to the 2x rule against the fp64 reference (see conftest), on fresh
random inputs: both layouts, partial rotary with odd pair counts, grouped-query k, positions from offsets (ints and
tensors), position ids, packed documents with cu_seqlens, q and k as non-contiguous views of a fused qkv tensor,
fp32 and low-precision tables, in place and out of place. On a CPU the Triton kernel runs under the interpreter on
small shapes; on a GPU, also both CUDA paths, large shapes, long tables and torch.compile.
"""
from __future__ import annotations

import csv
import functools
import math

import pytest
import torch
from conftest import (ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, cuda_path_problem, kernel_variants,
                      poison_cuda_allocator, seed, skip_interpreter_faults, sm90_lowering)

import megakern
from megakern import rotary
from megakern.rotary import rotary_inv_freq, rotary_positions, rotary_ref, rotary_table

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LAYOUTS = ("neox", "interleaved")


def _launcher(variant: str):
    """The launcher of one kernel implementation; skips when it cannot run here."""
    if variant.startswith("triton"):
        problem = megakern.available_backends(DEVICE)["triton"]
        if problem:
            pytest.skip(f"Triton unavailable: {problem}")
        from megakern import _rotary_triton

        # 'triton-rows': whole-row tiles (the default for partial rotary out of place) on every case
        return functools.partial(_rotary_triton.fwd, full_row=True) if variant == "triton-rows" else _rotary_triton.fwd
    path = variant.split("-", 1)[1]
    if problem := cuda_path_problem(path):
        pytest.skip(f"CUDA path {path!r} unavailable: {problem}")
    from megakern import _rotary_cuda

    return functools.partial(_rotary_cuda.fwd, path=path)


def run(variant, q, k, cos, sin, *, interleaved=False, rotary_dim=None, cu_seqlens=None, position_ids=None,
        offset=0, inplace=False):
    """One implementation: the public op for 'torch' / 'triton', the checked op on a CUDA path's launcher."""
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, cu_seqlens=cu_seqlens, position_ids=position_ids,
              offset=offset)
    if variant == "torch":
        return megakern.apply_rotary(q, k, cos, sin, inplace=inplace, backend="torch", **kw)
    launcher = _launcher(variant)
    if variant == "triton":
        return megakern.apply_rotary(q, k, cos, sin, inplace=inplace, backend="triton", **kw)
    rot = rotary.check_inputs(q, k, cos, sin, rotary_dim, interleaved, cu_seqlens, position_ids, offset)
    return rotary._apply(q, k, rot, inplace, launcher)


# ---- cases ---------------------------------------------------------------------------------------------------
# name -> (B, T, nh, nkv, hs, rotary_dim or None, positions); B = 0 means packed (total = T tokens); "qkv" views
def _cases():
    if HAS_CUDA:
        return {
            "full": (3, 300, 8, 8, 128, None, "default"),
            "gqa": (2, 257, 16, 2, 128, None, "default"),
            "partial": (2, 129, 12, 4, 64, 16, "default"),  # GPT-NeoX rotary_pct = 0.25
            "odd-pairs": (2, 77, 5, 3, 26, 10, "default"),  # 5 pairs: the scalar paths
            "hs256": (1, 130, 4, 1, 256, None, "default"),
            "offset": (2, 100, 8, 2, 128, None, "offset"),
            "offsets-tensor": (3, 50, 8, 2, 64, None, "offsets"),
            "position-ids": (2, 200, 8, 2, 128, None, "ids"),
            "position-ids-1d": (2, 200, 8, 2, 96, 64, "ids-1d"),
            "varlen": (0, 1000, 8, 2, 128, None, "cu"),
            "varlen-offsets": (0, 600, 6, 2, 64, 32, "cu-offsets"),
            "packed-position-ids": (0, 333, 4, 4, 128, None, "ids"),
            "qkv-view": (2, 150, 8, 2, 128, None, "qkv"),
            "no-k": (2, 100, 8, 0, 128, None, "default"),
            "table-lowp": (2, 100, 8, 2, 128, None, "table-lowp"),
        }
    return {
        "full": (2, 5, 3, 3, 16, None, "default"),
        "gqa-partial": (2, 4, 4, 1, 24, 8, "default"),
        "odd-pairs": (1, 6, 2, 1, 26, 10, "default"),
        "offset": (2, 4, 2, 1, 16, None, "offset"),
        "offsets-tensor": (3, 3, 2, 1, 16, 12, "offsets"),
        "position-ids": (2, 5, 2, 1, 16, None, "ids"),
        "position-ids-1d": (2, 5, 2, 2, 20, 16, "ids-1d"),
        "varlen": (0, 13, 3, 1, 16, None, "cu"),
        "varlen-offsets": (0, 11, 2, 1, 24, 16, "cu-offsets"),
        "packed-position-ids": (0, 9, 2, 2, 16, None, "ids"),
        "qkv-view": (2, 5, 3, 1, 16, None, "qkv"),
        "no-k": (2, 4, 3, 0, 16, None, "default"),
        "table-lowp": (2, 5, 2, 1, 16, None, "table-lowp"),
    }


CASES = _cases()
TABLE_LEN = 4096 if HAS_CUDA else 64


def _documents(total: int) -> torch.Tensor:
    """cu_seqlens splitting ``total`` tokens into a few documents, one of them empty."""
    cuts = sorted({0, total, total // 3, total // 3, (2 * total) // 3 + 1})
    cuts = [0, *cuts[1:2], *cuts[1:]]  # repeat the first cut: an empty document
    return torch.tensor(cuts, dtype=torch.int32, device=DEVICE)


def make_case(name, dtype, device=DEVICE):
    """(leaves, split, cos, sin, kwargs): ``split(*leaves) -> (q, k)`` builds the inputs from the leaves that
    gradients are taken of (q and k themselves, or the fused qkv they are views of)."""
    b, t, nh, nkv, hs, rd, positions = CASES[name]
    table_dtype = dtype if positions == "table-lowp" else torch.float32
    cos, sin = rotary_table(TABLE_LEN, rd or hs, 10000.0, dtype=table_dtype, device=device)
    lead = (t,) if b == 0 else (b, t)
    kw = {"rotary_dim": rd}
    if positions == "qkv":  # views out of a fused projection: (B, T, nh + 2 nkv, hs)
        qkv = torch.randn(*lead, nh + 2 * nkv, hs, dtype=dtype, device=device)
        return [qkv], (lambda x: (x[..., :nh, :], x[..., nh:nh + nkv, :])), cos, sin, kw
    q = torch.randn(*lead, nh, hs, dtype=dtype, device=device)
    k = torch.randn(*lead, nkv, hs, dtype=dtype, device=device) if nkv else None
    if positions == "offset":
        kw["offset"] = TABLE_LEN - t - 3
    elif positions == "offsets":
        kw["offset"] = torch.randint(0, TABLE_LEN - t, (b,), device=device)
    elif positions == "ids":
        kw["position_ids"] = torch.randint(0, TABLE_LEN, lead, device=device)
    elif positions == "ids-1d":
        kw["position_ids"] = torch.randint(0, TABLE_LEN, (t,), device=device, dtype=torch.int32)
    elif positions in ("cu", "cu-offsets"):
        kw["cu_seqlens"] = _documents(t)
        if positions == "cu-offsets":
            kw["offset"] = torch.randint(0, TABLE_LEN - t, (kw["cu_seqlens"].numel() - 1,), device=device,
                                         dtype=torch.int32)
    leaves = [q] if k is None else [q, k]
    return leaves, (lambda q, k=None: (q, k)), cos, sin, kw


def _outputs(out):
    return [o for o in out if o is not None]


def check_case(variant, dtype, leaves, split, cos, sin, kw, interleaved, dy_fn=torch.randn_like):
    """Run one implementation and the two references; compare outputs and the gradients of every leaf; inputs
    must be left intact."""
    skip_interpreter_faults(variant, dtype)
    saved = [t.clone() for t in leaves]
    leaves = [t.requires_grad_(True) for t in leaves]
    poison_cuda_allocator(16 * sum(t.numel() for t in leaves) * 4)
    outs = _outputs(run(variant, *split(*leaves), cos, sin, interleaved=interleaved, **kw))
    douts = [dy_fn(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, douts)

    truth_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    lowp_leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    truth = _outputs(rotary_ref(*split(*truth_leaves), cos.double(), sin.double(), interleaved=interleaved, **kw))
    lowp = _outputs(rotary_ref(*split(*lowp_leaves), cos, sin, interleaved=interleaved, upcast=False, **kw))
    truth_grads = torch.autograd.grad(truth, truth_leaves, [d.double() for d in douts])
    lowp_grads = torch.autograd.grad(lowp, lowp_leaves, douts)

    atol = ATOL[dtype]
    for name, o, t, lo in zip(("q_out", "k_out"), outs, truth, lowp):
        assert o.dtype == dtype and o.shape == lo.shape, f"{name}: {o.dtype} {tuple(o.shape)}"
        assert_close_to_ref(f"{variant} {name}", o, t, lo, atol)
    for i, (g, t, lo, leaf) in enumerate(zip(grads, truth_grads, lowp_grads, leaves)):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, f"grad {i}: {g.dtype} {tuple(g.shape)}"
        assert_close_to_ref(f"{variant} grad of input {i}", g, t, lo, atol * max(1.0, t.abs().max().item()))
    for t, s in zip(leaves, saved):
        assert torch.equal(t.detach(), s), "an input was modified"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES[:2] if not HAS_CUDA else DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_full_row_tiles_match_reference(dtype, layout, case):
    """The Triton kernel's whole-row tiles (out of place) on full and partial rotary alike: outputs and gradients
    against the reference."""
    seed(dtype, layout, case, "rows")
    leaves, split, cos, sin, kw = make_case(case, dtype)
    check_case("triton-rows", dtype, leaves, split, cos, sin, kw, layout == "interleaved")


def test_whole_row_tiles_by_gpu():
    """Partial rotary out of place takes whole-row tiles sized per GPU (TILE_FULL_ROW): the H200's, else the
    default; full rotary and in-place launches keep half-row tiles; an explicit tile wins."""
    from megakern import _rotary_triton as kern

    for gpu in ("H200", None, "some other GPU"):
        want = kern.TILE_FULL_ROW.get(gpu, kern.TILE_FULL_ROW[None])
        tiles, warps = kern.launch_config(64, 64, 96, 24, False, False, gpu)
        assert tiles["FULL_ROW"] and warps == kern.WARPS_FULL_ROW
        assert tiles["BLOCK_T"] * tiles["BLOCK_HQ"] * tiles["BLOCK_P"] == want, (gpu, tiles)
        assert not kern.launch_config(64, 64, 96, 24, False, True, gpu)[0]["FULL_ROW"]
        assert not kern.launch_config(32, 8, 128, 128, False, False, gpu)[0]["FULL_ROW"]
        tiles, _ = kern.launch_config(64, 64, 96, 24, False, False, gpu, tile=4096)
        assert tiles["BLOCK_T"] * tiles["BLOCK_HQ"] * tiles["BLOCK_P"] == 4096
    assert kern.TILE_FULL_ROW["H200"] != kern.TILE_FULL_ROW[None]
    assert kern.gpu_model(None) is None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("variant", kernel_variants())
def test_matches_reference(variant, dtype, layout, case):
    if case == "table-lowp" and dtype == torch.float32:
        pytest.skip("the table is fp32 in every case already")
    seed(variant, dtype, layout, case)
    leaves, split, cos, sin, kw = make_case(case, dtype)
    check_case(variant, dtype, leaves, split, cos, sin, kw, layout == "interleaved")


@pytest.mark.parametrize("variant", kernel_variants())
def test_strided_head_dim_and_broadcast_grad(variant):
    """q whose head dim is not unit-stride (copied for the kernels) and a gradient broadcast along T (stride 0)."""
    seed(variant, "strided")
    b, t, nh, hs = (2, 70, 4, 64) if HAS_CUDA else (2, 5, 2, 16)
    q = torch.randn(b, t, hs, nh, device=DEVICE).transpose(-1, -2)
    k = torch.randn(b, t, 1, hs, device=DEVICE)
    cos, sin = rotary_table(TABLE_LEN, hs, device=DEVICE)
    check_case(variant, torch.float32, [q, k], lambda q, k: (q, k), cos, sin, {}, False,
               dy_fn=lambda o: torch.randn_like(o[:, :1]).expand_as(o))


# ---- in place --------------------------------------------------------------------------------------------------
def _inplace_reference(qkv, nh, nkv, cos, sin, interleaved, upcast=True):
    """qkv with its q and k heads rotated out of place and v untouched: what the in-place op must leave."""
    q, k, v = qkv[..., :nh, :], qkv[..., nh:nh + nkv, :], qkv[..., nh + nkv:, :]
    q_out, k_out = rotary_ref(q, k, cos, sin, interleaved=interleaved, upcast=upcast)
    return torch.cat((q_out, k_out, v), dim=-2)


@pytest.mark.parametrize("arrangement", ("qkv-views", "separate", "views-of-two", "q-only"))
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("variant", kernel_variants())
def test_inplace(variant, dtype, layout, arrangement):
    """In place: q and k are rotated where they lie and returned; the values, and the gradients of the tensor they
    came from, match the out-of-place reference. Arrangements: views of one fused qkv (one launch), tensors of
    their own, views of two different tensors, q alone."""
    skip_interpreter_faults(variant, dtype)
    seed(variant, dtype, layout, arrangement)
    interleaved = layout == "interleaved"
    b, t, nh, nkv, hs = (2, 100, 8, 2, 128) if HAS_CUDA else (2, 5, 3, 1, 16)
    cos, sin = rotary_table(TABLE_LEN, hs, device=DEVICE)
    qkv = torch.randn(b, t, nh + 2 * nkv, hs, dtype=dtype, device=DEVICE, requires_grad=True)

    def forward(leaf, impl):
        x = leaf * 1  # a non-leaf: autograd refuses in-place ops on leaves that require grad
        if arrangement == "qkv-views":
            q, k = x[..., :nh, :], x[..., nh:nh + nkv, :]
            q_out, k_out = impl(q, k)
            assert q_out is q and k_out is k
            return x
        if arrangement == "separate":
            q, k, v = (x[..., :nh, :] * 1, x[..., nh:nh + nkv, :] * 1, x[..., nh + nkv:, :])
        elif arrangement == "views-of-two":
            y = leaf * 1
            q, k, v = x[..., :nh, :], y[..., nh:nh + nkv, :], x[..., nh + nkv:, :]
        else:
            q, k, v = x[..., :nh, :], None, x[..., nh:, :]
            q_out, _ = impl(q, None)
            assert q_out is q
            return torch.cat((q, v), dim=-2)
        q_out, k_out = impl(q, k)
        assert q_out is q and k_out is k
        return torch.cat((q, k, v), dim=-2)

    out = forward(qkv, lambda q, k: run(variant, q, k, cos, sin, interleaved=interleaved, inplace=True))
    dy = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, qkv, dy)

    n_rot = nh if arrangement == "q-only" else nh + nkv
    nk = 0 if arrangement == "q-only" else nkv
    truth_leaf = qkv.detach().double().requires_grad_(True)
    truth = _inplace_reference(truth_leaf, nh, nk, cos.double(), sin.double(), interleaved)
    lowp_leaf = qkv.detach().clone().requires_grad_(True)
    lowp = _inplace_reference(lowp_leaf, nh, nk, cos, sin, interleaved, upcast=False)
    (truth_grad,) = torch.autograd.grad(truth, truth_leaf, dy.double())
    (lowp_grad,) = torch.autograd.grad(lowp, lowp_leaf, dy)
    atol = ATOL[dtype]
    assert_close_to_ref(f"{variant} in-place {arrangement}", out, truth, lowp, atol)
    assert_close_to_ref(f"{variant} in-place {arrangement} grad", grad, truth_grad, lowp_grad,
                        atol * max(1.0, truth_grad.abs().max().item()))
    assert torch.equal(out[..., n_rot:, :], qkv.detach()[..., n_rot:, :]), "untouched heads changed"


@pytest.mark.parametrize("variant", kernel_variants())
def test_inplace_without_autograd(variant):
    """Under no_grad and inference_mode the kernels write straight into q and k (views of a qkv buffer, as a KV
    cache decode step does) and bump their version counters as torch's own in-place ops do."""
    seed(variant, "no-grad")
    nh, nkv, hs = 4, 2, 32
    cos, sin = rotary_table(TABLE_LEN, hs, device=DEVICE)
    qkv = torch.randn(3, 1, nh + 2 * nkv, hs, device=DEVICE)
    expected = _inplace_reference(qkv, nh, nkv, cos, sin, False, upcast=True)
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            buf = qkv.clone()
            q, k = buf[..., :nh, :], buf[..., nh:nh + nkv, :]
            version = buf._version if not buf.is_inference() else None
            q_out, k_out = run(variant, q, k, cos, sin, inplace=True)
            assert q_out is q and k_out is k
            torch.testing.assert_close(buf, expected, rtol=1e-6, atol=1e-6)
            if version is not None:
                assert buf._version > version


@pytest.mark.parametrize("backend", ("torch", "triton", "cuda"))
def test_checked_once_applied_many_times(backend):
    """The public pieces of apply_rotary, as models/gpt.py uses them (check once per forward, rotate per layer):
    rotary_backend names the backend apply_rotary takes; apply_rotation under autograd gives apply_rotary's outputs
    and gradients; rotate runs the kernels alone, out of place (packed q and k keep their shapes) or in place on views
    of a qkv buffer, without autograd, and conj=True rotates back."""
    if problem := megakern.available_backends(DEVICE)[backend]:
        pytest.skip(f"backend {backend!r} unavailable: {problem}")
    seed("checked-once", backend)
    nh, nkv, hs, t = 4, 2, 32, 7
    cos, sin = rotary_table(TABLE_LEN, hs, device=DEVICE)
    cu = torch.tensor([0, 3, t], dtype=torch.int32, device=DEVICE)
    assert rotary.rotary_backend(torch.empty(1, hs, device=DEVICE), {"rotary": backend}) == backend
    assert rotary.rotary_backend(torch.empty(1, hs)) == "torch"  # the CPU default
    qkv = torch.randn(t, nh + 2 * nkv, hs, device=DEVICE)
    q, k = qkv[:, :nh], qkv[:, nh:nh + nkv]
    rot = rotary.check_inputs(q, k, cos, sin, None, False, cu, None, 0)
    want = megakern.apply_rotary(q, k, cos, sin, cu_seqlens=cu, backend=backend)
    got = rotary.rotate(q, k, rot, backend)
    assert got[0].shape == q.shape and got[1].shape == k.shape and not got[0].requires_grad
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    back = rotary.rotate(*got, rot, backend, conj=True)
    for b, x in zip(back, (q, k)):
        torch.testing.assert_close(b, x, rtol=1e-5, atol=1e-5)
    buf = qkv.clone()
    qv, kv = buf[:, :nh], buf[:, nh:nh + nkv]
    q_in, k_in = rotary.rotate(qv, kv, rot, backend, inplace=True)
    assert q_in is qv and k_in is kv
    for g, w in zip((qv, kv), want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(buf[:, nh + nkv:], qkv[:, nh + nkv:], rtol=0, atol=0)  # v untouched
    leaves = [x.clone().requires_grad_(True) for x in (q, k)]
    out = rotary.apply_rotation(*leaves, rot, backend)
    ref_leaves = [x.clone().requires_grad_(True) for x in (q, k)]
    ref = megakern.apply_rotary(*ref_leaves, cos, sin, cu_seqlens=cu, backend=backend)
    dout = [torch.randn_like(o) for o in out]
    for g, w in zip(torch.autograd.grad(out, leaves, dout) + out, torch.autograd.grad(ref, ref_leaves, dout) + ref):
        assert torch.equal(g, w)


# ---- positions -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", kernel_variants())
def test_position_sources_agree(variant):
    """Packed documents (cu_seqlens, with and without per-document offsets) give what each document gives alone,
    and what explicit position ids give; a decode step at an offset gives the matching row of the full sequence."""
    dtype = torch.float16
    seed(variant, "positions")
    nh, nkv, hs = 3, 1, 16
    total = 300 if HAS_CUDA else 12
    cos, sin = rotary_table(TABLE_LEN, hs, device=DEVICE)
    q = torch.randn(total, nh, hs, dtype=dtype, device=DEVICE)
    k = torch.randn(total, nkv, hs, dtype=dtype, device=DEVICE)
    cu = _documents(total)
    ndocs = cu.numel() - 1
    offsets = torch.arange(ndocs, device=DEVICE, dtype=torch.int64) * 3
    for off in (0, offsets):
        packed = run(variant, q, k, cos, sin, cu_seqlens=cu, offset=off)
        ids = rotary_positions(q, cu_seqlens=cu, offset=off)
        by_ids = run(variant, q, k, cos, sin, position_ids=ids)
        for a, b in zip(packed, by_ids):
            assert torch.equal(a, b)
        bounds = cu.tolist()
        for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
            doc_off = off if isinstance(off, int) else int(off[d])
            alone = run(variant, q[None, s:e], k[None, s:e], cos, sin, offset=doc_off)
            assert torch.equal(packed[0][s:e], alone[0][0]) and torch.equal(packed[1][s:e], alone[1][0])
    # generation: token L of a sequence, rotated alone with offset L
    b, t = 2, (40 if HAS_CUDA else 6)
    qb = torch.randn(b, t, nh, hs, dtype=dtype, device=DEVICE)
    kb = torch.randn(b, t, nkv, hs, dtype=dtype, device=DEVICE)
    full = run(variant, qb, kb, cos, sin)
    step = run(variant, qb[:, -1:], kb[:, -1:], cos, sin, offset=t - 1)
    assert torch.equal(step[0], full[0][:, -1:]) and torch.equal(step[1], full[1][:, -1:])
    per_seq = run(variant, qb[:, -1:], kb[:, -1:], cos, sin, offset=torch.full((b,), t - 1, device=DEVICE))
    assert torch.equal(per_seq[0], step[0])


@pytest.mark.parametrize("variant", kernel_variants())
def test_empty(variant):
    cos, sin = rotary_table(TABLE_LEN, 16, device=DEVICE)
    q = torch.randn(2, 0, 3, 16, device=DEVICE, requires_grad=True)
    k = torch.randn(2, 0, 1, 16, device=DEVICE, requires_grad=True)
    q_out, k_out = run(variant, q, k, cos, sin)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    dq, dk = torch.autograd.grad((q_out, k_out), (q, k), (torch.randn_like(q_out), torch.randn_like(k_out)))
    assert dq.shape == q.shape and dk.shape == k.shape
    packed = torch.randn(0, 3, 16, device=DEVICE)
    out, _ = run(variant, packed, None, cos, sin, cu_seqlens=torch.zeros(2, dtype=torch.int32, device=DEVICE))
    assert out.shape == packed.shape


# ---- the table ---------------------------------------------------------------------------------------------------
def _hf_inv_freq(dim, base, scaling, seq_len):
    """transformers' RoPE initializers (modeling_rope_utils), written out independently of megakern, in fp64."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = scaling["factor"]
    if kind == "linear":
        return inv / factor
    if kind == "ntk":
        return 1.0 / ((base * factor ** (dim / (dim - 2))) ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if kind == "dynamic":
        orig = scaling["original_max_position_embeddings"]
        seq_len = max(seq_len, orig)
        new_base = base * ((factor * seq_len / orig) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (new_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    assert kind == "llama3"
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    inv_llama = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_llama)


SCALINGS = [
    None,
    {"type": "linear", "factor": 4.0},
    {"rope_type": "ntk", "factor": 2.0},
    {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: (s or {}).get("rope_type", (s or {}).get("type", "none")))
def test_table_values_and_scaling(scaling):
    dim, base, length = 128, 500000.0, 300
    inv = _hf_inv_freq(dim, base, scaling, length)
    torch.testing.assert_close(rotary_inv_freq(dim, base, scaling, length), inv, rtol=1e-12, atol=0)
    cos, sin = rotary_table(length, dim, base, scaling=scaling)
    angles = torch.arange(length, dtype=torch.float64)[:, None] * inv[None, :]
    assert cos.shape == sin.shape == (length, dim // 2) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, angles.cos().float(), rtol=0, atol=1e-7)
    torch.testing.assert_close(sin, angles.sin().float(), rtol=0, atol=1e-7)
    if scaling is not None and scaling.get("rope_type") == "dynamic":  # the base stretches with the table's length
        assert not torch.equal(rotary_table(length + 100, dim, base, scaling=scaling)[0][:length], cos)


def test_table_cache():
    a = rotary_table(100, 64, 10000.0, dtype=torch.bfloat16)
    assert rotary_table(100, 64, 10000, dtype=torch.bfloat16)[0] is a[0]  # int and float base: one entry
    assert rotary_table(100, 64, 10000.0, scaling={"rope_type": "default"})[0] is rotary_table(100, 64)[0]
    assert rotary_table(100, 64, 10000.0, dtype=torch.float32)[0] is not a[0]
    assert rotary_table(101, 64)[0] is not rotary_table(100, 64)[0]
    m1, m2 = megakern.RotaryEmbedding(64, 100), megakern.RotaryEmbedding(64, 100)
    assert m1.table()[0] is m2.table()[0]  # every layer shares one table


def test_module():
    """RotaryEmbedding is apply_rotary with its table and options; the kernel table {op: backend} is honoured."""
    seed("module")
    mod = megakern.RotaryEmbedding(16, 64, 1000.0, scaling={"rope_type": "linear", "factor": 2.0},
                                   interleaved=True, backend={"rotary": "torch"})
    q, k = torch.randn(2, 9, 3, 32), torch.randn(2, 9, 1, 32)
    cos, sin = rotary_table(64, 16, 1000.0, scaling={"rope_type": "linear", "factor": 2.0})
    got = mod(q, k, offset=5)
    want = megakern.apply_rotary(q, k, cos, sin, interleaved=True, offset=5, backend="torch")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][..., 16:], q[..., 16:])  # partial: the rest passes through
    assert "backend=" in repr(mod) and "interleaved=True" in repr(mod)
    with pytest.raises(ValueError, match="max_seqlen"):
        megakern.RotaryEmbedding(16, 0)
    with pytest.raises(ValueError, match="dim .* even"):
        megakern.RotaryEmbedding(15, 64)


def test_backend_default_on_cpu_is_the_reference():
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = rotary_table(8, 8)
    got = megakern.apply_rotary(q, k, cos, sin)
    want = rotary_ref(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- errors ------------------------------------------------------------------------------------------------------
def test_bad_input():
    q, k = torch.randn(2, 5, 4, 16), torch.randn(2, 5, 2, 16)
    cos, sin = rotary_table(8, 16)

    def call(q=q, k=k, cos=cos, sin=sin, **kw):
        return megakern.apply_rotary(q, k, cos, sin, **kw)

    cases = [
        (TypeError, "q has dtype torch.int64", dict(q=torch.ones(2, 5, 4, 16, dtype=torch.long))),
        (TypeError, "q must be a torch.Tensor", dict(q=[[1.0]])),
        (TypeError, "q has dtype torch.float32 but k has torch.float16", dict(k=k.half())),
        (TypeError, "cos has dtype torch.float32 but sin has torch.float16", dict(sin=sin.half())),
        (TypeError, r"cos/sin have dtype torch.float16; expected float32 or q's dtype \(torch.bfloat16\)",
         dict(q=q.bfloat16(), k=k.bfloat16(), cos=cos.half(), sin=sin.half())),
        (ValueError, "k is on meta", dict(k=k.to("meta"))),
        (ValueError, r"q must be \(batch, seq, heads, head_dim\)", dict(q=torch.randn(5, 16))),
        (ValueError, "is packed .* pass cu_seqlens or position_ids", dict(q=q[0], k=k[0])),
        (ValueError, "cu_seqlens needs packed q", dict(cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))),
        (ValueError, r"k \(2, 5, 2, 8\) must be", dict(k=torch.randn(2, 5, 2, 8))),
        (ValueError, r"k \(2, 4, 2, 16\) must be", dict(k=torch.randn(2, 4, 2, 16))),
        (ValueError, "cos and sin must both be", dict(sin=sin[:, :4])),
        (ValueError, "rotary_dim 7 is odd", dict(rotary_dim=7)),
        (ValueError, r"rotary_dim 18 must be in 2..16 \(the head dim\)", dict(rotary_dim=18)),
        (ValueError, r"rotary_dim = 2 \* cos.shape\[1\] = 32 is larger than the head dim 16",
         dict(cos=rotary_table(8, 32)[0], sin=rotary_table(8, 32)[1])),
        (ValueError, "cos/sin have 8 columns, expected rotary_dim // 2 = 4", dict(rotary_dim=8)),
        (ValueError, r"positions beyond the table: offset 4 \+ sequence length 5 reaches position 8, but the "
                     r"cos/sin table holds 8 positions", dict(offset=4)),
        (ValueError, "offset must be an int", dict(offset=-1)),
        (ValueError, "offset must be an int", dict(offset=1.5)),
        (ValueError, r"offset tensor must be \(2,\)", dict(offset=torch.tensor([1, 2, 3]))),
        (ValueError, "offset has a negative entry", dict(offset=torch.tensor([0, -1]))),
        (ValueError, "positions beyond the table: offset 5", dict(offset=torch.tensor([0, 5]))),
        (TypeError, "offset has dtype torch.float32", dict(offset=torch.tensor([0.0, 1.0]))),
        (ValueError, "positions beyond the table: position_ids reaches position 9",
         dict(position_ids=torch.tensor([0, 1, 2, 9, 3]))),
        (ValueError, r"position_ids has a negative position \(-1\)", dict(position_ids=torch.tensor([0, 1, -1, 2, 3]))),
        (ValueError, r"position_ids has shape \(3, 5\)", dict(position_ids=torch.zeros(3, 5, dtype=torch.long))),
        (TypeError, "position_ids has dtype torch.float32", dict(position_ids=torch.zeros(5))),
        (ValueError, "offset must be 0 with them", dict(position_ids=torch.zeros(5, dtype=torch.long), offset=1)),
        (TypeError, "interleaved must be a bool", dict(interleaved=1)),
        (TypeError, "inplace must be a bool", dict(inplace=None)),
        (ValueError, "unknown backend 'fast'", dict(backend="fast")),
    ]
    if not HAS_CUDA:
        cases.append((RuntimeError, "backend 'cuda' is not available: the CUDA kernels need a CUDA tensor",
                      dict(backend="cuda")))
    for exc, match, kw in cases:
        with pytest.raises(exc, match=match):
            call(**kw)

    packed_q, packed_k = torch.randn(10, 4, 16), torch.randn(10, 2, 16)

    def packed(cu, **kw):
        return megakern.apply_rotary(packed_q, packed_k, cos, sin, cu_seqlens=cu, **kw)

    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    with pytest.raises(TypeError, match="cu_seqlens must be a 1-D torch.int32"):
        packed(torch.tensor([0, 10]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        packed(i32([1, 10]))
    with pytest.raises(ValueError, match="non-decreasing"):
        packed(i32([0, 6, 4, 10]))
    with pytest.raises(ValueError, match="cu_seqlens ends at 9 but q holds 10 tokens"):
        packed(i32([0, 9]))
    with pytest.raises(ValueError, match=r"positions beyond the table: document 1 \(length 9, offset 0\) reaches "
                                         "position 8"):
        packed(i32([0, 1, 10]))
    with pytest.raises(ValueError, match=r"document 0 \(length 5, offset 4\) reaches position 8"):
        packed(i32([0, 5, 10]), offset=i32([4, 0]))
    with pytest.raises(ValueError, match="pass position_ids or cu_seqlens, not both"):
        packed(i32([0, 10]), position_ids=torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match=r"offset tensor must be \(2,\), one per document"):
        packed(i32([0, 5, 10]), offset=i32([1, 2, 3]))

    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'yarn'"):
        rotary_table(8, 16, scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(ValueError, match="llama3 scaling needs"):
        rotary_table(8, 16, scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="unknown keys"):
        rotary_table(8, 16, scaling={"rope_type": "linear", "factor": 2.0, "beta": 1})
    with pytest.raises(ValueError, match="factor must be a finite number > 0"):
        rotary_table(8, 16, scaling={"rope_type": "linear", "factor": 0})
    with pytest.raises(ValueError, match="dim .* must be an even int"):
        rotary_table(8, 15)
    with pytest.raises(ValueError, match="base must be"):
        rotary_table(8, 16, 1.0)


# ---- the benchmark ------------------------------------------------------------------------------------------------
def test_bench_rotary_cpu_smoke(tmp_path, capsys, monkeypatch):
    """benchmarks/bench_rotary.py on CPU: figures on file for the providers that run, a wrong provider reported
    and skipped, and the (B, nh, T, hs)-over-(B, T, nh, hs) arrangement liger takes, with its in-place rotation."""
    from benchmarks import bench_rotary as bench
    from benchmarks.common import CSV_HEADER

    def wrong(device):
        return lambda case, dtype: bench.Provider(lambda q, k: (q * 1.01, k), "bthd", 4)

    def hf_in_place(device):  # a stand-in for liger: rotates its (B, nh, T, hs) views in place, returns them
        def make(case, dtype):
            cos, sin = rotary_table(case.t, case.rd)

            def fn(q, k):
                assert q.shape[1] == case.nh and q.transpose(1, 2).is_contiguous()
                q2, k2 = q.transpose(1, 2), k.transpose(1, 2)
                q_out, k_out = megakern.apply_rotary(q2, k2, cos, sin, interleaved=case.interleaved, backend="torch")
                return q_out.transpose(1, 2), k_out.transpose(1, 2)

            return bench.Provider(fn, "hf", 4)

        return make

    monkeypatch.setitem(bench.PROVIDERS, "wrong", wrong)
    monkeypatch.setitem(bench.PROVIDERS, "hf", hf_in_place)
    providers = "torch,wrong,hf" + (",megakern-triton" if not megakern.available_backends("cpu")["triton"] else "")
    bench.main(["--device", "cpu", "--providers", providers, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "skip wrong on q2x64x4x32 k2 rd32 neox fp32: AssertionError: q_out is off the fp32 reference" in out
    with (tmp_path / "cpu" / "rotary.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER) and all(len(r) == 11 for r in rows)
    figures = {(r[6], r[7], r[8], r[9]) for r in rows[1:]}
    ran = set(providers.split(",")) - {"wrong"}
    for case in bench.cases(torch.device("cpu"), quick=False):
        for mode in bench.MODES:
            for provider in ran:
                assert (case.name(torch.float32), mode, provider, "GB/s") in figures, (case, mode, provider)
    headline = bench.HEADLINE
    assert bench.bytes_moved(headline, "fwd", 2, 4) == 2 * 8 * 4096 * 40 * 128 * 2 + 2 * 4096 * 64 * 4
    assert bench.bytes_moved(headline, "fwd+bwd", 2, 4) == 2 * bench.bytes_moved(headline, "fwd", 2, 4)


# ---- lowering for Hopper -------------------------------------------------------------------------------------------
SM90_VARIANTS = [  # (dtype, table, ROT_HALF, HEAD_DIM, INTERLEAVED, COPY_REST, POS_MODE, HAS_OFFSETS, CONJ)
    ("bf16", "fp32", 64, 128, False, False, 0, False, False),  # the headline: 16-byte loads expected
    ("bf16", "fp32", 64, 128, True, False, 0, False, True),
    ("fp16", "fp16", 12, 96, False, True, 2, True, False),  # GPT-NeoX-20B partial, packed documents
    ("fp32", "fp32", 5, 26, True, True, 1, False, True),
    ("bf16", "bf16", 128, 256, False, False, 1, True, False),
    ("fp16", "fp32", 1, 2, True, False, 0, False, False),
]


def compile_for_sm90(full_rows: bool | None = None) -> list[tuple[int, int, int]]:
    """(16-byte global loads, 16-byte global stores, shared memory bytes) of the rotary kernel compiled for sm_90 in
    each SM90_VARIANTS setting, with the 16-divisibility the runtime gives aligned pointers and strides. Needs real
    (not interpreted) Triton kernels: run with TRITON_INTERPRET=0."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from megakern import _rotary_triton as kern

    fn = kern._rotary_kernel
    out = []
    for dtype, table, rot_half, hs, interleaved, copy_rest, pos_mode, has_offsets, conj in SM90_VARIANTS:
        # the launcher's own tiles (out of place: copy_rest is partial rotary), whole rows everywhere if asked
        tiles, warps = kern.launch_config(32, 8, hs, 2 * rot_half, interleaved, False, full_row=full_rows)
        assert tiles["COPY_REST"] == copy_rest
        constexprs = dict(ROT_HALF=rot_half, HEAD_DIM=hs, POS_MODE=pos_mode, HAS_OFFSETS=has_offsets, HAS_K=True,
                          INTERLEAVED=interleaved, CONJ=conj, INPLACE=False, **tiles)
        pointers = {"Q": f"*{dtype}", "K": f"*{dtype}", "QO": f"*{dtype}", "KO": f"*{dtype}", "COS": f"*{table}",
                    "SIN": f"*{table}", "POS": "*i64", "CU": "*i32", "OFFS": "*i32"}
        signature = {n: "constexpr" if n in constexprs else pointers.get(n, "i32") for n in fn.arg_names}
        aligned = [i for i, n in enumerate(fn.arg_names) if n in pointers or n.startswith("stride_")]
        attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
        src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 64), options=dict(num_warps=warps))
        ptx = compiled.asm["ptx"]
        out.append((len(re.findall(r"ld\.global[.\w]*\.v4", ptx)), len(re.findall(r"st\.global[.\w]*\.v4", ptx)),
                    compiled.metadata.shared))
    return out


@pytest.mark.skipif(HAS_CUDA, reason="on a GPU the kernels run; this checks their lowering where none is present")
def test_triton_kernel_compiles_for_sm90():
    """Every kind of launch lowers for Hopper (Triton's sm_90 compiler runs without a GPU), and the headline
    layout moves q and k in 16-byte loads and stores."""
    results = sm90_lowering("test_rotary", "compile_for_sm90()")
    assert len(results) == len(SM90_VARIANTS)
    for (loads, stores, shared), variant in zip(results[:2], SM90_VARIANTS):
        assert loads > 0 and stores > 0, f"{variant}: no 16-byte global loads / stores in the sm_90 PTX"


# ---- GPU ---------------------------------------------------------------------------------------------------------
def _available_variants():
    out = ["triton"]
    for path in ("extension", "nvrtc"):
        if not cuda_path_problem(path):
            out.append(f"cuda-{path}")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=lambda d: str(d)[6:])
def test_triton_cuda_parity(dtype, layout):
    """Triton and both CUDA paths compute the same fp32 math: results agree to an ulp, forward and backward, and the
    public 'cuda' backend is the runtime's path exactly."""
    seed(dtype, layout, "parity")
    interleaved = layout == "interleaved"
    cos, sin = rotary_table(8192, 128, device=DEVICE)
    q = torch.randn(4, 2048, 32, 128, dtype=dtype, device=DEVICE, requires_grad=True)
    k = torch.randn(4, 2048, 8, 128, dtype=dtype, device=DEVICE, requires_grad=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    results = {}
    variants = _available_variants()
    assert len(variants) >= 2, f"need Triton and a CUDA path, have {variants}"
    for v in variants:
        out = run(v, q, k, cos, sin, interleaved=interleaved, offset=1000)
        results[v] = (*out, *torch.autograd.grad(out, (q, k), (dq, dk)))
    base = results.pop("triton")
    for v, res in results.items():
        for name, a, b in zip(("q_out", "k_out", "dq", "dk"), res, base):
            ulp = torch.finfo(dtype).eps * b.float().abs().clamp_min(1.0)
            assert ((a.float() - b.float()).abs() <= ulp).all(), f"{v}: {name} differs from triton by over an ulp"
    public = megakern.apply_rotary(q, k, cos, sin, interleaved=interleaved, offset=1000, backend="cuda")
    path = megakern.cuda_runtime()[0]
    direct = run(f"cuda-{path}", q, k, cos, sin, interleaved=interleaved, offset=1000)
    assert torch.equal(public[0], direct[0]) and torch.equal(public[1], direct[1])


@pytest.mark.gpu
@pytest.mark.parametrize("items", (2, 4))
@pytest.mark.parametrize("cap", (64, 80))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cuda_kernel_under_a_register_cap(layout, cap, items):
    """The CUDA kernel compiled under a register cap (MEGAKERN_ROTARY_MAXNREG, NVRTC; tuning) gives the uncapped
    kernel's outputs bit for bit (the same arithmetic, other registers and spills), forward and backward rotation."""
    import dataclasses

    from megakern import _rotary_cuda

    if problem := cuda_path_problem("nvrtc"):
        pytest.skip(f"the NVRTC path is unavailable: {problem}")
    seed(layout, cap, items, "register cap")
    cos, sin = rotary_table(4096, 128, device=DEVICE)
    q = torch.randn(2, 1000, 12, 128, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 1000, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    plain_cfg = _rotary_cuda.launch_config(16, 16, items=items, tokens=2000)
    capped_cfg = dataclasses.replace(plain_cfg, max_registers=cap)
    for conj in (False, True):
        outs = []
        for cfg in (plain_cfg, capped_cfg):
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)
            _rotary_cuda.fwd(q, k, q_out, k_out, cos, sin, None, None, None, 7, 128, layout == "interleaved", conj,
                             False, path="nvrtc", config=cfg)
            outs.append((q_out, k_out))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    with pytest.raises(ValueError, match="compiled by NVRTC, not the extension"):
        _rotary_cuda.fwd(q, k, q, k, cos, sin, None, None, None, 0, 128, False, False, True, path="extension",
                         config=capped_cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["triton", "cuda-extension", "cuda-nvrtc"])
def test_long_tables_and_unaligned_views(variant):
    """Positions past 65535 (int64 position ids, a 2**17-row table), and q / k views that start one element off
    a 16-byte boundary (the kernels' element-wise paths) against aligned ones (their 16-byte paths)."""
    seed(variant, "long")
    launcher_ok = variant == "triton" or not cuda_path_problem(variant.split("-", 1)[1])
    if not launcher_ok:
        pytest.skip(f"{variant} unavailable: {cuda_path_problem(variant.split('-', 1)[1])}")
    length, hs = 2**17, 128
    cos, sin = rotary_table(length, hs, 500000.0, device=DEVICE)
    b, t, nh, nkv = 2, 512, 8, 2
    ids = torch.randint(length - 5000, length, (b, t), device=DEVICE)
    q = torch.randn(b, t, nh, hs, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(b, t, nkv, hs, dtype=torch.bfloat16, device=DEVICE)
    got = run(variant, q, k, cos, sin, position_ids=ids)
    want = rotary_ref(q, k, cos, sin, position_ids=ids)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2 ** -7 * w.abs().max().item())
    flat = torch.empty(q.numel() + 1, dtype=q.dtype, device=DEVICE)[1:]
    q_off = flat.view(q.shape).copy_(q)  # starts 2 bytes past the allocation's alignment
    off = run(variant, q_off, k, cos, sin, position_ids=ids)
    assert torch.equal(off[0], got[0]) and torch.equal(off[1], got[1])


# (dtype, head dim, rotary dim, table pad): rotary halves that start or end mid-chunk on 16-byte aligned rows (the
# CUDA kernel's staged rows, IO 3): GPT-NeoX-20B (hs 96, rd 24), rotary halves of 20 and 6 features, fp32's 10, a
# chunk both rotated and passed through (rd 60 of 64); and full rotary whose table rows are not 16-byte aligned
# (a column slice of a wider table, ``pad`` columns more: the staged rows too)
MID_CHUNK = [(torch.bfloat16, 96, 24, 0), (torch.bfloat16, 128, 40, 0), (torch.float16, 64, 12, 0),
             (torch.float32, 64, 20, 0), (torch.bfloat16, 64, 60, 0), (torch.bfloat16, 128, 128, 2)]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["triton", "cuda-extension", "cuda-nvrtc"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("inplace", (False, True), ids=("out", "inplace"))
@pytest.mark.parametrize("dtype, hs, rd, pad", MID_CHUNK, ids=lambda v: str(v).removeprefix("torch."))
def test_partial_rotary_mid_chunk(variant, layout, inplace, dtype, hs, rd, pad):
    """Partial rotary dims whose halves start or end mid-chunk on 16-byte aligned rows, in 8 q heads and 5 k heads
    (a head run that ends in k's), out of place and in place, forward and backward against the reference; the
    features past rotary_dim keep their values (infinities and NaN included)."""
    seed(variant, layout, inplace, dtype, hs, rd, pad)
    interleaved = layout == "interleaved"
    cos, sin = (t[:, :rd // 2] for t in rotary_table(512, rd + 2 * pad, device=DEVICE))
    q = torch.randn(2, 131, 8, hs, dtype=dtype, device=DEVICE)
    k = torch.randn(2, 131, 5, hs, dtype=dtype, device=DEVICE)
    q[0, 3, 1, rd:] = float("inf")
    k[1, 7, 4, -1] = float("nan")
    q.requires_grad_(True), k.requires_grad_(True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    qi, ki = (x.detach().clone() for x in (q, k)) if inplace else (q, k)
    got = run(variant, qi, ki, cos, sin, interleaved=interleaved, offset=100, inplace=inplace)
    grads = torch.autograd.grad(run(variant, q, k, cos, sin, interleaved=interleaved, offset=100), (q, k), (dq, dk))
    qf, kf = (x.detach().double().requires_grad_() for x in (q, k))
    want = rotary_ref(qf, kf, cos.double(), sin.double(), interleaved=interleaved, offset=100)
    want = (*want, *torch.autograd.grad(want, (qf, kf), (dq.double(), dk.double())))
    for name, g, w, x in zip(("q", "k", "dq", "dk"), (*got, *grads), want, (q, k, dq, dk)):
        assert g.dtype == dtype and g.shape == w.shape, name
        fin = torch.isfinite(w)
        torch.testing.assert_close(g.double()[fin], w[fin], rtol=0, atol=2 ** -7 * w[fin].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")
        # unchanged values (infinities too; a NaN stays NaN, its payload may not: Triton's whole-row tiles pass
        # them through arithmetic, x * 1 + 0 * 0, as fast as a copy)
        torch.testing.assert_close(g.detach()[..., rd:], x.detach()[..., rd:], rtol=0, atol=0, equal_nan=True,
                                   msg=lambda m: f"{name}: the features past rotary_dim must pass through: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("inplace", (False, True))
def test_torch_compile_with_cuda_ops(inplace):
    """torch.compile runs a model that uses the CUDA backend (traced as the megakern:: custom ops) and matches
    eager, outputs and gradients; the ops' schemas and fake implementations pass torch.library.opcheck."""
    from megakern import _rotary_cuda

    seed("compile", inplace)
    cos, sin = rotary_table(1024, 64, device=DEVICE)
    qkv = torch.randn(2, 256, 12, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)

    def loss(qkv):
        x = qkv * 2
        q, k = x[..., :8, :], x[..., 8:10, :]
        q, k = megakern.apply_rotary(q, k, cos, sin, offset=3, inplace=inplace, backend="cuda")
        return (q.float().square().sum() + (k.float() * x[..., 10:, :].float()).sum())

    (eager,) = torch.autograd.grad(loss(qkv), qkv)
    torch.compiler.reset()
    (compiled,) = torch.autograd.grad(torch.compile(loss)(qkv), qkv)
    torch.testing.assert_close(compiled, eager, rtol=1e-2, atol=1e-2)

    q = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(2, 64, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    ids = torch.randint(0, 1024, (2, 64), device=DEVICE)
    for args in ((q, k, cos, sin, None, None, None, 5, 64, False, False),
                 (q, None, cos, sin, ids, None, None, 0, 64, True, True)):
        torch.library.opcheck(_rotary_cuda.rotary_op, args)
        torch.library.opcheck(_rotary_cuda.rotary_inplace_op, (args[0].clone(), *args[1:]))
