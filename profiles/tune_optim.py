"""Block sweep for megakern.optim.MasterAdamW's kernel (megakern._optim_triton) over GPT-350M's parameters (bf16
gradients, fp32 masters, bf16 weights), against the same-run copy bandwidth: (BLOCK, warps), in GB/s of the 28 bytes
a parameter the pass must move. Each configuration starts from the same state; the masters after one step must match
the default configuration's. The winner becomes megakern.optim's BLOCK, WARPS.

--sumsq sweeps megakern.optim.SumOfSquares (megakern._sumsq_triton) over the same model's bf16 gradients instead, in
GB/s of the 2 bytes a parameter it reads, each configuration's sum checked against the fp64 one, torch._foreach_norm
timed beside it; the winner becomes SUMSQ_BLOCK, SUMSQ_WARPS.

    python profiles/tune_optim.py [--model gpt-350m] [--sumsq]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_optim import BYTES_PER_PARAM, MODELS, State, shapes
from benchmarks.common import bench, measure_copy_gbps
from megakern.optim import MasterAdamW, SumOfSquares

CONFIGS = [(1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16)]
SUMSQ_CONFIGS = [(1024, 2), (2048, 4), (4096, 4), (4096, 8), (8192, 4), (8192, 8), (16384, 8), (16384, 16)]


def sweep_sumsq(params, numel: int, copy: float, dev: torch.device) -> None:
    grads = [w.grad for w in State(params, dev).models]
    truth = sum(float(g.double().square().sum()) for g in grads)
    t = bench(lambda: torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum(), device=dev)
    gbps = 2 * numel / (t["median"] * 1e-3) / 1e9
    print(f"torch._foreach_norm {t['median'] * 1e3:8.1f} us  {gbps:6.0f} GB/s ({gbps / copy:.2f})", flush=True)
    for block, warps in SUMSQ_CONFIGS:
        sumsq = SumOfSquares(block=block, warps=warps)
        err = abs(float(sumsq(grads)) - truth) / truth
        if not err <= 1e-5:
            print(f"{block:6} {warps:2}w WRONG: off the fp64 sum by {err:.3g}")
            continue
        t = bench(lambda: sumsq(grads), device=dev)
        gbps = 2 * numel / (t["median"] * 1e-3) / 1e9
        print(f"{block:6} {warps:2}w {t['median'] * 1e3:8.1f} us  {gbps:6.0f} GB/s ({gbps / copy:.2f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="gpt-350m", choices=sorted(MODELS))
    parser.add_argument("--sumsq", action="store_true", help="sweep the sum of squares' kernel instead")
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    params = shapes(args.model, dev)
    numel = sum(torch.Size(s).numel() for s in params)
    print(f"copy {copy:.0f} GB/s; {args.model}: {len(params)} tensors, {numel / 1e6:.1f}M parameters")
    if args.sumsq:
        sweep_sumsq(params, numel, copy, dev)
        return
    reference = None
    for block, warps in CONFIGS:
        state = State(params, dev)
        opt = MasterAdamW(state.optimizer, dict(zip(state.masters, state.models)), block=block, warps=warps)

        def step():
            opt.step(grad_scale=state.grad_scale, found_inf=state.found_inf)

        step()
        masters = torch.cat([m.reshape(-1) for m in state.masters])
        if reference is None:
            reference = masters
        elif not torch.equal(masters, reference):
            print(f"{block:6} {warps:2}w WRONG: masters differ from the first configuration's")
            continue
        t = bench(step, device=dev)
        gbps = BYTES_PER_PARAM * numel / (t["median"] * 1e-3) / 1e9
        print(f"{block:6} {warps:2}w {t['median'] * 1e3:8.1f} us  {gbps:6.0f} GB/s ({gbps / copy:.2f})", flush=True)
        del state, opt


if __name__ == "__main__":
    main()
