"""The attention forward at one shape, megakern's Gluon kernel or, where installed, FlashAttention-4's, for Nsight
Compute (sections, or warp stalls per SASS line with --set full), one provider a profiled process:

    ncu --nvtx --nvtx-include "prof/" --section SpeedOfLight --section WarpStateStats ... \
        python profiles/ncu_attention_fwd.py --provider megakern|fa4 [--hs 128] [--seq 8192] [--batch 2] [--causal]

The provider runs three times first (compilation, autotuning), then once inside the NVTX range "prof".
It also prints the Gluon forward's registers, spills and shared memory as the machine's Triton compiled it.
"""
from __future__ import annotations

import argparse

import torch

from megakern.attention import _fwd_kernels
from ncu_attention_bwd import print_resources  # profiles/ beside this script


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hs", type=int, default=128)
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--provider", default="megakern", choices=("megakern", "fa4"))
    a = p.parse_args()
    dev = torch.device("cuda")
    q, k, v = (torch.randn(a.batch, a.seq, a.heads, a.hs, device=dev, dtype=torch.bfloat16) for _ in range(3))
    win = (-1, 0 if a.causal else -1)
    if a.provider == "fa4":
        from flash_attn.cute import flash_attn_func

        def call():
            flash_attn_func(q, k, v, causal=a.causal)
    else:
        def call():
            _fwd_kernels(q, k, v, a.causal, a.hs ** -0.5, win, None, None)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("prof")
    call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    print_resources(("_attn_fwd_ws_kernel",))


if __name__ == "__main__":
    main()
