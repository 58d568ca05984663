"""MoE layers under the layouts that keep experts whole, on 2 gloo ranks, against one process (moe_check.py):
data parallel (DDP, FSDP2), tensor parallel with and without sequence parallel (dense layers sharded, experts whole
on every rank), context parallel and a 1F1B pipeline."""
import pytest
from moe_check import check_moe
from rankpool import pool

LAYOUTS = {
    "dp2-ddp": (dict(dp=2), dict(dp_shard="ddp")),
    "dp2-fsdp": (dict(dp=2), dict(dp_shard="fsdp", microbatches=2)),
    "tp2": (dict(tp=2), dict(sequence_parallel=False)),
    "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "cp2": (dict(cp=2), dict(dp_shard="ddp")),
    "pp2-1f1b": (dict(pp=2), dict(pp_schedule="1f1b", microbatches=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_layout_matches_one_process(layout):
    sizes, options = LAYOUTS[layout]
    losses = pool(2).run(check_moe, sizes, options)
    assert all(l == losses[0] for l in losses), f"ranks returned different losses: {losses}"
