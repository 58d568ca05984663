"""benchmarks/bench_cross_entropy.py on CPU, smallest case: every provider that runs here checked and timed, rows on
file with the same-run matmul roofline, a wrong provider reported and skipped."""
import csv

import pytest
import torch

import megakern

from benchmarks import bench_cross_entropy
from benchmarks.common import CSV_HEADER


def _wrong(device):
    return lambda chunk: (lambda x, w, t: 1.01 * bench_cross_entropy._plain(x, w, t))


def test_bench_cross_entropy_cpu_smoke(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(bench_cross_entropy.PROVIDERS, "wrong", _wrong)
    bench_cross_entropy.main(["--device", "cpu", "--providers", "torch,megakern-triton,wrong", "--chunks", "4",
                              "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "skip wrong on N=13 C=16 V=67 fp32: AssertionError: loss is off the fp32 reference" in out
    with (tmp_path / "cpu" / "cross_entropy.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER)
    records = [dict(zip(CSV_HEADER, row)) for row in rows[1:]]
    figures = {(r["mode"], r["provider"], r["metric"]) for r in records}
    assert ("-", "roofline", "bf16 matmul TFLOP/s") in figures
    wanted = [("fwd+bwd", "torch")]
    if not megakern.available_backends("cpu")["triton"]:  # Triton on CPU tensors: under the interpreter only
        wanted += [("fwd+bwd", "megakern-triton"), ("fwd+bwd chunk=4", "megakern-triton")]
    else:
        assert "skip megakern-triton" in out
    for mode, provider in wanted:
        for metric in ("ms", "TFLOP/s", "roofline_frac"):
            assert (mode, provider, metric) in figures, (mode, provider, metric)
    assert all(float(r["value"]) > 0 for r in records)
    assert bench_cross_entropy.flops(16384, 1024, 50304) == 6 * 16384 * 1024 * 50304


def test_bench_cross_entropy_tokens():
    """--tokens sets N of every CUDA case, --hidden its C values; a count below 1 is refused by name."""
    cases = bench_cross_entropy.shapes(torch.device("cuda"), False, 8192)
    assert len(cases) == 9 and {n for n, _, _ in cases} == {8192}
    assert {c for _, c, _ in cases} == {1024, 2048, 4096}
    assert {n for n, _, _ in bench_cross_entropy.shapes(torch.device("cuda"), False)} == {16384}
    cases = bench_cross_entropy.shapes(torch.device("cuda"), False, 8192, [2048])
    assert [(n, c) for n, c, _ in cases] == [(8192, 2048)] * 3
    with pytest.raises(SystemExit, match="--tokens must be >= 1, got 0"):
        bench_cross_entropy.main(["--device", "cpu", "--tokens", "0"])
    with pytest.raises(SystemExit, match="--hidden must list sizes >= 1"):
        bench_cross_entropy.main(["--device", "cpu", "--hidden", "0,2048"])
