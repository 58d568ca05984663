"""A tiny GPT trained a few steps under each parallel layout equals the single-process model under the same seed:
losses, clip norms, gradients (gathered) and parameters, within fp32 tolerance."""
import pytest
from gpt_check import check_train
from rankpool import pool


def run(world, layout, options, **kw):
    losses = pool(world).run(check_train, layout, options, **kw)
    assert all(l == losses[0] for l in losses), f"ranks returned different losses: {losses}"
    return losses[0]


@pytest.mark.parametrize("style,sp", [("llama", False), ("gpt", True)])
def test_tensor_parallel(style, sp):
    run(2, dict(tp=2), dict(sequence_parallel=sp), style=style)


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
