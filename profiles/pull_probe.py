"""How fast a rank pulls a peer's block out of symmetric memory over NVLink, by the ways parallel/overlap.py could
move it: copy-engine copies on 1, 2 or 4 streams at once (the block split in as many parts), and an SM copy kernel
(an elementwise kernel reading the peer's mapping), alone and beside a bf16 GEMM on the compute stream; every rank
pulls at once, as in the fused ops.

    torchrun --nproc-per-node 2 profiles/pull_probe.py [--sizes-mb 4,16,32] [--iters 30]

Rank 0 prints one row per (size, way): the median time of --iters (CUDA events around the pulls, queued behind a
sleeping kernel so that the host's launch cost stays out; the ranks aligned by a barrier before each) and the bandwidth (bytes / time); with "beside gemm" the GEMM's slowdown too. NVLink
multicast stays off.
"""
from __future__ import annotations

import argparse
import os
import statistics

os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", default="4,16,32")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    from torch.distributed import _symmetric_memory as symm_mem

    try:
        symm_mem.set_backend("CUDA")
    except Exception:
        pass
    n, r = dist.get_world_size(), dist.get_rank()
    peer = (r + 1) % n
    sizes = [int(float(s) * 2**20) for s in args.sizes_mb.split(",")]
    buf = symm_mem.empty(max(sizes), dtype=torch.uint8, device="cuda")
    handle = symm_mem.rendezvous(buf, dist.group.WORLD)
    buf.fill_(r)
    streams = [torch.cuda.Stream() for _ in range(4)]
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)

    def gemm():
        for _ in range(4):
            torch.mm(a, b)

    def pull_ce(k):
        def run(dst, src):
            current = torch.cuda.current_stream()
            parts_d, parts_s = dst.chunk(k), src.chunk(k)
            for s, d, x in zip(streams[:k], parts_d, parts_s):
                s.wait_stream(current)
                with torch.cuda.stream(s):
                    d.copy_(x)
            for s in streams[:k]:
                current.wait_stream(s)
        return run

    def pull_sm(dst, src):
        torch.mul(src.view(torch.int32), 1, out=dst.view(torch.int32))

    ways = {"ce x1": pull_ce(1), "ce x2": pull_ce(2), "ce x4": pull_ce(4), "sm kernel": pull_sm}

    def timed(fn) -> float:
        times = []
        for _ in range(args.iters):
            dist.barrier()
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000)  # the GPU busy while the host queues the timed work: its launch cost is not timed
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        return statistics.median(times)

    gemm_alone = timed(gemm)
    if r == 0:
        print(f"{n} ranks, {torch.cuda.get_device_name()}, torch {torch.__version__}; 4 bf16 GEMMs 4096^3 alone "
              f"{gemm_alone * 1e3:.0f} us", flush=True)
    for size in sizes:
        src = handle.get_buffer(peer, [size], torch.uint8, 0)
        dst = torch.empty(size, dtype=torch.uint8, device="cuda")
        for name, way in ways.items():
            alone = timed(lambda: way(dst, src))
            ok = bool((dst == peer).all())

            def both():
                side = streams[3] if name != "ce x4" else torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    gemm()
                way(dst, src)
                torch.cuda.current_stream().wait_stream(side)

            beside = timed(both)
            if r == 0:
                print(f"{size / 2**20:5.0f} MiB {name:10s} alone {alone * 1e3:7.1f} us {size / alone / 1e6:6.0f} GB/s"
                      f" | with the GEMMs {beside * 1e3:7.1f} us (GEMMs alone {gemm_alone * 1e3:.0f} us)"
                      f"{'' if ok else '  WRONG DATA'}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
