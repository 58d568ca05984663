"""Tile sweep for megakern.bias_gelu's backward kernel (megakern._activation_triton), bf16, against the same-run copy
bandwidth: (BLOCK_M, BLOCK_N, warps) per shape, the programs in column order as the launcher runs them, the kernel
alone and as the launcher runs it with that tile (``_activation_triton.bwd``: the kernel, then ``sum_rows`` over the
partial sums), in GB/s of the bytes it must move (read h and dy, write dh: 3 * M * N * 2). The winner goes into
``_activation_triton._bias_bwd_tile``.

    python profiles/tune_bias_gelu.py [--shapes 16384x4096,8192x8192] [--tiles 64x64x4,128x64x8]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench, measure_copy_gbps
from megakern import _activation_triton as kern
from megakern._intmath import cdiv

TILES = [(64, 64, 4), (64, 64, 2), (128, 64, 4), (128, 64, 8), (64, 128, 4), (64, 128, 8), (128, 32, 4), (64, 32, 2),
         (32, 64, 2), (32, 128, 4), (64, 256, 8)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", default="16384x4096,8192x8192,16384x1024,16384x1536,65536x1024")
    parser.add_argument("--tiles", default=None, help="BLOCK_MxBLOCK_Nxwarps,... (default: TILES)")
    args = parser.parse_args()
    tiles = [tuple(map(int, t.split("x"))) for t in args.tiles.split(",")] if args.tiles else TILES
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy {copy:.0f} GB/s")
    for shape in args.shapes.split(","):
        m, n = map(int, shape.split("x"))
        h = 2 * torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        dy, b = torch.randn_like(h), torch.randn(n, device=dev, dtype=torch.bfloat16)
        want_dh, want_db = kern.bwd(dy, h, b)
        nbytes = 3 * m * n * 2
        for bm, bn, warps in tiles:
            dh = torch.empty_like(h)
            part = torch.empty((cdiv(m, bm), n), dtype=torch.float32, device=dev)

            def kernel():
                kern._bias_gelu_bwd_kernel[(cdiv(n, bn), cdiv(m, bm))](dy, h, b, dh, part, m, n, BLOCK_M=bm,
                                                                         BLOCK_N=bn, COLS_FAST=True, num_warps=warps)

            def whole(tile=(bm, bn, warps)):
                return kern.bwd(dy, h, b, tile=tile)

            kernel()
            whole_dh, db = whole()
            if not (torch.equal(dh, want_dh) and torch.equal(whole_dh, want_dh)
                    and torch.allclose(db.float(), want_db.float(), rtol=1e-2, atol=1e-1)):
                print(f"{shape} {bm}x{bn} {warps}w WRONG")
                continue
            tk, tw = bench(kernel, device=dev)["median"], bench(whole, device=dev)["median"]
            gk, gw = nbytes / tk / 1e6, nbytes / tw / 1e6
            print(f"{shape:>11} {bm:4}x{bn:<5} {warps}w  kernel {tk * 1e3:7.1f} us {gk:6.0f} GB/s ({gk / copy:.2f})  "
                  f"launcher {tw * 1e3:7.1f} us {gw:6.0f} GB/s ({gw / copy:.2f})", flush=True)


if __name__ == "__main__":
    main()
