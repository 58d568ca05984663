"""Why the master-weight AdamW runs slower inside the training step than in bench_optim: the same step over the same
state (bench_optim's parameters of ``--model``), timed by CUDA events around the step alone in three settings,
alternated, medians of ``--reps``:

    idle        the step with nothing before it (as bench_optim times it)
    after-gemm  the step right after ``--burst-ms`` of bf16 GEMMs (the backward's products at the 8B layer shape,
                which run the card at its power limit), as the training step runs it
    after-wait  the same burst, then a spin of ``--wait-ms`` (torch.cuda._sleep: the SMs idle) before the step

If after-gemm is slower than idle and after-wait recovers it, the difference is the card's clocks after the GEMMs,
not the optimizer's memory layout.

    python profiles/profile_optim_step.py [--model llama-8b-4l] [--reps 15] [--burst-ms 100] [--wait-ms 5]
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks.bench_optim import BYTES_PER_PARAM, MODELS, State, shapes
from benchmarks.common import measure_copy_gbps
from megakern.optim import MasterAdamW


def _spin_cycles(ms: float) -> int:
    """torch.cuda._sleep cycles for about ``ms`` on this card (its SM clock rate in kHz)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    rate_khz = getattr(props, "clock_rate", 0) or 1_755_000
    return int(ms * rate_khz)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-8b-4l", choices=sorted(MODELS))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--burst-ms", type=float, default=100.0)
    parser.add_argument("--wait-ms", type=float, default=5.0)
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    params = shapes(args.model, dev)
    numel = sum(torch.Size(s).numel() for s in params)
    state = State(params, dev)
    opt = MasterAdamW(state.optimizer, dict(zip(state.masters, state.models)))

    def step():
        opt.step(grad_scale=state.grad_scale, found_inf=state.found_inf)

    a, b = (torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty(4096, 4096, device=dev, dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        torch.mm(a.t(), b, out=out)  # a weight-gradient product: dy^T x over 8192 tokens
    end.record()
    end.synchronize()
    gemm_ms = start.elapsed_time(end) / 10
    bursts = max(1, round(args.burst_ms / gemm_ms))
    print(f"copy {copy:.0f} GB/s; {args.model}: {numel / 1e6:.1f}M parameters; burst: {bursts} products of "
          f"{gemm_ms:.3f} ms", flush=True)
    step()  # compile, build the tables
    times: dict[str, list[float]] = {"idle": [], "after-gemm": [], "after-wait": []}
    for _ in range(args.reps):
        for setting in times:
            torch.cuda.synchronize()
            if setting != "idle":
                for _ in range(bursts):
                    torch.mm(a.t(), b, out=out)
            if setting == "after-wait":
                torch.cuda._sleep(_spin_cycles(args.wait_ms))
            start.record()
            step()
            end.record()
            end.synchronize()
            times[setting].append(start.elapsed_time(end))
    for setting, ms in times.items():
        median = statistics.median(ms)
        gbps = BYTES_PER_PARAM * numel / (median * 1e-3) / 1e9
        print(f"{setting:<11} {median:8.2f} ms [min {min(ms):.2f}, max {max(ms):.2f}]  {gbps:6.0f} GB/s "
              f"({gbps / copy:.2f} of copy)")


if __name__ == "__main__":
    main()
