"""The rotary forward at one shape through each backend, for Nsight Compute: the CUDA kernel (csrc/rotary/rotary.cu)
beside the Triton one, out of place, as megakern.apply_rotary runs them.

    ncu --kernel-name regex:rotary --launch-skip 4 --launch-count 4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats \
        python profiles/ncu_rotary.py [--shape 8,4096,32,8,128,128] [--interleaved]

--shape is B,T,nh,nkv,hs,rotary_dim (the headline of benchmarks/bench_rotary.py by default). Each backend runs
--reps forward calls after one warm-up, so --launch-skip 4 --launch-count 4 takes two calls of each.
"""
from __future__ import annotations

import argparse

import torch

import megakern


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="8,4096,32,8,128,128")
    p.add_argument("--interleaved", action="store_true")
    p.add_argument("--reps", type=int, default=4)
    a = p.parse_args()
    b, t, nh, nkv, hs, rd = (int(v) for v in a.shape.split(","))
    dev = torch.device("cuda")
    q = torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16)
    k = torch.randn(b, t, nkv, hs, device=dev, dtype=torch.bfloat16)
    cos, sin = megakern.rotary_table(t, rd, device=dev)
    for backend in ("cuda", "triton"):
        megakern.apply_rotary(q, k, cos, sin, interleaved=a.interleaved, backend=backend)  # compile / load
        torch.cuda.synchronize()
        for _ in range(a.reps):
            megakern.apply_rotary(q, k, cos, sin, interleaved=a.interleaved, backend=backend)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
