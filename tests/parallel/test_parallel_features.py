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
CELLS = ([("bf16", name) for name in LAYOUTS]
         + [("fp8", name) for name in LAYOUTS]
         + [(f"recompute-{kind}", name) for kind in ("full", "selective") for name in LAYOUTS]
         # (ZeRO-1 differs from DDP only in its optimizer step, which is not compiled)
         + [("compile", name) for name in ("tp2-sp", "dp2-ddp", "dp2-fsdp", "pp2-1f1b", "cp2")])


@pytest.mark.parametrize("feature,layout", CELLS, ids=[f"{f}-{l}" for f, l in CELLS])
def test_feature_under_layout(feature, layout):
    sizes, options = LAYOUTS[layout]
    # compile traces each block of each run once: one block per rank keeps the cells short
    n_layer = 4 if layout == "pp2-interleaved" else (1 if feature == "compile" and not layout.startswith("pp") else 2)
    style = "llama" if feature in ("fp8", "recompute-selective") else "gpt"
    losses = pool(2).run(check_feature, sizes, options, feature, style=style, n_layer=n_layer)
    assert all(l == losses[0] for l in losses), f"ranks returned different losses: {losses}"


@pytest.mark.parametrize("feature", ["bf16", "fp8"])
def test_feature_under_three_dimensional_layout(feature):
    """tp2 x dp2 (FSDP) on 4 ranks."""
    losses = pool(4).run(check_feature, dict(tp=2, dp=2), dict(dp_shard="fsdp"), feature, style="llama")
    assert all(l == losses[0] for l in losses)


def test_tensor_parallel_loss_is_the_vocab_parallel_fused_cross_entropy():
    """Under tensor parallelism the GPT's loss is parallel.cross_entropy's vocab-parallel linear cross-entropy (the
    equality with one process is test_parallel_model.py's test_tensor_parallel)."""
    assert pool(2).run(_loss_kind) == ["vocab_parallel_linear_cross_entropy"] * 2


def _loss_kind():
    import torch
    from feature_check import _config

    from megakern.models.gpt import GPT
    from megakern.parallel import ParallelDims, parallelize

    with torch.device("meta"):
        model = GPT(_config("gpt", 2, ""))
    pmodel = parallelize(model, ParallelDims(tp=2).build("cpu", timeout=60), None,
                         generator=torch.Generator().manual_seed(0))
    return pmodel.gpts[0].vocab_parallel_loss.func.__name__
