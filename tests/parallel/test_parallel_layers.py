"""Tensor-parallel mappings and layers, the vocab-parallel cross-entropy and ring attention, on spawned gloo ranks,
against the same computation on one process (every rank computes the reference from the same seed)."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rankpool import pool

from megakern.attention import attention_ref

TOL = dict(rtol=1e-5, atol=1e-5)


def _group(n):
    """A group of the first n ranks' consecutive blocks: here the whole world (n == world)."""
    assert dist.get_world_size() == n
    return dist.group.WORLD


def check_mappings(n):
    from megakern.parallel import mappings as m

    g, r = _group(n), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(5, 4 * n, 3, dtype=torch.float64)
    w = torch.randn_like(full)  # an arbitrary downstream weight: loss = sum(out * w_out)
    # scatter / gather along dim 1 are each other's transpose
    x = full.clone().requires_grad_()
    part = m.scatter_to_tp(x, g, dim=1)
    torch.testing.assert_close(part, full[:, 4 * r:4 * r + 4])
    (part * w[:, 4 * r:4 * r + 4]).sum().backward()
    torch.testing.assert_close(x.grad, w)  # all-gathered: every rank's chunk of the gradient
    shard = full[:, 4 * r:4 * r + 4].clone().requires_grad_()
    whole = m.gather_from_tp(shard, g, dim=1)
    torch.testing.assert_close(whole, full)
    (whole * w).sum().backward()
    torch.testing.assert_close(shard.grad, w[:, 4 * r:4 * r + 4])
    # copy / reduce: partial sums of rank-dependent values
    mine = (full * (r + 1)).requires_grad_()
    total = m.reduce_from_tp(mine, g)
    torch.testing.assert_close(total, full * sum(range(1, n + 1)))
    (total * w).sum().backward()
    torch.testing.assert_close(mine.grad, w)
    y = full.clone().requires_grad_()
    out = m.copy_to_tp(y, g)
    (out * w * (r + 1)).sum().backward()
    torch.testing.assert_close(y.grad, w * sum(range(1, n + 1)))
    # sequence parallel: gather (reduce-scatter back) and reduce-scatter (gather back), dim 1 non-contiguous input;
    # the token shards are runs of the (B, T) tokens in memory order: with B = 5 they cross batch rows
    def by_hand(t, k, dim=1):  # rank k's token shard of t, built by hand: t's tokens flattened, the k-th of n runs
        lead = math.prod(t.shape[:dim % t.dim()])
        rows = t.reshape(lead * t.shape[dim], -1)
        per = rows.shape[0] // n
        shape = list(t.shape)
        shape[dim] //= n
        return rows[k * per:(k + 1) * per].reshape(shape)

    assert full.shape[0] % n, "the check wants token shards that cross the batch rows"
    z = (full * (r + 1)).transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()  # strides of a transpose
    rs = m.reduce_scatter_to_sp(z, g, dim=1)
    torch.testing.assert_close(rs, by_hand(full * sum(range(1, n + 1)), r))
    torch.testing.assert_close(rs, m.token_shard(full * sum(range(1, n + 1)), n, r, 1))
    (rs * by_hand(w, r)).sum().backward()
    torch.testing.assert_close(z.grad, w)
    s = by_hand(full, r).clone().requires_grad_()
    ag = m.gather_from_sp(s, g, dim=1)
    torch.testing.assert_close(ag, full)
    (ag * w * (r + 1)).sum().backward()
    torch.testing.assert_close(s.grad, by_hand(w * sum(range(1, n + 1)), r))
    sc = m.scatter_to_sp(full.clone().requires_grad_(), g, dim=1)
    torch.testing.assert_close(sc, by_hand(full, r))
    # a batch of one and the sequence first: chunks of the sequence dim; the sequence last or inner
    for shape, dim in (((1, 4 * n, 5), 1), ((4 * n, 3, 2), 0), ((2, 3, 4 * n), 2), ((1, 1, 4 * n, 3), 2),
                       ((3, 4 * n, 2, 5), 1)):
        whole = torch.randn(shape, dtype=torch.float64)
        if math.prod(shape[:dim]) == 1:  # a plain chunk of the sequence dim
            torch.testing.assert_close(by_hand(whole, r, dim), whole.narrow(dim, 4 * r, 4))
        mine = by_hand(whole, r, dim) * (r + 1)
        piece = mine.clone().requires_grad_()
        ag = m.gather_from_sp(piece, g, dim=dim)
        expected = torch.cat([by_hand(whole, k, dim).reshape(-1) * (k + 1) for k in range(n)]).view(shape)
        torch.testing.assert_close(ag, expected)
        ag.backward(whole * (r + 1))
        torch.testing.assert_close(piece.grad, by_hand(whole * sum(range(1, n + 1)), r, dim))
        rs = m.reduce_scatter_to_sp(whole * (r + 1), g, dim=dim)
        torch.testing.assert_close(rs, by_hand(whole * sum(range(1, n + 1)), r, dim))
    with pytest.raises(ValueError, match="not divisible by the group size"):
        m.reduce_scatter_to_sp(torch.randn(3, 4 * n + 1, 2), g, dim=1)
    with pytest.raises(ValueError, match="rank 5 is not in"):
        m.token_shard(full, 2, 5)
    with pytest.raises(ValueError, match="not divisible by the group size"):
        m.scatter_to_tp(torch.randn(3, 4 * n + 1), g, dim=1)
    # in-place reduce refuses a tensor autograd saved
    a = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    b = a * 1.0
    c = b * b  # saves b
    m.reduce_from_tp(b, g, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()
    return True


def check_linear_layers(n, sequence_parallel):
    from megakern.parallel import ColumnParallelLinear, RowParallelLinear, gather_from_sp, scatter_to_sp, token_shard

    g, r = _group(n), dist.get_rank()
    torch.manual_seed(1)
    B, T, C, H = 2, 3 * n, 10, 6 * n
    fc, proj = torch.nn.Linear(C, H).double(), torch.nn.Linear(H, C).double()
    x = torch.randn(B, T, C, dtype=torch.float64, requires_grad=True)
    target = torch.randn(B, T, C, dtype=torch.float64)
    ref = proj(F.gelu(fc(x)))
    ((ref - target) ** 2).sum().backward()

    col = ColumnParallelLinear.from_linear(fc, g, sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(proj, g, sequence_parallel=sequence_parallel)
    xl = x.detach().clone().requires_grad_()
    inp = scatter_to_sp(xl, g, 1) if sequence_parallel else xl
    out = row(F.gelu(col(inp)))
    if sequence_parallel:
        assert out.shape == (B, T // n, C)
        torch.testing.assert_close(out, token_shard(ref, n, r, 1), **TOL)
        loss = ((gather_from_sp(out, g, 1) - target) ** 2).sum() / n  # each rank counts the whole loss once
    else:
        torch.testing.assert_close(out, ref, **TOL)
        loss = ((out - target) ** 2).sum()
    loss.backward()
    h = H // n
    torch.testing.assert_close(col.weight.grad, fc.weight.grad[r * h:(r + 1) * h], **TOL)
    torch.testing.assert_close(col.bias.grad, fc.bias.grad[r * h:(r + 1) * h], **TOL)
    torch.testing.assert_close(row.weight.grad, proj.weight.grad[:, r * h:(r + 1) * h], **TOL)
    bias_grad = row.bias.grad.clone()
    if sequence_parallel:  # the bias saw this rank's tokens only: partial
        assert row.sp_partial == ("bias",)
        dist.all_reduce(bias_grad, group=g)
    torch.testing.assert_close(bias_grad, proj.bias.grad, **TOL)
    torch.testing.assert_close(xl.grad, x.grad, **TOL)
    # product: the forward without the bias (a caller fusing the bias into its activation), same input handling
    with torch.no_grad():
        torch.testing.assert_close(col.product(inp) + col.bias, col(inp), rtol=0, atol=1e-12)
    gathering = ColumnParallelLinear.from_linear(fc, g, gather_output=True)
    with pytest.raises(ValueError, match="gathers its output"):
        gathering.product(x.detach())
    return True


def check_embedding_and_loss(n, sequence_parallel):
    from megakern.parallel import VocabParallelEmbedding, token_shard, vocab_parallel_cross_entropy

    g, r = _group(n), dist.get_rank()
    torch.manual_seed(2)
    V, C, B, T = 16 * n, 7, 3, 2 * n
    emb = torch.nn.Embedding(V, C).double()
    head = torch.randn(V, C, dtype=torch.float64)
    idx = torch.randint(0, V, (B, T))
    targets = torch.randint(0, V, (B, T))
    targets[0, 1] = -100
    ref_h = emb(idx)
    ref_loss = F.cross_entropy((ref_h @ head.T).view(-1, V), targets.view(-1), ignore_index=-100)
    ref_loss.backward()

    pe = VocabParallelEmbedding.from_embedding(emb, g, sequence_parallel=sequence_parallel)
    h = pe(idx)
    if sequence_parallel:
        torch.testing.assert_close(h, token_shard(ref_h, n, r, 1), **TOL)
        from megakern.parallel import gather_from_sp

        h = gather_from_sp(h, g, 1)
    else:
        torch.testing.assert_close(h, ref_h, **TOL)
    from megakern.parallel import copy_to_tp

    v = V // n
    head_local = head[r * v:(r + 1) * v].clone().requires_grad_()
    logits = copy_to_tp(h, g) @ head_local.T  # (B, T, V/n): this rank's columns only
    loss = vocab_parallel_cross_entropy(logits, targets, g)
    torch.testing.assert_close(loss, ref_loss, **TOL)
    loss.backward()
    grad = pe.weight.grad
    if sequence_parallel:
        grad = grad / n  # every rank backpropagated the whole loss through the gather: n times the gradient
    torch.testing.assert_close(grad, emb.weight.grad[r * v:(r + 1) * v], **TOL)
    # per-token losses with padding columns excluded, against torch on the first vocab_size columns
    z = torch.randn(5, V, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, V - 3, (5,))
    ref = F.cross_entropy(z[:, :V - 3], t, reduction="none")
    ref.sum().backward()
    zl = z.detach()[:, r * v:(r + 1) * v].clone().requires_grad_()
    per = vocab_parallel_cross_entropy(zl, t, g, reduction="none", vocab_size=V - 3)
    torch.testing.assert_close(per, ref, **TOL)
    per.sum().backward()
    want = torch.cat([z.grad[:, :V - 3], torch.zeros(5, 3, dtype=torch.float64)], 1)[:, r * v:(r + 1) * v]
    torch.testing.assert_close(zl.grad, want, **TOL)
    with pytest.raises(RuntimeError, match="targets outside"):
        vocab_parallel_cross_entropy(zl, torch.full((5,), V), g)
    with pytest.raises(ValueError, match="disagree"):
        vocab_parallel_cross_entropy(zl, t[:4], g)
    return True


def check_ring_attention(n, nh, nkv, batch):
    from megakern.parallel import cp_positions, cp_shard, cp_unshard, ring_attention

    g, r = _group(n), dist.get_rank()
    torch.manual_seed(3)
    T, hs = 4 * n, 16
    q = torch.randn(batch, T, nh, hs, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, T, nkv, hs, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, T, nkv, hs, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(batch, T, nh, hs, dtype=torch.float64)
    ref, _ = attention_ref(q, k, v, causal=True)
    (ref * dout).sum().backward()
    ql, kl, vl = (cp_shard(t.detach(), g, 1).requires_grad_() for t in (q, k, v))
    out = ring_attention(ql, kl, vl, g)
    torch.testing.assert_close(out, cp_shard(ref.detach(), g, 1), rtol=1e-10, atol=1e-10)
    (out * cp_shard(dout, g, 1)).sum().backward()
    for name, mine, full in (("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad), ("dv", vl.grad, v.grad)):
        torch.testing.assert_close(mine, cp_shard(full, g, 1), rtol=1e-10, atol=1e-10, msg=name)
    torch.testing.assert_close(cp_unshard(out, g, 1), ref.detach(), rtol=1e-10, atol=1e-10)
    pos = cp_positions(T, n, r)
    torch.testing.assert_close(pos, cp_shard(torch.arange(T)[None], g, 1)[0])
    return True


@pytest.mark.parametrize("n", [2, 4])
def test_mappings(n):
    assert all(pool(n).run(check_mappings, n))


def check_gloo_fallbacks(n):
    """Gloo without the single-tensor collectives: the list all-gather and all-reduce-and-slice paths agree."""
    from megakern.parallel import mappings as m

    def missing(*args, **kwargs):
        raise RuntimeError("ProcessGroupGloo does not support this collective")

    saved = m._ALL_GATHER, m._REDUCE_SCATTER
    m._ALL_GATHER = m._REDUCE_SCATTER = missing
    try:
        return check_mappings(n)
    finally:
        m._ALL_GATHER, m._REDUCE_SCATTER = saved


def test_gloo_fallbacks():
    assert all(pool(2).run(check_gloo_fallbacks, 2))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_column_row_linear(sequence_parallel):
    assert all(pool(2).run(check_linear_layers, 2, sequence_parallel))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_vocab_parallel_embedding_and_cross_entropy(sequence_parallel):
    assert all(pool(2).run(check_embedding_and_loss, 2, sequence_parallel))


def check_enter_hook_under_autocast(n, sequence_parallel):
    """A block's input enters the tensor-parallel region in the autocast dtype: the collectives (forward gather,
    backward reduce-scatter / all-reduce) move bf16, and the values are those of the fp32 path cast to bf16."""
    from megakern.parallel import mappings as m
    from megakern.parallel import token_shard
    from megakern.parallel.tensor_parallel import _enter_hook

    g, r = _group(n), dist.get_rank()
    torch.manual_seed(0)
    full = torch.randn(2, 4 * n, 6)
    w = torch.randn(2, 4 * n, 6)
    seen = []
    saved_ag, saved_ar = m._ALL_GATHER, dist.all_reduce

    def spy_ag(out, x, *a, **k):
        seen.append(("all_gather", x.dtype))
        return saved_ag(out, x, *a, **k)

    def spy_ar(x, *a, **k):
        seen.append(("all_reduce", x.dtype))
        return saved_ar(x, *a, **k)

    m._ALL_GATHER, m.dist.all_reduce = spy_ag, spy_ar
    try:
        hook = _enter_hook(g, sequence_parallel)
        mine = token_shard(full, n, r, 1) if sequence_parallel else full
        grads = {}
        for cast in (False, True):
            x = mine.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cast):
                (y, extra) = hook(None, (x, "pos"))
            assert extra == "pos"
            assert y.dtype == (torch.bfloat16 if cast else torch.float32)
            torch.testing.assert_close(y, full.to(y.dtype), rtol=0, atol=0)
            (y.float() * w * (r + 1)).sum().backward()
            grads[cast] = x.grad
    finally:
        m._ALL_GATHER, m.dist.all_reduce = saved_ag, saved_ar
    if sequence_parallel:  # forward all-gather; its backward reduce-scatter goes through _REDUCE_SCATTER
        assert [d for op, d in seen if op == "all_gather"] == [torch.float32, torch.bfloat16]
    else:  # copy_to_tp: the backward all-reduce
        assert [d for op, d in seen if op == "all_reduce"] == [torch.float32, torch.bfloat16]
    torch.testing.assert_close(grads[True], grads[False], rtol=2e-2, atol=2e-2)  # summed in bf16
    assert grads[True].dtype == torch.float32
    return True


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_block_input_enters_tensor_parallel_in_the_autocast_dtype(sequence_parallel):
    assert all(pool(2).run(check_enter_hook_under_autocast, 2, sequence_parallel))


@pytest.mark.parametrize("n,nh,nkv,batch", [(2, 2, 2, 2), (2, 4, 2, 1), (4, 2, 1, 1)])
def test_ring_attention(n, nh, nkv, batch):
    assert all(pool(n).run(check_ring_attention, n, nh, nkv, batch))


def test_layer_shapes_checked():
    from megakern.parallel import ColumnParallelLinear

    for message in pool(2).run(_column_odd):
        assert "5 is not divisible by the tensor-parallel size 2" in message
    assert ColumnParallelLinear(4, 6).weight.shape == (6, 4)  # no group: one rank holds all


def _column_odd():
    from megakern.parallel import ColumnParallelLinear

    try:
        ColumnParallelLinear(4, 5, group=dist.group.WORLD)
    except ValueError as exc:
        return str(exc)
    raise AssertionError("no error for 5 columns over 2 ranks")
