"""Sweeps for megakern's FP8 kernels on a GPU; the launchers' defaults are set from these tables.

casts: the per-tensor Triton cast (megakern/_fp8_triton.py) for each tile (BLOCK_M x BLOCK_N, warps) and persistent
grid size (programs per SM; 0 = one program per tile), delayed / delayed+T / current scaling, GB/s (bytes of
benchmarks/bench_fp8.py) as a fraction of the same-run copy roofline, GPU time of CUDA-graph replays (no host).

gemm: TFLOP/s (2 * M * N * K / time) of the Triton FP8 GEMM (megakern/_fp8_gemm_triton.py) for each
(BLOCK_M, BLOCK_N, warps, stages) and scaling (tensor, row, block 128), and of cuBLASLt (torch._scaled_mm, per
tensor and per row) on the same operands.

    python profiles/tune_fp8.py [--part casts,gemm] [--shapes 8192x8192x8192,16384x4096x14336] [--cast 16384x4096]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.bench_fp8 import bytes_moved
from benchmarks.common import bench, measure_copy_gbps
from megakern import _fp8_gemm_triton as kern
from megakern import _fp8_triton as casts
from megakern import fp8
from megakern.fp8 import quantize_ref

CAST_TILES = ((64, 128, 8), (32, 256, 8), (64, 256, 8), (128, 128, 8), (32, 128, 4), (16, 256, 4), (8, 1024, 8))
CAST_PROGRAMS = (0, 4, 8, 16)


def tune_casts(shape: str) -> None:
    dev = torch.device("cuda")
    m, n = map(int, shape.split("x"))
    copy = measure_copy_gbps(dev)
    print(f"\n== casts {m}x{n} bf16 -> e4m3; copy roofline {copy:.0f} GB/s (CUDA-graph replays)")
    x = torch.randn(m, n, device=dev, dtype=torch.bfloat16) * 3
    scale = torch.tensor([0.37], device=dev)
    amax_out = torch.zeros(1, device=dev)
    for tiles in CAST_TILES:
        for per_sm in CAST_PROGRAMS:
            casts.TILES = casts.TILES_TRANSPOSE = tiles
            casts.PROGRAMS_PER_SM = casts.PROGRAMS_PER_SM_TRANSPOSE = per_sm
            row = []
            for mode, kw in (("delayed", dict(scale=scale, amax_out=amax_out)),
                             ("delayed+T", dict(scale=scale, amax_out=amax_out, transpose=True)), ("current", {})):
                try:
                    t = bench(lambda kw=kw: fp8.quantize(x, torch.float8_e4m3fn, backend="triton", **kw), device=dev,
                              graph=True)["median"]
                    gbps = bytes_moved(mode, m, n, 2) / t / 1e6
                    row.append(f"{mode} {gbps:6.0f} ({gbps / copy:.2f})")
                except Exception as exc:
                    row.append(f"{mode} failed: {str(exc).splitlines()[0][:40]}")
            print(f"  {'x'.join(map(str, tiles)):10s} programs/SM {per_sm:2d}: " + " | ".join(row))

CONFIGS = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4),
           (64, 256, 4, 4), (128, 64, 4, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", default="casts,gemm")
    parser.add_argument("--cast", default="16384x4096")
    parser.add_argument("--shapes", default="8192x8192x8192,16384x4096x14336,16384x14336x4096")
    parser.add_argument("--configs", default="", help="BMxBNxWxS,... (default: the built-in list)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    configs = [tuple(map(int, c.split("x"))) for c in args.configs.split(",")] if args.configs else CONFIGS
    if "casts" in args.part:
        tune_casts(args.cast)
    if "gemm" not in args.part:
        return
    e4 = torch.float8_e4m3fn
    for shape in args.shapes.split(","):
        m, n, k = map(int, shape.split("x"))
        flop = 2.0 * m * n * k
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.05
        tflops = lambda ms: flop / ms / 1e9  # noqa: E731
        print(f"\n== M={m} N={n} K={k}")
        for name, gran in (("tensor", "tensor"), ("row", "row"), ("block", "block")):
            qa = quantize_ref(a, e4, granularity=gran, block=128)
            qb = quantize_ref(b, e4, granularity="tile" if gran == "block" else gran, block=128)
            scaling = {"tensor": kern.TENSOR, "row": kern.ROW, "block": kern.BLOCK}[name]
            if name != "block":
                sa = qa.scale_inv.float().reshape(()) if name == "tensor" else qa.scale_inv.float().reshape(m, 1)
                sb = qb.scale_inv.float().reshape(()) if name == "tensor" else qb.scale_inv.float().reshape(1, n)
                t = bench(lambda: torch._scaled_mm(qa.data, qb.data.t(), sa, sb, out_dtype=torch.bfloat16),
                          device=dev)["median"]
                print(f"  scaled_mm {name:6s}                 {tflops(t):7.1f} TFLOP/s")
            for cfg in configs:
                try:
                    t = bench(lambda cfg=cfg: kern.gemm(qa.data, qb.data, qa.scale_inv.float(), qb.scale_inv.float(),
                                                        scaling, torch.bfloat16, None, block=128, config=cfg),
                              device=dev)["median"]
                    print(f"  triton    {name:6s} {'x'.join(map(str, cfg)):14s} {tflops(t):7.1f} TFLOP/s")
                except Exception as exc:  # a config that does not fit (shared memory, registers) is reported
                    print(f"  triton    {name:6s} {'x'.join(map(str, cfg)):14s} failed: {str(exc).splitlines()[0][:80]}")
        t = bench(lambda: a @ b.t(), device=dev)["median"]
        print(f"  cublas    bf16                   {tflops(t):7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
