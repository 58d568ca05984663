"""Host time against GPU time of megakern.apply_rotary: where the eager fwd+bwd rows of benchmarks/bench_rotary.py go.

    python profiles/profile_rotary_launch.py [--backend triton]

For each case: microseconds of host time per call (perf_counter over many calls, no synchronization inside) of the
kernel launcher alone, of apply_rotary without autograd, with autograd (forward), and of forward + backward; and the
GPU time of forward + backward by CUDA-graph replay. Wherever the host time is above the GPU time, an eager
benchmark that times each call between CUDA events (as triton's do_bench does, after an L2 flush) measures the host.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import host_us

CASES = [(8, 4096, 32, 8, 128), (16, 4096, 16, 4, 64)]  # (B, T, nh, nkv, hs), full rotary, GPT-NeoX


def main() -> None:
    import megakern
    from megakern import rotary as R
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", default="triton")
    args = parser.parse_args()
    launcher = R._LAUNCHERS[args.backend]()
    for b, t, nh, nkv, hs in CASES:
        q = torch.randn(b, t, nh, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, t, nkv, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        cos, sin = megakern.rotary_table(t, hs, device="cuda")
        qd, kd = q.detach(), k.detach()

        def fb():
            return torch.autograd.grad(megakern.apply_rotary(q, k, cos, sin, backend=args.backend), (q, k), (dq, dk))

        rows = {
            "launcher": host_us(lambda: launcher(qd, kd, *R.rotary_outputs(qd, kd, False), cos, sin, None, None, None,
                                                 0, hs, False, False, False)),
            "apply (no grad)": host_us(lambda: megakern.apply_rotary(qd, kd, cos, sin, backend=args.backend)),
            "apply (grad)": host_us(lambda: megakern.apply_rotary(q, k, cos, sin, backend=args.backend)),
            "fwd+bwd": host_us(fb),
        }
        gpu = do_bench_cudagraph(fb, rep=300) * 1e3
        print(f"B{b} T{t} nh{nh} nkv{nkv} hs{hs} [{args.backend}]: GPU fwd+bwd {gpu:.0f} us (graph); host "
              + ", ".join(f"{name} {us:.0f} us" for name, us in rows.items()))


if __name__ == "__main__":
    main()
