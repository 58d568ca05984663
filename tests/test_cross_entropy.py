"""Cross-entropy (megakern/cross_entropy.py): the fused linear cross-entropy and the kernel on plain logits.

The loss and every gradient (x, weight, bias; logits) are held to the 2x rule against the fp64 reference (see
conftest), on fresh random inputs: odd row counts, vocabularies that are not a multiple of the kernel's block,
one chunk and many, ignored rows, a custom ignore_index, label smoothing, softcapping, bias, non-contiguous x and
logits, mean / sum / none, an incoming gradient other than 1. On a CPU the Triton kernel runs under the
interpreter on small shapes in fp32 / fp16 (the interpreter rounds bf16 wrongly); bf16 and large vocabularies run
on a GPU.
"""
from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from conftest import ATOL, DEVICE, HAS_CUDA, assert_close_to_ref, require_triton, seed

ce = importlib.import_module("megakern.cross_entropy")  # the module (megakern.cross_entropy is also the function)
from megakern.cross_entropy import (cross_entropy, cross_entropy_ref, default_chunk, linear_cross_entropy,
                                    linear_cross_entropy_ref, scale_gradients)

LOW_DTYPES = (torch.float32, torch.float16) + ((torch.bfloat16,) if HAS_CUDA else ())


def _targets(n, vocab, ignored=3, ignore_index=-100):
    t = torch.randint(0, vocab, (n,), device=DEVICE)
    t[torch.randperm(n, device=DEVICE)[:ignored]] = ignore_index
    return t


def _inputs(n, c, vocab, dtype, *, bias=False, strided=False):
    """x (n, c) (a non-contiguous view when ``strided``), weight (vocab, c), bias (vocab,) or None, all leaves."""
    if strided:
        x = torch.randn(c, 2 * n, device=DEVICE, dtype=dtype).t()[::2]  # strides (2, 2n)... rows every 2nd column
    else:
        x = torch.randn(n, c, device=DEVICE, dtype=dtype)
    w = (torch.randn(vocab, c, device=DEVICE) / c ** 0.5 * 2).to(dtype)
    b = torch.randn(vocab, device=DEVICE, dtype=dtype) if bias else None
    return [t if t is None else t.detach().requires_grad_() for t in (x, w, b)]


def _grads(loss, tensors, grad_out):
    for t in tensors:
        if t is not None:
            t.grad = None
    loss.backward(grad_out)
    return [None if t is None else t.grad.detach().clone() for t in tensors]


def _leaves(tensors, dtype):
    return [None if t is None else t.detach().to(dtype).requires_grad_() for t in tensors]


CASES = [  # n, c, vocab, chunk, options
    (37, 24, 101, None, {}),
    (37, 24, 101, 8, {}),
    (29, 16, 67, 1, dict(reduction="sum")),
    (19, 32, 130, 7, dict(bias=True)),
    (23, 24, 101, 10, dict(label_smoothing=0.1)),
    (23, 24, 101, 10, dict(softcap=3.0)),
    (23, 24, 101, None, dict(ignore_index=5, label_smoothing=0.2, bias=True, reduction="sum")),
    (21, 16, 45, 6, dict(strided=True)),
]


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_linear_cross_entropy_matches_reference(case, dtype):
    require_triton()
    n, c, vocab, chunk, options = CASES[case]
    options = dict(options)
    has_bias, strided = options.pop("bias", False), options.pop("strided", False)
    ignore_index = options.get("ignore_index", -100)
    seed("lce", case, dtype)
    x, w, b = _inputs(n, c, vocab, dtype, bias=has_bias, strided=strided)
    targets = _targets(n, vocab, ignore_index=ignore_index)
    grad_out = torch.tensor(0.7, device=DEVICE)
    loss = linear_cross_entropy(x, w, targets, bias=b, chunk_size=chunk, backend="triton", **options)
    assert loss.dtype == torch.float32 and loss.shape == ()
    grads = _grads(loss, (x, w, b), grad_out)
    truth_in, lowp_in = _leaves((x, w, b), torch.float64), _leaves((x, w, b), dtype)
    truth = linear_cross_entropy_ref(*truth_in[:2], targets, bias=truth_in[2], **options)
    lowp = linear_cross_entropy_ref(*lowp_in[:2], targets, bias=lowp_in[2], upcast=False, **options)
    atol = ATOL[dtype]
    assert_close_to_ref("loss", loss, truth, lowp, atol)
    for name, g, g64, gl in zip(("x", "weight", "bias"), grads, _grads(truth, truth_in, grad_out.double()),
                                _grads(lowp, lowp_in, grad_out.to(dtype))):
        if g is None:
            assert g64 is None
            continue
        assert g.dtype == dtype
        assert_close_to_ref(f"grad {name}", g, g64, gl, atol)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_on_logits_matches_reference(reduction, dtype):
    require_triton()
    seed("ce", reduction, dtype)
    n, vocab = 33, 157
    base = (torch.randn(vocab, n, device=DEVICE) * 3).to(dtype)
    logits = base.t().detach().requires_grad_()  # non-contiguous: unit stride along the rows
    targets = _targets(n, vocab)
    out = cross_entropy(logits, targets, reduction=reduction, backend="triton", label_smoothing=0.05)
    grad_out = torch.rand(out.shape, device=DEVICE) + 0.5
    (g,) = _grads(out, (logits,), grad_out)
    (l64,), (ll,) = _leaves((logits,), torch.float64), _leaves((logits,), dtype)
    truth = cross_entropy_ref(l64, targets, reduction=reduction, label_smoothing=0.05)
    lowp = cross_entropy_ref(ll, targets, reduction=reduction, label_smoothing=0.05, upcast=False)
    assert_close_to_ref("loss", out, truth, lowp, ATOL[dtype])
    if reduction == "none":
        assert out.shape == (n,) and out[targets == -100].eq(0).all()
    (g64,), (gl,) = _grads(truth, (l64,), grad_out.double()), _grads(lowp, (ll,), grad_out.to(dtype))
    assert g.dtype == dtype and g.shape == logits.shape
    assert_close_to_ref("grad logits", g, g64, gl, ATOL[dtype])


def test_leading_dims_and_no_grad():
    require_triton()
    seed("dims")
    x, w, _ = _inputs(6 * 5, 16, 70, torch.float32)
    x3 = x.detach().view(6, 5, 16)
    targets = _targets(30, 70).view(6, 5)
    with torch.no_grad():
        loss = linear_cross_entropy(x3, w, targets, backend="triton")
        per_row = linear_cross_entropy(x3, w, targets, reduction="none", backend="triton", chunk_size=4)
    ref = linear_cross_entropy_ref(x3.double(), w.double(), targets)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-5)
    assert per_row.shape == (6, 5)
    torch.testing.assert_close(per_row.double(), linear_cross_entropy_ref(x3.double(), w.double(), targets,
                                                                          reduction="none").view(6, 5),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="reduction 'none' is for evaluation"):
        linear_cross_entropy(x, w, targets.view(-1), reduction="none", backend="triton")


def test_only_weight_needs_grad_and_all_rows_ignored():
    require_triton()
    seed("weight only")
    x, w, _ = _inputs(11, 16, 50, torch.float32)
    targets = _targets(11, 50)
    loss = linear_cross_entropy(x.detach(), w, targets, backend="triton", chunk_size=4)
    loss.backward()
    w64 = w.detach().double().requires_grad_()
    linear_cross_entropy_ref(x.detach().double(), w64, targets).backward()
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=1e-5, atol=1e-6)
    # every row ignored: NaN loss (0 / 0), as torch; zero gradients with "sum"
    ignored = torch.full_like(targets, -100)
    assert torch.isnan(linear_cross_entropy(x, w, ignored, backend="triton"))
    w.grad = None
    loss = linear_cross_entropy(x, w, ignored, backend="triton", reduction="sum")
    loss.backward()
    assert loss.item() == 0 and w.grad.abs().max() == 0


def test_model_kernel_table_and_torch_backend():
    seed("table")
    x, w, _ = _inputs(9, 16, 40, torch.float32)
    targets = _targets(9, 40)
    ref = linear_cross_entropy(x, w, targets, backend={"cross_entropy": "torch"})
    torch.testing.assert_close(ref, linear_cross_entropy_ref(x, w, targets))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        linear_cross_entropy(x, w, targets, backend="cuda")


def test_autocast_casts_to_the_autocast_dtype():
    require_triton()
    seed("autocast")
    x, w, _ = _inputs(13, 16, 60, torch.float32)
    targets = _targets(13, 60)
    with torch.autocast(DEVICE.type, dtype=torch.float16):
        loss = linear_cross_entropy(x, w, targets, backend="triton")
    loss.backward()
    assert w.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = linear_cross_entropy_ref(x64, w64, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) < 5e-3
    torch.testing.assert_close(w.grad.double(), w64.grad, rtol=0, atol=2e-3)


def test_default_chunk():
    assert default_chunk(16384, 50304, 2) == 2048
    assert default_chunk(16384, 128256, 2) == 1024
    assert default_chunk(100, 50304, 2) == 100
    assert default_chunk(16384, 1000, 4) == 8192
    assert default_chunk(16384, 10_000_000, 4) == 256
    # with the weight's gradient: one chunk while the logits fit 8 V C bytes (bf16: N <= 4 C), else chunks of
    # 4 C / itemsize rows (their logits as large as the fp32 accumulator), never fewer rows than without it
    assert default_chunk(8192, 128256, 2, hidden=2048) == 8192  # Llama-1B, micro-batch 4 x 2048: one chunk
    assert default_chunk(8193, 128256, 2, hidden=2048) == 4096
    assert default_chunk(16384, 128256, 2, hidden=4096) == 16384
    assert default_chunk(16385, 128256, 2, hidden=4096) == 8192
    assert default_chunk(16384, 50304, 2, hidden=1024) == 2048
    assert default_chunk(16384, 50304, 2, hidden=64) == 2048  # a small C keeps the CHUNK_BYTES chunk
    assert default_chunk(8192, 50304, 4, hidden=4096) == 8192 and default_chunk(8193, 50304, 4, hidden=4096) == 4096
    assert default_chunk(3000, 128256, 2, hidden=16) == 1024
    # a sixteenth of the device's memory caps the budget: 24 GiB -> 1.5 GiB, under Llama-1B's 2 GiB of logits: chunks
    # of what the cap leaves beside the 1 GiB accumulator (0.52 GiB: 2182 rows of 128256 bf16 logits, 2048 as a power
    # of two); 8 GiB leaves nothing beside it: CHUNK_BYTES' chunks
    assert default_chunk(8192, 128256, 2, hidden=2048, device_memory=141 << 30) == 8192
    assert default_chunk(8192, 128256, 2, hidden=2048, device_memory=24 << 30) == 2048
    assert default_chunk(8192, 128256, 2, hidden=2048, device_memory=8 << 30) == 1024
    assert default_chunk(4096, 50304, 2, hidden=1024, device_memory=24 << 30) == 4096


@pytest.mark.parametrize("call, message", [
    (lambda x, w, t: linear_cross_entropy(x, w[:, :3], t), "weight must be \\(V, C\\) with C = x's last dim"),
    (lambda x, w, t: linear_cross_entropy(x, w.double(), t), "x has dtype torch.float32 but weight has"),
    (lambda x, w, t: linear_cross_entropy(x.long(), w, t), "x has dtype torch.int64"),
    (lambda x, w, t: linear_cross_entropy(x, w, t[:5]), "targets have shape \\(5,\\), expected \\(9,\\)"),
    (lambda x, w, t: linear_cross_entropy(x, w, t.float()), "targets have dtype torch.float32"),
    (lambda x, w, t: linear_cross_entropy(x, w, t.index_fill(0, torch.tensor([4]), 40)),
     "target 40 \\(row 4\\) is outside the vocabulary \\[0, 40\\)"),
    (lambda x, w, t: linear_cross_entropy(x, w, t.index_fill(0, torch.tensor([2]), -1)),
     "target -1 \\(row 2\\) is outside the vocabulary"),
    (lambda x, w, t: linear_cross_entropy(x, w, t, bias=torch.zeros(39)), "bias has shape \\(39,\\)"),
    (lambda x, w, t: linear_cross_entropy(x, w, t, chunk_size=0), "chunk_size must be None or an int >= 1"),
    (lambda x, w, t: linear_cross_entropy(x, w, t, reduction="avg"), "reduction must be one of"),
    (lambda x, w, t: linear_cross_entropy(x, w, t, label_smoothing=1.5), "label_smoothing must be a number"),
    (lambda x, w, t: linear_cross_entropy(x, w, t, softcap=0.0), "softcap must be None or a finite number > 0"),
    (lambda x, w, t: linear_cross_entropy(x, w.to("meta"), t), "weight is on meta but x is on cpu"),
    (lambda x, w, t: cross_entropy(x @ w.t(), t[:4]), "targets have shape \\(4,\\), expected \\(9,\\)"),
    (lambda x, w, t: cross_entropy(x @ w.t(), t + 100), "is outside the vocabulary \\[0, 40\\)"),
    (lambda x, w, t: cross_entropy((x @ w.t()).long(), t), "logits have dtype torch.int64"),
])
def test_errors(call, message):
    x, w = torch.randn(9, 16), torch.randn(40, 16)
    t = torch.randint(0, 40, (9,))
    with pytest.raises((ValueError, TypeError), match=message):
        call(x, w, t)


def test_kernel_makes_out_of_range_targets_nan():
    """What a compiled graph (no host check) gets for a target outside the vocabulary: NaN, no stray read."""
    require_triton()
    from megakern import _cross_entropy_triton

    logits = torch.randn(4, 70, device=DEVICE)
    targets = torch.tensor([3, 70, -100, -5], device=DEVICE)
    loss, _ = _cross_entropy_triton.fwd(logits, targets, None, None, -100, 0.0, None)
    assert torch.isfinite(loss[0]) and torch.isnan(loss[1]) and loss[2] == 0 and torch.isnan(loss[3])


@pytest.mark.parametrize("smoothing", (0.0, 0.1))
def test_kernel_masked_and_nan_logits(smoothing):
    """Logits of -inf (a masked vocabulary), in some lanes of every block, in whole blocks, and as a row's first
    block: the loss, lse and gradient of torch's fp64 cross-entropy; a NaN logit in one block makes its row's loss
    and lse NaN and leaves the other rows alone."""
    require_triton()
    from megakern import _cross_entropy_triton as kern

    v, block = 200, 32
    logits = torch.randn(5, v, device=DEVICE, dtype=torch.float32) * 4
    logits[0, 1::3] = float("-inf")  # lanes of every block
    logits[1, 64:128] = float("-inf")  # whole blocks
    logits[2, :block] = float("-inf")  # the first block: every lane starts at -inf
    logits[3, 150:] = float("-inf")  # the last, partial block
    logits[4, 77] = float("nan")
    targets = torch.tensor([0, 5, 40, 3, 9], device=DEVICE)
    grad = torch.empty_like(logits)
    scale = torch.ones(1, device=DEVICE)
    loss, lse = kern.fwd(logits, targets, grad, scale, -100, smoothing, None, block=block)
    assert torch.isnan(loss[4]) and torch.isnan(lse[4])
    if smoothing == 0.0:  # a -inf logit smoothed into the loss makes it inf in torch as here
        ref = logits[:4].double().requires_grad_(True)
        want = F.cross_entropy(ref, targets[:4], reduction="none")
        want.sum().backward()
        torch.testing.assert_close(loss[:4].double(), want.detach(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:4].double(), torch.logsumexp(ref.detach(), 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(grad[:4].double(), ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_kernel_in_place_reads_the_target_logit_first(softcap):
    """In place (the gradient written over the logits, as the fused linear cross-entropy runs it) every row's loss
    equals the out-of-place loss bit for bit with every target in the row's last block, the first that pass 2
    overwrites: the target's logit is read before any warp can store over it (on a GPU 8 warps a row, 8192 rows)."""
    require_triton()
    from megakern import _cross_entropy_triton as kern

    seed("ce-in-place-target", softcap)
    rows, vocab = (8192, 50304) if DEVICE.type == "cuda" else (6, 70)
    logits = (torch.randn(rows, vocab, device=DEVICE) * 3).to(torch.bfloat16 if DEVICE.type == "cuda" else
                                                              torch.float32)
    last = vocab - (vocab - 1) % (8192 if DEVICE.type == "cuda" else 64) - 1  # the first column of the last block
    targets = torch.randint(last, vocab, (rows,), device=DEVICE)
    scale = torch.full((1,), 1.0, device=DEVICE)
    out = torch.empty_like(logits)
    ref = kern.fwd(logits, targets, out, scale, -100, 0.0, softcap)
    grad = logits.clone()
    got = kern.fwd(grad, targets, grad, scale, -100, 0.0, softcap)
    for a, b in zip(got, ref):
        assert torch.equal(a, b), int((a != b).sum())
    assert torch.equal(grad, out)


@pytest.mark.parametrize("block, warps", [(16, 1), (32, 2), (64, None)])
def test_kernel_block_and_warps_overrides(block, warps):
    """The tuning overrides (profiles/tune_cross_entropy.py): any block and warps give the default's loss, lse and
    in-place gradient (blocks smaller than the row: several per row, both passes); bad values are refused by name."""
    require_triton()
    from megakern import _cross_entropy_triton as kern

    seed("ce-block", block, warps)
    logits = torch.randn(5, 70, device=DEVICE)
    targets = torch.tensor([3, 69, -100, 0, 12], device=DEVICE)
    scale = torch.full((1,), 0.25, device=DEVICE)
    ref_grad = logits.clone()
    ref = kern.fwd(logits, targets, ref_grad, scale, -100, 0.0, None)
    grad = logits.clone()
    got = kern.fwd(grad, targets, grad, scale, -100, 0.0, None, block=block, warps=warps)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="block must be a power of two >= 16, got 48"):
        kern.fwd(logits, targets, None, None, -100, 0.0, None, block=48)
    with pytest.raises(ValueError, match="warps must be a power of two in \\[1, 32\\], got 64"):
        kern.fwd(logits, targets, None, None, -100, 0.0, None, warps=64)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [50304, 128256])
def test_gpu_bf16_large_vocab_and_memory(vocab):
    """bf16 at a real vocabulary: 2x rule on loss and gradients, and peak memory well below the fp32 logits."""
    seed("gpu", vocab)
    n, c = 4096, 512
    x, w, _ = _inputs(n, c, vocab, torch.bfloat16)
    targets = _targets(n, vocab, ignored=100)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = linear_cross_entropy(x, w, targets, backend="triton", chunk_size=1024)
    grads = _grads(loss, (x, w), None)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < n * vocab * 4 / 2, f"peak {peak / 2**20:.0f} MiB"
    truth_in, lowp_in = _leaves((x, w), torch.float64), _leaves((x, w), torch.bfloat16)
    truth = linear_cross_entropy_ref(*truth_in, targets)
    lowp = linear_cross_entropy_ref(*lowp_in, targets, upcast=False)
    assert_close_to_ref("loss", loss, truth, lowp, ATOL[torch.bfloat16])
    for name, g, g64, gl in zip(("x", "weight"), grads, _grads(truth, truth_in, None), _grads(lowp, lowp_in, None)):
        assert_close_to_ref(f"grad {name}", g, g64, gl, ATOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_fp32_accumulation_probe():
    assert isinstance(ce._fp32_accumulating_mm(torch.device("cuda", torch.cuda.current_device())), bool)


def test_check_targets_false_skips_the_range_check():
    """check_targets=False: no range check (no host sync); valid targets give the same loss and gradients, and an
    id outside the vocabulary gives a NaN loss on the kernels' path rather than an error or a stray read."""
    require_triton()
    seed("check_targets")
    x, w = torch.randn(9, 16, device=DEVICE, requires_grad=True), torch.randn(40, 16, device=DEVICE)
    t = _targets(9, 40, ignored=2)
    checked = linear_cross_entropy(x, w, t, backend="triton")
    (gx_checked,) = torch.autograd.grad(checked, x)
    trusted = linear_cross_entropy(x, w, t, backend="triton", check_targets=False)
    (gx_trusted,) = torch.autograd.grad(trusted, x)
    assert torch.equal(checked, trusted) and torch.equal(gx_checked, gx_trusted)
    bad = t.index_fill(0, torch.tensor([4], device=DEVICE), 40)
    with pytest.raises(ValueError, match="target 40 \\(row 4\\) is outside the vocabulary"):
        linear_cross_entropy(x, w, bad, backend="triton")
    assert torch.isnan(linear_cross_entropy(x.detach(), w, bad, backend="triton", check_targets=False))
    logits = (x @ w.t()).detach()
    assert torch.isnan(cross_entropy(logits, bad, backend="triton", check_targets=False))
    assert torch.equal(cross_entropy(logits, t, backend="triton", check_targets=False),
                       cross_entropy(logits, t, backend="triton"))


@pytest.mark.gpu
def test_gpu_check_targets_false_does_not_sync():
    """With check_targets=False the forward and backward of linear_cross_entropy never wait for the GPU."""
    seed("no sync")
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(50304, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = _targets(1000, 50304, ignored=10)
    linear_cross_entropy(x, w, t, backend="triton", chunk_size=256).backward()  # warm-up: compiles, probes once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        linear_cross_entropy(x, w, t, backend="triton", chunk_size=256, check_targets=False).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.isfinite(w.grad.float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 67, 4099])
def test_backward_scale_kernel_rounds_as_torch(dtype, n):
    """The backward's multiplication by the loss's gradient (a device factor, fp32 arithmetic, rounded to nearest):
    bit for bit torch's fp32 product cast to the gradient's dtype, a new tensor, the input left as it was; in place
    the same bits (a factor of 1: the input as it was)."""
    require_triton()
    from megakern import _cross_entropy_triton as kern

    seed("ce-scale", n, dtype)
    x = (torch.randn(n, device=DEVICE) * 3).to(dtype)
    before = x.clone()
    for factor in (torch.tensor(0.7, device=DEVICE), torch.tensor([1 / 3], device=DEVICE, dtype=torch.float64),
                   torch.tensor(-2.5, device=DEVICE, dtype=torch.bfloat16)):
        out = kern.scale(x, factor)
        want = (x.float() * factor.float().reshape(())).to(dtype)
        assert out.dtype == dtype and out.shape == x.shape and out.data_ptr() != x.data_ptr()
        assert torch.equal(out, want), (out - want).abs().max()
        assert torch.equal(x, before)
        inplace = x.clone()
        assert kern.scale(inplace, factor, inplace=True) is inplace  # in place: the same bits
        assert torch.equal(inplace, want)
    one = x.clone()
    assert kern.scale(one, torch.ones((), device=DEVICE), inplace=True) is one and torch.equal(one, x)
    assert kern.scale(x[:0], torch.ones(1, device=DEVICE)).numel() == 0


def _upcast(t):
    """t in at least fp32: torch's CUDA ``bf16 * 0-d fp32 tensor`` rounds the factor to bf16 first (the CPU's does
    not), so a reference product is taken in fp32 explicitly."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def test_linear_cross_entropy_hands_on_its_gradients_without_a_copy():
    """The gradients made in the forward are scaled in place by the backward and become the parameters' .grad
    themselves (no second weight-sized tensor while the first is alive); the values are those of a fresh forward
    with the incoming gradient applied out of place (the product in at least fp32, rounded once). A second backward
    through the same graph (retain_graph=True) raises, naming the cause, instead of scaling them twice.
    scale_gradients' torch path (fp64, non-contiguous fp32 and bf16 tensors) scales in place too, in fp32 at least."""
    require_triton()
    seed("lce-handoff")
    x, w, b = _inputs(33, 24, 101, torch.bfloat16, bias=True)
    targets = _targets(33, 101)
    factor = torch.tensor(0.37, device=DEVICE)
    loss = linear_cross_entropy(x, w, targets, bias=b, backend="triton")
    made = loss.grad_fn.grads
    ptrs = [t.data_ptr() for t in made]
    want = [(_upcast(t) * factor).to(t.dtype) for t in made]
    del made  # a reference held here would make autograd copy them
    loss.backward(factor, retain_graph=True)
    assert w.grad.data_ptr() == ptrs[1] and b.grad.data_ptr() == ptrs[2] and x.grad.data_ptr() == ptrs[0]
    for got, expected in zip((x.grad, w.grad, b.grad), want):
        assert torch.equal(got, expected)
    assert loss.grad_fn.grads is None
    with pytest.raises(RuntimeError, match="backward ran twice through the same graph"):
        loss.backward(factor)
    for t in (torch.randn(7, 5, device=DEVICE, dtype=torch.float64), torch.randn(5, 14, device=DEVICE).t()[::2],
              torch.randn(5, 14, device=DEVICE, dtype=torch.bfloat16).t()[::2]):
        want = (_upcast(t) * factor).to(t.dtype)
        (got,) = scale_gradients([t], factor, inplace=True)
        assert got is t and torch.equal(got, want)


@pytest.mark.parametrize("dtype", LOW_DTYPES)
@pytest.mark.parametrize("arrives", ["as announced", "other", "announced zero", "announced inf"])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_cross_entropy_grad_scale(reduction, arrives, dtype, monkeypatch):
    """``grad_scale`` (the incoming gradient announced in advance, as a training step's 1 / tokens): the loss is
    unchanged, every gradient holds the 2x rule against the fp64 reference of (loss * incoming gradient), and when
    the gradient arrives as announced the backward's factor is exactly 1 (its kernel reads and writes nothing); any
    other incoming gradient, or an announced 0 / inf (which the forward cannot carry), still gives the right
    gradients."""
    require_triton()
    seed("lce-grad-scale", reduction, arrives, dtype)
    n, c, vocab = 29, 24, 101
    x, w, b = _inputs(n, c, vocab, dtype, bias=True)
    targets = _targets(n, vocab)
    announced = {"as announced": 1 / 300, "other": 1 / 300, "announced zero": 0.0,
                 "announced inf": float("inf")}[arrives]
    incoming = 0.37 if arrives != "as announced" else announced
    grad_scale = torch.tensor(announced, device=DEVICE)
    factors = []
    real = ce.scale_gradients
    monkeypatch.setattr(ce, "scale_gradients", lambda grads, factor, **kw: factors.append(factor.clone()) or
                        real(grads, factor, **kw))
    loss = linear_cross_entropy(x, w, targets, bias=b, reduction=reduction, chunk_size=8, backend="triton",
                                grad_scale=grad_scale)
    plain = linear_cross_entropy(x, w, targets, bias=b, reduction=reduction, chunk_size=8, backend="triton")
    assert torch.equal(loss, plain)
    grads = _grads(loss, (x, w, b), torch.tensor(incoming, device=DEVICE))
    if arrives == "as announced":
        assert factors[-1].item() == 1.0
    truth_in, lowp_in = _leaves((x, w, b), torch.float64), _leaves((x, w, b), dtype)
    truth = linear_cross_entropy_ref(*truth_in[:2], targets, bias=truth_in[2], reduction=reduction)
    lowp = linear_cross_entropy_ref(*lowp_in[:2], targets, bias=lowp_in[2], reduction=reduction, upcast=False)
    for name, g, g64, gl in zip(("x", "weight", "bias"), grads,
                                _grads(truth, truth_in, torch.tensor(incoming, dtype=torch.float64, device=DEVICE)),
                                _grads(lowp, lowp_in, torch.tensor(incoming, device=DEVICE).to(dtype))):
        assert g.dtype == dtype
        assert_close_to_ref(f"grad {name}", g, g64, gl, ATOL[dtype])


def test_linear_cross_entropy_grad_scale_checks():
    """A grad_scale that is not a one-element floating tensor on x's device is refused, naming the problem; the
    torch backend takes it and computes its gradients in the backward as always."""
    x, w, _ = _inputs(5, 8, 11, torch.float32)
    targets = _targets(5, 11, ignored=0)
    for bad, err, match in ((0.5, TypeError, "one-element tensor"),
                            (torch.ones(2, device=DEVICE), ValueError, "one element"),
                            (torch.ones(1, dtype=torch.int64, device=DEVICE), TypeError, "floating"),
                            (torch.ones(1, device="meta"), ValueError, "is on meta")):
        with pytest.raises(err, match=match):
            linear_cross_entropy(x, w, targets, grad_scale=bad)
    scale = torch.tensor(0.25, device=DEVICE)
    loss = linear_cross_entropy(x, w, targets, reduction="sum", backend="torch", grad_scale=scale)
    (gw,) = _grads(loss, (w,), scale)
    plain = linear_cross_entropy(x, w, targets, reduction="sum", backend="torch")
    (gw_plain,) = _grads(plain, (w,), scale)
    assert torch.equal(gw, gw_plain)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_linear_cross_entropy_without_rows_gives_zero_gradients(reduction):
    """No rows at all: the loss of an empty batch (0, or NaN for "mean" as torch), and exactly zero weight and bias
    gradients (no GEMM runs to write them)."""
    require_triton()
    x = torch.randn(0, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(37, 16, device=DEVICE, requires_grad=True)
    b = torch.randn(37, device=DEVICE, requires_grad=True)
    loss = linear_cross_entropy(x, w, torch.zeros(0, dtype=torch.long, device=DEVICE), bias=b, reduction=reduction,
                                backend="triton")
    assert (loss.item() == 0) if reduction == "sum" else torch.isnan(loss)
    loss.backward()
    assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
    assert x.grad.shape == (0, 16)

