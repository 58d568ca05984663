"""Packed documents under context and pipeline parallelism.

Context parallel (THD layout, megakern.parallel.context): the sharding helpers round-trip any document lengths, and
ring attention over packed documents at cp 2 and 4 equals megakern's fp64 reference attention over the whole packed
batch, output and dq / dk / dv, for documents of 1 token, odd lengths, lengths that are multiples of 2*cp and
documents longer than a rank's share; pad tokens (random values, zero upstream gradient, as in the model where
their targets are ignored) change nothing. Pipeline parallel: a tiny GPT cut into pp=2 stages, run by 1F1B and
interleaved 1F1B on packed micro-batches (``packed_microbatches``), gives the single model's loss and gradients.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from rankpool import pool

from megakern.attention import attention_ref
from megakern.parallel import context
from megakern.parallel.context import IGNORE_INDEX, cp_pack_layout, cp_shard_packed

# every length class: 1, odd, a multiple of 2*cp (cp 2 and 4), longer than a rank's share, two in a row of 2
LENGTHS = [1, 7, 16, 3, 40, 2, 2, 9, 24]
TOL = 1e-10  # fp64 throughout: the ring reorders sums only


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(lengths), dtype=torch.int64).cumsum(0).to(torch.int32)


# ---- the layout, one process ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("multiple", [1, 3, 4])
def test_layout_covers_every_token_once(cp, multiple):
    lengths = LENGTHS + [0, 5]  # an empty document is dropped
    cu = _offsets(lengths)
    total = int(cu[-1])
    tokens = torch.arange(100, 100 + total)
    layouts = [cp_pack_layout(cu, total, cp, r, multiple=multiple) for r in range(cp)]
    seen = torch.cat([lay.index[lay.index >= 0] for lay in layouts])
    assert torch.equal(seen.sort().values, torch.arange(total)), "every token on exactly one rank"
    starts = torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths))
    for r, lay in enumerate(layouts):
        assert torch.equal(lay.cu_seqlens, layouts[0].cu_seqlens), "the local packing is the same on every rank"
        assert lay.length % multiple == 0 and (cp == 1 or lay.length % 2 == 0)
        local = lay.cu_seqlens.tolist()
        assert local[-1] == lay.length and lay.max_seqlen == max(b - a for a, b in zip(local, local[1:]))
        if cp > 1:
            assert all(o % 2 == 0 for o in local), "two equal chunks per local document"
        real = lay.index >= 0
        # positions: each token's place in its document; pads at 0
        assert torch.equal(lay.position_ids[real], lay.index[real] - starts[lay.index[real]])
        assert not lay.position_ids[~real].any()
        ids = lay.shard(tokens.view(1, -1), fill=-1)
        assert torch.equal(ids[real], tokens[lay.index[real]]) and bool((ids[~real] == -1).all())
        tg = lay.shard_targets(tokens)
        assert bool((tg[~real] == IGNORE_INDEX).all())
        # pads only at the end of each document: a real token's chunk-mates before it in the padded document are real
        for d, (a, b) in enumerate(zip(local, local[1:])):
            doc_real = real[a:b]
            if cp > 1 and doc_real.any():
                c = (b - a) // 2
                for half in (doc_real[:c], doc_real[c:]):
                    assert torch.equal(half, half.sort(descending=True).values), "pads follow the real tokens"
    # the number of pads per document is below 2*cp, and the final pad document is below lcm(2, multiple)
    pads = sum(int((lay.index < 0).sum()) for lay in layouts)
    assert pads < cp * (len(lengths) * 2 * cp + 2 * multiple)


def test_layout_to_a_fixed_length_and_shard_helper():
    cu = _offsets([5, 11, 3])
    x, lay = cp_shard_packed(torch.arange(19), cu, 2, 1, length=24)
    assert lay.length == 24 and x.shape == (24,) and lay.cu_seqlens.tolist()[-1] == 24
    with pytest.raises(ValueError, match="length 10"):
        cp_pack_layout(cu, 19, 2, 0, length=10)
    with pytest.raises(ValueError, match="multiple of 4"):
        cp_pack_layout(cu, 19, 2, 0, multiple=4, length=26)


def test_layout_bad_inputs_raise():
    cu = _offsets([5, 11, 3])
    with pytest.raises(ValueError, match="ends at 19"):
        cp_pack_layout(cu, 20, 2, 0)  # not covering the batch
    with pytest.raises(TypeError, match="int32"):
        cp_pack_layout(cu.long(), 19, 2, 0)
    with pytest.raises(ValueError, match="start at 0"):
        cp_pack_layout(torch.tensor([1, 19], dtype=torch.int32), 19, 2, 0)
    with pytest.raises(ValueError, match="rank"):
        cp_pack_layout(cu, 19, 2, 2)
    with pytest.raises(ValueError, match="does not hold"):
        cp_pack_layout(cu, 19, 2, 0).shard(torch.arange(18))


# ---- ring attention over packed documents, on ranks --------------------------------------------------------------
def ring_packed(lengths, multiple: int):
    group = dist.group.WORLD
    cp, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)  # the same batch on every rank
    cu = _offsets(lengths)
    total, nh, nkv, hs = int(cu[-1]), 4, 2, 16
    q = torch.randn(total, nh, hs, dtype=torch.float64)
    k, v = (torch.randn(total, nkv, hs, dtype=torch.float64) for _ in range(2))
    dout = torch.randn_like(q)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_ref(*refs, causal=True, cu_seqlens=cu)
    (ref * dout).sum().backward()

    lay = cp_pack_layout(cu, total, cp, rank, multiple=multiple)
    pad = lay.index < 0
    torch.manual_seed(1 + rank)
    local = []
    for t in (q, k, v):
        x = lay.shard(t, fill=None).clone()
        x[pad] = 100 * torch.randn_like(x[pad])  # pads must not leak into real tokens
        local.append(x.requires_grad_())
    core = context.RingAttention(group)  # the module the model's blocks hold, as the GPT calls it
    out = core(*local, cu_seqlens=lay.cu_seqlens, max_seqlen=lay.max_seqlen)
    (out * lay.shard(dout, fill=0.0)).sum().backward()
    got = [context.cp_unshard_packed(t, lay, group) for t in (out.detach(), *(x.grad for x in local))]
    # without max_seqlen the offsets are read and checked
    again = context.ring_attention_packed(*(x.detach() for x in local), lay.cu_seqlens, group)
    torch.testing.assert_close(again, out.detach(), rtol=0, atol=0)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, (ref.detach(), *(t.grad for t in refs))):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m, n=name: f"{n}: {m}")
    return lay.length


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_attention_over_packed_documents_equals_attention_on_the_whole_batch(cp):
    ranks = pool(cp)
    lengths = ranks.run(ring_packed, LENGTHS, 3)
    assert len(set(lengths)) == 1 and lengths[0] % 6 == 0
    ranks.run(ring_packed, [2 * cp * 3, 1], 1)  # exact multiples of 2*cp and a single token
    ranks.run(ring_packed, [37], 1)  # one document


def packed_refusals():
    group = dist.group.WORLD
    q = torch.randn(6, 2, 16, dtype=torch.float64)
    errors = {}
    for name, cu, exc in (("odd", torch.tensor([0, 3, 6], dtype=torch.int32), ValueError),
                          ("dtype", torch.tensor([0, 6]), TypeError),
                          ("short", torch.tensor([0, 4], dtype=torch.int32), ValueError)):
        try:
            context.ring_attention_packed(q, q, q, cu, group)
        except exc as e:
            errors[name] = str(e)
    try:
        context.ring_attention_packed(q[:5], q[:5], q[:5], torch.tensor([0, 5], dtype=torch.int32), group)
    except ValueError as e:
        errors["tokens"] = str(e)
    return errors


def test_ring_attention_packed_refuses_bad_packing():
    errors = pool(2).run(packed_refusals)[0]
    assert "odd length" in errors["odd"] and "int32" in errors["dtype"]
    assert "ends at 4" in errors["short"] and "5 local tokens" in errors["tokens"]


# ---- pipeline parallel: packed micro-batches ---------------------------------------------------------------------
def pipeline_packed(schedule: str, m: int, style: str):
    from gpt_check import STYLES

    from megakern.models.gpt import GPT, GPTConfig
    from megakern.parallel.pipeline import (PipelineChunk, build_schedule, cut_stage, packed_microbatches,
                                            stage_layout)

    rank, pp = dist.get_rank(), dist.get_world_size()
    spr = 2 if schedule == "interleaved-1f1b" else 1
    stages = pp * spr
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, n_kv_head=2, vocab_size=120, max_seqlen=32, ffn_hidden=96,
                    dropout=0.0, **{**STYLES[style], "tie_embeddings": False})
    torch.manual_seed(0)
    ref = GPT(cfg)
    layout = stage_layout(cfg.n_layer, pp, spr, rank)
    chunks = [PipelineChunk(cut_stage(ref, s, stages, blocks)[0]) for s, blocks in layout]
    g = torch.Generator().manual_seed(5)
    rows, seqlen = 1, 24  # micro-batches of one row; documents of 1..13 tokens
    idx = torch.randint(0, cfg.vocab_size, (rows * m, seqlen), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (rows * m, seqlen), generator=g)
    targets[0, :2] = IGNORE_INDEX
    per, cus, offsets = rows * seqlen, [], [0]
    for j in range(m):
        o = [0]
        while o[-1] < per:
            o.append(min(o[-1] + int(torch.randint(1, 14, (1,), generator=g)), per))
        cus.append(torch.tensor(o, dtype=torch.int32))
        offsets += [x + j * per for x in o[1:]]
    n = float((targets != IGNORE_INDEX).sum())

    def loss_fn(logits, t):
        return F.cross_entropy(logits.flatten(0, 1).float(), t.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / n

    sched = build_schedule(schedule, chunks, [s for s, _ in layout], stages, torch.device("cpu"), dist.group.WORLD,
                           m, loss_fn)
    first, last = layout[0][0] == 0, layout[-1][0] == stages - 1
    losses = [] if last else None
    sched.step(*((idx,) if first else ()), target=targets if last else None, losses=losses,
               **packed_microbatches(cus))
    ref_loss = loss_fn(ref(idx, cu_seqlens=torch.tensor(offsets, dtype=torch.int32)), targets)
    ref_loss.backward()
    if rank == 0:  # the check must tell packed from unpacked attention
        w = ref.blocks["0"].attn.qkv.weight
        plain = torch.autograd.grad(loss_fn(ref(idx), targets), w)[0]
        assert not torch.allclose(plain, w.grad, rtol=1e-3, atol=1e-6), "packing must change the gradients"
    ref_params = dict(ref.named_parameters())
    names = []
    for c in chunks:
        for name, p in c.gpt.named_parameters():
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=2e-4, atol=2e-6,
                                       msg=lambda msg, n=name: f"{n}: {msg}")
            names.append(name)
    if last:
        torch.testing.assert_close(torch.stack(losses).detach().sum(), ref_loss.detach(), rtol=2e-5, atol=1e-6)
    return names


@pytest.mark.parametrize("schedule,m,style", [("1f1b", 2, "llama"), ("1f1b", 3, "gpt"),
                                              ("interleaved-1f1b", 4, "llama")])
def test_pipeline_runs_packed_microbatches(schedule, m, style):
    names = pool(2).run(pipeline_packed, schedule, m, style)
    assert len(set(names[0]) | set(names[1])) == len(names[0]) + len(names[1])  # every parameter, once


def test_packed_microbatches_table():
    from megakern.parallel.pipeline import packed_microbatches

    kw = packed_microbatches([torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32)])
    assert kw["cu_seqlens"].tolist() == [[0, 3, 8], [0, 8, 8]] and kw["max_seqlen"] == 8
    with pytest.raises(ValueError, match="holds 7 tokens"):
        packed_microbatches([torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 7], dtype=torch.int32)])
    with pytest.raises(TypeError, match="int32"):
        packed_microbatches([torch.tensor([0, 8])])
