"""Where a profiled step's time goes on the GPU, from a torch.profiler chrome trace (``megakern-train --profile``
writes ``timeline.txt`` beside ``trace.json``; ``python -m megakern.train.timeline trace.json`` prints it).

A kernel table sums kernel durations, which says little once streams overlap or the GPU waits: a collective that
waits for its peer looks long, a GPU starved by its host looks idle nowhere. This reads the trace's intervals
instead and splits each profiled step's GPU wall time (its first kernel's start to its last kernel's end) into

    compute alone      only non-communication kernels (and local copies) running
    overlapped         communication and compute kernels running together (communication hidden)
    comm exposed       only communication running (NCCL kernels, peer-to-peer copies, symmetric memory's signal
                       kernels): the step waits for the network, or a peer
    idle               nothing running: waiting for the host's launches (``host``: the next kernel was launched
                       after the gap began) or for something else (``other``: a synchronization, an event)

and lists the longest idle gaps and exposed communication, grouped by kernel name (the gaps also by the pair of the
op that ended last before the gap and the kernel that ended it, on the same stream or across streams: which wait a
gap is), the median lead of the launches (kernel start - launch call; near zero when the GPU keeps up with the host
and waits for it), and the host's synchronizations with the device (each one drains the GPU's queue: the GPU then
waits for the host).

``window`` lists every GPU op, on every stream, in a stretch of the trace around one kernel (``python -m
megakern.train.timeline trace.json --around attn_fwd [--at 0.4] [--us 1400]``): when a transfer started against the
GEMM meant to hide it, which op a kernel waited for. A CUDA-graph replay's ops carry no launch, so their order and
streams are what places them in the model.

Steps are the ``ProfilerStep#N`` ranges of the host; a kernel belongs to the step during which it was launched.
GPU work launched outside them is not counted: the GPU runs behind the host, so the first profiled step's trace
also holds the end of the step before it (the tail of its backward, its optimizer), whose launches the profiler did
not record; ``sources`` says how much it left out.
"""
from __future__ import annotations

import bisect
import gzip
import json
import statistics
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
GAP_US = 2.0  # idle stretches shorter than this (launch latency between back-to-back kernels) are not listed


def is_comm(name: str) -> bool:
    """Communication: NCCL kernels (every collective and send/recv), copies between GPUs (``Memcpy PtoP``: the
    copy-engine pulls of parallel.overlap's symmetric ops) and symmetric memory's signal kernels (a wait spins
    until a peer's signal: time the step waits for the peer)."""
    n = name.lower()
    return (n.startswith("nccl") or "nccldevkernel" in n or n.startswith("memcpy ptop")
            or ("symmetric_memory" in n and ("wait_signal" in n or "put_signal" in n)))


@dataclass
class GpuOp:
    name: str
    start: float  # us
    end: float
    stream: int
    launch: float | None  # host time of the launch call, us
    comm: bool


@dataclass
class StepTimeline:
    wall: float = 0.0
    compute_alone: float = 0.0
    overlapped: float = 0.0
    comm_exposed: float = 0.0
    idle_host: float = 0.0
    idle_other: float = 0.0
    comm_busy: float = 0.0
    compute_busy: float = 0.0
    kernels: int = 0
    gaps: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0, ""]))  # next kernel -> [us, n, cause]
    # (the op that ended last before the gap, the kernel that ended it, "same" / "across" streams) -> [us, n]
    gap_pairs: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))
    exposed: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))  # comm kernel -> [us, n]
    leads: list = field(default_factory=list)
    host: float = 0.0  # the host's ProfilerStep range, us
    waits: dict = field(default_factory=lambda: defaultdict(lambda: [0.0, 0]))  # host sync call -> [us, n]


def load(path: str | Path) -> dict:
    """A chrome trace, as written (``.json``) or compressed (``.json.gz``)."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def _gpu_ops(events: list[dict]) -> list[GpuOp]:
    launches = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS:
            corr = (e.get("args") or {}).get("correlation")
            if corr is not None:
                launches[corr] = float(e["ts"])
    ops = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS:
            continue
        args = e.get("args") or {}
        start = float(e["ts"])
        ops.append(GpuOp(e.get("name", "?"), start, start + float(e.get("dur", 0.0)), int(args.get("stream", -1)),
                         launches.get(args.get("correlation")), is_comm(e.get("name", ""))))
    ops.sort(key=lambda o: o.start)
    return ops


def _is_wait(name: str) -> bool:
    """Runtime calls where the host waits for the device (a synchronous copy included)."""
    return "Synchronize" in name or name in ("cudaMemcpy", "cuMemcpyDtoH_v2", "cuMemcpy")


def _steps(events: list[dict]) -> list[tuple[float, float]]:
    steps = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events
             if e.get("ph") == "X" and str(e.get("name", "")).startswith("ProfilerStep#")
             and e.get("cat") in ("user_annotation", "cpu_op", None)]
    return sorted(steps)


def _step_of(t: float | None, steps: list[tuple[float, float]], starts: list[float]) -> int | None:
    """The index of the step whose range holds time ``t`` (a launch), or None (no launch record, or outside)."""
    if t is None:
        return None
    k = bisect.bisect_right(starts, t) - 1
    return k if k >= 0 and t < steps[k][1] else None


def host_summary(trace: dict) -> str:
    """'# per step: host X ms (mean of N ProfilerStep ranges)': the host's wall time per profiled step, on any
    device (the GPU's side is ``report``)."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    steps = _steps(events)
    if not steps:
        return "# per step: n/a (no ProfilerStep ranges in the trace)"
    return (f"# per step: host {sum(e - s for s, e in steps) / len(steps) / 1e3:.1f} ms (mean of {len(steps)} "
            "ProfilerStep ranges)")


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(intervals) -> float:
    return sum(e - s for s, e in intervals)


def _intersect(a, b) -> list[tuple[float, float]]:
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a, b) -> list[tuple[float, float]]:
    """a minus b, both sorted disjoint unions."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def analyze(trace: dict) -> list[StepTimeline]:
    """One StepTimeline per profiled step that launched GPU work."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    ops = _gpu_ops(events)
    steps = _steps(events)
    if not ops:
        return []
    per_step: list[list[GpuOp]]
    if not steps:  # no step ranges: the whole trace is one step
        steps = [(min(o.start for o in ops), max(o.end for o in ops))]
        per_step = [ops]
    else:  # each op in the step that launched it; ops launched outside every step are left out
        starts = [s for s, _ in steps]
        per_step = [[] for _ in steps]
        for o in ops:
            k = _step_of(o.launch, steps, starts)
            if k is not None:
                per_step[k].append(o)
    bounds = [s for s, _ in steps[1:]]
    waits: list[list[tuple[str, float, float]]] = [[] for _ in steps]
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS and _is_wait(str(e.get("name", ""))):
            t = float(e["ts"])
            if steps[0][0] <= t < steps[-1][1]:
                waits[bisect.bisect_right(bounds, t)].append((e["name"], t, float(e.get("dur", 0.0))))
    out = []
    for (h0, h1), group, step_waits in zip(steps, per_step, waits):
        if not group:
            continue
        st = StepTimeline(kernels=len(group), host=h1 - h0)
        for name, _, dur in step_waits:
            st.waits[name][0] += dur
            st.waits[name][1] += 1
        t0, t1 = min(o.start for o in group), max(o.end for o in group)
        st.wall = t1 - t0
        comm = _union((o.start, o.end) for o in group if o.comm)
        comp = _union((o.start, o.end) for o in group if not o.comm)
        busy = _union(comm + comp)
        st.comm_busy, st.compute_busy = _length(comm), _length(comp)
        st.overlapped = _length(_intersect(comm, comp))
        st.compute_alone = st.compute_busy - st.overlapped
        exposed = _subtract(comm, comp)
        st.comm_exposed = _length(exposed)
        # which communication kernels are exposed: attribute each exposed piece to the comm kernels covering it
        comm_ops = sorted((o for o in group if o.comm), key=lambda o: o.start)
        for s, e in exposed:
            for o in comm_ops:
                if o.start >= e:
                    break
                cut = min(e, o.end) - max(s, o.start)
                if cut > 0:
                    rec = st.exposed[o.name]
                    rec[0] += cut
                    rec[1] += 1
        # idle gaps between busy stretches, what ended them, and what ended last before them
        starts = sorted(group, key=lambda o: o.start)
        ends = sorted(group, key=lambda o: o.end)
        j = k = 0
        for (_, prev_end), (nxt_start, _) in zip(busy, busy[1:]):
            gap = nxt_start - prev_end
            while j < len(starts) and starts[j].start < nxt_start:
                j += 1
            while k < len(ends) and ends[k].end <= prev_end:
                k += 1
            nxt = starts[j] if j < len(starts) else None
            prev = ends[k - 1] if k else None
            host = nxt is not None and nxt.launch is not None and nxt.launch > prev_end
            if host:
                st.idle_host += gap
            else:
                st.idle_other += gap
            if gap < GAP_US:  # counted, not listed
                continue
            rec = st.gaps[nxt.name if nxt else "?"]
            rec[0] += gap
            rec[1] += 1
            rec[2] = "host" if host else "other"
            if prev is not None and nxt is not None:
                pair = st.gap_pairs[prev.name, nxt.name, "same" if prev.stream == nxt.stream else "across"]
                pair[0] += gap
                pair[1] += 1
        st.leads = [o.start - o.launch for o in group if o.launch is not None and not o.comm]
        out.append(st)
    return out


def sources(trace: dict, top: int = 25) -> str:
    """GPU time per step by what launched it: each kernel, copy or memset under the innermost host op around its
    launch and the nearest context (a backward function of autograd, or a ``record_function`` / NVTX range such as
    ``megakern.attention``), most time first. Says which call a kernel comes from when its name does not (a
    ``reduce_kernel`` is a bias gradient under ``AddmmBackward0``, a norm's weight gradient elsewhere)."""
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    host: dict = defaultdict(list)  # tid -> (start, -dur, kind, event)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat")
        if cat in ("cpu_op", "user_annotation") and not str(e.get("name", "")).startswith("ProfilerStep#"):
            host[e.get("tid")].append((float(e["ts"]), -float(e.get("dur", 0.0)), 0, e))
        elif cat in LAUNCH_CATS and (e.get("args") or {}).get("correlation") is not None:
            host[e.get("tid")].append((float(e["ts"]), 0.0, 1, e))
    origin = {}  # correlation -> (innermost op, context)
    for items in host.values():
        items.sort(key=lambda x: (x[0], x[1], x[2]))
        stack: list[tuple[float, str, str]] = []  # (end, name, cat)
        for ts, neg_dur, kind, e in items:
            while stack and stack[-1][0] <= ts:
                stack.pop()
            if kind == 0:
                stack.append((ts - neg_dur, str(e.get("name", "?")), e.get("cat")))
                continue
            ops = [n for _, n, c in stack if c == "cpu_op"]
            context = next((n.removeprefix("autograd::engine::evaluate_function: ") for _, n, c in reversed(stack)
                            if n.startswith("autograd::engine::evaluate_function") or c == "user_annotation"), "")
            origin[e["args"]["correlation"]] = (ops[-1] if ops else "", context)
    steps = _steps(events)
    starts = [s for s, _ in steps]
    launches = {(e.get("args") or {}).get("correlation"): float(e["ts"]) for e in events
                if e.get("ph") == "X" and e.get("cat") in LAUNCH_CATS}
    n_steps = max(1, len(steps))
    totals: dict = defaultdict(lambda: [0.0, 0])
    left_out: dict = defaultdict(lambda: [0.0, 0])  # name -> [us, count] launched outside every step
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS:
            corr = (e.get("args") or {}).get("correlation")
            name = str(e.get("name", "?"))
            if steps and _step_of(launches.get(corr), steps, starts) is None:
                rec = left_out[name]
            else:
                op, context = origin.get(corr, ("", ""))
                rec = totals[(name, op, context)]
            rec[0] += float(e.get("dur", 0.0))
            rec[1] += 1
    if not totals and not left_out:
        return "# GPU time by source: no GPU work in the trace"
    lines = [f"# GPU time by source, per step (mean of {n_steps}): ms, count, GPU op <- host op [context]"]
    for (name, op, context), (us, c) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        where = f"{op} [{context}]" if context else op
        lines.append(f"#   {us / n_steps / 1e3:8.2f} ms {c / n_steps:7.1f}x  {_short(name, 48)} <- {_short(where, 60)}")
    if left_out:
        us, count = sum(v[0] for v in left_out.values()), sum(v[1] for v in left_out.values())
        biggest = ", ".join(f"{_short(n, 40)} {v[0] / 1e3:.2f} ms" for n, v in
                            sorted(left_out.items(), key=lambda kv: -kv[1][0])[:3])
        lines.append(f"# not counted: {count} GPU ops, {us / 1e3:.2f} ms in all, launched outside the profiled steps "
                     f"(the step before the first one, still running on the GPU): {biggest}")
    return "\n".join(lines)


def _short(name: str, width: int = 70) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def report(steps: list[StepTimeline], top: int = 8) -> str:
    """The per-step means and the top idle gaps and exposed collectives, as text."""
    if not steps:
        return "# timeline: no GPU kernels in the trace"
    n = len(steps)

    def mean(attr):
        return sum(getattr(s, attr) for s in steps) / n / 1e3

    wall = mean("wall")
    rows = [("compute alone", mean("compute_alone")), ("comm + compute overlapped", mean("overlapped")),
            ("comm exposed", mean("comm_exposed")), ("idle, waiting for the host", mean("idle_host")),
            ("idle, other (sync, events)", mean("idle_other"))]
    leads = [x for s in steps for x in s.leads]
    lines = [f"# timeline per step (mean of {n}): host {mean('host'):.1f} ms, GPU wall {wall:.1f} ms, "
             f"{sum(s.kernels for s in steps) / n:.0f} kernels; communication busy {mean('comm_busy'):.1f} ms "
             f"({100 * mean('overlapped') / max(mean('comm_busy'), 1e-9):.0f}% hidden), compute busy "
             f"{mean('compute_busy'):.1f} ms"]
    lines += [f"#   {label:<28} {ms:8.2f} ms  {100 * ms / max(wall, 1e-9):5.1f}%" for label, ms in rows]
    if leads:
        lines.append(f"#   launch lead (kernel start - launch), median {statistics.median(leads) / 1e3:.3f} ms "
                     "(near 0: the GPU waits for the host)")
    waits: dict = defaultdict(lambda: [0.0, 0])
    for s in steps:
        for k, (us, c) in s.waits.items():
            waits[k][0] += us
            waits[k][1] += c
    lines.append("#   host waits for the device: " + (", ".join(
        f"{k} {c / n:.1f}x {us / n / 1e3:.2f} ms" for k, (us, c) in sorted(waits.items(), key=lambda kv: -kv[1][0]))
        if waits else "none"))
    gaps: dict = defaultdict(lambda: [0.0, 0, ""])
    exposed: dict = defaultdict(lambda: [0.0, 0])
    for s in steps:
        for k, (us, c, cause) in s.gaps.items():
            gaps[k][0] += us
            gaps[k][1] += c
            gaps[k][2] = cause
        for k, (us, c) in s.exposed.items():
            exposed[k][0] += us
            exposed[k][1] += c
    if gaps:
        lines.append("# idle gaps, by the kernel that ended them (ms per step, count per step, cause)")
        for k, (us, c, cause) in sorted(gaps.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"#   {us / n / 1e3:8.2f} ms {c / n:6.1f}x  {cause:<5} {_short(k)}")
    pairs: dict = defaultdict(lambda: [0.0, 0])
    for s in steps:
        for key, (us, c) in s.gap_pairs.items():
            pairs[key][0] += us
            pairs[key][1] += c
    if pairs:
        lines.append("# idle gaps, by the op that ended last before them -> the kernel that ended them (ms per step, "
                     "count per step; across: the two on different streams, a wait on an event or a signal)")
        for (before, after, streams), (us, c) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"#   {us / n / 1e3:8.2f} ms {c / n:6.1f}x  {streams:<6} {_short(before, 44)} -> "
                         f"{_short(after, 44)}")
    if exposed:
        lines.append("# exposed communication, by kernel (ms per step, pieces per step)")
        for k, (us, c) in sorted(exposed.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"#   {us / n / 1e3:8.2f} ms {c / n:6.1f}x  {_short(k)}")
    return "\n".join(lines)


def window(trace: dict, pattern: str, at: float = 0.5, before_us: float = 150.0, after_us: float = 1400.0) -> str:
    """Every GPU op from ``before_us`` before to ``after_us`` after the first kernel whose name holds ``pattern``
    that starts at or after the share ``at`` (0 to 1) of the trace's GPU span: a line each, its start relative to
    that kernel's, its duration (us), its stream, its name and the bytes a copy or a fill moved."""
    if not 0.0 <= at <= 1.0:
        raise ValueError(f"window: at must be a share of the trace's GPU span, 0 to 1, got {at}")
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in GPU_CATS]
    if not events:
        return "# window: no GPU ops in the trace"
    events.sort(key=lambda e: float(e["ts"]))
    first, last = float(events[0]["ts"]), max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
    after = first + at * (last - first)
    anchor = next((e for e in events if float(e["ts"]) >= after and pattern in e.get("name", "")), None)
    if anchor is None:
        return f"# window: no GPU op named like {pattern!r} starts past {100 * at:.0f}% of the trace"
    t0 = float(anchor["ts"])
    lines = [f"# window: the GPU ops from {before_us:.0f} us before to {after_us:.0f} us after {_short(anchor['name'])}"
             f" at {(t0 - first) / 1e3:.3f} ms into the trace (start us, duration us, stream, op, bytes)"]
    for e in events:
        start = float(e["ts"]) - t0
        if -before_us <= start <= after_us:
            args = e.get("args") or {}
            moved = f" {args['bytes']}" if "bytes" in args else ""
            lines.append(f"{start:9.1f} {float(e.get('dur', 0.0)):8.1f}  s{args.get('stream', '?'):<5} "
                         f"{_short(e.get('name', '?'), 60)}{moved}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m megakern.train.timeline",
                                description="Where a profiled step's GPU time goes (a torch.profiler chrome trace).")
    p.add_argument("trace", help="trace.json or trace.json.gz")
    p.add_argument("--around", metavar="KERNEL", help="list the GPU ops around the first kernel named like KERNEL "
                                                      "instead (window)")
    p.add_argument("--at", type=float, default=0.5, help="with --around: where to look from, a share of the trace")
    p.add_argument("--us", type=float, default=1400.0, help="with --around: microseconds after the kernel")
    try:
        a = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    trace = load(a.trace)
    if a.around:
        print(window(trace, a.around, at=a.at, after_us=a.us))
        return 0
    print(report(analyze(trace)))
    print(sources(trace))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
