"""The norm forward's kernels at one width each, for Nsight Compute: the Triton forward, the CUDA row-group kernel at
its table geometry (``launch_config``), the CUDA team kernel at its geometry (``team_geometry``) and in its reload mode
on a grid of a team a row, each once inside the NVTX range "<op>_<kernel>_<hidden>":

    ncu --nvtx --nvtx-include "rms_team_4096/" --nvtx-include "rms_triton_4096/" ... --section SpeedOfLight \
        python profiles/ncu_norm_fwd.py --hidden 4096,8192 --ops rms,ln

Each runs once first (compilation), outside the ranges. bf16 tensors of 2**27 elements, a weight (and LayerNorm's
bias), no residual; NVRTC path.
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from ab_norm_fwd_team import widths_and_ops  # profiles/ beside this script
from megakern import _norm_cuda, _norm_triton

ELEMENTS = 2**27
KERNELS = ("triton", "rowgroup", "team", "reload")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="4096", help="comma-separated hidden sizes (multiples of 8)")
    parser.add_argument("--ops", default="rms", help="comma-separated: rms, ln")
    args = parser.parse_args(argv)
    hidden, ops = widths_and_ops("ncu_norm_fwd", args.hidden, args.ops)
    for op in ops:
        rms = op == "rms"
        for n in hidden:
            x = torch.randn(ELEMENTS // n, n, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
            b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16)
            team = _norm_cuda.team_geometry(n, x.dtype)
            configs = {"rowgroup": _norm_cuda.launch_config(n, x.dtype, False), "team": team,
                       "reload": dataclasses.replace(team, prefetch=False, weight_regs=False, reload=True,
                                                     persistent=False)}

            def run(kernel: str) -> None:
                if kernel == "triton":
                    _norm_triton.fwd(x, None, w, b, 1e-5, rms)
                else:
                    _norm_cuda.fwd(x, None, w, b, 1e-5, rms, path="nvrtc", config=configs[kernel])

            for kernel in KERNELS:
                run(kernel)
            torch.cuda.synchronize()
            for kernel in KERNELS:
                torch.cuda.nvtx.range_push(f"{op}_{kernel}_{n}")
                run(kernel)
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()


if __name__ == "__main__":
    main()
