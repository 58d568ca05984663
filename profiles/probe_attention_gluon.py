"""The Gluon forward (megakern._attention_gluon) on the GPU: correctness against the fp32 reference next to the
Triton forward's error, then TFLOP/s beside the Triton forward and SDPA's flash and cuDNN backends (bf16, B * T =
16384, nh * hs = 2048, as benchmarks/bench_attention.py), and the same-run bf16 matmul rate.

    python profiles/probe_attention_gluon.py [--check] [--bench [--graph]] [--hs 64,96,128] [--seq 1024,2048]
                                             [--configs "128x128x8x2,..."] [--masks causal,full] [--own-ranges]

``--own-ranges``: each 192-row (three-warpgroup) configuration also with ``own_ranges`` (each warpgroup computes
only the key blocks its own rows see).
    python profiles/probe_attention_gluon.py --bwd [--hs 64,96,128] [--configs "128x64x128x4x2,..."]
                                             [--dq-configs "128x128x64x4x3x1"]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import bench, measure_matmul_tflops
from megakern import _attention_gluon as glu
from megakern import _attention_triton as kern
from megakern.attention import _bwd_kernels, _fwd_kernels, attention_ref


def _err(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


def _variants(cfg, own_ranges: bool) -> list[bool]:
    """The own_ranges values to run ``cfg`` (hs, BLOCK_M, ...) with."""
    return [False, True] if own_ranges and cfg is not None and cfg[1] == 192 else [False]


def check(configs, own_ranges: bool = False) -> bool:
    ok = True
    dev = torch.device("cuda")
    cases = [  # (B, Tq, Tk, nh, nkv, hs, causal, dtype)
        (2, 1000, 1000, 4, 4, 128, True, torch.bfloat16), (2, 1000, 1000, 4, 4, 128, False, torch.bfloat16),
        (1, 4097, 4097, 2, 1, 128, True, torch.float16), (3, 17, 17, 4, 2, 64, True, torch.bfloat16),
        (2, 1, 1, 2, 2, 64, True, torch.bfloat16), (2, 300, 700, 4, 2, 64, True, torch.float16),
        (2, 700, 300, 4, 4, 128, True, torch.bfloat16), (2, 513, 513, 8, 1, 64, False, torch.float16),
        (1, 2048, 2048, 3, 3, 128, True, torch.bfloat16), (2, 1000, 1000, 4, 2, 96, True, torch.bfloat16),
        (2, 513, 700, 4, 4, 96, False, torch.float16),
    ]
    for b, tq, tk, nh, nkv, hs, causal, dtype in cases:
        g = torch.Generator(device=dev).manual_seed(tq * 7 + hs)
        q = torch.randn(b, tq, nh, hs, device=dev, dtype=dtype, generator=g)
        k = torch.randn(b, tk, nkv, hs, device=dev, dtype=dtype, generator=g)
        v = torch.randn(b, tk, nkv, hs, device=dev, dtype=dtype, generator=g)
        scale = hs ** -0.5
        assert glu.supported(q, k, v, causal, (-1, -1), None), "not supported"
        ref, ref_lse = attention_ref(q, k, v, causal=causal)
        tout, tlse = kern.fwd(q, k, v, causal, scale, (-1, -1), None, None)
        low = attention_ref(q, k, v, causal=causal, upcast=False)[0]
        te, le = _err(tout, ref), _err(low, ref)
        for cfg in configs or [None]:
            if cfg is not None and cfg[0] != hs:
                continue
            for own in _variants(cfg, own_ranges):
                out, lse = glu.fwd(q, k, v, causal, scale, cfg[1:] if cfg else None, own_ranges=own)
                out3, lse3 = glu.fwd(q, k, v, causal, scale, cfg[1:] if cfg else None, heads=3, own_ranges=own)
                same = torch.equal(out3, out) and torch.equal(lse3, lse)  # tiles in groups of 3 heads: same results
                e = _err(out, ref)
                finite = torch.isfinite(ref_lse)
                lse_e = (lse - ref_lse)[finite].abs().max().item() if finite.any() else 0.0
                lse_inf = bool((lse[~finite] == float("-inf")).all())
                good = (e <= 2 * max(le, te) + 1e-5 and lse_e < 1e-3 and lse_inf
                        and torch.isfinite(out).all().item() and same)
                ok &= good
                label = f"{cfg}{' own ranges' if own else ''}"
                print(f"check B{b} Tq{tq} Tk{tk} nh{nh}/{nkv} hs{hs} causal={causal} {dtype} {label}: gluon {e:.2e} "
                      f"triton {te:.2e} low-precision torch {le:.2e} lse {lse_e:.1e} grouped same {same} -> "
                      f"{'ok' if good else 'WRONG'}",
                      flush=True)
    return ok


def run_bench(hss, seqs, masks, configs, heads=(None,), own_ranges: bool = False, graph: bool = False,
              vector_stores: bool = False, turns: bool = False) -> None:
    """TFLOP/s of the forward: Triton's, the Gluon one (each of ``configs``, or the default tiles; ``vector_stores``:
    also with the output by 16-byte stores in place of TMA stores; ``turns``: with the ping-pong warpgroups taking
    turns and without, in place of default_turns), SDPA's flash and cuDNN kernels."""
    dev = torch.device("cuda")
    peak = measure_matmul_tflops(dev)
    print(f"bf16 matmul {peak:.1f} TFLOP/s")
    for hs in hss:
        nh = 2048 // hs
        for t in seqs:
            b = max(1, 16384 // t)
            q, k, v = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(3))
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            for mask in masks:
                causal = mask == "causal"
                flops = 4 * b * nh * t * t * hs / (2 if causal else 1)
                runs = [("triton", lambda: kern.fwd(q, k, v, causal, hs ** -0.5, (-1, -1), None, None))]
                for cfg in [c[1:] for c in configs if c[0] == hs] or [glu.default_config(hs, causal, t)]:
                    for hg in heads:
                        for own in _variants((hs, *cfg), own_ranges):
                            for o_tma in (True, False) if vector_stores else (True,):
                                for turn in (True, False) if turns else (None,):
                                    runs.append((f"gluon {cfg}{' own ranges' if own else ''} heads {hg}"
                                                 f"{'' if o_tma else ' 16-byte stores'}"
                                                 f"{'' if turn is None else ' turns' if turn else ' no turns'}",
                                                 lambda c=cfg, hg=hg, own=own, o_tma=o_tma, turn=turn: glu.fwd(
                                                     q, k, v, causal, hs ** -0.5, c, heads=hg, own_ranges=own,
                                                     o_tma=o_tma, turns=turn)))
                for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
                    def fn(backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
                    runs.append((name, fn))
                row = []
                for name, fn in runs:
                    try:
                        ms = bench(fn, device=dev, graph=graph)["median"]
                        row.append(f"{name} {flops / ms / 1e9:6.1f}")
                    except Exception as exc:
                        row.append(f"{name} failed: {' '.join(str(exc).split())[:80]}")
                print(f"hs{hs} T{t} {mask:6} | " + " | ".join(row), flush=True)
            del q, k, v, qt, kt, vt
            torch.cuda.empty_cache()


def host() -> None:
    """Host time per call (no synchronization inside) of the Gluon launcher, the Triton one and megakern.attention
    with grad on a small problem, the Gluon launcher's profile, and the GPU time of the T 2048 hs128 causal forward
    by CUDA-graph replay."""
    import cProfile
    import pstats

    import megakern
    from benchmarks.common import host_us
    from triton.testing import do_bench_cudagraph

    q, k, v = (torch.randn(2, 256, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qg = q.clone().requires_grad_(True)
    rows = {"gluon fwd": host_us(lambda: glu.fwd(q, k, v, True, 0.088)),
            "triton fwd": host_us(lambda: kern.fwd(q, k, v, True, 0.088, (-1, -1), None, None)),
            "attention (grad)": host_us(lambda: megakern.attention(qg, k, v))}
    print("host us: " + ", ".join(f"{n} {us:.0f}" for n, us in rows.items()), flush=True)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        glu.fwd(q, k, v, True, 0.088)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    q, k, v = (torch.randn(8, 2048, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    flops = 4 * 8 * 16 * 2048 * 2048 * 128 / 2

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    for name, fn in (("gluon", lambda: glu.fwd(q, k, v, True, 0.088)), ("sdpa-flash", sdpa)):
        ms = do_bench_cudagraph(fn, rep=300)
        print(f"T2048 hs128 causal fwd, CUDA graph: {name} {flops / ms / 1e9:.1f} TFLOP/s", flush=True)


def _gluon_bwd(do, q, k, v, out, lse, causal, heads):
    """(dq, dk, dv) by the two Gluon passes, tiles in groups of ``heads`` heads (None: all in one group)."""
    dq, dk, dv, delta = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(lse)
    glu.bwd_dq(do, q, k, v, out, lse, delta, dq, causal, q.shape[-1] ** -0.5, None, heads)
    glu.bwd_dkdv(do, q, k, v, lse, delta, dk, dv, causal, q.shape[-1] ** -0.5, None, heads)
    return dq, dk, dv


def _single_passes(hs):
    """(name, the ``gluon`` argument) of the Gluon single-pass backward for head dim hs (dq added by TMA reduces),
    where this Triton has it."""
    if hs not in glu.ATOMIC_HEAD_DIMS or not glu.TMA_REDUCE:
        return []
    return [("tma", glu.SINGLE_CONFIGS[glu.block_d(hs)])]


def bwd_probe(configs, dq_configs, heads=(None,), head_dims=(64, 96, 128)) -> None:
    """The Gluon backward passes: dq, dk, dv against fp64 truth next to the Triton passes' errors, then the
    deterministic backward's TFLOP/s (backward = 2.5x forward FLOPs) with the Triton passes, the Gluon dk/dv pass and
    both Gluon passes (``configs``: dk/dv tiles, ``dq_configs``: dq tiles, (hs, ...) each); for the head dims of
    ATOMIC_HEAD_DIMS also the single-pass backward (``deterministic=False``), by the Triton and the Gluon kernels; the
    cases and shapes of ``head_dims`` only."""
    dev = torch.device("cuda")
    cases = [(2, 1000, 1000, 4, 4, 128, True), (2, 1000, 1000, 4, 2, 128, False), (1, 777, 777, 2, 1, 64, True),
             (2, 300, 700, 4, 2, 64, True), (2, 700, 300, 4, 4, 128, True), (3, 17, 17, 4, 2, 128, True),
             (2, 1, 1, 2, 2, 64, True), (1, 2048, 2048, 3, 3, 128, True), (2, 513, 513, 8, 1, 64, False),
             (2, 1000, 1000, 4, 2, 96, True), (2, 513, 700, 4, 4, 96, False)]
    ok = True
    for b, tq, tk, nh, nkv, hs, causal in (c for c in cases if c[5] in head_dims):
        g = torch.Generator(device=dev).manual_seed(tq + hs)
        q = torch.randn(b, tq, nh, hs, device=dev, dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, tk, nkv, hs, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(2))
        do = torch.randn(b, tq, nh, hs, device=dev, dtype=torch.bfloat16, generator=g)
        win = (-1, 0 if causal else -1)
        out, lse = _fwd_kernels(q, k, v, causal, hs ** -0.5, win, None, None)
        tri = kern.bwd(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, True)
        leaves = [t.double().requires_grad_(True) for t in (q, k, v)]
        truth = torch.autograd.grad(attention_ref(*leaves, causal=causal)[0], leaves, do.double())
        dkdv = [c[1:] for c in configs if c[0] == hs] or [None]
        dqs = [c[1:] for c in dq_configs if c[0] == hs] or [None]
        for cfg, dcfg in [(c, False) for c in dkdv] + [(dkdv[0], d) for d in dqs]:
            glu_g = _bwd_kernels(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, True, gluon=cfg or True,
                                 gluon_dq=dcfg if dcfg is False else (dcfg or True))
            errs = [(_err(a, t), _err(c, t)) for a, c, t in zip(glu_g, tri, truth)]
            good = all(e <= 2 * te + 1e-3 for e, te in errs) and all(torch.isfinite(x).all() for x in glu_g)
            if cfg is None and dcfg is None:  # tiles in groups of 3 heads: the same results
                grouped = _gluon_bwd(do, q, k, v, out, lse, causal, 3)
                good &= all(torch.equal(a, c) for a, c in zip(grouped, glu_g))
            ok &= good
            print(f"bwd check B{b} Tq{tq} Tk{tk} nh{nh}/{nkv} hs{hs} causal={causal} dkdv {cfg} dq {dcfg}: dq, dk, dv "
                  "gluon / triton " + ", ".join(f"{e:.2e} / {te:.2e}" for e, te in errs) + (" ok" if good else " WRONG"),
                  flush=True)
        for how, cfg in _single_passes(hs):  # the single-pass backward (dq added in the dk/dv pass)
            single = _bwd_kernels(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, False, gluon=cfg)
            errs = [(_err(a, t), _err(c, t)) for a, c, t in zip(single, tri, truth)]
            good = all(e <= 2 * te + 1e-3 for e, te in errs) and all(torch.isfinite(x).all() for x in single)
            ok &= good
            print(f"bwd check B{b} Tq{tq} Tk{tk} nh{nh}/{nkv} hs{hs} causal={causal} single pass ({how}): dq, dk, dv "
                  "gluon / triton " + ", ".join(f"{e:.2e} / {te:.2e}" for e, te in errs) + (" ok" if good else " WRONG"),
                  flush=True)
    if not ok:
        print("GLUON BWD CHECK FAILED")
        return
    for hs, t, causal in ((128, 1024, True), (128, 2048, True), (128, 4096, True), (128, 16384, True),
                          (128, 4096, False), (64, 2048, True), (64, 4096, True), (64, 4096, False),
                          (96, 2048, True), (96, 8192, True), (96, 4096, False)):
        if hs not in head_dims:
            continue
        b, nh = max(1, 16384 // t), 2048 // hs
        q, k, v, do = (torch.randn(b, t, nh, hs, device=dev, dtype=torch.bfloat16) for _ in range(4))
        win = (-1, 0 if causal else -1)
        out, lse = _fwd_kernels(q, k, v, causal, hs ** -0.5, win, None, None)
        flops = 2.5 * 4 * b * nh * t * t * hs / (2 if causal else 1)

        def rate(dkdv, dq, deterministic=True):
            ms = bench(lambda: _bwd_kernels(do, q, k, v, out, lse, causal, hs ** -0.5, win, None, None, deterministic,
                                            gluon=dkdv, gluon_dq=dq), device=dev)["median"]
            return flops / ms / 1e9
        row = [f"triton {rate(False, False):6.1f}"]
        if hs in glu.ATOMIC_HEAD_DIMS:  # the single-pass backward: Triton's atomic kernel, the Gluon ones
            row += [f"single pass triton {rate(False, False, False):6.1f}"]
            row += [f"single pass gluon {how} {rate(cfg, False, False):6.1f}" for how, cfg in _single_passes(hs)]
        dkdv = [c[1:] for c in configs if c[0] == hs] or [True]
        for cfg in dkdv:
            row.append(f"gluon dkdv {cfg} {rate(cfg, False):6.1f}")
        for dcfg in [c[1:] for c in dq_configs if c[0] == hs] or [True]:
            row.append(f"+ gluon dq {dcfg} {rate(dkdv[0], dcfg):6.1f}")
        for hg in heads if heads != (None,) else ():
            ms = bench(lambda: _gluon_bwd(do, q, k, v, out, lse, causal, hg), device=dev)["median"]
            row.append(f"gluon heads {hg} {flops / ms / 1e9:6.1f}")
        print(f"bwd hs{hs} T{t} {'causal' if causal else 'full'} | " + " | ".join(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--check", action="store_true")
    p.add_argument("--bench", action="store_true")
    p.add_argument("--host", action="store_true")
    p.add_argument("--graph", action="store_true", help="--bench by CUDA-graph replay: the GPU time alone (short "
                   "sequences' eager launches take longer on the host than on the GPU)")
    p.add_argument("--bwd", action="store_true")
    p.add_argument("--hs", default="64,128")
    p.add_argument("--seq", default="1024,2048,4096,8192,16384")
    p.add_argument("--masks", default="causal,full")
    p.add_argument("--configs", default="")
    p.add_argument("--dq-configs", default="", help="hs x BLOCK_M x BLOCK_N x warps x slots x pingpong (0 / 1), comma "
                   "separated")
    p.add_argument("--own-ranges", action="store_true",
                   help="192-row configurations also with each warpgroup's own key ranges")
    p.add_argument("--vector-stores", action="store_true",
                   help="--bench: the Gluon forward also with its output by 16-byte stores (o_tma=False)")
    p.add_argument("--turns", action="store_true",
                   help="--bench: the Gluon forward with its ping-pong warpgroups taking turns and without")
    p.add_argument("--heads", default="", help="tile orders to time: (batch, head) pairs per group, comma "
                   "separated, 0 for all in one group")
    a = p.parse_args()
    heads = tuple(int(h) or None for h in a.heads.split(",")) if a.heads else (None,)
    # configs: hs x BLOCK_M x BLOCK_N x warps x slots x pingpong (0 / 1)
    configs = [tuple(int(x) for x in c.split("x")) for c in a.configs.split(",") if c]
    configs = [(*c[:5], bool(c[5])) if len(c) == 6 else c for c in configs]  # backward configs: 5 numbers
    if a.check and not check(configs, a.own_ranges):
        print("GLUON CHECK FAILED")
    if a.bwd:
        dq_configs = [tuple(int(x) for x in c.split("x")) for c in a.dq_configs.split(",") if c]
        bwd_probe(configs, [(*c[:5], bool(c[5])) if len(c) == 6 else c for c in dq_configs], heads,
                  tuple(int(h) for h in a.hs.split(",")))
    if a.host:
        host()
    if a.bench:
        run_bench([int(h) for h in a.hs.split(",")], [int(s) for s in a.seq.split(",")], a.masks.split(","),
                  configs, heads, a.own_ranges, a.graph, a.vector_stores, a.turns)


if __name__ == "__main__":
    main()
