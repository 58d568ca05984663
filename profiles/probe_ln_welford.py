"""What makes torch.compile's LayerNorm forward faster than megakern's at hidden 16384? Times, in one process, by
CUDA-graph replay: torch.compile's F.layer_norm, megakern's forward at its launch table's geometry and as its
two-pass kernel unrolled, and a probe kernel written here after Inductor's (a row a program, CHUNK columns a step,
the row's width compiled in, a lane's running mean and M2 in Welford's update), whose differences from megakern's
two-pass kernel can be switched one at a time:

- ``merge``: the lanes' statistics in one reduction (a Chan merge of (count, mean, M2), as Inductor's
  ``triton_helpers.welford``), else in two (the lanes' weighted mean, then their M2 and spread about it);
- ``div``: the lane's mean updated by a division by its count, as Inductor's ``welford_reduce``, else by a
  reciprocal taken once a step;
- ``unroll``: the steps unrolled (``tl.static_range``), else a loop over a trip count the compiler knows.

Inductor picked a row a program, 2048 columns a step and 16 warps at hidden 9216-16384
(`profiles/h200/probe_compile_norm.txt`). In one bench_norm run (2026-12-01, H200) compile's LayerNorm forward read
0.94 of copy at 16384 and megakern's 0.89; megakern's two-pass kernel looped at the same geometry read 0.66 in a
sweep of the same session (`profiles/h200/tune_ln_fwd_16384_d321b2e.txt`).

    python profiles/probe_ln_welford.py --hidden 12288,14336,16384 [--warps 8,16] [--chunks 2048] [--mib 256]
        [--against COPY_OF_NORM_TRITON.py] [--no-probe]

Bytes counted: x read once, y written once. Fraction: of the same-run copy. Every variant's output is checked
against torch's in fp32 before it is timed.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import triton
import triton.language as tl

from benchmarks.common import bench, import_file, int_list, measure_copy_gbps
from megakern import _norm_triton

EPS = 1e-5


@triton.jit
def _chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    n = n_a + n_b
    delta = mean_b - mean_a
    f = n_b / tl.maximum(n, 1.0)
    return n, mean_a + delta * f, m2_a + m2_b + delta * delta * (n_a * f)


@triton.jit
def _step(X, W, B, Y, row_x, row_y, start, offs, mean, m2, count, i, rstd, STATS: tl.constexpr, N: tl.constexpr,
          CHUNK: tl.constexpr, DIV: tl.constexpr):
    """Pass 1 (STATS): the lanes' Welford update by step ``i``'s columns; pass 2: y of those columns. Where the
    steps fill the row (N a multiple of CHUNK) no column is masked."""
    EVEN: tl.constexpr = N % CHUNK == 0
    cols = start + offs
    live = cols < N
    policy: tl.constexpr = "evict_last" if STATS else "evict_first"
    if EVEN:
        x = tl.load(X + row_x + cols, eviction_policy=policy).to(tl.float32)
    else:
        x = tl.load(X + row_x + cols, mask=live, other=0.0, eviction_policy=policy).to(tl.float32)
    if STATS:
        delta = x - mean
        if DIV:
            count = count + 1.0 if EVEN else tl.where(live, count + 1.0, count)
            step = delta / tl.maximum(count, 1.0)
        else:
            step = delta * (1.0 / (i + 1.0))
        if EVEN:
            mean = mean + step
            m2 = m2 + delta * (x - mean)
        else:
            mean = tl.where(live, mean + step, mean)
            m2 = tl.where(live, m2 + delta * (x - mean), m2)
        return mean, m2, count
    if EVEN:
        w = tl.load(W + cols, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(B + cols, eviction_policy="evict_last").to(tl.float32)
        tl.store(Y + row_y + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty))
    else:
        w = tl.load(W + cols, mask=live, other=0.0, eviction_policy="evict_last").to(tl.float32)
        b = tl.load(B + cols, mask=live, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(Y + row_y + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty), mask=live)
    return mean, m2, count


@triton.jit
def _ln_probe_kernel(X, W, B, Y, MEAN, RSTD, stride_x, stride_y, eps, N: tl.constexpr, CHUNK: tl.constexpr,
                     MERGE: tl.constexpr, DIV: tl.constexpr, UNROLL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_x, row_y = row * stride_x, row * stride_y
    offs = tl.arange(0, CHUNK)
    mean = tl.zeros([CHUNK], dtype=tl.float32)
    m2 = tl.zeros([CHUNK], dtype=tl.float32)
    # the lanes' counts: counted as they go with DIV, else the steps in which the lane held a column
    count = tl.zeros([CHUNK], dtype=tl.float32)
    if not DIV:
        count = ((N - offs + CHUNK - 1) // CHUNK).to(tl.float32)
    STEPS: tl.constexpr = (N + CHUNK - 1) // CHUNK
    if UNROLL:
        for i in tl.static_range(STEPS):
            mean, m2, count = _step(X, W, B, Y, row_x, row_y, i * CHUNK, offs, mean, m2, count, i, 0.0, True, N, CHUNK, DIV)
    else:
        for i in tl.range(0, STEPS):
            mean, m2, count = _step(X, W, B, Y, row_x, row_y, i * CHUNK, offs, mean, m2, count, i, 0.0, True, N, CHUNK, DIV)
    if MERGE:
        _, row_mean, row_m2 = tl.reduce((count, mean, m2), 0, _chan)
    else:
        row_mean = tl.sum(mean * count, axis=0) / N
        spread = mean - row_mean
        row_m2 = tl.sum(m2 + count * spread * spread, axis=0)
    rstd = 1.0 / tl.sqrt(row_m2 / N + eps)
    tl.store(MEAN + row, row_mean)
    tl.store(RSTD + row, rstd)
    if UNROLL:
        for i in tl.static_range(STEPS):
            _step(X, W, B, Y, row_x, row_y, i * CHUNK, offs, row_mean, m2, count, i, rstd, False, N, CHUNK, DIV)
    else:
        for i in tl.range(0, STEPS):
            _step(X, W, B, Y, row_x, row_y, i * CHUNK, offs, row_mean, m2, count, i, rstd, False, N, CHUNK, DIV)


def probe_fwd(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, chunk: int, warps: int, merge: bool, div: bool,
              unroll: bool) -> torch.Tensor:
    """y of the probe kernel over the rows of 2-D ``x``."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"probe_ln_welford: x must be 2-D with unit column stride, got {tuple(x.shape)}")
    if chunk < 16 or chunk & (chunk - 1):
        raise ValueError(f"probe_ln_welford: chunk must be a power of two >= 16, got {chunk}")
    rows, n = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(rows, device=x.device, dtype=torch.float32)
    rstd = torch.empty_like(mean)
    _ln_probe_kernel[(rows,)](x, w, b, y, mean, rstd, x.stride(0), y.stride(0), EPS, N=n,
                              CHUNK=min(chunk, triton.next_power_of_2(n)), MERGE=merge, DIV=div, UNROLL=unroll,
                              num_warps=warps)
    return y


def variants(warps: list[int], chunks: list[int]) -> list[tuple[str, dict]]:
    """(label, probe_fwd keywords) of every probe kernel swept."""
    out = []
    for w, c, merge, div, unroll in itertools.product(warps, chunks, (True, False), (True, False), (True, False)):
        label = f"probe warps={w} chunk={c} merge={int(merge)} div={int(div)} unroll={int(unroll)}"
        out.append((label, dict(chunk=c, warps=w, merge=merge, div=div, unroll=unroll)))
    return out


def cases(x, w, b, warps: list[int], chunks: list[int], with_compile: bool, against=None,
          probes: bool = True) -> list[tuple[str, object]]:
    """(label, zero-argument callable returning y) of every provider timed at one width: torch.compile's, megakern's
    table and two-pass kernel unrolled (either statistics), each also as the module ``against`` (a (label, megakern._norm_triton module) pair) has them, first; the probe's variants."""
    out = []
    if with_compile:
        compiled = torch.compile(lambda x, w, b: torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS),
                                 dynamic=False)
        out.append(("torch.compile", lambda: compiled(x, w, b)))
    modules = ([(f" @{against[0]}", against[1])] if against else []) + [("", _norm_triton)]
    for tag, mod in modules:
        out.append((f"megakern table{tag}", lambda mod=mod: mod.fwd(x, None, w, b, EPS, False)[0]))
    for wp, c in itertools.product(warps, chunks):
        for tag, mod in modules:
            for sums in (True, False):
                out.append((f"megakern wide unrolled warps={wp} chunk={c} sums={int(sums)}{tag}",
                            lambda wp=wp, c=c, sums=sums, mod=mod: mod.fwd(x, None, w, b, EPS, False, num_warps=wp,
                                                                           wide=True, chunk=c, unrolled=True,
                                                                           sums=sums)[0]))
    if probes:
        for label, kwargs in variants(warps, chunks):
            out.append((label, lambda kwargs=kwargs: probe_fwd(x, w, b, **kwargs)))
    return out


def run(hidden: int, rows: int, device, warps: list[int], chunks: list[int], rep_ms: int = 200,
        with_compile: bool = True, against=None, probes: bool = True) -> list[tuple[str, float, float]]:
    """(label, ms, GB/s) of every provider at ``hidden`` (``cases``), each checked against torch's fp32 LayerNorm
    first."""
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    x = torch.randn(rows, hidden, device=device, dtype=dtype) * 2 + 3
    w = 1 + 0.1 * torch.randn(hidden, device=device, dtype=dtype)
    b = 0.1 * torch.randn(hidden, device=device, dtype=dtype)
    ref = torch.nn.functional.layer_norm(x.float(), (hidden,), w.float(), b.float(), EPS)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    out = []
    for label, fn in cases(x, w, b, warps, chunks, with_compile, against, probes):
        err = (fn().float() - ref).abs().max().item()
        if err > tol * max(1.0, ref.abs().max().item()):
            raise AssertionError(f"probe_ln_welford: hidden {hidden}, {label}: output off by {err}")
        ms = bench(fn, device=device, rep_ms=rep_ms, graph=torch.device(device).type == "cuda")["median"]
        out.append((label, ms, 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_list, default=[16384])
    parser.add_argument("--warps", type=int_list, default=[16])
    parser.add_argument("--chunks", type=int_list, default=[2048])
    parser.add_argument("--mib", type=int, default=256, help="MiB of bf16 input a case")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--against", metavar="PATH", default=None,
                        help="a copy of megakern/_norm_triton.py (e.g. git show main:megakern/_norm_triton.py) whose "
                        "table and unrolled kernel are timed too, each just before the checkout's (an A/B)")
    parser.add_argument("--no-probe", action="store_true", help="megakern's kernels and torch.compile's only")
    args = parser.parse_args(argv)
    if min(args.hidden) < 1 or args.mib < 1:
        raise SystemExit(f"probe_ln_welford: --hidden and --mib must be >= 1, got {args.hidden} and {args.mib}")
    if any(c < 16 or c & (c - 1) for c in args.chunks):
        raise SystemExit(f"probe_ln_welford: --chunks must be powers of two >= 16, got {args.chunks}")
    cuda = torch.device(args.device).type == "cuda"
    against = None
    if args.against:
        if not Path(args.against).is_file():
            raise SystemExit(f"probe_ln_welford: --against {args.against!r} is not a file")
        against = (Path(args.against).stem, import_file(Path(args.against), "_norm_triton_against"))
    copy = measure_copy_gbps(args.device)
    print(f"copy {copy:.0f} GB/s; LayerNorm forward, bf16, graph replay on CUDA")
    for hidden in args.hidden:
        rows = max(1, args.mib * 2**20 // (2 * hidden))
        for label, ms, gbps in run(hidden, rows, args.device, args.warps, args.chunks, args.rep_ms, cuda,
                                   against, not args.no_probe):
            print(f"{rows}x{hidden} {label:64s} {ms * 1e3:8.1f} us  {gbps:6.0f} GB/s  {gbps / copy:.2f}")


if __name__ == "__main__":
    main()
