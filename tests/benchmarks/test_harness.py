"""The benchmark harness on CPU: timing, rooflines, provider lookup, CSV rows and the markdown table."""

import csv
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import (bench_activation, bench_attention, bench_embedding, bench_fp8, bench_gemm, bench_norm,
                        bench_optim, bench_qkv_order, common)
from benchmarks.common import (CSV_HEADER, Results, Unavailable, bench, file_rows, gpu_slug, git_sha, load_providers,
                               measure_copy_gbps, measure_matmul_tflops, record, run_launch)

REPO = Path(__file__).resolve().parents[2]


def _read_csv(path: Path) -> list[list[str]]:
    with path.open(newline="") as f:
        return list(csv.reader(f))


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "h200"),
    ("NVIDIA H100 80GB HBM3", "h100"),
    ("NVIDIA A100-SXM4-80GB", "a100"),
    ("Tesla V100-SXM2-16GB", "v100"),
    ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("AMD Instinct MI300X", "mi300x"),
])
def test_gpu_slug(monkeypatch, name, slug):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert gpu_slug("cuda") == slug


def test_gpu_slug_cpu():
    assert gpu_slug("cpu") == "cpu"


def test_git_sha(monkeypatch):
    monkeypatch.setenv("MEGAKERN_GIT_SHA", "1a2b3c4")
    assert git_sha() == "1a2b3c4"
    monkeypatch.delenv("MEGAKERN_GIT_SHA")
    assert git_sha()  # short sha, sha-dirty, or 'unknown' outside a repository with commits


def test_bench_and_rooflines():
    t = bench(lambda: torch.randn(64, 64).sum(), device="cpu")
    assert 0 < t["p20"] <= t["median"] <= t["p80"]
    assert measure_copy_gbps("cpu") > 0
    assert measure_matmul_tflops("cpu") > 0


def test_load_providers(capsys):
    def unavailable(device):
        raise Unavailable("not built here")

    def broken(device):
        raise ImportError("No module named 'peer'")

    loaded = load_providers({"ok": lambda device: "fn", "unbuilt": unavailable, "peer": broken}, "cpu")
    assert loaded == {"ok": "fn"}
    out = capsys.readouterr().out.splitlines()
    assert out == ["skip unbuilt: not built here", "skip peer: ImportError: No module named 'peer'"]
    assert load_providers({"ok": lambda device: "fn", "peer": broken}, "cpu", {"ok"}) == {"ok": "fn"}
    with pytest.raises(SystemExit, match="unknown providers"):
        load_providers({"ok": lambda device: "fn"}, "cpu", {"typo"})


def test_results_fractions_and_markdown():
    results = Results("cpu")
    results.smoke = False  # the table of a CUDA run
    results.add_roofline("GB/s", 4000.0)
    results.add("rmsnorm 16384x8192 bf16", "fwd", "torch", "ms", 0.25)
    results.add("rmsnorm 16384x8192 bf16", "fwd", "torch", "GB/s", 3000.0)
    results.add("rmsnorm 16384x8192 bf16", "fwd", "megakern-triton", "GB/s", 3987.0)
    rows = results.rows()
    assert ("roofline", "-", "roofline", "copy GB/s", 4000.0) in rows
    assert ("rmsnorm 16384x8192 bf16", "fwd", "torch", "roofline_frac", 0.75) in rows
    assert not any(r[2] == "torch" and r[3] == "roofline_frac" and r[4] == 0.25 / 4000 for r in rows)  # no ms frac
    table = results.markdown("GB/s")
    assert "| case | mode | torch | megakern-triton |" in table
    assert "| rmsnorm 16384x8192 bf16 | fwd | 3000 GB/s (0.75) | 3987 GB/s (1.00) |" in table


def test_gpu_run_prints_rates_and_files_rows_by_default(tmp_path, monkeypatch, capsys):
    """A CUDA run's line gives the figure and its fraction of the roofline; its rows go to benchmarks/results/."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    results = Results("cpu")
    results.smoke = False  # as on a CUDA device
    results.add_roofline("GB/s", 4000.0)
    record(results, "rmsnorm 16384x8192 bf16", "fwd", "torch", {"median": 0.5, "p20": 0.4, "p80": 0.6}, "GB/s", 3000)
    assert capsys.readouterr().out.rstrip().endswith("[p20 0.4000, p80 0.6000]   3000.00 GB/s (0.75)")
    assert file_rows(results, "norm", None) == tmp_path / "results" / "cpu" / "norm.csv"
    assert file_rows(results, "norm", tmp_path / "elsewhere", no_save=True) is None
    assert "Same-run roofline, copy GB/s: 4000" in results.markdown("GB/s")


def test_cpu_run_prints_times_and_files_no_rows_by_default(tmp_path, monkeypatch, capsys):
    """A CPU run says what it measured (ms per call of tiny shapes) and prints no GB/s nor fraction of a roofline:
    a few KiB against a copy of 16 MiB on a shared CPU gave rows like 0.0167 GB/s (0.00) next to 6.66 GB/s (0.14).
    Without --out it writes nothing under benchmarks/results/."""
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    results = bench_norm.main(["--device", "cpu", "--providers", "torch"])
    out = capsys.readouterr().out
    assert not (tmp_path / "results").exists()
    assert "no rows filed: a cpu run is a smoke test" in out and "(--out DIR files them under DIR)" in out
    assert re.search(r"\d GB/s|roofline, copy|\(0\.\d\d\)", out) is None, out
    assert ("cpu: a smoke run on tiny shapes, each provider checked against the fp32 reference and timed; ms per call "
            "on this cpu, mostly host overhead. GB/s and fractions of the roofline are figures of a CUDA device") in out
    timing_lines = [line for line in out.splitlines() if line.startswith(("rmsnorm ", "layernorm "))]
    assert len(timing_lines) == 2 * 2 * len(bench_norm.MODES)  # two ops, two shapes
    timing = re.compile(r".* torch +\d+\.\d{4} ms \[p20 \d+\.\d{4}, p80 \d+\.\d{4}\]")
    assert all(timing.fullmatch(line) for line in timing_lines), timing_lines
    table = out.split("\n| case | mode | torch |\n|---|---|---|\n")[1].splitlines()
    assert len(table) == len(timing_lines)
    assert all(re.fullmatch(r"\| \S+ \S+ fp32 \| \S+ \| \S+ ms \|", row) for row in table), table
    ms = {(f[0], f[1]): f[4] for f in results.figures if f[3] == "ms"}
    assert all(value > 0 for value in ms.values()) and len(ms) == len(timing_lines)


def _wrong(device):
    return lambda op: lambda x, w, b: 2 * x * w + (0 if b is None else b)


def _raises(device):
    def make(op):
        raise RuntimeError("kernel launch failed")

    return make


def test_bench_norm_hidden_and_ops(capsys):
    """--hidden replaces the GPU sweep (2**27 elements a tensor); --ops picks the ops, an unknown one is named."""
    assert bench_norm.shapes(torch.device("cuda"), False, (16384, 32768)) == [(8192, 16384), (4096, 32768)]
    sweep = bench_norm.shapes(torch.device("cuda"), False)
    assert len(sweep) == 9  # 16384 x 8192 is also the sweep's 8192
    assert {3072, 5120, 12288} <= {c for _, c in sweep}  # widths that are not powers of two
    results = bench_norm.main(["--device", "cpu", "--providers", "torch", "--ops", "rmsnorm", "--no-save"])
    assert {f[0].split()[0] for f in results.figures if f[0] != "roofline"} == {"rmsnorm"}
    with pytest.raises(SystemExit, match=r"unknown op\(s\) \['groupnorm'\]"):
        bench_norm.main(["--device", "cpu", "--ops", "rmsnorm,groupnorm"])


def test_bench_norm_cpu_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(bench_norm.PROVIDERS, "wrong", _wrong)
    monkeypatch.setitem(bench_norm.PROVIDERS, "raises", _raises)
    argv = ["--device", "cpu", "--providers", "torch,wrong,raises", "--out", str(tmp_path)]
    bench_norm.main(argv)
    bench_norm.main(argv)  # appends: the header must appear once
    out = capsys.readouterr().out
    assert "skip wrong on rmsnorm 64x256 fp32: AssertionError: y is off the fp32 reference" in out
    assert "skip raises on layernorm 16x1024 fp32: RuntimeError: kernel launch failed" in out
    assert "| case | mode | torch |" in out.split("saved ")[-1]  # the table comes after the save line

    path = tmp_path / "cpu" / "norm.csv"
    assert b"\r" not in path.read_bytes()
    rows = _read_csv(path)
    assert rows[0] == list(CSV_HEADER)
    assert all(len(row) == 11 for row in rows)
    assert sum(row == list(CSV_HEADER) for row in rows) == 1
    records = [dict(zip(CSV_HEADER, row)) for row in rows[1:]]
    assert all(r["date"] and r["git_sha"] and r["gpu"] == "cpu" and r["bench"] == "norm" for r in records)
    assert {r["provider"] for r in records} == {"torch", "roofline"}
    figures = {(r["case"], r["mode"], r["provider"], r["metric"]) for r in records}
    for op in bench_norm.OPS:
        for mode in bench_norm.MODES:
            for metric in ("ms", "GB/s", "roofline_frac"):
                assert (f"{op} 64x256 fp32", mode, "torch", metric) in figures
    assert ("roofline", "-", "roofline", "copy GB/s") in figures


def test_bench_norm_as_script():
    proc = subprocess.run([sys.executable, "benchmarks/bench_norm.py", "--device", "cpu", "--providers", "torch",
                           "--no-save"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| layernorm 16x1024 fp32 | fwd+bwd |" in proc.stdout


def test_bench_norm_megakern_providers(monkeypatch, capsys):
    """The megakern providers against a stand-in with megakern's public signatures."""
    def rms_norm(x, weight, eps=1e-6, *, residual=None, backend=None):
        assert residual is None and backend == "torch"
        return F.rms_norm(x, x.shape[-1:], weight, eps)

    def layer_norm(x, weight, bias, eps=1e-5, *, residual=None, backend=None):
        assert residual is None and backend == "torch"
        return F.layer_norm(x, x.shape[-1:], weight, bias, eps)

    backends = {"torch": "", "triton": "Triton needs CUDA", "cuda": "megakern._C is not built"}
    stand_in = types.SimpleNamespace(rms_norm=rms_norm, layer_norm=layer_norm, available_backends=lambda d: backends)
    monkeypatch.setitem(sys.modules, "megakern", stand_in)
    results = bench_norm.main(["--device", "cpu", "--providers", "megakern-torch,megakern-triton,megakern-cuda",
                               "--no-save"])
    out = capsys.readouterr().out
    assert "skip megakern-triton: Triton needs CUDA" in out and "skip megakern-cuda: megakern._C is not built" in out
    assert {figure[2] for figure in results.figures} == {"roofline", "megakern-torch"}


def test_bench_norm_megakern_torch_backend():
    megakern = pytest.importorskip("megakern", reason="megakern is not importable yet")
    if not hasattr(megakern, "available_backends"):
        pytest.skip("megakern.available_backends is not written yet")
    results = bench_norm.main(["--device", "cpu", "--providers", "megakern-torch", "--no-save"])
    providers = {figure[2] for figure in results.figures}
    assert providers == {"roofline", "megakern-torch"}


def test_attention_flops_and_cases():
    fwd = 4 * 2 * 16 * 1024 * 1024 * 128
    assert bench_attention.flops("fwd", 2, 16, 1024, 1024, 128, False) == fwd
    assert bench_attention.flops("fwd", 2, 16, 1024, 1024, 128, True) == fwd / 2
    assert bench_attention.flops("fwd+bwd", 2, 16, 1024, 1024, 128, True) == 3.5 * fwd / 2
    full = bench_attention.cases(torch.device("cuda"), quick=False)
    assert len(full) == 40  # hs 64 and 128, 5 lengths, causal or not, GQA ratio 1 and 4
    assert all(c.b * c.t == 16384 and c.nh * c.hs == 2048 and c.nh in (c.nkv, 4 * c.nkv) for c in full)
    quick = [bench_attention.case_name(c, torch.bfloat16) for c in bench_attention.cases(torch.device("cuda"), True)]
    assert quick == ["attn hs128 T1024 B16 causal bf16", "attn hs128 T4096 B4 causal bf16",
                     "attn hs128 T16384 B1 causal bf16"]
    # hs 96 has 21 heads: ratio 4 does not divide them and is left out; hs 256 has 8
    odd = bench_attention.cases(torch.device("cuda"), False, head_dims=(96, 256), seqlens=(2048,), gqa=(4,))
    assert [bench_attention.case_name(c, torch.bfloat16) for c in odd] == [
        "attn hs256 T2048 B8 causal gqa8:2 bf16", "attn hs256 T2048 B8 noncausal gqa8:2 bf16"]


def _attention_wrong_mask(device):
    return bench_attention.Provider("bhtd", lambda q, k, v, causal: F.scaled_dot_product_attention(
        q, k, v, is_causal=not causal, enable_gqa=k.shape[1] != q.shape[1]))


def _attention_bthd(device):
    """SDPA behind the (B, T, nh, hs) layout that flash_attn and megakern take."""
    def fn(q, k, v, causal):
        assert q.shape[1] == 64 and q.is_contiguous()  # (B, T, nh, hs) on the CPU cases
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    return bench_attention.Provider("bthd", fn)


def _attention_capped(device):
    return bench_attention.Provider("bhtd", lambda q, k, v, causal: F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]), max_t=32)


def _attention_raises(device):
    def fn(q, k, v, causal):
        raise RuntimeError("kernel launch failed")

    return bench_attention.Provider("bhtd", fn)


def test_bench_attention_cpu_smoke(tmp_path, capsys, monkeypatch):
    """SDPA and stand-in providers only: no dependence on megakern.attention."""
    monkeypatch.setitem(bench_attention.PROVIDERS, "wrong", _attention_wrong_mask)
    monkeypatch.setitem(bench_attention.PROVIDERS, "bthd", _attention_bthd)
    monkeypatch.setitem(bench_attention.PROVIDERS, "capped", _attention_capped)
    monkeypatch.setitem(bench_attention.PROVIDERS, "raises", _attention_raises)
    argv = ["--device", "cpu", "--providers", "torch,sdpa-flash,sdpa-efficient,wrong,bthd,capped,raises",
            "--out", str(tmp_path)]
    results = bench_attention.main(argv)
    out = capsys.readouterr().out
    assert "skip sdpa-efficient: RuntimeError" in out  # no CPU kernel: skipped once, at load
    assert "skip wrong on attn hs32 T64 B1 causal fp32: AssertionError: out is off the fp32 reference" in out
    assert "skip capped on attn hs32 T64 B1 noncausal fp32: run only up to T=32 on cpu" in out
    assert "skip raises on attn hs32 T64 B1 causal fp32: RuntimeError: kernel launch failed" in out
    assert "| case | mode | torch | sdpa-flash | bthd |" in out.split("saved ")[-1]  # the table comes last
    assert "TFLOP/s and fractions of the roofline are figures of a CUDA device" in out  # a CPU run: ms, no rates

    rows = _read_csv(tmp_path / "cpu" / "attention.csv")
    assert rows[0] == list(CSV_HEADER) and all(len(row) == 11 for row in rows)
    records = [dict(zip(CSV_HEADER, row)) for row in rows[1:]]
    assert all(r["gpu"] == "cpu" and r["bench"] == "attention" for r in records)
    assert {r["provider"] for r in records} == {"torch", "sdpa-flash", "bthd", "roofline"}
    figures = {(r["case"], r["mode"], r["provider"], r["metric"]) for r in records}
    cpu_cases = ("attn hs32 T64 B1 causal fp32", "attn hs32 T64 B1 noncausal fp32",
                 "attn hs32 T64 B1 causal gqa4:2 fp32")
    for case in cpu_cases:
        for mode in bench_attention.MODES:
            for provider in ("torch", "sdpa-flash", "bthd"):
                for metric in ("ms", "TFLOP/s", "roofline_frac"):
                    assert (case, mode, provider, metric) in figures
    assert ("roofline", "-", "roofline", "bf16 matmul TFLOP/s") in figures
    ms = {(f[0], f[1], f[2]): f[4] for f in results.figures if f[3] == "ms"}
    for (case, mode, provider, metric, value) in results.figures:
        if metric == "TFLOP/s":  # TFLOP/s is the formula's FLOPs over the median time
            causal, nh = "noncausal" not in case, 4 if "gqa4:2" in case else 2
            expected = bench_attention.flops(mode, 1, nh, 64, 64, 32, causal) / (ms[case, mode, provider] * 1e-3) / 1e12
            assert value == pytest.approx(expected)


def test_bench_attention_megakern_provider(monkeypatch, capsys):
    """The megakern-triton provider against a stand-in with the call megakern.attention is to take."""
    def attention(q, k, v, *, causal=False, backend=None):
        assert backend == "triton" and q.shape[:2] == (1, 64) and k.shape == (1, 64, 2, 32)  # (B, T, heads, hs)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                             enable_gqa=k.shape[2] != q.shape[2])
        return out.transpose(1, 2)

    stand_in = types.SimpleNamespace(attention=attention, available_backends=lambda d: {"triton": ""})
    monkeypatch.setitem(sys.modules, "megakern", stand_in)
    results = bench_attention.main(["--device", "cpu", "--providers", "megakern-triton", "--no-save"])
    assert {figure[2] for figure in results.figures} == {"roofline", "megakern-triton"}
    out = capsys.readouterr().out
    assert "| attn hs32 T64 B1 causal fp32 | fwd+bwd |" in out
    assert "| attn hs32 T64 B1 causal gqa4:2 fp32 | fwd+bwd |" in out

    no_attention = types.SimpleNamespace(available_backends=lambda d: {"triton": ""})
    monkeypatch.setitem(sys.modules, "megakern", no_attention)
    results = bench_attention.main(["--device", "cpu", "--providers", "megakern-triton", "--no-save"])
    assert "skip megakern-triton: megakern has no attention" in capsys.readouterr().out
    assert {figure[2] for figure in results.figures} == {"roofline"}


def test_bench_attention_as_script():
    proc = subprocess.run([sys.executable, "benchmarks/bench_attention.py", "--device", "cpu", "--providers",
                           "torch,sdpa-flash", "--no-save"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "| attn hs32 T64 B1 noncausal fp32 | fwd+bwd |" in proc.stdout


def test_bench_fp8_bytes_and_cpu_smoke(tmp_path, capsys):
    assert bench_fp8.bytes_moved("delayed", 4, 256, 2) == 4 * 256 * 3 + 4
    assert bench_fp8.bytes_moved("delayed+T", 4, 256, 2) == 4 * 256 * 4 + 4
    assert bench_fp8.bytes_moved("block", 4, 256, 2) == 4 * 256 * 3 + 4 * 4 * 2
    assert bench_fp8.bytes_moved("tile", 130, 256, 2) == 130 * 256 * 3 + 4 * 2 * 2
    bench_fp8.main(["--device", "cpu", "--providers", "torch", "--out", str(tmp_path)])
    records = [dict(zip(CSV_HEADER, row)) for row in _read_csv(tmp_path / "cpu" / "fp8.csv")[1:]]
    figures = {(r["case"], r["mode"], r["provider"], r["metric"]) for r in records}
    for mode in bench_fp8.MODES:
        assert ("fp8 64x96 fp32 e4m3", mode, "torch", "GB/s") in figures
    assert "| fp8 64x96 fp32 e4m3 | tile |" in capsys.readouterr().out


def test_bench_activation_cpu_smoke(tmp_path, capsys):
    import megakern

    bench_activation.main(["--device", "cpu", "--providers", "torch,megakern-triton", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "| bias_gelu 64x96 fp32 | fwd+bwd |" in out and "| gelu 33x72 fp32 | fwd+bwd |" in out
    assert " on gelu" not in out and " on bias_gelu" not in out, out  # no provider failed its check
    records = [dict(zip(CSV_HEADER, row)) for row in _read_csv(tmp_path / "cpu" / "activation.csv")[1:]]
    assert {r["case"] for r in records if r["provider"] == "torch"} >= {"gelu 33x72 fp32", "bias_gelu 64x96 fp32"}
    # megakern-triton runs on CPU tensors under the interpreter only (a GPU machine's suite does not interpret)
    providers = ("torch",) + (("megakern-triton",) if not megakern.available_backends("cpu")["triton"] else ())
    assert {(r["provider"], r["mode"]) for r in records if r["provider"] != "roofline"} == {
        (p, m) for p in providers for m in ("fwd", "fwd+bwd")}
    assert all(float(r["value"]) > 0 for r in records)


def test_bench_optim_cpu_smoke(tmp_path, capsys):
    """Both providers on tiny parameter sets (GPT-2's layout and the llama presets', their models on the meta device):
    they agree after one step and on the gradients' sum of squares (else the row is missing) and are filed."""
    import megakern

    bench_optim.main(["--device", "cpu", "--model", "gpt-350m", "--model", "llama-1b", "--model", "llama-8b-4l",
                      "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert " on adamw masters" not in out and " on grad norm" not in out, out  # no provider failed at run time
    records = [dict(zip(CSV_HEADER, row)) for row in _read_csv(tmp_path / "cpu" / "optim.csv")[1:]]
    providers = {"torch-fused"} | ({"megakern"} if not megakern.available_backends("cpu")["triton"] else set())
    assert {r["provider"] for r in records if r["provider"] != "roofline"} == providers
    assert {r["case"].split()[2] for r in records if r["provider"] != "roofline"} == {"gpt-350m", "llama-1b",
                                                                                       "llama-8b-4l"}
    assert {(r["provider"], r["mode"]) for r in records if r["provider"] != "roofline"} == {
        (p, m) for p in providers for m in ("step", "sum of squares")}
    assert all(float(r["value"]) > 0 for r in records)


def test_bench_optim_untouched_embedding_rows(tmp_path):
    """--untouched: that fraction of the embedding's gradient rows is zero (the others random), named in the case;
    out of [0, 1) it is refused."""
    state = bench_optim.State([(400, 8), (8,)], torch.device("cpu"), untouched=0.75)
    zero_rows = (state.models[0].grad == 0).all(1)
    assert 0.6 < zero_rows.float().mean() < 0.9 and (state.models[1].grad != 0).all()
    assert (state.models[0].grad[~zero_rows] != 0).all()
    bench_optim.main(["--device", "cpu", "--quick", "--untouched", "0.5", "--providers", "torch-fused", "--out",
                      str(tmp_path)])
    cases = {r[6] for r in _read_csv(tmp_path / "cpu" / "optim.csv")[1:]}
    assert any(c.startswith("adamw masters gpt-350m") and c.endswith(" untouched 0.5") for c in cases), cases
    with pytest.raises(SystemExit, match="--untouched must be in"):
        bench_optim.main(["--device", "cpu", "--untouched", "1", "--no-save"])


def test_import_peer_says_why():
    """A frontier peer that cannot run here is Unavailable with the reason: no CUDA, or not installed (and where
    it comes from); one that imports is returned."""
    def missing():
        raise ImportError("No module named 'quack'")

    with pytest.raises(common.Unavailable, match="quack-kernels needs CUDA"):
        common.import_peer(torch.device("cpu"), "quack-kernels", missing)
    with pytest.raises(common.Unavailable, match=r"quack-kernels is not installed \(No module named 'quack'; "
                                                 r"\.\./shared/peers/README.md brings it\)"):
        common.import_peer("cuda", "quack-kernels", missing)
    assert common.import_peer("cuda", "math", lambda: __import__("math")).sqrt(4.0) == 2.0


def test_killed_run_keeps_its_rows(tmp_path):
    """A benchmark stopped by SIGTERM (``timeout``) or by an exception files the figures it measured so far
    (keep_rows_on_exit), saying so; one that reaches file_rows files them once. Under SIGTERM the rows are filed
    before other exit handlers run, and a handler that hangs (as torch.compile's worker pools can) does not keep the
    process alive past SIGTERM_GRACE_S. A SIGTERM handler a library installed before is called after the filing."""
    script = f"""
import atexit, os, signal, sys, time
sys.path.insert(0, {str(REPO)!r})
from benchmarks import common
from benchmarks.common import Results, file_rows, keep_rows_on_exit, record
how = sys.argv[1]
if how == "sigterm-chained":
    signal.signal(signal.SIGTERM, lambda signum, frame: print("the library's handler ran", flush=True))
results = Results("cpu")
keep_rows_on_exit(results, "norm", {str(tmp_path)!r})
record(results, "rmsnorm 4x8 fp32", "fwd", "torch", {{"median": 0.5, "p20": 0.4, "p80": 0.6}}, "GB/s", 1.0)
if how == "sigterm-hang":
    common.SIGTERM_GRACE_S = 1.0
    atexit.register(time.sleep, 3600)  # registered later, so it runs before keep_rows_on_exit's handler
if how.startswith("sigterm"):
    os.kill(os.getpid(), signal.SIGTERM)
    signal.pause()
elif how == "error":
    raise RuntimeError("a provider failed hard")
else:
    file_rows(results, "norm", {str(tmp_path)!r})
"""
    csv_path = tmp_path / "cpu" / "norm.csv"
    cases = (("sigterm", 143), ("sigterm-hang", 143), ("sigterm-chained", 143), ("error", 1), ("done", 0))
    for how, code in cases:
        run = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120)
        assert run.returncode == code, run.stderr
        assert ("the run ended early: filing the 2 figures it measured" in run.stdout) == (how != "done")
        assert run.stdout.count("saved ") == 1, run.stdout
        chained = "the library's handler ran" in run.stdout
        assert chained == (how == "sigterm-chained"), run.stdout
        assert not chained or run.stdout.index("saved ") < run.stdout.index("the library's handler ran")
    rows = _read_csv(csv_path)
    assert rows[0] == list(CSV_HEADER)
    assert [r[-4:-1] for r in rows[1:]] == [["fwd", "torch", "ms"], ["fwd", "torch", "GB/s"]] * len(cases)


def _smoke_torch_and_triton(bench, name: str, word: str, modes: tuple, cases: tuple, tmp_path, capsys) -> None:
    """A CPU run of ``bench`` (providers torch and megakern-triton, the latter where the interpreter runs): no
    provider failed, and a positive row filed for every (provider, mode, case)."""
    import megakern

    bench.main(["--device", "cpu", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert f" on {word} " not in out, out  # no provider failed at run time
    records = [dict(zip(CSV_HEADER, row)) for row in _read_csv(tmp_path / "cpu" / f"{name}.csv")[1:]]
    providers = {"torch"} | ({"megakern-triton"} if not megakern.available_backends("cpu")["triton"] else set())
    assert {(r["provider"], r["mode"], r["case"]) for r in records if r["provider"] != "roofline"} == {
        (p, m, c) for p in providers for m in modes for c in cases}
    assert all(float(r["value"]) > 0 for r in records)


def test_bench_qkv_order_cpu_smoke(tmp_path, capsys):
    """Both providers on tiny grouped-query shapes, both directions: the same rows (else the row is missing), filed."""
    _smoke_torch_and_triton(bench_qkv_order, "qkv_order", "qkv", ("to heads-major", "to grouped"),
                            ("qkv tiny 80x40 bf16", "qkv tiny-mha 144x24 bf16"), tmp_path, capsys)


def test_bench_embedding_cpu_smoke(tmp_path, capsys):
    """Both providers on tiny tables: the fp32 sums (else the row is missing), filed; Zipf ids in range."""
    _smoke_torch_and_triton(bench_embedding, "embedding", "embedding", ("bwd",),
                            ("embedding tiny 29x40 120 tokens bf16", "embedding tiny-wide 13x130 64 tokens bf16"),
                            tmp_path, capsys)
    ids = bench_embedding.zipf_ids(1000, 5000, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert 0 <= int(ids.min()) and int(ids.max()) < 1000
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[:10].sum() > 0.2 * 5000 and (counts == 0).sum() > 100  # a few ids take much, many none


def test_bench_gemm_linears():
    """The products come from the model as built: Llama's untied output layer, GPT-2's tied one (the embedding's
    padded shape), each block's four projections with their (out, in) features."""
    dev = torch.device("cpu")
    llama = bench_gemm.linears(bench_gemm.model_shape("llama-1b", dev))
    assert [name for name, *_ in llama] == ["attn.qkv", "attn.proj", "mlp.fc", "mlp.proj", "lm_head"]
    shape = bench_gemm.model_shape("gpt-350m", dev)
    gpt = dict((name, (n, k)) for name, n, k in bench_gemm.linears(shape))
    assert gpt["attn.qkv"] == (3 * shape.n_embd, shape.n_embd)
    assert gpt["mlp.proj"] == (shape.n_embd, 4 * shape.n_embd)
    assert gpt["lm_head"][1] == shape.n_embd and gpt["lm_head"][0] >= shape.vocab
    for product in bench_gemm.PRODUCTS:  # (m, k) x (k, n) shapes of each product of a (n, k) weight over m tokens
        a, b = bench_gemm.operands(product, 12, 5, 7, dev, torch.float32, torch.Generator().manual_seed(0))
        assert a.shape[1] == b.shape[0]
        assert (a.shape[0], b.shape[1]) == {"forward": (12, 5), "input grad": (12, 7), "weight grad": (5, 7)}[product]


def test_bench_gemm_cpu_smoke(tmp_path, capsys):
    """Every product of every model for both providers, filed; an unknown model is refused by name."""
    bench_gemm.main(["--device", "cpu", "--out", str(tmp_path), "--models", "llama-1b,gpt-350m"])
    out = capsys.readouterr().out
    assert " on llama-1b " not in out and " on gpt-350m " not in out, out  # no provider failed
    records = [dict(zip(CSV_HEADER, row)) for row in _read_csv(tmp_path / "cpu" / "gemm.csv")[1:]]
    cases = {r["case"] for r in records if r["provider"] != "roofline"}
    assert len(cases) == 2 * 5 * 3
    assert {r["provider"] for r in records if r["provider"] != "roofline"} == {"cublas", "cublaslt"}
    assert "the step's products" in out
    with pytest.raises(SystemExit, match="unknown 'gpt-9'"):
        bench_gemm.main(["--device", "cpu", "--no-save", "--models", "gpt-9"])


def test_run_launch_leaves_no_process_behind(tmp_path):
    """A run stopped at its timeout: subprocess.TimeoutExpired with what it printed, and no process of it left,
    neither one in its process group nor a worker in a session of its own whose launcher stops it on SIGTERM (as
    torchrun does)."""
    pids = tmp_path / "pids"
    launcher = f"""
import os, signal, subprocess, sys, time
same = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
own = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
open({str(pids)!r}, "w").write(f"{{same.pid}} {{own.pid}}")
def stop(*_):
    os.killpg(own.pid, signal.SIGTERM)
    sys.exit(1)
signal.signal(signal.SIGTERM, stop)
print("launched", flush=True)
time.sleep(120)
"""
    start = time.perf_counter()
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_launch([sys.executable, "-c", launcher], timeout=3.0, env=dict(os.environ))
    assert time.perf_counter() - start < 30
    assert "launched" in info.value.stdout
    deadline = time.time() + 10
    for pid in map(int, pids.read_text().split()):
        while _running(pid):
            if time.time() > deadline:
                pytest.fail(f"process {pid} of the stopped run is still running")
            time.sleep(0.05)


def _running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie (a killed process waits in that state for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
