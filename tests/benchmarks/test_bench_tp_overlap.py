"""bench_tp_overlap on CPU: two gloo ranks, each provider checked against the unfused op and timed (a smoke run: no
rows filed, no hidden share printed); the hidden-share arithmetic on made-up medians."""
from benchmarks import bench_tp_overlap


def test_cpu_smoke(capsys):
    results = bench_tp_overlap.main(["--device", "cpu", "--tp", "2", "--no-save"])
    out = capsys.readouterr().out
    for op in bench_tp_overlap.OPS:
        for provider in ("gemm", "unfused", "megakern"):
            assert any(line.startswith(op) and f" {provider} " in line for line in out.splitlines()), (op, provider)
    assert "skip " not in out and "hides" not in out
    assert results is not None


def test_hidden_shares():
    fig = [("c", "fwd", "gemm", {"median": 1.0}, 0.0), ("c", "fwd", "unfused", {"median": 2.0}, 0.0),
           ("c", "fwd", "megakern", {"median": 1.25}, 0.0), ("c", "fwd", "torch-symm", {"median": 2.5}, 0.0),
           ("c", "fwd-graph", "gemm", {"median": 1.0}, 0.0), ("c", "fwd-graph", "unfused", {"median": 1.5}, 0.0),
           ("c", "fwd-graph", "megakern", {"median": 1.125}, 0.0), ("c", "fwd+bwd", "megakern", {"median": 9.0}, 0.0),
           ("d", "fwd", "unfused", {"median": 2.0}, 0.0), ("d", "fwd", "megakern", {"median": 1.0}, 0.0)]
    assert bench_tp_overlap.hidden_shares(fig) == {("c", "fwd", "megakern"): 0.75, ("c", "fwd", "torch-symm"): -0.5,
                                                   ("c", "fwd-graph", "megakern"): 0.75}
