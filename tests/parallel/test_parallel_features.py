"""The feature x layout table (README, "Features by layout"): each training feature under each layout against the
same feature in one process (megakern.parallel's local mesh of ones, the training program's single-process path);
see feature_check.py for what "equal" means per feature."""
import pytest
from feature_check import check_feature
from rankpool import pool

LAYOUTS = {
    "tp2-sp": (dict(tp=2), dict(sequence_parallel=True)),
    "dp2-ddp": (dict(dp=2), dict(dp_shard="ddp", microbatches=2)),
    "dp2-fsdp": (dict(dp=2), dict(dp_shard="fsdp")),
    "dp2-zero1": (dict(dp=2), dict(dp_shard="ddp", zero1=True)),
    "pp2-1f1b": (dict(pp=2), dict(pp_schedule="1f1b", microbatches=2)),
    "pp2-interleaved": (dict(pp=2), dict(pp_schedule="interleaved-1f1b", microbatches=2)),
    "cp2": (dict(cp=2), dict(dp_shard="ddp")),
}
# FP8 under pipeline parallelism is refused by the training program (megakern.train.trainer.check_parallel_options)
CELLS = ([("bf16", name) for name in LAYOUTS]
         + [("fp8", name) for name in LAYOUTS if not name.startswith("pp")]
         + [(f"recompute-{kind}", name) for kind in ("full", "selective") for name in LAYOUTS]
         + [("compile", "tp2-sp"), ("compile", "dp2-fsdp")])


@pytest.mark.parametrize("feature,layout", CELLS, ids=[f"{f}-{l}" for f, l in CELLS])
def test_feature_under_layout(feature, layout):
    sizes, options = LAYOUTS[layout]
    n_layer = 4 if layout == "pp2-interleaved" else 2
    style = "llama" if feature in ("fp8", "recompute-selective") else "gpt"
    losses = pool(2).run(check_feature, sizes, options, feature, style=style, n_layer=n_layer)
    assert all(l == losses[0] for l in losses), f"ranks returned different losses: {losses}"


def test_feature_under_three_dimensional_layout():
    """tp2 x dp2 (FSDP) on 4 ranks, bf16 weights with fp32 masters."""
    losses = pool(4).run(check_feature, dict(tp=2, dp=2), dict(dp_shard="fsdp"), "bf16", style="llama")
    assert all(l == losses[0] for l in losses)
