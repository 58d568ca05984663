"""bench_hf_patch on CPU: the tiny Llama through the unpatched and patched providers, rows filed; the FLOPs per token
of the shapes against the matmul weights of the transformers models they build."""
import csv
import math

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install '.[dev]')")

from benchmarks import bench_hf_patch  # noqa: E402
from benchmarks.common import CSV_HEADER  # noqa: E402


def test_bench_hf_patch_cpu_smoke(tmp_path, capsys):
    results = bench_hf_patch.main(["--device", "cpu", "--providers", "hf,hf-megakern", "--warmup", "1", "--steps", "2",
                                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    figures = {(f[2], f[3]): f[4] for f in results.figures}
    tokens = bench_hf_patch.TINY.micro_batch * bench_hf_patch.TINY.seq
    for name in ("hf", "hf-megakern"):
        assert math.isclose(figures[name, "tok/s"], tokens / (figures[name, "ms"] / 1e3))
    with (tmp_path / "cpu" / "hf_patch.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER)
    assert {("hf-megakern", "tok/s"), ("hf", "tok/s")} <= {(r[8], r[9]) for r in rows[1:]}
    assert "| tiny 2x64 h4:2 F96 V257 T64 B2 fp32 | train step |" in out


@pytest.mark.parametrize("name", list(bench_hf_patch.SHAPES))
def test_flops_per_token_counts_the_models_matmul_weights(name):
    """6 x (every Linear's weight; the output projection once, tied or not) + 12 L C T."""
    import transformers

    shape = bench_hf_patch.SHAPES[name]
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(shape.config())
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert shape.flops_per_token() == 6 * n + 12 * shape.n_layer * shape.hidden * shape.seq


def test_unknown_shape_is_named():
    with pytest.raises(SystemExit, match="unknown \\['gpt-9'\\]"):
        bench_hf_patch.main(["--device", "cuda", "--shapes", "gpt-9"])


def test_liger_style_module_patches_are_put_back():
    """liger_kernel's patch replaces a modeling module's classes, functions and the causal LM class's forward for the
    whole process: the snapshot taken before it restores them, so the providers after it build unpatched models."""
    import transformers.models.llama.modeling_llama as m

    norm, forward, rotary = m.LlamaRMSNorm, m.LlamaForCausalLM.forward, m.apply_rotary_pos_emb
    restore = bench_hf_patch._snapshot(m)
    m.LlamaRMSNorm, m.apply_rotary_pos_emb, m.added = object, None, 3
    m.LlamaForCausalLM.forward = lambda self: None
    restore()
    assert m.LlamaRMSNorm is norm and m.apply_rotary_pos_emb is rotary and not hasattr(m, "added")
    assert m.LlamaForCausalLM.forward is forward
