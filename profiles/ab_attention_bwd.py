"""The Gluon attention backward against another version of its module, in one process on one card: the dk/dv pass
(``bwd_dkdv``) and the single pass (``bwd_single``) of both, alternated and each timed twice, their dk and dv
compared bit for bit (dq of the single pass within the rounding of its atomic order); then, with ``--pair``, this
version's whole backward, deterministic (the Gluon dq and dk/dv passes) against the single pass, as
``megakern.attention`` runs them (delta, the zeroed fp32 dq and its conversion included).

    git show REV:megakern/_attention_gluon.py > /tmp/base_attention_gluon.py
    python profiles/ab_attention_bwd.py --base /tmp/base_attention_gluon.py [--pair]
        [--single-config 64=128,128,4,2,2,1] [--dkdv-config 64=128,128,4,2]

``--single-config`` / ``--dkdv-config`` (head dim = tiles, a SINGLE_CONFIGS / BWD_CONFIGS entry): this version
runs those tiles at that head dim (``--base megakern/_attention_gluon.py`` then times tiles against tiles).

TFLOP/s: the dk/dv pass's four products (2x the forward's FLOPs), the backward's 2.5x the forward's; bf16.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench, import_file
from megakern import _attention_gluon as new
from megakern.attention import _bwd_kernels, _fwd_kernels

SHAPES = ((2, 4096, 32, 8, 128, True), (4, 4096, 16, 16, 128, True), (2, 8192, 16, 16, 128, True),
          (8, 2048, 16, 16, 128, True), (16, 1024, 16, 16, 128, True), (4, 4096, 16, 16, 128, False),
          (8, 2048, 32, 32, 64, True), (4, 4096, 32, 32, 64, True), (4, 4096, 32, 32, 64, False),
          (2, 3000, 8, 2, 128, True))  # (B, T, heads, kv heads, hs, causal)


def _case(b, t, nh, nkv, hs, causal, dev):
    q, do = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, t, nkv, hs, device=dev, dtype=torch.bfloat16) for _ in range(2))
    out, lse = _fwd_kernels(q, k, v, causal, hs ** -0.5, (-1, 0 if causal else -1), None, None)
    return q, k, v, do, out, lse


def _tiles(text: str | None) -> dict:
    """{head dim: tiles} from 'hs=a,b,c,...' items separated by spaces."""
    out = {}
    for item in (text or "").split():
        hs, _, tiles = item.partition("=")
        out[int(hs)] = tuple(int(x) for x in tiles.split(","))
    return out


def ab(base, dev, single_tiles=None, dkdv_tiles=None) -> None:
    single_tiles, dkdv_tiles = single_tiles or {}, dkdv_tiles or {}
    for b, t, nh, nkv, hs, causal in SHAPES:
        q, k, v, do, out, lse = _case(b, t, nh, nkv, hs, causal, dev)
        delta = torch.empty_like(lse)
        new.bwd_dq(do, q, k, v, out, lse, delta, torch.empty_like(q), causal, hs ** -0.5)
        fwd_flops = 4 * b * nh * t * t * hs / (2 if causal else 1)
        row = f"B{b} T{t} h{nh}/{nkv} hs{hs} {'causal' if causal else 'full'}"
        for name, single in (("dk/dv", False), ("single", True)):
            if single and hs not in new.SINGLE_CONFIGS:
                continue
            rates, grads = {}, {}
            for label, mod in (("base", base), ("this", new), ("base ", base), ("this ", new)):
                dk, dv = torch.empty_like(k), torch.empty_like(v)
                dq = torch.zeros(q.shape, device=dev, dtype=torch.float32)
                tiles = (single_tiles if single else dkdv_tiles).get(hs) if mod is new else None
                if single:
                    fn = lambda: mod.bwd_single(do, q, k, v, lse, delta, dk, dv, dq.zero_(), causal,  # noqa: E731
                                                hs ** -0.5, tiles)
                else:
                    fn = lambda: mod.bwd_dkdv(do, q, k, v, lse, delta, dk, dv, causal, hs ** -0.5,  # noqa: E731
                                              tiles)
                fn()
                grads[label.strip()] = (dk.clone(), dv.clone(), dq.clone())
                rates[label] = (2.5 if single else 2) * fwd_flops / bench(fn, device=dev)["median"] / 1e9
            same = all(torch.equal(x, y) for x, y in zip(grads["base"][:2], grads["this"][:2]))
            dq_err = (grads["base"][2] - grads["this"][2]).abs().max().item()
            row += (f" | {name}: base {rates['base']:.1f} {rates['base ']:.1f}, this {rates['this']:.1f} "
                    f"{rates['this ']:.1f}, dk dv {'same bits' if same else 'DIFFER'}"
                    + (f", dq within {dq_err:.1e}" if single else ""))
        print(row, flush=True)


def pair_against_single(dev) -> None:
    for b, t, nh, nkv, hs, causal in SHAPES:
        q, k, v, do, out, lse = _case(b, t, nh, nkv, hs, causal, dev)
        win = (-1, 0 if causal else -1)
        flops = 2.5 * 4 * b * nh * t * t * hs / (2 if causal else 1)
        runs = {"pair": lambda: _bwd_kernels(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, True,
                                             gluon=True, gluon_dq=True)}
        if hs in new.SINGLE_CONFIGS and new.TMA_REDUCE:
            runs["single"] = lambda: _bwd_kernels(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, False,
                                                  gluon=True, gluon_dq=False)
        rates = {name: [flops / bench(fn, device=dev)["median"] / 1e9 for _ in range(2)] for name, fn in runs.items()}
        print(f"backward B{b} T{t} h{nh}/{nkv} hs{hs} {'causal' if causal else 'full'} | "
              + " | ".join(f"{name} {r[0]:.1f} {r[1]:.1f}" for name, r in rates.items()), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="another version of megakern/_attention_gluon.py to time against")
    p.add_argument("--pair", action="store_true", help="this version's deterministic backward against its single pass")
    p.add_argument("--single-config", help="'hs=tiles ...': this version's single-pass tiles at those head dims")
    p.add_argument("--dkdv-config", help="'hs=tiles ...': this version's dk/dv pass tiles at those head dims")
    a = p.parse_args()
    dev = torch.device("cuda")
    if a.base:
        ab(import_file(a.base, "base_attention_gluon"), dev, _tiles(a.single_config), _tiles(a.dkdv_config))
    if a.pair:
        pair_against_single(dev)


if __name__ == "__main__":
    main()
