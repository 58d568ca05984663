"""Tile-size sweep for the attention kernels (megakern._attention_triton), bf16, against the same-run bf16 matmul
rate: forward configs, backward with atomic dq (kind dkdv: dk/dv kernel configs), the two-pass backward's dk/dv
kernel (dkdv-det) and its dq kernel (dq), per head dim and mask, with tensor descriptors (TMA) or pointer loads.

    python profiles/tune_attention.py [--hs 64,128] [--seq 4096] [--masks causal,full] [--kinds fwd,dkdv,dq]
                                      [--modes host,device,ptr] [--tiles "fwd=128x128x8x3,128x64x8x3 dq=..."]

Tile moves (--modes): host = the launcher's 4-D tensor descriptors, device = device-side descriptors per (sequence,
head), hybrid = device-side for the tiles a program loads or stores once and the launcher's for its loop, ptr =
masked pointer loads; each tile of the lists below (or of --tiles, BLOCK_M x BLOCK_N x warps x stages)
is timed in each mode. A backward mode is forced on both backward kernels (the dk/dv and the dq kernel).

FLOPs as benchmarks/bench_attention.py: forward 4 * B * nh * T^2 * hs (halved causal), backward 2.5x forward (the
deterministic backward does 3.5x: two more matmuls, counted as 2.5x here so the two modes compare by time).
Every config is checked against SDPA (out, or dq / dk / dv) before it is timed; configs that fail to compile or run
(shared memory, registers) or are wrong are reported and skipped. The best of each group is printed last; the
winners go into ``CONFIGS`` in megakern/_attention_triton.py.
"""
from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from benchmarks.common import bench, measure_matmul_tflops
from megakern import _attention_triton as kern
from megakern.attention import _fwd_kernels

# (BLOCK_M, BLOCK_N, num_warps, num_stages)
TILES = {
    "fwd": [(128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
            (64, 128, 4, 3), (128, 32, 4, 4)],
    "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (32, 128, 8, 3), (16, 128, 8, 3), (64, 64, 4, 2), (32, 64, 4, 3),
             (64, 128, 8, 1), (32, 128, 4, 2)],
    "dq": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 128, 8, 2), (128, 32, 4, 3)],
}
MODES = {"host": True, "hybrid": "hybrid", "device": "device", "ptr": False}


def _configs(kind: str, tiles: dict, modes: list[str]) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, warps, stages, tma argument) for each tile of ``kind`` in each mode."""
    return [(*tile, MODES[m]) for tile in tiles[kind] for m in modes]


def _parse_tiles(text: str | None) -> dict:
    tiles = dict(TILES)
    for part in (text or "").split():
        kind, _, spec = part.partition("=")
        tiles[kind] = [tuple(int(x) for x in t.split("x")) for t in spec.split(",")]
    return tiles


def _rel_err(got, want) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hs", default="64,128")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--masks", default="causal,full")
    parser.add_argument("--kinds", default="fwd,dkdv,dkdv-det,dq")
    parser.add_argument("--modes", default="host,device,ptr")
    parser.add_argument("--tiles", default=None)
    args = parser.parse_args()
    tiles, modes = _parse_tiles(args.tiles), args.modes.split(",")
    FWD, DKDV, DQ = (_configs(kind, tiles, modes) for kind in ("fwd", "dkdv", "dq"))
    dev = torch.device("cuda")
    peak = measure_matmul_tflops(dev)
    print(f"bf16 matmul {peak:.0f} TFLOP/s")
    t = args.seq
    b = max(1, 16384 // t)
    kinds = args.kinds.split(",")
    best = {}
    for hs, mask in itertools.product(map(int, args.hs.split(",")), args.masks.split(",")):
        causal = mask == "causal"
        nh = 2048 // hs
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(4))
        leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
        ref = F.scaled_dot_product_attention(*leaves, is_causal=causal)
        ref_grads = [g.transpose(1, 2) for g in torch.autograd.grad(ref, leaves, do.transpose(1, 2))]
        ref = ref.transpose(1, 2)
        scale = hs ** -0.5
        fwd_flops = 4 * b * nh * t * t * hs / (2 if causal else 1)
        out, lse = _fwd_kernels(q, k, v, causal, scale, (-1, -1), None, None)  # the op's forward kernels
        runs = []
        if "fwd" in kinds:
            runs += [("fwd", cfg, fwd_flops, lambda c=cfg: kern.fwd(q, k, v, causal, scale, (-1, -1), None, None,
                                                                    c[:4], c[4])) for cfg in FWD]
        if "dkdv-det" in kinds:  # the deterministic backward's dk/dv kernel (no atomics), dq kernel at its default
            runs += [("bwd-det-kv", cfg, 2.5 * fwd_flops, lambda c=cfg: kern.bwd(
                do, q, k, v, out, lse, causal, scale, (-1, -1), None, None, True, {"dkdv": c[:4]}, c[4]))
                for cfg in DKDV]
        if "dkdv" in kinds:
            runs += [("bwd-atomic", cfg, 2.5 * fwd_flops, lambda c=cfg: kern.bwd(
                do, q, k, v, out, lse, causal, scale, (-1, -1), None, None, False, {"dkdv": c[:4]}, c[4]))
                for cfg in DKDV]
        if "dq" in kinds:
            runs += [("bwd-det-dq", cfg, 2.5 * fwd_flops, lambda c=cfg: kern.bwd(
                do, q, k, v, out, lse, causal, scale, (-1, -1), None, None, True, {"dq": c[:4]}, c[4]))
                for cfg in DQ]
        for kind, cfg, flops, fn in runs:
            label = f"hs{hs} {mask:6} T{t} {kind:10} {str(cfg):28}"
            try:
                result = fn()
                fwd_kind = kind.startswith("fwd")
                got = [result[0]] if fwd_kind else list(result)
                want = [ref] if fwd_kind else ref_grads
                err = max(_rel_err(g, w) for g, w in zip(got, want))
                if not err < 0.03:
                    print(f"{label} WRONG: max relative error {err:.3g}")
                    continue
                ms = bench(fn, device=dev)["median"]
            except Exception as exc:  # a config that does not fit: report, go on
                print(f"{label} failed: {' '.join(str(exc).split())[:90]}")
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            print(f"{label} {ms:8.3f} ms {tflops:7.1f} TFLOP/s {tflops / peak:5.2f}  err {err:.1e}", flush=True)
            key = (hs, mask, kind)
            if key not in best or tflops > best[key][1]:
                best[key] = (cfg, tflops)
        del q, k, v, do, leaves, ref, ref_grads, out, lse
        torch.cuda.empty_cache()
    print("\nbest per group:")
    for (hs, mask, kind), (cfg, tflops) in sorted(best.items()):
        print(f"  hs{hs} {mask:6} {kind:10} {str(cfg):28} {tflops:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
