"""bench_parallel on CPU: the tiny model on one process and two gloo ranks, figures read back from the runs' logs."""
import csv
import math

import pytest

from benchmarks import bench_parallel
from benchmarks.bench_parallel import Layout
from benchmarks.common import CSV_HEADER


def test_runs_share_the_cores_out():
    """A run's processes split the cores between them (gloo ranks with more threads than cores ran a data-parallel
    step 15x slower), at least one thread each and at most 4; OMP_NUM_THREADS set by the user is kept."""
    assert [bench_parallel.omp_threads(p, cores=2) for p in (1, 2, 4)] == [2, 1, 1]
    assert [bench_parallel.omp_threads(p, cores=64) for p in (1, 4, 8)] == [4, 4, 4]
    assert bench_parallel.omp_threads(3, cores=8) == 2


def test_run_env_keeps_the_users_thread_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    assert bench_parallel._run_env(2)["OMP_NUM_THREADS"] == "7"
    monkeypatch.delenv("OMP_NUM_THREADS")
    env = bench_parallel._run_env(2)
    assert env["OMP_NUM_THREADS"] == str(bench_parallel.omp_threads(2)) and env["NCCL_NVLS_ENABLE"] == "0"


def test_layout_specs():
    assert Layout.parse("1").world == 1
    layout = Layout.parse("tp2.pp2.dp2-ddp-zero1")
    assert (layout.tp, layout.pp, layout.cp, layout.dp, layout.dp_shard, layout.zero1, layout.world) == (
        2, 2, 1, 2, "ddp", True, 8)
    assert Layout.parse("cp4").dp_shard == "fsdp"
    assert Layout.parse("tp2.dp2-ovl").tp_comm_overlap and not Layout.parse("tp2").tp_comm_overlap
    assert Layout.parse("tp2-ovl").tp_overlap_impl == "ring"
    assert Layout.parse("tp2-ovl-symm-graph").tp_overlap_impl == "symmetric"
    assert Layout.parse("tp2-ovl-symm-kern-graph").tp_overlap_impl == "symmetric-kernel"
    with pytest.raises(ValueError, match="symm picks the overlap's implementation; add '-ovl'"):
        Layout.parse("tp2-symm")
    assert Layout.parse("tp2-ovl-symm-ksig-graph").tp_overlap_signals == "kernel"
    assert Layout.parse("tp2-ovl-symm-graph").tp_overlap_signals == "stream"
    with pytest.raises(ValueError, match="ksig picks symm's signals; add '-symm'"):
        Layout.parse("tp2-ovl-ksig")
    assert Layout.parse("tp2-ovl-symm-pull-graph").tp_overlap_gather == "pull"
    assert Layout.parse("tp2-ovl-symm-graph").tp_overlap_gather == "push"
    with pytest.raises(ValueError, match="pull picks symm's all-gather of the kept inputs; add '-symm'"):
        Layout.parse("tp2-ovl-pull")
    copies = Layout.parse("1x4")
    assert (copies.world, copies.copies, copies.gpus) == (1, 4, 4)
    # "-graph": the captured step; its one-GPU base is "1-graph"; DDP's reducer needs 11 eager steps first
    graphed = Layout.parse("tp2-ovl-graph")
    assert graphed.cuda_graph and graphed.tp_comm_overlap and graphed.base == "1-graph"
    assert (graphed.graph_warmup(4), graphed.untimed(4)) == (3, 4)
    ddp = Layout.parse("dp2-ddp-graph")
    assert ddp.ddp and (ddp.graph_warmup(4), ddp.untimed(4)) == (11, 12)
    assert Layout.parse("1-graph").world == 1 and Layout.parse("1x2-graph").copies == 2
    assert not Layout.parse("tp2").cuda_graph and Layout.parse("tp2").untimed(4) == 4
    # expert parallel: carved out of dp x cp, no GPUs of its own
    ep = Layout.parse("dp4.ep2-ddp")
    assert (ep.dp, ep.ep, ep.world, ep.dp_shard) == (4, 2, 4, "ddp") and Layout.parse("cp2.ep2").ep == 2
    for bad, why in [("tp2.tp2", "once"), ("xp2", "tp|pp|cp|dp|ep"), ("dp2.ep4", "must divide"),
                     ("tp2.ep2", "must divide"), ("tp0", "size >= 1"), ("dp2-ring", "unknown flag"),
                     ("dp2-zero1", "add '-ddp'"), ("dp2-ovl", "needs tp >= 2"),
                     ("tp2-graph-ovl", "unknown flag"),
                     ("1x0", "K >= 1")]:
        with pytest.raises(ValueError, match=why):
            Layout.parse(bad)


def test_bench_parallel_cpu_smoke(tmp_path, capsys):
    results = bench_parallel.main(["--tiny", "--device", "cpu", "--layouts", "1,1x2,dp2-ddp,tp2,tp2-ovl,tp4",
                                   "--overlap", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    figures = {(f[1], f[3]): f[4] for f in results.figures}
    ran = {"1", "1x2", "dp2-ddp", "tp2", "tp2-ovl"}
    if bench_parallel.available_gpus("cpu") < 4:
        assert "tp4              skipped: needs 4 devices" in out
    else:  # 4 CPU ranks fit (a 16-core GPU machine): tp4 runs and is filed too
        ran.add("tp4")
        assert figures["tp4", "tok/s"] > 0
    # every layout ran: a failed one printed "<layout> FAILED: <why>" (its train.log's last lines, then its output)
    failed = [line for line in out.splitlines() if " FAILED: " in line]
    assert ran <= {layout for layout, _ in figures} and not failed, out[out.find(failed[0]):] if failed else out
    for layout in ("1", "dp2-ddp"):
        tokens = 2 * 256 * (2 if layout == "dp2-ddp" else 1)  # micro-batch 2 per data-parallel rank, T 256
        assert math.isclose(figures[layout, "tok/s"], tokens / (figures[layout, "ms"] / 1e3))
        assert figures[layout, "GiB"] > 0 and 0 < figures[layout, "loss"] < 10
    assert figures["1", "scaling"] == 1.0
    # the overlapped tensor-parallel layout trains the same model: its loss is the one-device run's (same data, seed)
    assert figures["tp2-ovl", "loss"] == pytest.approx(figures["1", "loss"], abs=1e-3)
    # measured after tp2: the row-parallel collectives timed alone, and the share the overlap hides
    assert ("tp2-ovl", "comm ms") in figures, out[-3000:]
    assert figures["tp2-ovl", "comm ms"] > 0 and 0 <= figures["tp2-ovl", "comm hidden"] <= 1
    assert "row-parallel reduce-scatters + all-gathers alone (tp 2)" in out
    # two independent runs at once: tokens/s of both, per GPU against one run's
    assert math.isclose(figures["1x2", "tok/s"], 2 * 2 * 256 / (figures["1x2", "ms"] / 1e3))
    assert math.isclose(figures["1x2", "tok/s/gpu"], figures["1x2", "tok/s"] / 2)
    assert math.isclose(figures["dp2-ddp", "scaling"], figures["dp2-ddp", "tok/s/gpu"] / figures["1", "tok/s/gpu"])
    assert ("dp2-ddp", "comm ms") in figures, out[-3000:]  # the collectives' run failed: its error is in the output
    assert figures["dp2-ddp", "comm ms"] > 0 and 0 <= figures["dp2-ddp", "comm hidden"] <= 1
    assert "over 1x2:" in out  # the hidden share is taken against the two one-GPU runs at once
    assert ("1", "MFU") not in figures  # no peak FLOP/s for a CPU
    with (tmp_path / "cpu" / "parallel.csv").open(newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == list(CSV_HEADER) and {r[7] for r in rows[1:]} == ran
    # --from-log: the printed lines give back the figures, to the printed precision, and file them with the stamp given
    log = tmp_path / "run.log"
    log.write_text(out)
    parsed = bench_parallel.rows_from_log(out)
    printed = {"ms": 0.05, "tok/s": 0.5, "tok/s/gpu": 0.5, "GiB": 0.05, "scaling": 0.005, "loss": 5e-4,
               "comm ms": 0.05, "comm hidden": 0.005}
    assert [r[:4] for r in parsed] == [f[:4] for f in results.figures]
    for (*_, metric, value), f in zip(parsed, results.figures):
        assert abs(value - f[4]) <= printed[metric] + 1e-9, (f, value)
    path = bench_parallel.save_from_log(log, "2026-01-02,abc1234,h200,2.11.0+cu130,3.6.0", tmp_path / "back")
    with path.open(newline="") as f:
        back = list(csv.reader(f))
    assert path.parent.name == "h200" and len(back) == len(parsed) + 1
    assert back[1][:6] == ["2026-01-02", "abc1234", "h200", "2.11.0+cu130", "3.6.0", "parallel"]
    with pytest.raises(SystemExit, match="--meta"):
        bench_parallel.save_from_log(log, "2026-01-02,abc1234", tmp_path / "back")


def test_expert_all_to_all_rows_count_the_capacity_slots():
    """The all-to-all timed alone moves what the dispatch moves: tokens x top-k dropless; with a capacity factor
    every expert's fixed slots (the empty rows too)."""
    from benchmarks.bench_parallel import moe_facts, routed_rows

    dropless = moe_facts("moe-mixtral")
    assert dropless == (2, 16, None, 8)
    assert routed_rows(4096, dropless) == 8192
    capped = moe_facts("moe-mixtral", ["model.moe_capacity_factor=1.25", "train.steps=3"])
    assert capped == (2, 16, 1.25, 8)
    assert routed_rows(4097, capped) == 8 * 1281  # ceil(1.25 x 4097 x 2 / 8) = ceil(1280.3)
    assert moe_facts("gpt-tiny") == (0, 0, None, 0)


def test_bench_parallel_profile_keeps_the_tables_and_every_ranks_trace(tmp_path, capsys):
    """--profile: rank 0's tables and every rank's chrome trace (compressed) land in DIR, named by model and layout
    (rank 0's trace without a rank suffix)."""
    import gzip
    import json

    bench_parallel.main(["--tiny", "--device", "cpu", "--layouts", "dp2", "--profile", str(tmp_path / "prof"),
                         "--timeout", "300"])
    tables = tmp_path / "prof" / "gpt-tiny_dp2_kernels.txt"
    assert tables.read_text().startswith("# megakern-train --profile"), tables.read_text()[:200]
    assert sorted(p.name for p in (tmp_path / "prof").glob("*trace*")) == [
        "gpt-tiny_dp2_trace.json.gz", "gpt-tiny_dp2_trace_rank1.json.gz"]
    for name in ("gpt-tiny_dp2_trace.json.gz", "gpt-tiny_dp2_trace_rank1.json.gz"):
        with gzip.open(tmp_path / "prof" / name, "rt") as f:
            trace = json.load(f)
        assert any(e.get("name", "").startswith("ProfilerStep") for e in trace["traceEvents"]), name


def test_bench_parallel_reports_where_a_stopped_run_was(tmp_path, capsys):
    """A run still going at --timeout is stopped and reported with the output it had printed (where it hung),
    and the other layouts still run."""
    results = bench_parallel.main(["--tiny", "--device", "cpu", "--layouts", "1", "--timeout", "0.5",
                                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    # (a run stopped later would quote its train.log's last lines between the two)
    assert "1                FAILED: no exit within 0.5 s (--timeout);" in out, out[-2000:]
    assert " the run's last output:" in out, out[-2000:]
    assert not [f for f in results.figures if f[1] == "1"]


def test_a_failed_runs_message_quotes_its_log(tmp_path):
    """A run that fails names why in its train.log (the step watchdog's verdict, a rank's error); the failure's
    message quotes the log's last text lines, not its JSON records."""
    assert bench_parallel._log_text_tail(tmp_path) == ""  # no log written
    lines = [f"note {i}" for i in range(30)]
    (tmp_path / "train.log").write_text('{"step": 1}\n' + "\n".join(lines) + '\n{"step": 2}\n\n')
    text = bench_parallel._log_text_tail(tmp_path, lines=3)
    assert text == " its train.log ends:\nnote 27\nnote 28\nnote 29\n"
