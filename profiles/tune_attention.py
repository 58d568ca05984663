"""Tile-size sweep for the attention kernels (megakern._attention_triton), bf16, against the same-run bf16 matmul
rate: forward configs, then backward (dk/dv, and dq for the deterministic path), per head dim and mask.

    python profiles/tune_attention.py [--hs 64,128] [--seq 4096]

FLOPs as benchmarks/bench_attention.py: forward 4 * B * nh * T^2 * hs (halved causal), backward 2.5x forward.
Configs that fail to compile or run (e.g. shared memory) are reported and skipped. The winners go into
``_config`` in megakern/_attention_triton.py.
"""
from __future__ import annotations

import argparse
import itertools

import torch

from benchmarks.common import bench, measure_matmul_tflops
from megakern import _attention_triton as kern

FWD = [(m, n, w, s) for m, n in ((128, 64), (128, 128), (64, 64), (128, 32)) for w in (4, 8) for s in (2, 3, 4)]
DKDV = [(m, n, w, s) for m, n in ((32, 128), (64, 64), (64, 128), (32, 64)) for w in (4, 8) for s in (2, 3)]
DQ = [(m, n, w, s) for m, n in ((128, 32), (64, 64), (128, 64), (64, 32)) for w in (4, 8) for s in (2, 3)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hs", default="64,128")
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    dev = torch.device("cuda")
    peak = measure_matmul_tflops(dev)
    print(f"bf16 matmul {peak:.0f} TFLOP/s")
    t = args.seq
    b = max(1, 16384 // t)
    for hs, causal in itertools.product(map(int, args.hs.split(",")), (True, False)):
        nh = 2048 // hs
        q, k, v, do = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = hs ** -0.5
        fwd_flops = 4 * b * nh * t * t * hs / (2 if causal else 1)
        out, lse = kern.fwd(q, k, v, causal, scale, (-1, -1), None, None)
        runs = [(f"fwd {cfg}", fwd_flops, lambda cfg=cfg: kern.fwd(q, k, v, causal, scale, (-1, -1), None, None, cfg))
                for cfg in FWD]
        runs += [(f"bwd atomic dkdv={cfg}", 2.5 * fwd_flops, lambda cfg=cfg: kern.bwd(
            do, q, k, v, out, lse, causal, scale, (-1, -1), None, None, False, {"dkdv": cfg})) for cfg in DKDV]
        runs += [(f"bwd deterministic dq={cfg}", 2.5 * fwd_flops, lambda cfg=cfg: kern.bwd(
            do, q, k, v, out, lse, causal, scale, (-1, -1), None, None, True, {"dq": cfg})) for cfg in DQ]
        for name, flops, fn in runs:
            try:
                ms = bench(fn, device=dev)["median"]
            except Exception as exc:  # a config that does not fit: report, go on
                print(f"hs{hs} {'causal' if causal else 'full'} T{t} {name:44} failed: {str(exc).splitlines()[0][:70]}")
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            print(f"hs{hs} {'causal' if causal else 'full'} T{t} {name:44} {ms:8.3f} ms {tflops:7.1f} TFLOP/s "
                  f"{tflops / peak:5.2f}")


if __name__ == "__main__":
    main()
