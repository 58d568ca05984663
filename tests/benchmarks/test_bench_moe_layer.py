"""benchmarks/bench_moe.py's layer section on CPU (tiny shape): megakern's MoE MLP and, where transformers is
installed, Hugging Face's Mixtral block with the same weights, checked against the fp32 reference and timed; a wrong
provider reported and skipped; the FLOP count."""
import csv
import importlib.util

import torch

from benchmarks import bench_moe
from benchmarks.common import CSV_HEADER

HAS_HF = importlib.util.find_spec("transformers") is not None


def _wrong(device):
    def build(case, w, args):
        layer = bench_moe._megakern_layer(case, w, device, compile=False)
        return layer._replace(forward=lambda x: 1.1 * layer.forward(x))

    return build


def test_layer_section_cpu_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(bench_moe.LAYER_PROVIDERS, "wrong", _wrong)
    results = bench_moe.main(["--device", "cpu", "--sections", "layer", "--providers", "megakern,hf-eager,wrong",
                              "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "skip wrong on tiny layer" in out and "out is off the fp32 reference" in out
    if not HAS_HF:
        assert "skip hf-eager: transformers is not installed" in out
    providers = {f[2] for f in results.figures if f[0] != "roofline"}
    assert providers == {"megakern"} | ({"hf-eager"} if HAS_HF else set())
    with (tmp_path / "cpu" / "moe.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER)
    records = {(r[7], r[8], r[9]) for r in rows[1:]}
    for provider in providers:
        for mode in ("fwd", "fwd+bwd"):
            for metric in ("ms", "TFLOP/s", "tok/s"):
                assert (mode, provider, metric) in records, (mode, provider, metric)
    figures = {(f[1], f[2], f[3]): f[4] for f in results.figures}
    r = bench_moe.layer_cases(torch.device("cpu"), False)[0].routing
    tok_s = r.tokens / (figures["fwd+bwd", "megakern", "ms"] / 1e3)
    assert abs(figures["fwd+bwd", "megakern", "tok/s"] - tok_s) <= 1e-9 * tok_s


def test_layer_flops_mixtral():
    """2 N k (C 2F + F C) forward, three times that for forward + backward: 5.77 TFLOP for 8192 tokens."""
    fwd = bench_moe.layer_flops(8192, 2, 4096, 14336, "fwd")
    assert fwd == 2 * 8192 * 2 * 3 * 4096 * 14336
    assert bench_moe.layer_flops(8192, 2, 4096, 14336, "fwd+bwd") == 3 * fwd


def test_check_layer_allows_router_near_ties_only():
    torch.manual_seed(0)
    n, c = 1000, 8
    ref_idx = torch.stack([torch.arange(n) % 4, (torch.arange(n) + 1) % 4], dim=1)
    ref = [torch.randn(n, c), torch.randn(n, c)]
    route = ref_idx.flip(1).clone()  # the same sets, another order
    route[:5, 1] = 3 - route[:5, 1].clamp(max=2)  # a few tokens routed elsewhere: excluded from the comparison
    outs = [ref[0].clone(), ref[1].clone()]
    outs[0][:5] += 10  # off only where the routing differs
    assert "995 of 1000 tokens routed" in bench_moe.check_layer("p", outs, ref, route, ref_idx, 1e-3)
    outs[1][100:110] += 1  # off where the routing agrees
    try:
        bench_moe.check_layer("p", outs, ref, route, ref_idx, 1e-3)
    except AssertionError as exc:
        assert "dx is off the fp32 reference at 10 of 995 tokens" in str(exc)
    else:
        raise AssertionError("a provider off at 10 tokens passed")


def test_hf_weights_layouts():
    """The weights land where each transformers layout expects them: the block's output equals the reference."""
    if not HAS_HF:
        import pytest

        pytest.skip("transformers is not installed")
    case = bench_moe.layer_cases(torch.device("cpu"), False)[0]
    w = bench_moe.layer_weights(case, torch.device("cpu"), torch.float32)
    args = type("Args", (), {"hf_experts": "eager"})()
    layer = bench_moe._hf_layer(case, w, torch.device("cpu"), False, args.hf_experts)
    x = torch.randn(1, case.routing.tokens, case.hidden)
    ref, _ = bench_moe.layer_ref(x, w, case.routing.top_k)
    torch.testing.assert_close(layer.forward(x), ref, rtol=1e-4, atol=1e-5)
