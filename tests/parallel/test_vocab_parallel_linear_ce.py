"""The vocab-parallel fused linear cross-entropy (parallel/cross_entropy.py), on spawned gloo ranks.

Every rank builds the same full inputs from the same seed and keeps its weight (and bias) shard; the loss, the sum
over the ranks of their partial dx, each rank's dW and db shards are held to the 2x rule (conftest) against the
full-vocabulary fp64 reference (x @ W^T + b, padding columns cut, F.cross_entropy) with plain torch in the low
precision as the yardstick. Odd row counts, chunks that do not divide them, padded vocabularies (a rank whose shard
is all padding too), ignored rows and a custom ignore_index, bias, non-contiguous x, mean / sum / none with an
incoming gradient other than 1; one rank (group None and groups of one) against megakern.linear_cross_entropy; the
largest fp32 tensor made bounded by a chunk; autocast, no_grad, and the argument checks.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import ATOL, assert_close_to_ref, seed
from rankpool import pool
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megakern.cross_entropy import linear_cross_entropy, linear_cross_entropy_ref
from megakern.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

REDUCTIONS = ("mean", "sum", "none")
CASES = [  # n, c, weight rows per rank, padding rows (vocab_size = tp * rows - padding, or more), chunk, options
    (37, 12, 24, 5, 8, {}),
    (29, 16, 20, 23, 7, dict(bias=True)),  # at tp 4 the last rank's shard is all padding
    (23, 8, 16, 0, None, dict(strided=True, ignore_index=3)),
    (19, 12, 9, 1, 1, dict(bias=True, strided=True)),
]


def _group(n):
    if n == 1:
        return None
    assert dist.get_world_size() == n
    return dist.group.WORLD


def _rank(n):
    return 0 if n == 1 else dist.get_rank()


def _full_inputs(n_rows, c, vocab_rows, vocab_size, dtype, *, bias=False, strided=False, ignore_index=-100):
    """x (n, c) (a non-contiguous view when ``strided``), the full weight (vocab_rows, c), bias or None, targets."""
    if strided:
        x = torch.randn(c, 2 * n_rows, dtype=dtype).t()[::2]
    else:
        x = torch.randn(n_rows, c, dtype=dtype)
    w = (torch.randn(vocab_rows, c) / c ** 0.5 * 2).to(dtype)
    b = torch.randn(vocab_rows, dtype=dtype) if bias else None
    t = torch.randint(0, vocab_size, (n_rows,))
    t[torch.randperm(n_rows)[:3]] = ignore_index
    return x, w, b, t


def _reference(x, w, b, t, vocab_size, reduction, ignore_index, dtype):
    """The full-vocabulary loss in ``dtype`` throughout (fp64: the truth; else plain low-precision torch)."""
    z = x.to(dtype) @ w.to(dtype).t()
    if b is not None:
        z = z + b.to(dtype)
    return F.cross_entropy(z[:, :vocab_size], t, ignore_index=ignore_index, reduction=reduction)


def _leaves(tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_() for t in tensors]


def _grads(out, tensors, grad_out):
    present = [t for t in tensors if t is not None]
    got = iter(torch.autograd.grad(out, present, grad_out))
    return [None if t is None else next(got) for t in tensors]


def check_matches_reference(n, dtype, cases):
    g, r = _group(n), _rank(n)
    for case in cases:
        n_rows, c, rows, padding, chunk, options = CASES[case]
        options = dict(options)
        has_bias, strided = options.pop("bias", False), options.pop("strided", False)
        ignore_index = options.pop("ignore_index", -100)
        vocab_size = max(n * rows - padding, rows // 2 + 1)  # one rank: some padding still
        for reduction in REDUCTIONS:
            seed("vplce", n, dtype, case, reduction)  # the same inputs on every rank
            x, w, b, t = _full_inputs(n_rows, c, n * rows, vocab_size, dtype, bias=has_bias, strided=strided,
                                      ignore_index=ignore_index)
            grad_out = torch.tensor(0.7) if reduction != "none" else torch.rand(n_rows) + 0.5
            mine = slice(r * rows, (r + 1) * rows)
            xs, ws, bs = _leaves((x, w[mine], None if b is None else b[mine]))
            assert xs.stride() == x.stride()
            loss = vocab_parallel_linear_cross_entropy(xs, ws, t, g, bias=bs, ignore_index=ignore_index,
                                                       reduction=reduction, vocab_size=vocab_size, chunk_size=chunk)
            assert loss.dtype == torch.float32 and loss.shape == (() if reduction != "none" else (n_rows,))
            gx, gw, gb = _grads(loss, (xs, ws, bs), grad_out.float())
            assert gx.dtype == dtype and gw.dtype == dtype and (gb is None or gb.dtype == dtype)
            dx = gx.double()  # this rank's partial dx: the caller's copy_to_tp sums it over the group
            if g is not None:
                dist.all_reduce(dx, group=g)
                every = [torch.empty_like(loss) for _ in range(n)]
                dist.all_gather(every, loss.detach(), group=g)
                assert all(torch.equal(e, loss.detach()) for e in every), "ranks disagree on the loss"
            truth_in, lowp_in = _leaves((x, w, b), torch.float64), _leaves((x, w, b))
            truth = _reference(*truth_in, t, vocab_size, reduction, ignore_index, torch.float64)
            lowp = _reference(*lowp_in, t, vocab_size, reduction, ignore_index, dtype)
            what = f"tp{n} {dtype} case {case} {reduction}"
            atol = ATOL[dtype]
            assert_close_to_ref(f"{what}: loss", loss, truth, lowp, atol)
            tx, tw, tb = _grads(truth, truth_in, grad_out.double())
            lx, lw, lb = _grads(lowp, lowp_in, grad_out.to(dtype))
            assert_close_to_ref(f"{what}: dx summed over ranks", dx, tx, lx, atol)
            assert_close_to_ref(f"{what}: dW shard", gw, tw[mine], lw[mine], atol)
            if b is not None:
                assert_close_to_ref(f"{what}: db shard", gb, tb[mine], lb[mine], atol)
            if r * rows >= vocab_size:  # a shard of padding rows only: no gradient at all
                assert gw.abs().max() == 0
    return True


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_full_vocabulary_reference(n, dtype):
    assert all(pool(n).run(check_matches_reference, n, dtype, range(len(CASES))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_rank_padded_or_per_row_matches_reference(dtype):
    """group None with padding columns or reduction "none": the chunked path on one rank."""
    assert check_matches_reference(1, dtype, range(len(CASES)))


def check_one_rank_is_linear_cross_entropy(n):
    """group None and a group of one rank: megakern.linear_cross_entropy's loss and gradients."""
    singles = [dist.new_group([k]) for k in range(n)]  # every rank creates every group, in the same order
    for group in (None, singles[dist.get_rank()]):
        seed("one rank")
        x, w, b, t = _full_inputs(21, 8, 40, 40, torch.float32, bias=True)
        for reduction in ("mean", "sum"):
            ours_in, theirs_in = _leaves((x, w, b)), _leaves((x, w, b))
            ours = vocab_parallel_linear_cross_entropy(ours_in[0], ours_in[1], t, group, bias=ours_in[2],
                                                       reduction=reduction, chunk_size=6)
            theirs = linear_cross_entropy(theirs_in[0], theirs_in[1], t, bias=theirs_in[2], reduction=reduction,
                                          chunk_size=6)
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
            for a, e in zip(_grads(ours, ours_in, None), _grads(theirs, theirs_in, None)):
                torch.testing.assert_close(a, e, rtol=0, atol=0)
        # per-row losses (the chunked path) against linear_cross_entropy's reference
        xs, ws, bs = _leaves((x, w, b))
        per = vocab_parallel_linear_cross_entropy(xs, ws, t, group, bias=bs, reduction="none", chunk_size=4)
        ref = linear_cross_entropy_ref(x.double(), w.double(), t, bias=b.double(), reduction="none")
        torch.testing.assert_close(per.double(), ref, rtol=1e-5, atol=1e-5)
    return True


def test_one_rank_is_linear_cross_entropy():
    assert all(pool(2).run(check_one_rank_is_linear_cross_entropy, 2))


class _LargestFloat(TorchDispatchMode):
    """The largest storage (bytes) of any floating-point tensor an op makes while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def check_memory_bounded_by_the_chunk(n):
    g, r = _group(n), _rank(n)
    n_rows, c, rows, chunk = 96, 6, 64, 8
    seed("memory")
    x, w, _, t = _full_inputs(n_rows, c, n * rows, n * rows - 7, torch.float32)
    # everything this op may hold: a chunk of local logits, dx (N, C), dW (V/tp, C); not the (N, V/tp) logits
    bound = 4 * max(chunk * rows, n_rows * c, rows * c)
    assert bound * 4 <= 4 * n_rows * rows
    for reduction in REDUCTIONS:
        xs, ws = _leaves((x, w[r * rows:(r + 1) * rows].clone()))  # a shard of its own (not a view of w)
        with _LargestFloat() as seen:
            loss = vocab_parallel_linear_cross_entropy(xs, ws, t, g, reduction=reduction, vocab_size=n * rows - 7,
                                                       chunk_size=chunk)
            loss.backward(torch.ones_like(loss))  # "none": the backward recomputes chunk by chunk
        assert 0 < seen.largest <= bound, f"{reduction}: an fp32 tensor of {seen.largest} bytes > {bound}"
    # the hook sees what a whole-logits loss makes: (N, V/tp) fp32
    xs, ws = _leaves((x, w[r * rows:(r + 1) * rows].clone()))
    with _LargestFloat() as seen:
        vocab_parallel_cross_entropy(xs @ ws.t(), t, g, reduction="sum").backward()
    assert seen.largest >= 4 * n_rows * rows
    return True


def test_memory_bounded_by_the_chunk():
    assert all(pool(2).run(check_memory_bounded_by_the_chunk, 2))


def check_autocast_no_grad_and_ignored_rows(n):
    g, r = _group(n), _rank(n)
    seed("autocast")
    x, w, _, t = _full_inputs(13, 8, n * 16, n * 16 - 3, torch.float32)
    ws_full = w[r * 16:(r + 1) * 16]
    # autocast: both cast to bf16 under autograd; the fp32 leaves get fp32 gradients
    xs, ws = _leaves((x, ws_full))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = vocab_parallel_linear_cross_entropy(xs, ws, t, g, vocab_size=n * 16 - 3, chunk_size=5)
    xb, wb = _leaves((x, ws_full), torch.bfloat16)
    want = vocab_parallel_linear_cross_entropy(xb, wb, t, g, vocab_size=n * 16 - 3, chunk_size=5)
    torch.testing.assert_close(loss, want, rtol=0, atol=0)
    gx, gw = _grads(loss, (xs, ws), None)
    ex, ew = _grads(want, (xb, wb), None)
    assert gx.dtype == torch.float32 and gw.dtype == torch.float32
    torch.testing.assert_close(gx, ex.float(), rtol=0, atol=0)
    torch.testing.assert_close(gw, ew.float(), rtol=0, atol=0)
    # no_grad: the same loss, no graph
    xs, ws = _leaves((x, ws_full))
    with torch.no_grad():
        quiet = vocab_parallel_linear_cross_entropy(xs, ws, t, g, reduction="sum", chunk_size=4)
    assert not quiet.requires_grad
    torch.testing.assert_close(quiet, vocab_parallel_linear_cross_entropy(xs, ws, t, g, reduction="sum").detach())
    # every row ignored: NaN mean (0 / 0, as torch), zero sum and zero gradients
    ignored = torch.full_like(t, -100)
    assert torch.isnan(vocab_parallel_linear_cross_entropy(xs, ws, ignored, g))
    loss = vocab_parallel_linear_cross_entropy(xs, ws, ignored, g, reduction="sum", chunk_size=4)
    loss.backward()
    assert loss.item() == 0 and xs.grad.abs().max() == 0 and ws.grad.abs().max() == 0
    # check_targets=False: a target outside the vocabulary gives a NaN loss for its row, the others are finite
    bad = t.clone()
    bad[4] = n * 16 - 1  # a padding column
    per = vocab_parallel_linear_cross_entropy(xs.detach(), ws.detach(), bad, g, reduction="none",
                                              vocab_size=n * 16 - 3, check_targets=False)
    assert torch.isnan(per[4]) and torch.isfinite(per[torch.arange(13) != 4]).all()
    return True


def test_autocast_no_grad_and_ignored_rows():
    assert all(pool(2).run(check_autocast_no_grad_and_ignored_rows, 2))


def check_errors(n):
    g, r = _group(n), _rank(n)
    x, w, t = torch.randn(9, 16), torch.randn(20, 16), torch.randint(0, 35, (9,))
    f = vocab_parallel_linear_cross_entropy
    calls = [
        (lambda: f(x, w[:, :3], t, g), ValueError, "weight must be \\(V, C\\) with C = x's last dim"),
        (lambda: f(x, w.double(), t, g), TypeError, "x has dtype torch.float32 but weight has"),
        (lambda: f(x.long(), w, t, g), TypeError, "x has dtype torch.int64"),
        (lambda: f(x, w, t[:5], g), ValueError, "targets have shape \\(5,\\), expected \\(9,\\)"),
        (lambda: f(x, w, t.float(), g), TypeError, "targets have dtype torch.float32"),
        (lambda: f(x, w, t, g, bias=torch.zeros(40)), ValueError, "bias has shape \\(40,\\), expected \\(20,\\)"),
        (lambda: f(x, w, t, g, chunk_size=0), ValueError, "chunk_size must be None or an int >= 1"),
        (lambda: f(x, w, t, g, reduction="avg"), ValueError, "reduction must be one of"),
        (lambda: f(x, w.to("meta"), t, g), ValueError, "weight is on meta but x is on cpu"),
        (lambda: f(x, w, t, g, vocab_size=41), ValueError, "vocab_size must be None or an int in 1..40 "
                                                           "\\(weight's 20 rows x 2 ranks\\), got 41"),
        (lambda: f(x, w, t, g, vocab_size=0), ValueError, "vocab_size must be None or an int in 1..40"),
        (lambda: f(x, w, t, g, vocab_size=35.0), ValueError, "vocab_size must be None or an int"),
        (lambda: f(x, w, t, g, vocab_size=33), ValueError,
         "target 3[3-4] \\(row \\d\\) is outside the vocabulary \\[0, 33\\)"),
        (lambda: f(x, w, t.index_fill(0, torch.tensor([2]), 40), g), ValueError,
         "target 40 \\(row 2\\) is outside the vocabulary \\[0, 40\\)"),
        (lambda: f(x, w, t.index_fill(0, torch.tensor([1]), -1), g), ValueError, "target -1 \\(row 1\\)"),
        (lambda: f(x, w, t, g, backend="triton"), ValueError, "backend 'triton' is not offered with 2 ranks"),
        (lambda: f(x, w, t, g, backend="nope"), ValueError, "backend 'nope' is not offered"),
        (lambda: f(x, w, t, g, backend=3), TypeError, "backend must be None, a str or a kernel table"),
    ]
    t[:2] = torch.tensor([33, 34])  # targets in the padding when vocab_size = 33
    for call, kind, message in calls:
        with pytest.raises(kind, match="vocab_parallel_linear_cross_entropy: " + message):
            call()
    # a kernel table is taken (it applies to one rank) and "torch" is the path itself
    ref = f(x, w, t, g, chunk_size=4)
    torch.testing.assert_close(f(x, w, t, g, backend={"cross_entropy": "triton"}), ref)
    torch.testing.assert_close(f(x, w, t, g, backend="torch"), ref)
    return True


def test_bad_arguments_raise():
    assert all(pool(2).run(check_errors, 2))



def check_gradients_handed_on_once(n):
    """"mean" / "sum" make the gradients in the forward; the backward scales them in place and hands them on as the
    parameters' .grad (no copy), equal to the full-vocabulary loss's; a second backward through the same graph
    (retain_graph=True) raises."""
    g, r = _group(n), _rank(n)
    rows = 11
    for reduction in ("mean", "sum"):
        seed("handed-on", reduction)
        x, w, _, t = _full_inputs(13, 8, n * rows, n * rows, torch.float64)
        xs, ws = _leaves((x, w[r * rows:(r + 1) * rows].clone()))
        loss = vocab_parallel_linear_cross_entropy(xs, ws, t, g, reduction=reduction)
        ptr = loss.grad_fn.grads[1].data_ptr()
        loss.backward(torch.tensor(0.5, dtype=torch.float64), retain_graph=True)
        assert ws.grad.data_ptr() == ptr
        xr, wr = _leaves((x, w))
        (_reference(xr, wr, None, t, n * rows, reduction, -100, torch.float64) * 0.5).backward()
        torch.testing.assert_close(ws.grad, wr.grad[r * rows:(r + 1) * rows])
        if n > 1:
            dist.all_reduce(xs.grad, group=g)  # each rank's partial dx
        torch.testing.assert_close(xs.grad, xr.grad)
        with pytest.raises(RuntimeError, match="backward ran twice through the same graph"):
            loss.backward(torch.tensor(0.5, dtype=torch.float64))
    return True


def test_gradients_handed_on_once():
    assert all(pool(2).run(check_gradients_handed_on_once, 2))
