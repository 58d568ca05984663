"""A tiny GPT trained a few steps under each parallel layout equals the single-process model under the same seed:
losses, clip norms, gradients (gathered) and parameters, within fp32 tolerance."""
import copy

import pytest
import torch
from gpt_check import check_fsdp_bf16_params, check_local_shard_step, check_packed, check_train, tiny_config
from rankpool import pool

from megakern.models.gpt import GPT
from megakern.parallel import cut_stage


def run(world, layout, options, **kw):
    losses = pool(world).run(check_train, layout, options, **kw)
    assert all(l == losses[0] for l in losses), f"ranks returned different losses: {losses}"
    return losses[0]


@pytest.mark.parametrize("style,sp,overlap", [("llama", False, False), ("gpt", True, False), ("gpt", True, True),
                                             ("llama", True, True), ("neox", True, True)])
def test_tensor_parallel(style, sp, overlap):
    """overlap: parallel.overlap in the layers (gloo: the row layers' ring behind the chunks' matmuls, the column
    layers' unfused gather through their gather_gemm seam)."""
    run(2, dict(tp=2), dict(sequence_parallel=sp, tp_comm_overlap=overlap), style=style)


@pytest.mark.parametrize("style,shard,zero1,micro", [("gpt", "fsdp", False, 2), ("llama", "ddp", False, 2),
                                                     ("gpt", "ddp", True, 1)])
def test_data_parallel(style, shard, zero1, micro):
    run(2, dict(dp=2), dict(dp_shard=shard, zero1=zero1, microbatches=micro), style=style)


@pytest.mark.parametrize("schedule,n_layer,micro", [("gpipe", 2, 2), ("1f1b", 2, 4), ("interleaved-1f1b", 4, 2)])
def test_pipeline_parallel(schedule, n_layer, micro):
    run(2, dict(pp=2), dict(pp_schedule=schedule, microbatches=micro), n_layer=n_layer)


@pytest.mark.parametrize("style", ["llama", "gpt"])
def test_context_parallel(style):
    run(2, dict(cp=2), dict(dp_shard="ddp"), style=style)


@pytest.mark.parametrize("layout,options,style", [
    (dict(tp=2, pp=2), dict(pp_schedule="1f1b", microbatches=2), "gpt"),              # TP+SP x PP, tied head
    (dict(tp=2, cp=2), dict(dp_shard="fsdp"), "llama"),                               # TP+SP x CP (FSDP over cp)
    (dict(pp=2, dp=2), dict(pp_schedule="gpipe", dp_shard="fsdp", microbatches=2), "llama"),  # FSDP x PP
    (dict(pp=2, cp=2), dict(pp_schedule="1f1b", dp_shard="fsdp", microbatches=2), "llama"),   # CP x PP, rotary
    (dict(tp=2, pp=2), dict(pp_schedule="1f1b", dp_shard="ddp", microbatches=2), "neox"),     # parallel residual
])
def test_combined_layouts(layout, options, style):
    run(4, layout, options, style=style)


@pytest.mark.parametrize("layout,options,style", [(dict(tp=2), dict(sequence_parallel=True), "llama"),
                                                  (dict(pp=2), dict(pp_schedule="gpipe"), "gpt")])
def test_meta_device_model_is_initialized_per_shard(layout, options, style):
    run(2, layout, options, style=style, meta=True, steps=1)


def test_replicated_pipeline_with_zero1():
    # pp x dp with "ddp": stages replicated by hand (all-reduce after the schedule), ZeRO-1 optimizer
    run(4, dict(pp=2, dp=2), dict(pp_schedule="1f1b", dp_shard="ddp", zero1=True, microbatches=2), style="llama")


def test_pipeline_sequence_and_context_parallel():
    # tp2 (sequence parallel) x pp2 x cp2: a later stage's input is the hidden state's sequence shard (B, T/(cp tp), C)
    # while its position ids cover the cp rank's T/cp tokens (rotary, after attention's all-gather)
    losses = pool(8).run(check_train, dict(tp=2, pp=2, cp=2), dict(pp_schedule="1f1b", dp_shard="fsdp",
                                                                   microbatches=2), style="llama", steps=2)
    assert all(l == losses[0] for l in losses), losses


def test_stage_without_embedding_takes_position_ids_of_its_attention_sequence():
    cfg = tiny_config("llama")
    torch.manual_seed(0)
    full = GPT(cfg)
    stage, _ = cut_stage(copy.deepcopy(full), 1, 2, range(1, 2))
    x = torch.randn(2, 4, cfg.n_embd)
    stage(x, position_ids=torch.arange(4))                    # the shard's own length
    with pytest.raises(ValueError, match="position_ids must be"):
        stage(x, position_ids=torch.arange(6))                # not a multiple of the input's 4 tokens
    with pytest.raises(ValueError, match="position_ids must be"):
        stage(x, position_ids=torch.arange(2))                # shorter than the input
    with pytest.raises(ValueError, match="position_ids must be"):
        full(torch.randint(0, 100, (2, 4)), position_ids=torch.arange(8))  # with wte: exactly T
    # a multiple is accepted by the check and left to rotary, which sees the gathered sequence: here it is not
    with pytest.raises(ValueError, match="apply_rotary: position_ids"):
        stage(x, position_ids=torch.arange(8))


def test_three_dimensional_layout():
    # tp2 (sequence parallel) x pp2 (interleaved, tied head) x dp2 (FSDP2): 8 ranks
    ranks = pool(8)
    try:
        losses = ranks.run(check_train, dict(tp=2, pp=2, dp=2),
                           dict(pp_schedule="interleaved-1f1b", dp_shard="fsdp", microbatches=2), style="gpt",
                           n_layer=4, steps=2)
        assert all(l == losses[0] for l in losses), losses
    finally:
        ranks.close()  # the only 8-rank check: free its processes


@pytest.mark.parametrize("world,layout,options,style", [
    (2, dict(tp=2), dict(sequence_parallel=False), "llama"),                    # TP, rotary restarts per document
    (2, dict(tp=2), dict(sequence_parallel=True), "gpt"),                       # TP+SP, learned positions restart
    (2, dict(dp=2), dict(dp_shard="fsdp", microbatches=2), "llama"),            # FSDP, 2 micro-batches each
    (4, dict(tp=2, dp=2), dict(dp_shard="ddp", microbatches=2), "gpt"),         # TP+SP x DDP
])
def test_packed_documents(world, layout, options, style):
    results = pool(world).run(check_packed, layout, options, style=style)
    assert all(r[0] == results[0][0] for r in results), results
    for _, errors in results:
        assert "must be a 1-D torch.int32 tensor" in errors["dtype"]
        if options.get("microbatches", 1) > 1:
            assert "crosses a micro-batch boundary" in errors["crossing"], errors


@pytest.mark.parametrize("world,layout,options,kw", [
    # CP: every document padded to 2*cp chunks (THD layout), ring attention over them; rotary positions within the
    # documents; T = 18 (not a multiple of 2*cp: packing pads instead); DDP over cp, 2 micro-batches of their own L
    (2, dict(cp=2), dict(dp_shard="ddp", microbatches=2), dict(style="llama", seqlen=18)),
    # TP+SP x CP: the local tokens padded to a multiple of tp; learned positions; T = 15; FSDP over cp
    (4, dict(tp=2, cp=2), dict(sequence_parallel=True), dict(style="gpt", seqlen=15)),
    # PP: each micro-batch's packing as the schedule's kwargs; tied head across the stages
    (2, dict(pp=2), dict(pp_schedule="1f1b", microbatches=2), dict(style="gpt")),
    (2, dict(pp=2), dict(pp_schedule="interleaved-1f1b", microbatches=2), dict(style="llama", n_layer=4)),
    # PP x CP: THD micro-batches of one bucketed length, positions as kwargs
    (4, dict(pp=2, cp=2), dict(pp_schedule="1f1b", microbatches=2), dict(style="llama")),
], ids=["cp2", "tp2-sp-cp2", "pp2-1f1b", "pp2-interleaved", "pp2-cp2"])
def test_packed_documents_under_context_and_pipeline_parallel(world, layout, options, kw):
    results = pool(world).run(check_packed, layout, options, **kw)
    assert all(r[0] == results[0][0] for r in results), results
    for _, errors in results:
        assert "must be a 1-D torch.int32 tensor" in errors["dtype"]
        if options.get("microbatches", 1) > 1:
            assert "crosses a micro-batch boundary" in errors["crossing"], errors


@pytest.mark.parametrize("layout", [{"tp": 2}, {"pp": 2}], ids=["tp2", "pp2"])
def test_token_ids_and_targets_checked_once_per_batch(layout):
    from gpt_check import bad_values

    for errors in pool(2).run(bad_values, layout):
        assert errors["ok"] > 0
        assert "ParallelModel: token ids span" in errors["ids"] and "outside the vocabulary [0, 120)" in errors["ids"]
        # ignore_index (-100) is not counted: the span starts at the smallest real target
        assert "ParallelModel: targets span 0..120 (besides ignore_index -100)" in errors["targets"], errors


def test_fsdp_optimizer_steps_on_local_shards():
    times = pool(2).run(check_local_shard_step)
    print("optimizer step on DTensors / on local shards (s):", times)


@pytest.mark.parametrize("style", ["gpt", "llama"])
def test_fsdp_blocks_compute_in_bf16_under_autocast(style):
    assert all(pool(2).run(check_fsdp_bf16_params, style))


def test_all_ignored_targets_report_zero_loss():
    from gpt_check import check_all_ignored_targets

    (zero0, mean0), (zero1, mean1) = pool(2).run(check_all_ignored_targets)
    assert zero0 == zero1 == 0.0
    assert mean0 == mean1 and mean0 > 0  # rank 0's targets alone make the global mean


@pytest.mark.parametrize("micro", [1, 2])
def test_forward_backward_announces_the_loss_gradient(monkeypatch, micro):
    """One process on the test device, the fused loss on its Triton kernel: forward_backward hands the loss its
    incoming gradient (1 / the step's tokens) in advance, so the loss's backward factor is exactly 1 at every
    micro-batch (its kernel reads and writes nothing), and the gradients equal (within fp32 rounding) those of a step
    that announces nothing."""
    import dataclasses
    import datetime
    import importlib

    from conftest import DEVICE, require_triton

    from megakern.models import gpt as gpt_module
    from megakern.parallel import ParallelDims, ParallelMesh, parallelize

    require_triton()  # on DEVICE: the interpreter on CPU, the compiled kernel on a GPU
    ce = importlib.import_module("megakern.cross_entropy")  # the module (megakern.cross_entropy is the function)
    cfg = dataclasses.replace(tiny_config("llama", n_layer=1), kernels={"cross_entropy": "triton"})
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    targets[0, :5] = -100
    idx, targets = idx.to(DEVICE), targets.to(DEVICE)

    def step(announce: bool):
        with torch.device("meta"):
            model = GPT(cfg)
        mesh = ParallelMesh(ParallelDims(world_size=1).resolve(1), DEVICE.type, datetime.timedelta(seconds=60), local=True)
        pmodel = parallelize(model, mesh, None, generator=torch.Generator().manual_seed(7), microbatches=micro)
        factors = []
        real_scale, real_lce = ce.scale_gradients, gpt_module.linear_cross_entropy
        with monkeypatch.context() as m:
            m.setattr(ce, "scale_gradients",
                      lambda grads, factor, **kw: factors.append(factor.item()) or real_scale(grads, factor, **kw))
            if not announce:
                m.setattr(gpt_module, "linear_cross_entropy",
                          lambda *a, grad_scale=None, **kw: real_lce(*a, **kw))
            loss = pmodel.forward_backward(idx, targets, check_values=False)
        grads = {n: p.grad.clone() for n, p in pmodel.gpts[0].named_parameters() if p.grad is not None}
        return loss, factors, grads

    loss, factors, grads = step(True)
    loss_plain, factors_plain, grads_plain = step(False)
    assert len(factors) == micro and all(f == 1.0 for f in factors), factors
    assert all(f != 1.0 for f in factors_plain), factors_plain
    assert torch.equal(loss, loss_plain)
    assert grads.keys() == grads_plain.keys() and grads
    for name, gr in grads.items():
        torch.testing.assert_close(gr, grads_plain[name], rtol=1e-5, atol=1e-7, msg=name)
