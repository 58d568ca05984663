"""The Gluon attention backward kernels at one training shape, for Nsight Compute (warp stalls per SASS line), and
their register / spill counts as the machine's Triton compiled them.

    ncu --kernel-name regex:_attn_bwd --launch-skip 4 --launch-count 2 --set full --import-source yes -o bwd \
        python profiles/ncu_attention_bwd.py [--hs 128] [--seq 4096] [--batch 2] [--heads 32] [--full]
"""
from __future__ import annotations

import argparse

import torch

from megakern import _attention_gluon as glu
from megakern.attention import _bwd_kernels, _fwd_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hs", type=int, default=128)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--full", action="store_true")
    p.add_argument("--single", action="store_true", help="the single-pass backward (deterministic=False)")
    a = p.parse_args()
    dev = torch.device("cuda")
    causal = not a.full
    q, k, v, do = (torch.randn(a.batch, a.seq, a.heads, a.hs, device=dev, dtype=torch.bfloat16) for _ in range(4))
    win = (-1, 0 if causal else -1)
    out, lse = _fwd_kernels(q, k, v, causal, a.hs ** -0.5, win, None, None)
    for _ in range(3):
        _bwd_kernels(do, q, k, v, out, lse, causal, a.hs ** -0.5, win, None, None, not a.single, gluon=True,
                     gluon_dq=False if a.single else True)
    torch.cuda.synchronize()
    print_resources(("_attn_bwd_dkdv_ws_kernel", "_attn_bwd_dq_ws_kernel", "_attn_fwd_ws_kernel"))


def print_resources(names) -> None:
    """Registers, spills and shared memory of each compiled instance of the Gluon kernels ``names``."""
    for name in names:
        fn = getattr(glu, name)
        for cache in getattr(fn, "device_caches", {}).values():
            kernels = cache[0] if isinstance(cache, tuple) else cache
            for kern in kernels.values():
                print(f"{name}: {getattr(kern, 'n_regs', '?')} registers, {getattr(kern, 'n_spills', '?')} spills, "
                      f"{kern.metadata.shared} B shared")


if __name__ == "__main__":
    main()
