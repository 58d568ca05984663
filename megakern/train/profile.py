"""``megakern-train --profile``: a few steps under torch.profiler (``make_profiler``), then the trace, a top-kernels
table and, on GPUs, the split of each step's GPU time written into log.profile_dir (``write_profile``); with a
CUDA-graph step the recorded steps are replays (``past_capture``)."""
from __future__ import annotations

import dataclasses
import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist

from megakern.train import timeline


def past_capture(log_config, graph_warmup: int | None):
    """(log config, note | None): with a CUDA-graph step (``graph_warmup`` eager steps, then the capture) the
    profiler waits until the capture is done, so that it records replays and never runs during a capture; the note
    says so where that lengthens log.profile_wait."""
    if graph_warmup is None or log_config.profile_wait > graph_warmup:
        return log_config, None
    wait = graph_warmup + 1
    return (dataclasses.replace(log_config, profile_wait=wait),
            f"profile: waits {wait} steps (log.profile_wait is {log_config.profile_wait}), past the {graph_warmup} "
            "eager steps and the capture of the CUDA-graph step: it records replays")


def make_profiler(log_config, device: torch.device):
    """A torch.profiler over log.profile_wait + warmup + active steps (CPU, and CUDA on a GPU)."""
    lg = log_config
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    else:  # a CUDA build of torch on a machine without a GPU: libkineto's GPU enumeration logs a spurious
        # "gpuGetDeviceCount failed" ERROR when the profiler starts, whatever the activities; its log level is
        # read then (an explicit KINETO_LOG_LEVEL is kept)
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")
    schedule = torch.profiler.schedule(wait=lg.profile_wait, warmup=lg.profile_warmup, active=lg.profile_active,
                                       repeat=1)
    return torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True)


def write_profile(profiler, config, *, device: torch.device, global_batch: int, seq_length: int, precision: str,
                  log) -> Path:
    """The profile's files in a new directory of log.profile_dir: trace.json, kernels.txt (and timeline.txt on a
    GPU). Returns the directory."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    c = config.model
    rank = f"-rank{dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
    out = Path(config.log.profile_dir) / f"train-{c.n_layer}x{c.n_embd}-{device.type}-{stamp}{rank}"
    out.mkdir(parents=True, exist_ok=True)
    profiler.export_chrome_trace(str(out / "trace.json"))
    on_gpu = device.type == "cuda"
    sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    events = profiler.key_averages()
    trace = timeline.load(out / "trace.json")
    split = ""
    if on_gpu:  # the split of each step's GPU time, then the GPU time by launching op
        split = timeline.report(timeline.analyze(trace)) + "\n" + timeline.sources(trace, top=40)
    if split:
        (out / "timeline.txt").write_text(split + "\n")
    lines = [f"# megakern-train --profile: {config.log.profile_active} steps of {global_batch} x "
             f"{seq_length} tokens, {device} ({torch.cuda.get_device_name(device) if on_gpu else 'cpu'}), "
             f"precision {precision}, torch {torch.__version__}",
             "# ranges: data, forward, backward, optimizer (also NVTX ranges train.* for Nsight Systems)",
             timeline.host_summary(trace), *([split] if split else []), "",
             events.table(sort_by=sort, row_limit=40, max_name_column_width=80)]
    if on_gpu:  # the host's side too: launches, synchronizations, Python-side overheads
        lines += ["", "# host (sorted by self CPU time)",
                  events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=80)]
    (out / "kernels.txt").write_text("\n".join(lines))
    log(f"profile: {out / 'trace.json'} (chrome://tracing or ui.perfetto.dev), {out / 'kernels.txt'}")
    return out
