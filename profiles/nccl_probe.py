"""NCCL's bandwidth on this machine, alone and beside a busy compute stream, for the collectives megakern's parallel
layer issues (all-reduce: DDP, copy_to_tp; all-gather / reduce-scatter: FSDP2, sequence parallel).

    torchrun --nproc-per-node 2 profiles/nccl_probe.py [--sizes-mb 8,32,128] [--iters 20]

Rank 0 prints one row per (collective, size, dtype): time (median of --iters, CUDA events), algorithm bandwidth
(bytes of the full tensor / time) and bus bandwidth (nccl-tests' convention: all-reduce x 2(n-1)/n, all-gather and
reduce-scatter x (n-1)/n), alone and while a bf16 matmul loop keeps every SM busy on another stream ("loaded": how
much a collective slows when it overlaps compute, the way DDP's buckets and FSDP's prefetches run). Run with
NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT to see the transport each channel uses (P2P over NVLink, SHM, NET).
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist


def _time(fn, iters: int, stream) -> float:
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="8,32,128")
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    n, rank = dist.get_world_size(), dist.get_rank()
    comm = torch.cuda.Stream()
    load = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if rank == 0:
        print(f"# {n} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}, nccl "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}")
        print(f"| collective | MiB | dtype | alone ms | algbw GB/s | busbw GB/s | loaded ms | slowdown |")
        print("|---|---|---|---|---|---|---|---|")
    for mb in [int(x) for x in args.sizes_mb.split(",")]:
        for dtype in (torch.float32, torch.bfloat16):
            numel = (mb << 20) // torch.empty((), dtype=dtype).element_size()
            numel -= numel % n
            full = torch.randn(numel, device="cuda", dtype=dtype)
            shard = torch.randn(numel // n, device="cuda", dtype=dtype)
            ops = {
                "all_reduce": (lambda: dist.all_reduce(full), 2 * (n - 1) / n),
                "all_gather": (lambda: dist.all_gather_into_tensor(full, shard), (n - 1) / n),
                "reduce_scatter": (lambda: dist.reduce_scatter_tensor(shard, full), (n - 1) / n),
            }
            for name, (fn, factor) in ops.items():
                for _ in range(3):
                    with torch.cuda.stream(comm):
                        fn()
                torch.cuda.synchronize()
                dist.barrier()
                alone = _time(fn, args.iters, comm)
                # the same collective while matmuls fill the GPU on another stream
                with torch.cuda.stream(load):
                    for _ in range(4 * args.iters):
                        torch.mm(a, a)
                loaded = _time(fn, args.iters, comm)
                torch.cuda.synchronize()
                dist.barrier()
                t = torch.tensor([alone, loaded], device="cuda")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                alone, loaded = t.tolist()
                if rank == 0:
                    nbytes = numel * full.element_size()
                    alg = nbytes / (alone / 1e3) / 1e9
                    print(f"| {name} | {mb} | {str(dtype).replace('torch.', '')} | {alone:.3f} | {alg:.0f} | "
                          f"{alg * factor:.0f} | {loaded:.3f} | {loaded / alone:.1f}x |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
