"""Geometry sweep for megakern._reduce_triton.sum_rows, the last step of the norms' and biases' column sums.

Times the (BLOCK_G, BLOCK_N, warps) of the kernel on the partial-sum shapes the backward kernels leave (the norms'
persistent programs at hidden 384-16384, dweight alone or with dbias; the linear's and bias + GELU's tile rows), in a
CUDA graph (a training step replays them from one, and their partial rows were just written, so they are in L2),
against the default geometry (``sum_rows_geometry``), which is set from this table.

    python profiles/tune_sum_rows.py [--shapes 1056x384,528x1024x2] [--rep-ms 100]

A shape is GxN or GxNxL (L partial tensors, as a LayerNorm's dweight and dbias).
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench
from megakern import _reduce_triton as kern
from megakern._cuda import sm_count

# the norms' backward at 132 SMs (programs: 8, 4, 2, 1 an SM at hidden 384, 768-1024, 2048, 4096+), the linear's
# bias (128 rows a tile at 16384 tokens), bias + GELU's (32 rows a tile)
SHAPES = ("1056x384,1056x384x2,528x768,528x1024,528x1024x2,264x2048,264x2048x2,132x4096,132x8192x2,132x16384,"
          "128x1024,128x4096,512x1536,512x4096")
BLOCK_N = (8, 16, 32, 64, 128)
BLOCK_G = (16, 32, 64, 128, 256, 512, 1024, 2048)
WARPS = (4, 8)


def geometries(g: int) -> list[tuple[int, int, int]]:
    """Every (BLOCK_G, BLOCK_N, warps) with 8 to 64 values a thread, BLOCK_G at most the next power of two of g."""
    out = []
    for block_n in BLOCK_N:
        for block_g in BLOCK_G:
            if block_g > max(16, 1 << (g - 1).bit_length()):
                continue
            for warps in WARPS:
                per_thread = block_g * block_n // (32 * warps)
                if 8 <= per_thread <= 64:
                    out.append((block_g, block_n, warps))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES)
    parser.add_argument("--rep-ms", type=int, default=100)
    args = parser.parse_args()
    dev = torch.device("cuda")
    sms = sm_count(dev.index)
    print(f"{torch.cuda.get_device_name(dev)}, {sms} SMs, torch {torch.__version__}")
    for shape in args.shapes.split(","):
        dims = [int(d) for d in shape.split("x")]
        g, n, lead = dims[0], dims[1], dims[2] if len(dims) > 2 else 1
        part = torch.randn((lead, g, n) if lead > 1 else (g, n), device=dev)
        want = part.double().sum(-2)
        default = kern.sum_rows_geometry(g, n, lead, sms)
        rows = []
        for geometry in [default] + [x for x in geometries(g) if x != default]:
            block_g, block_n, warps = geometry
            got = kern.sum_rows(part, block_g=block_g, block_n=block_n, num_warps=warps)
            if not torch.allclose(got.double(), want, rtol=1e-5, atol=1e-3):
                print(f"{shape} {geometry} WRONG")
                continue
            t = bench(lambda: kern.sum_rows(part, block_g=block_g, block_n=block_n, num_warps=warps), device=dev,
                      rep_ms=args.rep_ms, graph=True)["median"]
            rows.append((t, geometry))
        rows.sort()
        t_default = next(t for t, geometry in rows if geometry == default)
        print(f"{shape}: default {default} {t_default * 1e3:.2f} us; best "
              + ", ".join(f"{geometry} {t * 1e3:.2f}" for t, geometry in rows[:5]), flush=True)


if __name__ == "__main__":
    main()
