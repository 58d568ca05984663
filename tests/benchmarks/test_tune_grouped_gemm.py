"""profiles/tune_grouped_gemm.py on CPU: the sweep's machinery at the tiny shape under the Triton interpreter
(candidates checked against the fp32 reference, a wrong one reported and skipped, the budget's stop, the file), and
that its GPU candidates are the launcher's Config."""
from pathlib import Path

import pytest
import torch

from benchmarks.common import import_file

REPO = Path(__file__).resolve().parents[2]


def _module():
    return import_file(REPO / "profiles" / "tune_grouped_gemm.py", "tune_grouped_gemm")


@pytest.fixture(scope="module")
def tune():
    import megakern

    if megakern.available_backends("cpu")["triton"]:
        pytest.skip("Triton kernels on CPU tensors need the interpreter (TRITON_INTERPRET=1)")
    return _module()


def test_sweep_cpu_smoke(tune, tmp_path, capsys, monkeypatch):
    real = tune.runner
    cands = tune.candidates(tune.TINY, "fwd", torch.device("cpu"), tiny=True)
    wrong_cfg = cands[1][0]

    def runner(ops, pass_, cfg, tma):
        fn = real(ops, pass_, cfg, tma)
        return (lambda: 1.5 * fn()) if cfg == wrong_cfg and pass_ == "fwd" else fn

    monkeypatch.setattr(tune, "runner", runner)
    out_file = tmp_path / "tune.txt"
    rows, summary = tune.main(["--device", "cpu", "--max-candidates", "2", "--passes", "fwd,dw",
                               "--out", str(out_file)])
    out = capsys.readouterr().out
    status = {(r.pass_, r.cfg): r.status for r in rows}
    assert status["fwd", wrong_cfg] == "wrong"
    assert status["fwd", cands[0][0]] == "ok"
    assert sum(s == "ok" for s in status.values()) == 3
    assert summary["tiny", "fwd"]["torch_ms"] > 0
    text = out_file.read_text()
    assert "== tiny fwd: torch._grouped_mm" in text and "wrong" in text
    assert "| tiny | dw | `Config(block_m=" in text and "| tiny | dw |" in out
    assert "4 candidates: 3 timed, 1 wrong, 0 failed, 0 skipped" in out


def test_budget_stops_cleanly(tune, capsys):
    rows, _ = tune.main(["--device", "cpu", "--max-candidates", "2", "--passes", "fwd", "--budget-s", "0.01"])
    out = capsys.readouterr().out
    assert rows and all(r.status == "skipped" for r in rows)
    assert "stopped: budget" in out and "none timed" in out


def test_gpu_candidates_are_launcher_configs(tune):
    from megakern import _grouped_gemm_triton as gg

    table = tune._configs()
    for pass_ in tune.PASSES:
        assert 20 <= len(table[pass_]) <= 40
        assert len(set(table[pass_])) == len(table[pass_])
        for cfg, tma in table[pass_]:
            assert isinstance(cfg, gg.Config) and isinstance(tma, bool)
            assert tune.smem_ok(cfg), cfg
    # the order: the launcher's default first, then 64-row tiles earlier where experts hold few rows
    cpu = torch.device("cpu")
    for shape in tune.SHAPES.values():
        assert tune.routing(shape).shape == (shape.tokens, shape.top_k)
    assert torch.equal(tune.routing(tune.SHAPES["e64"]), tune.routing(tune.SHAPES["e64"]))
    counts = torch.bincount(tune.routing(tune.SHAPES["e8"]).flatten(), minlength=8)
    assert counts.sum() == 32768 and counts.max() > 1.15 * counts.float().mean()  # uneven
    assert cpu.type == "cpu"
