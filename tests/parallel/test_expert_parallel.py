"""Expert parallelism on gloo ranks against one process (expert_check.py): EP2 (carved out of dp, and out of cp),
EP2 x DP2 (the expert weights reduced over their expert-data-parallel pair), EP2 x TP2 with sequence parallel, EP2 x
PP2 (1F1B), each with DDP; with FSDP2 (the experts an FSDP2 unit over their expert-data-parallel ranks): EP2 (one
rank per edp group), EP2 x DP2 (experts sharded over the edp pair), EP2 x PP2; bf16 weights with fp32 masters under
DDP and FSDP2 (there 3 experts per ep rank, sharded over the edp pair on dim 1); routing forced so that a rank's experts
receive no token; checkpoints saved under ep2 with DDP and with FSDP2, loaded under ep1 (one process), ep2 (with the
other data parallelism) and ep4; the bad layouts, each refused with its numbers before a step; the training program
under torchrun with parallel.ep=2 (DDP and FSDP2) against one process, and its bad ep layouts refused before anything
is written."""
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from expert_check import bad_layout, check_ep, dispatch_host_reads, load_ep, save_ep
from rankpool import pool

from megakern.config import ConfigError, load_config
from megakern.parallel import ParallelDims
from benchmarks.common import run_launch

REPO = Path(__file__).resolve().parents[2]

LAYOUTS = {  # (ranks, sizes, options)
    "ep2": (2, dict(dp=2, ep=2), dict(dp_shard="ddp")),
    "ep2-cp2": (2, dict(cp=2, ep=2), dict(dp_shard="ddp")),
    "ep2-dp2": (4, dict(dp=4, ep=2), dict(dp_shard="ddp")),
    "ep2-tp2-sp": (4, dict(dp=2, tp=2, ep=2), dict(dp_shard="ddp", sequence_parallel=True)),
    "ep2-pp2": (4, dict(dp=2, pp=2, ep=2), dict(dp_shard="ddp", pp_schedule="1f1b", microbatches=2)),
    # FSDP2: dense parameters sharded over dp x cp, each MoE layer's experts over their edp ranks
    "ep2-fsdp": (2, dict(dp=2, ep=2), dict(dp_shard="fsdp")),
    "ep2-dp2-fsdp": (4, dict(dp=4, ep=2), dict(dp_shard="fsdp")),
    "ep2-pp2-fsdp": (4, dict(dp=2, pp=2, ep=2), dict(dp_shard="fsdp", pp_schedule="1f1b", microbatches=2)),
}
# how each layout holds its expert weights: whole (DDP), or FSDP2's shards over the edp ranks (dim 0; one rank: all)
EXPERTS_HELD = {"ep2-dp2-fsdp": ["(Shard(dim=0),)"], "ep2-fsdp": ["(Shard(dim=0),)"],
                "ep2-pp2-fsdp": ["(Shard(dim=0),)"]}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_layout_matches_one_process(layout):
    ranks, sizes, options = LAYOUTS[layout]
    out = pool(ranks).run(check_ep, sizes, options)
    assert all(o["losses"] == out[0]["losses"] for o in out), [o["losses"] for o in out]
    held = sorted({h for o in out for h in o["placements"]})  # (a pipeline's first stage has no MoE layer)
    assert held == EXPERTS_HELD.get(layout, ["whole"]), held


@pytest.mark.parametrize("dp_shard", ["ddp", "fsdp"])
def test_ep_bf16_master_weights(dp_shard):
    """bf16 weights with fp32 masters (2 micro-batches accumulated in fp32), against one process's bf16 run: equal to
    bf16 rounding. DDP: fp32 masters by hand, ep2 over dp2. FSDP2: its fp32 shards are the masters, all-gathered in
    bf16; ep2 x dp2 (4 ranks) with 6 experts, so each ep rank's 3 are sharded over the edp pair on dim 1."""
    if dp_shard == "ddp":
        out = pool(2).run(check_ep, dict(dp=2, ep=2), dict(dp_shard="ddp", microbatches=2),
                          both=dict(master_weights=True), rtol=2e-2, atol=2e-3)
    else:
        out = pool(4).run(check_ep, dict(dp=4, ep=2), dict(dp_shard="fsdp"), config=dict(n_experts=6),
                          both=dict(master_weights=True), rtol=2e-2, atol=2e-3)
        assert all(o["placements"] == ["(Shard(dim=1),)"] for o in out), [o["placements"] for o in out]
    assert all(o["losses"] == out[0]["losses"] for o in out)


@pytest.mark.parametrize("bias,empty", [([1.0, 0.0, -1.0, 0.0], [2]), ([1.0, 1.0, -1.0, -1.0], [2, 3])])
def test_experts_without_tokens(bias, empty):
    """The sigmoid routers' biases force the routing: expert 2 (rank 1's first) receives no token, or neither of
    rank 1's experts does (it computes on no rows at all); the step still equals one process's."""
    out = pool(2).run(check_ep, dict(dp=2, ep=2), dict(dp_shard="ddp"), bias=bias)
    figures = out[0]["first_step_tokens"]
    assert figures[0] == 0.0, f"an expert must receive no token (tokens_min {figures[0]})"


@pytest.mark.parametrize("layout,factor", [("ep2", 1.0), ("ep2-dp2", 1.0), ("ep2-fsdp", 2.0), ("ep2-pp2", 1.25),
                                           ("ep2-tp2-sp", 2.0)])
def test_fixed_size_dispatch_matches_one_process(layout, factor):
    """With a capacity factor the dispatch sends fixed slots (padded_plan) and reads nothing on the host; it still
    equals one process, whose layer drops the same assignments (each rank's micro-batch is one of its micro-batches).
    Factors 1.0 and 1.25 drop some (cap = 32 and 40 of 64 tokens x top-2 over 4 experts); 2.0 none (cap = every
    token), though the slots hold empty rows. Under tp with sequence parallel the layer sees half the tokens, so only a factor that
    drops nothing equals one process."""
    ranks, sizes, options = LAYOUTS[layout]
    out = pool(ranks).run(check_ep, sizes, options, config=dict(moe_capacity_factor=factor))
    assert all(o["losses"] == out[0]["losses"] for o in out), [o["losses"] for o in out]
    dropped = out[0]["first_step_tokens"][3]  # (the single model's first step: its one MoE layer)
    assert (dropped > 0) == (factor < 2.0), f"dropped fraction {dropped} at capacity factor {factor}"


def test_fixed_size_dispatch_reads_nothing_on_the_host():
    reads = pool(2).run(dispatch_host_reads, 1.25)
    assert reads == [[], []], reads
    dropless = pool(2).run(dispatch_host_reads, None)  # the check can fail: the dropless dispatch reads its sizes
    assert all(any("Tensor.tolist" in r for r in rank) for rank in dropless), dropless


@pytest.mark.parametrize("saved", ["ddp", "fsdp"])
def test_checkpoint_reshards_across_ep(tmp_path, saved):
    """Saved under ep2 with DDP (dp2) or FSDP2 (dp4: the experts sharded over their edp pair too): the experts load as
    the single model's (E, ...) tensors under ep1 in one process, under ep2 (dp2) with the other data parallelism and
    under ep4 (dp4) with the same, and the next step (loss and AdamW update, the moments resharded too) agrees."""
    path = str(tmp_path / "ckpt")
    if saved == "ddp":
        pool(2).run(save_ep, dict(dp=2, ep=2), path)
        two_shard, four_shard = "fsdp", "ddp"
    else:
        pool(4).run(save_ep, dict(dp=4, ep=2), path, dp_shard="fsdp")
        two_shard, four_shard = "ddp", "fsdp"
    one = pool(2).run(load_ep, None, path)[0]
    four = pool(4).run(load_ep, dict(dp=4, ep=4), path, dp_shard=four_shard)
    two = pool(2).run(load_ep, dict(dp=2, ep=2), path, dp_shard=two_shard)
    assert set(one["loaded"]) == {"blocks.1.mlp.w_in", "blocks.1.mlp.w_out"}
    for other in (two[0], four[0], four[3]):
        for name, w in one["loaded"].items():
            assert torch.equal(other["loaded"][name], w), name
            torch.testing.assert_close(other["stepped"][name], one["stepped"][name], rtol=1e-4, atol=1e-6)
        assert other["loss"] == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.parametrize("sizes,world,message", [
    (dict(ep=3), 4, "ep=3 does not divide dp\\*cp = 4\\*1 = 4"),
    (dict(ep=4, tp=2), 4, "ep=4 does not divide dp\\*cp = 2\\*1 = 2"),
])
def test_ep_not_dividing_dp_cp(sizes, world, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**sizes).resolve(world)


@pytest.mark.parametrize("experts,message", [
    (3, "3 experts are not divisible by ep=2"),
    (0, "ep=2 splits the experts of MoE layers, and this model has none"),
])
def test_experts_that_do_not_fit_ep(experts, message):
    d = ParallelDims(dp=2, ep=2).resolve(2)
    with pytest.raises(ValueError, match=message):
        d.check_model(n_layer=2, n_head=4, n_kv_head=2, vocab=128, n_experts=experts)


def test_expert_data_mesh_needs_expert_parallelism():
    from moe_check import _local_mesh

    from megakern.parallel.expert import expert_data_mesh

    with pytest.raises(ValueError, match="expert_data_mesh: the mesh has no expert parallelism \\(ep=1, local\\)"):
        expert_data_mesh(_local_mesh())


def test_tensor_parallel_checks_the_dense_mlp_width_only_where_there_is_one():
    """MoE MLPs stay whole on each tp rank: an all-MoE model's (unused) dense ffn_hidden need not divide by tp; with
    a dense block it must."""
    messages = pool(2).run(bad_layout, dict(tp=2), dict(dp_shard="ddp"), dict(ffn_hidden=33, moe_first_dense=0))
    assert messages == ["", ""], messages
    messages = pool(2).run(bad_layout, dict(tp=2), dict(dp_shard="ddp"), dict(ffn_hidden=33, moe_first_dense=1))
    assert "the MLP's 33 hidden units are not divisible by tp=2" in messages[0], messages


def test_parallelize_refuses_what_ep_cannot_run():
    messages = pool(2).run(bad_layout, dict(dp=2, ep=2), dict(dp_shard="ddp", zero1=True), {})
    assert "ep=2 with zero1" in messages[0]
    messages = pool(2).run(bad_layout, dict(dp=2, ep=2), dict(dp_shard="ddp"), dict(n_experts=5, moe_top_k=2))
    assert "5 experts are not divisible by ep=2" in messages[0]


# ---- the training program ------------------------------------------------------------------------------------------
MOE = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0", "train.device=cpu",
       "model.preset=moe-tiny", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.n_kv_head=2",
       "model.max_seqlen=64", "model.n_experts=4", "model.moe_ffn_hidden=64", "train.micro_batch_size=4",
       "train.global_batch_size=8", "eval.every=0", "optim.lr=3e-3", "schedule.warmup_steps=2"]


@pytest.mark.parametrize("overrides,message", [
    (["model.n_experts=0", "parallel.ep=2"], "parallel.ep=2 splits the experts of MoE layers, but the model "
                                                 "has none (model.n_experts=0)"),
    (["parallel.ep=3"], "parallel.ep=3 does not divide model.n_experts=4"),
    (["model.moe_top_k=5"], "moe_top_k (5) must be <= n_experts (4)"),
    (["model.moe_capacity_factor=0"], "moe_capacity_factor must be None (dropless) or a number > 0"),
])
def test_config_errors_name_the_values(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(")", "\\)")):
        load_config(None, [*MOE, *overrides, f"log.run_dir={tmp_path / 'run'}"]).validate()
    assert not (tmp_path / "run").exists()


def test_check_parallel_options_refuses_by_name():
    from megakern.train.trainer import check_parallel_options

    config = load_config(None, [*MOE, "parallel.ep=2", "train.cuda_graph=true", "parallel.zero1=true"])
    with pytest.raises(ConfigError) as info:
        check_parallel_options(config, "fp32", 2)
    text = str(info.value)
    assert "parallel.ep=2 with parallel.zero1" in text
    assert "parallel.ep=2 needs" not in text  # FSDP2 (the default dp_shard) runs with ep
    assert ("parallel.ep=2 with train.cuda_graph needs model.moe_capacity_factor: the dropless all-to-all dispatch "
            "reads its split sizes on the host") in text
    # with a capacity factor the dispatch has fixed sizes: a graph may capture it
    config = load_config(None, [*MOE, "parallel.ep=2", "train.cuda_graph=true", "parallel.dp_shard=ddp",
                                "train.cuda_graph_warmup=11", "model.moe_capacity_factor=1.25"])
    check_parallel_options(config, "fp32", 2)


def _losses(run_dir: Path) -> dict[int, float]:
    from megakern.train.log import read_records

    return {r["step"]: r["train/loss"] for r in read_records(run_dir) if "train/loss" in r}


def test_training_program_ep2_under_torchrun(tmp_path):
    """python -m megakern.train under torchrun, 2 gloo ranks, parallel.ep=2 (dp2) with DDP and with FSDP2 (the
    default parallel.dp_shard): the losses of one process on the same global batch, and each run's checkpoint
    (experts saved as dim-0 shards; under FSDP2 the dense parameters as FSDP2 shards) resumes in one process."""
    from megakern.train import Trainer

    common = [*MOE, f"data.cache_dir={tmp_path / 'data'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for dp_shard in ("ddp", "fsdp"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
               "-m", "megakern.train", *common, "train.steps=3", "parallel.dp=2", "parallel.ep=2",
               *(["parallel.dp_shard=ddp"] if dp_shard == "ddp" else []), f"log.run_dir={tmp_path / dp_shard}"]
        proc = run_launch(cmd, cwd=REPO, timeout=600, env=env)
        assert proc.returncode == 0, dp_shard + proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "2 ranks (tp 1, pp 1, cp 1, dp 2, ep 2)" in proc.stdout
    single = Trainer(load_config(None, [*common, "train.steps=4", f"log.run_dir={tmp_path / 'single'}"]),
                     stream=open(tmp_path / "single.console", "a")).run()
    for dp_shard in ("ddp", "fsdp"):
        ranks = _losses(tmp_path / dp_shard)
        assert sorted(ranks) == [1, 2, 3], dp_shard
        for step, loss in ranks.items():
            assert loss == pytest.approx(single.losses[step], abs=1e-5), (dp_shard, step)
        ckpt = tmp_path / dp_shard / "checkpoints" / "step_00000003"
        assert json.loads((ckpt / "manifest.json").read_text())["world_size"] == 2
        resumed = Trainer(load_config(None, [*common, "train.steps=4", f"checkpoint.resume={ckpt}",
                                             "schedule.on_resume=config", f"log.run_dir={tmp_path / dp_shard}-resumed"]),
                          stream=open(tmp_path / f"{dp_shard}-resumed.console", "a")).run()
        assert resumed.losses[4] == pytest.approx(single.losses[4], abs=1e-5), dp_shard


@pytest.mark.parametrize("overrides,message", [
    (["parallel.dp=2", "parallel.ep=2", "parallel.dp_shard=ddp", "parallel.zero1=true"],
     "parallel.ep=2 with parallel.zero1"),
    (["parallel.tp=2", "parallel.ep=2", "parallel.dp_shard=ddp"], "ep=2 does not divide dp*cp = 1*1 = 1"),
])
def test_training_program_refuses_bad_ep_layouts_before_writing(tmp_path, overrides, message):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           "-m", "megakern.train", *MOE, "train.steps=1", *overrides, f"data.cache_dir={tmp_path / 'data'}",
           f"log.run_dir={tmp_path / 'run'}"]
    proc = run_launch(cmd, cwd=REPO, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()
