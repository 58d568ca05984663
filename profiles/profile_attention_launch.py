"""Host time of megakern.attention against its GPU time: what an eager step pays per call on the host.

    python profiles/profile_attention_launch.py

Microseconds of host time per call (perf_counter over many calls, no synchronization inside) of the forward kernels'
launcher alone (megakern.attention's _fwd_kernels: the Gluon forward where it applies, else the Triton one), of
megakern.attention without and with autograd, and of forward + backward, for each
way of moving tiles (the CONFIGS choice, device-side descriptors only, pointer loads only); next to the GPU time of
forward + backward by CUDA-graph replay. A small problem keeps the GPU time short, so the host cost shows. Where
the host time of a step is above its GPU time, the GPU waits for the host: an eager benchmark that times each call
between CUDA events (triton's do_bench) measures part of the host.
"""
from __future__ import annotations

import torch

from benchmarks.common import host_us


def main() -> None:
    import megakern
    from megakern import _attention_triton as kern
    from megakern.attention import _fwd_kernels
    from triton.testing import do_bench_cudagraph

    saved = {kind: {hs: rows for hs, rows in table.items()} for kind, table in kern.CONFIGS.items()}
    for b, t, nh, hs in ((2, 256, 16, 128), (16, 1024, 16, 128)):
        q, k, v = (torch.randn(b, t, nh, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        dout = torch.randn_like(q)
        qd, kd, vd = (x.detach() for x in (q, k, v))
        for label, move in (("table", None), ("device", "device"), ("pointers", False)):
            for kind, table in kern.CONFIGS.items():  # every entry's tile moves replaced, tiles kept
                for key, rows in saved[kind].items():
                    table[key] = tuple((lim, cfg if move is None else (*cfg[:4], move)) for lim, cfg in rows)

            def fb():
                return torch.autograd.grad(megakern.attention(q, k, v), (q, k, v), dout)

            rows = {
                "launcher": host_us(lambda: _fwd_kernels(qd, kd, vd, True, hs ** -0.5, (-1, -1), None, None)),
                "attention (no grad)": host_us(lambda: megakern.attention(qd, kd, vd)),
                "attention (grad)": host_us(lambda: megakern.attention(q, k, v)),
                "fwd+bwd": host_us(fb),
            }
            gpu = do_bench_cudagraph(fb, rep=200) * 1e3
            print(f"B{b} T{t} nh{nh} hs{hs} causal, {label:8}: GPU fwd+bwd {gpu:6.0f} us (graph); host "
                  + ", ".join(f"{name} {us:.0f} us" for name, us in rows.items()), flush=True)
    for kind in saved:
        kern.CONFIGS[kind] = saved[kind]


if __name__ == "__main__":
    main()
