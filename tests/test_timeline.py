"""megakern.train.timeline: the split of a profiled step's GPU time, on hand-made traces with known answers."""
import json

import pytest

from megakern.train import timeline as _timeline


def _trace(kernels, steps, launches=()):
    """kernels: (name, start, end, stream, correlation); launches: (correlation, ts); steps: (ts, dur)."""
    ev = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{i}", "ts": ts, "dur": dur}
          for i, (ts, dur) in enumerate(steps)]
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1.0,
            "args": {"correlation": c}} for c, ts in launches]
    ev += [{"ph": "X", "cat": "kernel", "name": n, "ts": s, "dur": e - s, "args": {"stream": st, "correlation": c}}
           for n, s, e, st, c in kernels]
    ev.append({"ph": "i", "name": "marker", "ts": 0})  # other event kinds are ignored
    return {"traceEvents": ev}


def test_split_of_one_step():
    kernels = [("gemm", 10.0, 110.0, 7, 1),
               ("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 60.0, 210.0, 20, 2),  # 50 overlapped, 100 exposed
               ("norm_fwd", 310.0, 350.0, 7, 3),      # 100 us idle before it: launched at 300 -> the host
               ("norm_bwd", 450.0, 500.0, 7, 4)]      # 100 us idle before it: launched at 320 -> other
    launches = [(1, 5.0), (2, 8.0), (3, 300.0), (4, 320.0)]
    trace = _trace(kernels, [(0.0, 1000.0)], launches)
    trace["traceEvents"].append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 220.0,
                                 "dur": 70.0, "args": {}})
    (st,) = _timeline.analyze(trace)
    assert st.host == 1000.0 and st.waits["cudaStreamSynchronize"] == [70.0, 1]
    assert st.wall == pytest.approx(490.0)
    assert st.overlapped == pytest.approx(50.0)
    assert st.comm_exposed == pytest.approx(100.0)
    assert st.compute_alone == pytest.approx(50.0 + 40.0 + 50.0)
    assert st.idle_host == pytest.approx(100.0)
    assert st.idle_other == pytest.approx(100.0)
    assert st.comm_busy == pytest.approx(150.0)
    parts = st.compute_alone + st.overlapped + st.comm_exposed + st.idle_host + st.idle_other
    assert parts == pytest.approx(st.wall)
    assert st.gaps["norm_fwd"][2] == "host" and st.gaps["norm_bwd"][2] == "other"
    # each gap by what ended last before it: the all-reduce (stream 20) before norm_fwd (stream 7), then norm_fwd
    assert dict(st.gap_pairs) == {("ncclDevKernel_AllReduce_Sum_f32_RING_LL", "norm_fwd", "across"): [100.0, 1],
                                  ("norm_fwd", "norm_bwd", "same"): [100.0, 1]}
    assert st.exposed["ncclDevKernel_AllReduce_Sum_f32_RING_LL"][0] == pytest.approx(100.0)
    text = _timeline.report([st])
    assert "comm exposed" in text and "norm_fwd" in text and "ncclDevKernel_AllReduce" in text
    assert "cudaStreamSynchronize 1.0x 0.07 ms" in text and "host 1.0 ms" in text
    assert "across ncclDevKernel_AllReduce_Sum_f32_RING_LL -> norm_fwd" in text
    assert "same   norm_fwd -> norm_bwd" in text


def test_what_counts_as_communication():
    """NCCL kernels, copies between GPUs and symmetric memory's signal kernels; local copies and GEMMs do not."""
    comm = ["ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "ncclKernel_SendRecv",
            "Memcpy PtoP (Device -> Device)",
            "c10d::symmetric_memory::wait_signal_kernel(unsigned int**, int, int, int, int)",
            "c10d::symmetric_memory::put_signal_kernel(unsigned int**, int, int, int, int)"]
    local = ["Memcpy DtoD (Device -> Device)", "Memcpy DtoH (Device -> Pinned)", "nvjet_sm90_tst_256x128_64x4",
             "memcpy128", "_norm_fwd_kernel"]
    assert all(_timeline.is_comm(n) for n in comm)
    assert not any(_timeline.is_comm(n) for n in local)
    # a pull on a side stream under a GEMM is hidden communication, its tail beyond the GEMM exposed
    kernels = [("nvjet_gemm", 0.0, 100.0, 7, 1), ("Memcpy PtoP (Device -> Device)", 40.0, 130.0, 21, 2)]
    (st,) = _timeline.analyze(_trace(kernels, [(0.0, 1000.0)], [(1, 0.0), (2, 0.0)]))
    assert st.overlapped == pytest.approx(60.0) and st.comm_exposed == pytest.approx(30.0)


def test_kernels_go_to_the_step_that_launched_them():
    # step 0 [0, 100) launches a kernel that runs late (150..250); step 1 [100, 300) launches one at 260
    kernels = [("a", 150.0, 250.0, 7, 1), ("b", 260.0, 300.0, 7, 2), ("c", 300.0, 320.0, 7, 3)]
    launches = [(1, 50.0), (2, 120.0), (3, 130.0)]
    steps = _timeline.analyze(_trace(kernels, [(0.0, 100.0), (100.0, 200.0)], launches))
    assert [s.kernels for s in steps] == [1, 2]
    assert steps[0].wall == pytest.approx(100.0)
    assert steps[1].wall == pytest.approx(60.0) and steps[1].idle_host == 0 and steps[1].idle_other == 0


def test_work_launched_outside_the_steps_is_left_out():
    # "tail" ran in the first step's time but was launched before the trace began (no launch record: the step
    # before, which the GPU was still running); "late" was launched after the last step ended
    kernels = [("tail", 5.0, 60.0, 7, 9), ("a", 60.0, 100.0, 7, 1), ("b", 120.0, 150.0, 7, 2),
               ("late", 400.0, 450.0, 7, 3)]
    launches = [(1, 10.0), (2, 110.0), (3, 350.0)]
    trace = _trace(kernels, [(0.0, 100.0), (100.0, 200.0)], launches)
    steps = _timeline.analyze(trace)
    assert [s.kernels for s in steps] == [1, 1]
    assert steps[0].wall == pytest.approx(40.0) and steps[1].wall == pytest.approx(30.0)
    lines = _timeline.sources(trace).splitlines()
    assert lines[0].startswith("# GPU time by source, per step (mean of 2)") and len(lines) == 4
    assert "0.02 ms     0.5x  a <- " in lines[1] and "0.01 ms     0.5x  b <- " in lines[2]
    assert lines[3].startswith("# not counted: 2 GPU ops, 0.10 ms in all, launched outside the profiled steps")
    assert "tail 0.06 ms, late 0.05 ms" in lines[3]


def test_host_summary():
    trace = _trace([("k", 0.0, 10.0, 7, 1)], [(0.0, 2000.0), (2000.0, 4000.0)], [(1, 0.0)])
    assert _timeline.host_summary(trace) == "# per step: host 3.0 ms (mean of 2 ProfilerStep ranges)"
    assert "n/a" in _timeline.host_summary({"traceEvents": []})


def test_no_gpu_work_and_cli(tmp_path, capsys):
    assert _timeline.analyze({"traceEvents": []}) == []
    assert "no GPU kernels" in _timeline.report([])
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(_trace([("k", 0.0, 10.0, 7, 1)], [(0.0, 20.0)], [(1, 0.0)])))
    assert _timeline.main([str(path)]) == 0
    assert "GPU wall 0.0 ms" in capsys.readouterr().out
    assert _timeline.main([]) == 2


def test_sources_name_the_launching_op_and_its_context():
    kernels = [("reduce_kernel", 200.0, 260.0, 7, 1), ("_attn_fwd_kernel", 300.0, 400.0, 7, 2),
               ("reduce_kernel", 400.0, 430.0, 7, 4), ("Memset (Device)", 450.0, 452.0, 7, 3)]
    trace = _trace(kernels, [(0.0, 1000.0)], [(1, 20.0), (2, 120.0), (3, 500.0), (4, 610.0)])
    host = [("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 0.0, 100.0),
            ("cpu_op", "aten::sum", 10.0, 40.0),
            ("user_annotation", "megakern.attention[triton]", 100.0, 100.0),
            ("cpu_op", "AttentionFunction", 110.0, 80.0),
            ("cpu_op", "aten::sum", 600.0, 20.0)]  # no context around it
    trace["traceEvents"] += [{"ph": "X", "cat": c, "name": n, "ts": ts, "dur": d} for c, n, ts, d in host]
    text = _timeline.sources(trace)
    lines = text.splitlines()
    assert lines[0].startswith("# GPU time by source, per step (mean of 1)")
    assert "0.10 ms     1.0x  _attn_fwd_kernel <- AttentionFunction [megakern.attention[triton]]" in lines[1]
    assert "0.06 ms     1.0x  reduce_kernel <- aten::sum [AddmmBackward0]" in lines[2]
    assert lines[3].endswith("reduce_kernel <- aten::sum") and lines[4].endswith("Memset (Device) <- ")
    assert _timeline.sources({"traceEvents": []}).endswith("no GPU work in the trace")


def test_a_gap_is_paired_with_what_it_waited_for():
    """The op that ended last before a gap, not the one that started last: a pull on a side stream outlasting the
    GEMM beside it, then the next GEMM on the GEMM's stream (a wait on the pull's event)."""
    kernels = [("nvjet_gemm", 0.0, 100.0, 7, 1), ("Memcpy PtoP (Device -> Device)", 40.0, 130.0, 21, 2),
               ("nvjet_gemm_badd", 135.0, 200.0, 7, 3), ("memset", 200.5, 201.0, 7, 4)]  # 0.5 us: not listed
    (st,) = _timeline.analyze(_trace(kernels, [(0.0, 1000.0)], [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0)]))
    assert dict(st.gap_pairs) == {("Memcpy PtoP (Device -> Device)", "nvjet_gemm_badd", "across"): [5.0, 1]}
    assert st.idle_other == pytest.approx(5.5)


def test_window_lists_every_stream_around_a_kernel(tmp_path, capsys):
    import gzip

    kernels = [("gemm", 0.0, 100.0, 7, 1), ("attn_fwd", 200.0, 300.0, 7, 2), ("gemm", 310.0, 400.0, 7, 3),
               ("attn_fwd", 1000.0, 1100.0, 7, 4)]
    trace = _trace(kernels, [(0.0, 2000.0)])
    trace["traceEvents"].append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy PtoP (Device -> Device)",
                                 "ts": 320.0, "dur": 50.0, "args": {"stream": 9, "bytes": 16777216}})
    text = _timeline.window(trace, "attn_fwd", at=0.0, before_us=150.0, after_us=200.0)
    lines = text.splitlines()
    assert "attn_fwd at 0.200 ms" in lines[0]
    rows = [line.split() for line in lines[1:]]
    # the gemm 200 us before the anchor is outside; the copy on another stream is in
    assert [(r[0], r[2], r[3]) for r in rows] == [("0.0", "s7", "attn_fwd"), ("110.0", "s7", "gemm"),
                                                   ("120.0", "s9", "Memcpy")]
    assert rows[-1][-1] == "16777216"
    # past the middle of the trace the later occurrence is the anchor; nothing matches past its start
    assert "at 1.000 ms" in _timeline.window(trace, "attn_fwd", at=0.9).splitlines()[0]
    assert "no GPU op named like 'attn_bwd'" in _timeline.window(trace, "attn_bwd")
    assert "no GPU ops" in _timeline.window({"traceEvents": []}, "k")
    with pytest.raises(ValueError, match="at must be a share"):
        _timeline.window(trace, "gemm", at=1.5)
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    assert _timeline.main([str(path), "--around", "attn_fwd", "--at", "0", "--us", "200"]) == 0
    assert "Memcpy PtoP" in capsys.readouterr().out
