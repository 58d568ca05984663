"""bench_train on CPU: the tiny shape through the megakern provider (and HF where transformers is installed)."""
import csv
import importlib.util
import math

import pytest

from benchmarks import bench_train
from benchmarks.common import CSV_HEADER


def test_bench_train_cpu_smoke(tmp_path, capsys):
    results = bench_train.main(["--device", "cpu", "--providers", "megakern,hf-eager", "--warmup", "1", "--steps", "2",
                                "--out", str(tmp_path)])
    out = capsys.readouterr().out
    has_hf = importlib.util.find_spec("transformers") is not None
    if not has_hf:
        assert "skip hf-eager: transformers is not installed" in out
    providers = {f[2] for f in results.figures}
    assert providers == {"roofline", "megakern"} | ({"hf-eager"} if has_hf else set())
    figures = {(f[2], f[3]): f[4] for f in results.figures}
    tokens = bench_train.TINY.micro_batch * bench_train.TINY.seq
    assert math.isclose(figures["megakern", "tok/s"], tokens / (figures["megakern", "ms"] / 1e3))
    assert math.isclose(figures["megakern", "TFLOP/s"],
                        figures["megakern", "tok/s"] * bench_train.flops_per_token(bench_train.TINY) / 1e12)
    assert ("megakern", "MFU") not in figures  # no peak FLOP/s for a CPU
    with (tmp_path / "cpu" / "train.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER)
    metrics = {(r[8], r[9]) for r in rows[1:]}
    assert {("megakern", "tok/s"), ("megakern", "TFLOP/s"), ("megakern", "roofline_frac"), ("megakern", "ms")} <= metrics
    assert "| gpt 2x64 h2 T64 V257 B2 fp32 | train step |" in out


def test_bench_train_gpu_busy_without_cuda(capsys):
    """--gpu-busy on a CPU says it has no figure and files none (gpu_busy_ms needs CUDA's kernel records)."""
    results = bench_train.main(["--device", "cpu", "--providers", "megakern", "--warmup", "0", "--steps", "1",
                                "--gpu-busy", "--no-save"])
    assert "GPU busy: n/a (no CUDA device)" in capsys.readouterr().out
    assert not [f for f in results.figures if f[3] == "GPU busy ms"]


@pytest.mark.gpu
def test_bench_train_gpu_busy_on_a_gpu(capsys):
    """--gpu-busy on a GPU: a busy time a step above 0 and below the 5 profiled steps' wall time, filed and printed
    beside the step's median."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    results = bench_train.main(["--device", "cuda", "--tiny", "--providers", "megakern", "--warmup", "1", "--steps",
                                "3", "--gpu-busy", "--no-save"])
    figures = {f[3]: f[4] for f in results.figures if f[2] == "megakern"}
    assert 0 < figures["GPU busy ms"] < 5 * figures["ms"] + 50
    assert "GPU busy" in capsys.readouterr().out


def test_flops_per_token_of_the_350m_shape():
    """6 N + 12 L C T, N: every block's weights, biases and norms (12 C^2 + 13 C), the final norm and the tied
    50304 x C output projection; 2.42 GFLOP per token (the 36.5% MFU of HF + torch.compile at 148k tok/s)."""
    C, L, V, T = 1024, 24, 50304, 1024
    n = L * (12 * C * C + 13 * C) + 2 * C + V * C
    assert bench_train.flops_per_token(bench_train.GPT_350M) == 6 * n + 12 * L * C * T
    assert abs(148e3 * (6 * n + 12 * L * C * T) / 989.4e12 - 0.365) < 0.005


def test_quick_skip_compile_selects_providers_and_prints_times(tmp_path, capsys):
    """--quick runs megakern, hf-eager and hf-compile (--skip-compile leaves out the compiled ones), prints an
    estimate first and the run's wall time and each provider's setup time."""
    results = bench_train.main(["--device", "cpu", "--quick", "--skip-compile", "--warmup", "0", "--steps", "2",
                                "--no-save"])
    out = capsys.readouterr().out
    assert "estimated run time: about" in out and "for megakern, hf-eager (cold compile caches)" in out
    assert "run time:" in out and "(setup " in out
    assert {f[2] for f in results.figures} <= {"roofline", "megakern", "hf-eager"}
    assert "megakern" in {f[2] for f in results.figures}
    with pytest.raises(SystemExit, match="--skip-compile leaves no provider"):
        bench_train.main(["--device", "cpu", "--providers", "hf-compile", "--skip-compile", "--no-save"])


def test_run_time_estimates():
    full = bench_train.estimate_seconds(list(bench_train.PROVIDERS), 8, 20, tiny=False)
    quick = bench_train.estimate_seconds(bench_train.QUICK_PROVIDERS, 3, 8, tiny=False)
    assert quick < 150 < full  # --quick is meant to fit about 2 minutes on an H200
    assert bench_train.estimate_seconds(["megakern", "hf-eager"], 3, 8, tiny=False) < 75


def test_moe_preset_and_dense_equivalent_cpu_smoke(capsys):
    """--model moe-mixtral --dense-equivalent: the tiny MoE preset and its dense twin through the same megakern step;
    F is each model's own flops_per_token (active parameters), which the twin matches up to the routers."""
    results = bench_train.main(["--device", "cpu", "--model", "moe-mixtral", "--dense-equivalent", "--providers",
                                "megakern", "--warmup", "0", "--steps", "1", "--no-save"])
    out = capsys.readouterr().out
    moe = bench_train.preset_shape("moe-mixtral", tiny=True)
    dense = bench_train.dense_equivalent(moe)
    assert dict(dense.overrides)["n_experts"] == 0 and dict(dense.overrides)["ffn_hidden"] == 2 * 64
    cases = {f[0] for f in results.figures if f[2] == "megakern"}
    assert cases == {f"{moe.name} fp32", f"{dense.name} fp32"}
    assert "moe-mixtral E8 k2 F64 2x64" in out and "M active" in out
    router = 2 * 8 * 64  # n_layer x E x C
    assert bench_train.flops_per_token(moe) - bench_train.flops_per_token(dense) == 6 * router
    figures = {(f[0], f[3]): f[4] for f in results.figures if f[2] == "megakern"}
    tokens = moe.micro_batch * moe.seq
    assert math.isclose(figures[f"{moe.name} fp32", "TFLOP/s"],
                        tokens / (figures[f"{moe.name} fp32", "ms"] / 1e3) * bench_train.flops_per_token(moe) / 1e12)


def test_moe_mixtral_shape_on_a_gpu():
    """The preset's full shape: 16k tokens a micro-batch, hf providers refused by name."""
    shape = bench_train.preset_shape("moe-mixtral")
    assert (shape.n_layer, shape.n_embd, shape.seq, shape.micro_batch) == (16, 1024, 2048, 8)
    assert dict(bench_train.dense_equivalent(shape).overrides)["ffn_hidden"] == 7168
    with pytest.raises(SystemExit, match="no dense equivalent"):
        bench_train.main(["--device", "cpu", "--model", "gpt-tiny", "--dense-equivalent", "--no-save"])
    with pytest.raises(SystemExit, match="unknown preset"):
        bench_train.main(["--device", "cpu", "--model", "nope", "--no-save"])


@pytest.mark.parametrize("preset", ["llama-1b", "llama-8b", "moe-mixtral"])
def test_hf_provider_builds_the_same_model(preset):
    """The HF providers of a preset build the Hugging Face model megakern exports it as: the same parameter count
    (a meta-device build), so tok/s and MFU compare like with like."""
    transformers = pytest.importorskip("transformers")
    import torch

    shape = bench_train.preset_shape(preset)
    if preset == "llama-8b":
        shape = bench_train.Shape(**{**shape.__dict__, "n_layer": 2})
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(bench_train.hf_config(shape))
    ours = bench_train.meta_model(shape)
    assert sum(p.numel() for p in theirs.parameters()) == ours.num_params()


def test_hf_provider_unavailable_is_named(capsys):
    pytest.importorskip("transformers")
    bench_train.main(["--device", "cpu", "--model", "moe-deepseek", "--providers", "hf-eager", "--no-save"])
    assert "skip hf-eager on moe-deepseek" in capsys.readouterr().out


def test_llama_preset_against_hf_on_cpu(capsys):
    pytest.importorskip("transformers")
    results = bench_train.main(["--device", "cpu", "--model", "llama-tiny", "--providers", "megakern,hf-eager",
                                "--n-layer", "1", "--no-save"])
    assert {f[2] for f in results.figures} == {"roofline", "megakern", "hf-eager"}
    assert "llama-tiny 1x64" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["gpt-char", "gpt-350m"])
def test_plain_provider_builds_the_same_model(name):
    """The plain-PyTorch GPT of a GPT-2 family shape holds megakern's parameters (a meta-device build; biases or
    none, the padded vocabulary, tied embeddings), so the small-model comparison is like with like."""
    import torch

    from benchmarks.plain_gpt import PlainGPT

    shape = bench_train.BENCH_SHAPES.get(name, bench_train.GPT_350M)
    c = bench_train._gpt_config(shape, bench_train._config_cls())
    with torch.device("meta"):
        theirs = PlainGPT(c.n_layer, c.n_embd, c.n_head, c.padded_vocab, shape.seq, c.bias)
    assert sum(p.numel() for p in theirs.parameters()) == bench_train.meta_model(shape).num_params()
    assert (name == "gpt-char") == (not c.bias)


def test_plain_model_loss_and_gradients():
    """PlainGPT's loss is the mean next-token cross-entropy of its logits (computed here by hand), and too long a
    sequence is refused by name."""
    import torch
    import torch.nn.functional as F

    from benchmarks.plain_gpt import PlainGPT

    torch.manual_seed(0)
    model = PlainGPT(2, 32, 4, 61, 16, bias=False).double()
    idx = torch.randint(0, 61, (3, 16))
    x = model.wte(idx) + model.wpe(torch.arange(16))
    for block in model.blocks:
        x = block(x)
    want = F.cross_entropy((model.ln_f(x) @ model.wte.weight.T).reshape(-1, 61), idx.reshape(-1))
    loss = model(idx, idx)
    torch.testing.assert_close(loss, want)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_seqlen 16"):
        model(torch.zeros(1, 17, dtype=torch.long), torch.zeros(1, 17, dtype=torch.long))


def test_small_model_providers_on_cpu(capsys):
    """--model gpt-char runs megakern (eager), megakern-default (the training program's defaults) and the plain
    providers; the plain providers refuse a family they do not build, naming what differs."""
    results = bench_train.main(["--device", "cpu", "--model", "gpt-char", "--providers",
                                "megakern,megakern-default,plain-eager", "--warmup", "0", "--steps", "1", "--no-save"])
    assert {f[2] for f in results.figures} == {"roofline", "megakern", "megakern-default", "plain-eager"}
    bench_train.main(["--device", "cpu", "--model", "llama-tiny", "--providers", "plain-eager", "--no-save",
                      "--steps", "1", "--warmup", "0"])
    assert "the plain GPT is GPT-2's family; llama-tiny has norm='rmsnorm'" in capsys.readouterr().out


def test_single_pass_provider_trains_with_the_single_pass_attention(attention_determinism):
    """megakern-single-pass is the training program's defaults with model.deterministic_attention=false: its model's
    attention calls ask for the single-pass backward."""
    results = bench_train.main(["--device", "cpu", "--providers", "megakern-single-pass", "--warmup", "0", "--steps",
                                "1", "--no-save"])
    assert {f[2] for f in results.figures} == {"roofline", "megakern-single-pass"}
    assert attention_determinism and set(attention_determinism) == {False}
