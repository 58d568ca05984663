"""The Gluon attention forward against another version of its module, in one process on one card: outputs and lse
compared bit for bit at assorted shapes (odd lengths, GQA, head dims 64 / 96 / 128, causal and full), then each
version timed twice, alternated, by CUDA-graph replay at the benchmark's shapes (B * T = 16384 tokens, 2048 / hs
heads), beside cuDNN's SDPA forward.

    git show REV:megakern/_attention_gluon.py > /tmp/base_attention_gluon.py
    python profiles/ab_attention_fwd.py --base /tmp/base_attention_gluon.py [--seqlens 1024,4096,8192]
        [--head-dims 64,128]

TFLOP/s: 4 B H T^2 hs (half of it causal), bf16. "base" is the module given, "this" the checkout's.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import bench, import_file, int_list
from megakern import _attention_gluon as new

# (B, Tq, Tk, heads, kv heads, hs, causal): odd lengths, GQA, Tq != Tk (bottom-right causal), tiny and long rows
CHECKS = ((2, 1000, 1000, 4, 4, 128, True), (2, 513, 700, 8, 2, 64, False), (3, 17, 17, 4, 2, 64, True),
          (1, 2048, 2048, 4, 4, 64, True), (1, 4096, 4096, 2, 2, 64, False), (2, 300, 700, 4, 2, 96, True),
          (2, 700, 300, 4, 4, 128, True), (4, 256, 256, 8, 8, 64, True), (1, 4099, 4099, 2, 1, 128, False))


def load(path: str):
    """The module at ``path`` (a copy of megakern/_attention_gluon.py), imported under a name of its own."""
    if not Path(path).is_file():
        raise SystemExit(f"ab_attention_fwd: --base {path!r}: no such file")
    module = import_file(path, "base_attention_gluon")
    if not hasattr(module, "fwd"):
        raise SystemExit(f"ab_attention_fwd: --base {path!r} has no fwd: not a copy of megakern/_attention_gluon.py")
    return module


def check(base, dev) -> bool:
    """Both versions' (out, lse) at CHECKS, bit for bit; prints a line each and returns whether all matched."""
    ok = True
    for b, tq, tk, nh, nkv, hs, causal in CHECKS:
        g = torch.Generator(device=dev).manual_seed(tq * 131 + hs)
        q = torch.randn(b, tq, nh, hs, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, tk, nkv, hs, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        o1, l1 = base.fwd(q, k, v, causal, hs ** -0.5)
        o2, l2 = new.fwd(q, k, v, causal, hs ** -0.5)
        same = torch.equal(o1, o2) and torch.equal(l1, l2)
        ok &= same
        print(f"same bits B{b} Tq{tq} Tk{tk} h{nh}/{nkv} hs{hs} {'causal' if causal else 'full'}: {same}", flush=True)
    return ok


def cudnn_forward(q, k, v, causal: bool):
    """cuDNN's SDPA forward on (B, T, H, hs) tensors, or None where this torch lacks it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def run():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    try:
        run()
    except RuntimeError:
        return None
    return run


def timing(base, dev, seqlens, head_dims) -> None:
    for hs in head_dims:
        for t in seqlens:
            b, nh = max(1, 16384 // t), 2048 // hs
            q, k, v = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(3))
            for causal in (True, False):
                flops = 4 * b * nh * t * t * hs / (2 if causal else 1)
                runs = [("base", lambda: base.fwd(q, k, v, causal, hs ** -0.5)),
                        ("this", lambda: new.fwd(q, k, v, causal, hs ** -0.5))]
                cudnn = cudnn_forward(q, k, v, causal)
                row = []
                for name, fn in runs + ([("cudnn", cudnn)] if cudnn else []) + runs:
                    fn()
                    row.append(f"{name} {flops / bench(fn, device=dev, graph=True)['median'] / 1e9:6.1f}")
                print(f"hs{hs} B{b} T{t} {'causal' if causal else 'full  '} | " + " | ".join(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", required=True, help="another version of megakern/_attention_gluon.py")
    p.add_argument("--seqlens", type=int_list, default=[1024, 4096, 8192])
    p.add_argument("--head-dims", type=int_list, default=[64, 128])
    a = p.parse_args(argv)
    base = load(a.base)
    if not torch.cuda.is_available() or not new.AVAILABLE:
        raise SystemExit("ab_attention_fwd: needs a Hopper GPU and a Triton with Gluon")
    dev = torch.device("cuda")
    print("ALL SAME BITS" if check(base, dev) else "OUTPUTS DIFFER", flush=True)
    timing(base, dev, a.seqlens, a.head_dims)


if __name__ == "__main__":
    main()
