"""Where the MoE layer's forward + backward time goes: the GPU kernels of megakern's MoEMLP and of Hugging Face's
Mixtral sparse-MoE block (torch.compile) at a Mixtral-8x7B layer's shape, by torch.profiler.

    python profiles/profile_moe_layer.py [--tokens 8192] [--iters 5] [--rows 25]

For each provider: the GPU time of one forward + backward (the sum of its kernels over ``--iters`` iterations, divided),
and its kernels grouped by name with their share, the largest first. The weights, tokens and routing are
benchmarks/bench_moe.py's layer case.
"""
from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import bench_moe as B


def kernel_times(step, iters: int) -> dict[str, float]:
    """{kernel name: GPU microseconds per iteration} over ``iters`` iterations of ``step`` (after warm-up)."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            step()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] += event.device_time / iters
    return dict(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--hf-experts", default="default")
    args = parser.parse_args()
    device = torch.device("cuda")
    case = B.Layer(B.Routing("Mixtral-8x7B layer", 8, 2, args.tokens), 4096, 14336)
    w = B.layer_weights(case, device, torch.bfloat16)
    x = torch.randn(1, args.tokens, case.hidden, device=device).to(torch.bfloat16).requires_grad_()
    g = torch.randn_like(x)
    layers = {"megakern": B._load_layer_megakern(False)(device), "hf-compile": B._load_layer_hf(True)(device)}
    for name, load in layers.items():
        layer = load(case, w, args)

        def step():
            out = layer.forward(x)
            torch.autograd.grad(out, [x, *layer.params], g, allow_unused=True)

        times = kernel_times(step, args.iters)
        total = sum(times.values())
        print(f"\n{name}: {total / 1e3:.2f} ms of GPU kernels per forward + backward, {len(times)} kernels")
        for kernel, us in sorted(times.items(), key=lambda kv: -kv[1])[:args.rows]:
            print(f"  {us / 1e3:8.3f} ms {100 * us / total:5.1f}%  {kernel[:110]}")
        del layer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
