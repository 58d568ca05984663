"""Tile sweep for the Triton FP8 GEMM (megakern/_fp8_gemm_triton.py) against torch._scaled_mm in the same run.

TFLOP/s (2 * M * N * K / time) of the kernel-level launcher for each (BLOCK_M, BLOCK_N, warps, stages) and
scaling (tensor, row, block 128), and of cuBLASLt (torch._scaled_mm, per tensor and per row) on the same operands.
The launcher's defaults are set from this table.

    python profiles/tune_fp8_gemm.py [--shapes 8192x8192x8192,16384x4096x14336]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench
from megakern import _fp8_gemm_triton as kern
from megakern.fp8 import quantize_ref

CONFIGS = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (256, 128, 8, 3), (128, 128, 4, 4),
           (64, 256, 4, 4), (128, 64, 4, 4))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="8192x8192x8192,16384x4096x14336,16384x14336x4096")
    parser.add_argument("--configs", default="", help="BMxBNxWxS,... (default: the built-in list)")
    args = parser.parse_args()
    dev = torch.device("cuda")
    configs = [tuple(map(int, c.split("x"))) for c in args.configs.split(",")] if args.configs else CONFIGS
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
