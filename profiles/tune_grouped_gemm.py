"""Tile sweep of the grouped GEMM (megakern/_grouped_gemm_triton.py) for its forward, dX and dW launchers, against
torch._grouped_mm in the same run, within a wall-time budget.

Shapes (bf16, 32768 routed rows, nothing dropped; tokens per expert uneven and fixed: each token's k experts drawn
without replacement with a per-expert popularity, Gumbel top-k, seed 0 on the host):
    e8     E=8    K 4096 -> F 14336   16384 tokens top-2     Mixtral-8x7B's w1
    e64    E=64   K 2048 -> F 1408    8192 tokens top-4      DeepSeek-MoE-16B's experts
    e128   E=128  K 2048 -> F 768     4096 tokens top-8      fine-grained (Qwen3-MoE-30B's experts)
Passes, x (M, K), w (E, K, F), dout (M, F), offsets (E + 1,) on the device:
    fwd   grouped_mm(x, w, offsets)                torch._grouped_mm(x, w, offs)
    dx    grouped_mm(dout, w.transpose(1, 2))      torch._grouped_mm(dout, w.transpose(1, 2), offs)
    dw    grouped_mm_dw(x, dout, offsets, E)       torch._grouped_mm(x.t(), dout, offs)
FLOPs = 2 * rows * K * F for each pass; TFLOP/s = FLOPs / median time (triton.testing.do_bench, L2 flushed).

Candidates are ``Config(block_m, block_n, block_k, group_m, stages, warps, persistent)`` of the launcher with TMA
tile moves on or off (``tma=``): the launcher's default first, then a curated list per pass (about 30; those whose
pipeline buffers exceed shared memory left out), ordered so the likeliest come first (64-row tiles earlier where
experts hold few rows). Each candidate's output is checked against the fp32 reference before it is timed: the error
(max |out - ref| / max |ref|, rows from offsets[E] on zero) must be at most 2x torch._grouped_mm's plus 2e-3; a
wrong or failing candidate is reported and skipped.

Budget (``--budget-s``): candidates are compiled first by worker processes (``--compile-workers``, into Triton's
on-disk cache; up to half the budget), then timed round-robin over the (shape, pass) groups, so that every group has
its best candidates timed when the budget ends; the best three per group and torch._grouped_mm are timed again
(longer) at the end. The sweep stops cleanly with what it has.

Output: a table of the best candidate per (shape, pass) with its speedup over torch._grouped_mm, and every
candidate (config, status, ms, TFLOP/s, speedup) in ``--out`` (default profiles/<gpu>/tune_grouped_gemm.txt on a
GPU; a CPU run writes no file without it).

    python -m profiles.tune_grouped_gemm [--budget-s 420] [--shapes e8,e64,e128] [--passes fwd,dx,dw]
                                         [--out profiles/h100/tune_grouped_gemm.txt] [--compile-workers 12]
    python -m profiles.tune_grouped_gemm --device cpu --max-candidates 3     # smoke test (interpreter, tiny shape)
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

REPO = Path(__file__).resolve().parents[1]

PASSES = ("fwd", "dx", "dw")
SMEM_BYTES = 232448  # Hopper's shared memory per block
SMEM_PER_SM = 233472  # and per SM


class Shape(NamedTuple):
    name: str
    experts: int
    top_k: int
    tokens: int
    k: int
    f: int


SHAPES = {"e8": Shape("e8", 8, 2, 16384, 4096, 14336), "e64": Shape("e64", 64, 4, 8192, 2048, 1408),
          "e128": Shape("e128", 128, 8, 4096, 2048, 768)}
TINY = Shape("tiny", 4, 2, 24, 32, 48)


def _configs():
    from megakern._grouped_gemm_triton import Config as C

    # (config, tma), likeliest first
    mn = [C(128, 256, 64, 8, 3, 8, True), C(128, 128, 64, 8, 4, 8, True), C(128, 128, 64, 8, 4, 4, True),
          C(64, 128, 64, 8, 4, 4, True), C(128, 256, 64, 8, 4, 8, True), C(256, 128, 64, 8, 3, 8, True),
          C(128, 128, 128, 8, 3, 8, True), C(64, 256, 64, 8, 4, 4, True), C(128, 256, 64, 8, 3, 8, False),
          C(128, 128, 64, 8, 4, 8, False), C(64, 128, 64, 8, 4, 4, False), C(128, 256, 64, 4, 3, 8, True),
          C(128, 256, 64, 16, 3, 8, True), C(128, 128, 64, 4, 4, 8, True), C(128, 128, 64, 16, 4, 8, True),
          C(64, 256, 64, 8, 3, 8, True), C(64, 128, 128, 8, 3, 4, True), C(128, 64, 64, 8, 4, 4, True),
          C(128, 128, 64, 8, 5, 4, True), C(256, 128, 64, 8, 4, 8, True), C(128, 256, 32, 8, 5, 8, True),
          C(64, 64, 64, 8, 5, 4, True), C(128, 64, 128, 8, 3, 4, True),
          C(128, 128, 32, 8, 6, 4, True), C(256, 64, 64, 8, 4, 8, True), C(64, 128, 64, 4, 5, 4, True),
          C(128, 256, 128, 8, 2, 8, True)]
    mn = [(c, True) for c in mn] + [(C(128, 256, 64, 8, 3, 8, True), False), (C(128, 128, 64, 8, 4, 8, True), False),
                                    (C(64, 128, 64, 8, 4, 4, True), False)]
    dw = [C(128, 128, 64, 8, 4, 8, True), C(128, 256, 64, 8, 3, 8, True), C(128, 128, 64, 8, 4, 4, True),
          C(128, 128, 128, 8, 3, 8, True), C(256, 128, 64, 8, 3, 8, True), C(64, 128, 64, 8, 4, 4, True),
          C(128, 128, 32, 8, 5, 4, True), C(128, 128, 64, 8, 4, 8, False), C(128, 256, 64, 8, 3, 8, False),
          C(64, 256, 64, 8, 4, 4, True), C(128, 64, 64, 8, 4, 4, True), C(128, 128, 64, 4, 4, 8, True),
          C(128, 128, 64, 1, 4, 8, True), C(128, 128, 64, 16, 4, 8, True), C(256, 128, 32, 8, 4, 8, True),
          C(128, 256, 32, 8, 4, 8, True), C(128, 256, 128, 8, 2, 8, True), C(64, 128, 128, 8, 3, 4, True),
          C(128, 64, 64, 4, 4, 4, True), C(64, 64, 64, 8, 5, 4, True), C(256, 64, 64, 8, 4, 8, True),
          C(128, 64, 128, 8, 3, 4, True), C(128, 256, 64, 8, 4, 8, True), C(256, 128, 64, 8, 4, 8, True)]
    dw = [(c, True) for c in dw] + [(C(128, 128, 64, 8, 4, 8, True), False), (C(128, 256, 64, 8, 3, 8, True), False)]
    # two programs per SM (one's epilogue under the other's main loop), and dW's tail step prefetched
    two = [C(128, 128, 64, 8, 2, 8, True, 2), C(128, 128, 32, 8, 4, 8, True, 2), C(128, 128, 32, 8, 4, 4, True, 2),
           C(64, 128, 64, 8, 3, 4, True, 2)]
    mn = [(c, True) for c in two[:2]] + mn + [(c, True) for c in two[2:]]
    tails = [C(128, 128, 32, 8, 4, 8, True, 2, True), C(128, 256, 32, 8, 4, 8, True, 1, True),
             C(128, 128, 32, 8, 3, 8, True, 2, True), C(128, 128, 32, 8, 4, 4, True, 2, True),
             C(128, 128, 32, 4, 4, 8, True, 2, True), C(128, 128, 32, 16, 4, 8, True, 2, True),
             C(128, 128, 64, 8, 2, 8, True, 2, True), C(256, 128, 32, 8, 4, 8, True, 1, True),
             C(128, 256, 64, 8, 3, 8, True, 1, True), C(128, 128, 32, 8, 4, 8, True, 2),
             C(64, 256, 32, 8, 3, 4, True, 2, True), C(128, 128, 64, 8, 4, 8, True, 1, True)]
    dw = [(c, True) for c in tails] + dw
    return {"fwd": mn, "dx": mn, "dw": dw}


def _tiny_configs():
    from megakern._grouped_gemm_triton import INTERPRETER_CONFIG, Config as C

    cands = [(INTERPRETER_CONFIG, False), (C(16, 32, 16, 2, 1, 4, False), False), (C(16, 32, 16, 2, 1, 4, True), True),
             (C(32, 16, 32, 1, 1, 4, True), False)]
    return {p: cands for p in PASSES}


def smem_ok(cfg) -> bool:
    """The pipeline's buffers (stages x (A tile + B tile), 2 bytes an element) fit Hopper's shared memory, and with
    two or more programs per SM their buffers and output tiles fit the SM's together."""
    pipeline = cfg.stages * (cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n) * 2
    if cfg.occupancy <= 1:
        return pipeline <= SMEM_BYTES
    return cfg.occupancy * (pipeline + cfg.block_m * cfg.block_n * 2 + 1024) <= SMEM_PER_SM


def candidates(shape: Shape, pass_: str, device: torch.device, tiny: bool) -> list[tuple]:
    """(config, tma) in the order they are tried: the launcher's default first."""
    from megakern import _grouped_gemm_triton as gg

    table = _tiny_configs() if tiny else _configs()
    rows = shape.tokens * shape.top_k
    m, n, k = (rows, shape.f, shape.k) if pass_ != "dx" else (rows, shape.k, shape.f)
    default = gg.default_config(m, n, k, shape.experts, _dtype(device), device, dw=pass_ == "dw")
    listed = list(table[pass_])
    if not tiny and rows // shape.experts < 1024:  # few rows per expert: 64-row tiles waste less of each expert's last
        listed = sorted(listed, key=lambda c: listed.index(c) - (6 if c[0].block_m == 64 and pass_ != "dw" else 0))
    tma_default = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    out = [(default, tma_default)]
    for cand in listed:
        if cand not in out and (tiny or smem_ok(cand[0])):
            out.append(cand)
    return out


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def label(cfg, tma: bool) -> str:
    return f"{cfg!r} tma={tma}"


# ---- the operands --------------------------------------------------------------------------------------------------
def routing(shape: Shape, seed: int = 0) -> torch.Tensor:
    """(tokens, k) expert indices on the host: per-expert popularity (log-normal, sigma 0.35) and Gumbel noise, the k
    best per token; fixed by ``seed``."""
    g = torch.Generator().manual_seed(seed)
    popularity = torch.randn(shape.experts, generator=g) * 0.35
    u = torch.rand(shape.tokens, shape.experts, generator=g).clamp_(1e-9, 1 - 1e-9)
    return (popularity - torch.log(-torch.log(u))).topk(shape.top_k, dim=1).indices


class Operands(NamedTuple):
    x: torch.Tensor
    w: torch.Tensor
    dout: torch.Tensor
    offsets: torch.Tensor
    offs32: torch.Tensor
    rows: int
    counts: list


def operands(shape: Shape, device: torch.device, fill: bool = True) -> Operands:
    from megakern import moe

    plan = moe.route_plan(routing(shape).to(device), shape.experts)
    m = shape.tokens * shape.top_k
    dtype = _dtype(device)
    if fill:
        g = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(m, shape.k, device=device, generator=g).to(dtype)
        w = (torch.randn(shape.experts, shape.k, shape.f, device=device, generator=g) * shape.k ** -0.5).to(dtype)
        dout = torch.randn(m, shape.f, device=device, generator=g).to(dtype)
    else:  # compile-only workers: the same shapes, strides and alignment
        x = torch.empty(m, shape.k, device=device, dtype=dtype)
        w = torch.empty(shape.experts, shape.k, shape.f, device=device, dtype=dtype)
        dout = torch.empty(m, shape.f, device=device, dtype=dtype)
    counts = plan.counts.tolist()
    return Operands(x, w, dout, plan.offsets, plan.offsets[1:].to(torch.int32), int(sum(counts)), counts)


def runner(ops: Operands, pass_: str, cfg, tma: bool):
    """fn() -> the pass's output with (cfg, tma)."""
    from megakern import _grouped_gemm_triton as gg

    experts = ops.w.shape[0]
    if pass_ == "fwd":
        return lambda: gg.grouped_mm(ops.x, ops.w, ops.offsets, config=cfg, tma=tma)
    if pass_ == "dx":
        wt = ops.w.transpose(1, 2)
        return lambda: gg.grouped_mm(ops.dout, wt, ops.offsets, config=cfg, tma=tma)
    return lambda: gg.grouped_mm_dw(ops.x, ops.dout, ops.offsets, experts, out_dtype=ops.w.dtype, config=cfg, tma=tma)


def torch_runner(ops: Operands, pass_: str):
    if pass_ == "fwd":
        return lambda: torch._grouped_mm(ops.x, ops.w, offs=ops.offs32)
    if pass_ == "dx":
        wt = ops.w.transpose(1, 2)
        return lambda: torch._grouped_mm(ops.dout, wt, offs=ops.offs32)
    xt = ops.x.t()
    return lambda: torch._grouped_mm(xt, ops.dout, offs=ops.offs32)


def reference(ops: Operands, pass_: str) -> torch.Tensor:
    """The pass's output in fp32, a loop over the experts (fwd / dx: rows from offsets[E] on are 0)."""
    bounds = ops.offsets.tolist()
    experts = ops.w.shape[0]
    if pass_ == "dw":
        out = torch.zeros(ops.w.shape, dtype=torch.float32, device=ops.w.device)
        for e in range(experts):
            a, b = bounds[e], bounds[e + 1]
            if b > a:
                out[e] = ops.x[a:b].float().t() @ ops.dout[a:b].float()
        return out
    src = ops.x if pass_ == "fwd" else ops.dout
    cols = ops.w.shape[2] if pass_ == "fwd" else ops.w.shape[1]
    out = torch.zeros(src.shape[0], cols, dtype=torch.float32, device=src.device)
    for e in range(experts):
        a, b = bounds[e], bounds[e + 1]
        if b > a:
            we = ops.w[e].float()
            out[a:b] = src[a:b].float() @ (we if pass_ == "fwd" else we.t())
    return out


def error(out: torch.Tensor, ref: torch.Tensor, rows: int, pass_: str) -> float:
    """max |out - ref| / max |ref| over the routed rows (fwd / dx) or all of dw; NaN propagates."""
    if pass_ != "dw":
        out, ref = out[:rows], ref[:rows]
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def tail_zero(out: torch.Tensor, rows: int, pass_: str) -> bool:
    return pass_ == "dw" or rows >= out.shape[0] or bool((out[rows:] == 0).all())


def time_ms(fn, device: torch.device, rep_ms: int) -> float:
    """Median ms of fn (do_bench on CUDA; perf_counter on a CPU)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="median"))
    start = time.perf_counter_ns()  # the interpreter: one call (a smoke test, not a figure)
    fn()
    return (time.perf_counter_ns() - start) / 1e6


# ---- compile workers -----------------------------------------------------------------------------------------------
def _precompile(shape: Shape, pass_: str, cfg, tma: bool) -> str:
    """In a worker process: run the launcher once on uninitialized operands of the shape (the same specialization as
    the timed call), so that its binary lands in Triton's on-disk cache. '' or the error."""
    device = torch.device("cuda")
    try:
        ops = _WORKER_OPS.get(shape)
        if ops is None:
            _WORKER_OPS.clear()
            torch.cuda.empty_cache()
            ops = _WORKER_OPS[shape] = operands(shape, device, fill=False)
        runner(ops, pass_, cfg, tma)()
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # out of shared memory or registers, a lowering error: reported by the main process
        return f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"


_WORKER_OPS: dict = {}


def precompile(jobs: list[tuple], workers: int, deadline: float) -> dict:
    """{(shape, pass, cfg, tma): error or ''} of the jobs compiled by ``workers`` processes before ``deadline``."""
    import concurrent.futures as cf
    import multiprocessing as mp

    done = {}
    if workers <= 0 or not jobs:
        return done
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"))
    try:
        futures = {pool.submit(_precompile, *job): job for job in jobs}
        try:
            for fut in cf.as_completed(futures, timeout=max(0.0, deadline - time.perf_counter())):
                try:
                    done[futures[fut]] = fut.result()
                except Exception as exc:  # a worker that died
                    done[futures[fut]] = f"{type(exc).__name__}: {exc}"
        except cf.TimeoutError:
            print(f"compile phase: the budget's share ran out with {len(done)} of {len(jobs)} compiled; the rest "
                  "compile when timed, as the budget allows")
    finally:
        procs = list((getattr(pool, "_processes", None) or {}).values())  # shutdown() drops the table
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
    return done


# ---- the sweep -----------------------------------------------------------------------------------------------------
class Row(NamedTuple):
    shape: str
    pass_: str
    cfg: object
    tma: bool
    status: str   # ok | wrong | failed | skipped
    ms: float
    tflops: float
    note: str


def sweep(args) -> tuple[list[Row], dict]:
    start = time.perf_counter()
    deadline = start + args.budget_s
    device = args.device
    tiny = device.type != "cuda"
    shapes = [TINY] if tiny else [SHAPES[s] for s in args.shapes]
    groups = [(s, p) for s in shapes for p in args.passes]
    cands = {(s, p): candidates(s, p, device, tiny)[:args.max_candidates or None] for s, p in groups}
    reserve = min(30.0, 0.1 * args.budget_s)  # the confirm phase's share

    # 1. compile in worker processes (round-robin order, so a cut-off phase still covers every group)
    order = [(s, p, *cands[s, p][i]) for i in range(max(map(len, cands.values()))) for s, p in groups
             if i < len(cands[s, p])]
    workers = args.compile_workers if args.compile_workers is not None else (
        0 if tiny else max(1, min(12, (os.cpu_count() or 2) - 2)))
    compiled = precompile(order, 0 if tiny else workers, start + 0.5 * args.budget_s)
    if workers and not tiny:
        bad = sum(1 for v in compiled.values() if v)
        print(f"compile phase: {len(compiled)} of {len(order)} candidates compiled by {workers} workers in "
              f"{time.perf_counter() - start:.0f} s ({bad} failed)")

    # 2. operands, references and torch._grouped_mm per group; then the candidates round-robin
    state = {}
    rows: list[Row] = []
    has_torch = hasattr(torch, "_grouped_mm")
    for s in shapes:
        ops = operands(s, device)
        counts = ops.counts
        mean = sum(counts) / len(counts)
        print(f"{s.name}: E={s.experts} {s.k}->{s.f} rows={ops.rows} tokens per expert min {min(counts)} mean "
              f"{mean:.0f} max {max(counts)} (max/mean {max(counts) / mean:.2f})")
        for p in args.passes:
            ref = reference(ops, p)
            torch_err, torch_ms, note = None, None, ""
            if has_torch:
                try:
                    fn = torch_runner(ops, p)
                    torch_err = error(fn(), ref, ops.rows, p)
                    torch_ms = time_ms(fn, device, args.rep_ms)
                except Exception as exc:
                    note = f"torch._grouped_mm failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
                    print(f"  {p}: {note}")
            else:
                note = f"torch {torch.__version__} has no torch._grouped_mm"
            state[s, p] = dict(ops=ops, ref=ref, torch_err=torch_err, torch_ms=torch_ms, note=note,
                               flop=2.0 * ops.rows * s.k * s.f)
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def tol(g):
        te = state[g]["torch_err"]
        return 2 * te + 2e-3 if te is not None else 2e-2

    # operands of one shape at a time on the device: groups ordered by shape within each round
    stopped = None
    for i in range(max(map(len, cands.values()))):
        for s, p in groups:
            if i >= len(cands[s, p]):
                continue
            cfg, tma = cands[s, p][i]
            if stopped is None and time.perf_counter() > deadline - reserve - _cost(compiled, s, p, cfg, tma, args):
                stopped = f"budget ({args.budget_s:.0f} s) spent after round {i}"
            if stopped:
                rows.append(Row(s.name, p, cfg, tma, "skipped", float("nan"), float("nan"), "budget"))
                continue
            rows.append(_try(state[s, p], s, p, cfg, tma, compiled, tol((s, p)), device, args))
            r = rows[-1]
            speed = (f" {state[s, p]['torch_ms'] / r.ms:5.2f}x torch" if r.status == "ok" and state[s, p]["torch_ms"]
                     else "")
            print(f"  {s.name:5s} {p:3s} {label(cfg, tma):100s} {r.status:7s} "
                  + (f"{r.ms:8.3f} ms {r.tflops:7.1f} TFLOP/s{speed}" if r.status == "ok" else r.note))
    if stopped:
        print(f"stopped: {stopped}; the rest marked skipped")

    # 3. confirm: the best three per group and torch, timed longer, while the budget lasts
    for (s, p), st in state.items():
        best = sorted((j for j, r in enumerate(rows) if (r.shape, r.pass_) == (s.name, p) and r.status == "ok"),
                      key=lambda j: rows[j].ms)[:3]
        if tiny or not best or time.perf_counter() + (len(best) + 1) * (1.0 + 5 * args.rep_ms / 1e3) > deadline:
            continue
        if st["torch_ms"] is not None:
            st["torch_ms"] = time_ms(torch_runner(st["ops"], p), device, 4 * args.rep_ms)
        for j in best:
            ms = time_ms(runner(st["ops"], p, rows[j].cfg, rows[j].tma), device, 4 * args.rep_ms)
            rows[j] = rows[j]._replace(ms=ms, tflops=st["flop"] / ms / 1e9, note=rows[j].note + ", re-timed")
    summary = {(s.name, p): dict(torch_ms=st["torch_ms"], torch_err=st["torch_err"], flop=st["flop"], note=st["note"])
               for (s, p), st in state.items()}
    summary["_elapsed"] = time.perf_counter() - start
    return rows, summary


def _cost(compiled: dict, s, p, cfg, tma, args) -> float:
    """A candidate's expected seconds: the timing (warm-up + repetitions + check), plus a compile when no worker
    compiled it."""
    return 1.0 + 1.5 * args.rep_ms / 1e3 + (0.0 if (s, p, cfg, tma) in compiled else 6.0)


def _try(st: dict, s: Shape, p: str, cfg, tma: bool, compiled: dict, tol: float, device, args) -> Row:
    if err := compiled.get((s, p, cfg, tma)):
        return Row(s.name, p, cfg, tma, "failed", float("nan"), float("nan"), err)
    fn = runner(st["ops"], p, cfg, tma)
    try:
        out = fn()
        e = error(out, st["ref"], st["ops"].rows, p)
        if not (e <= tol and tail_zero(out, st["ops"].rows, p)):
            return Row(s.name, p, cfg, tma, "wrong", float("nan"), float("nan"),
                       f"error {e:.3g} > {tol:.3g}" if not e <= tol else "rows past offsets[E] not zero")
        del out
        ms = time_ms(fn, device, args.rep_ms)
    except Exception as exc:
        msg = str(exc).splitlines()[0][:160] if str(exc) else ""
        return Row(s.name, p, cfg, tma, "failed", float("nan"), float("nan"), f"{type(exc).__name__}: {msg}")
    return Row(s.name, p, cfg, tma, "ok", ms, st["flop"] / ms / 1e9, f"error {e:.3g}")


# ---- report --------------------------------------------------------------------------------------------------------
def best_table(rows: list[Row], summary: dict) -> str:
    lines = ["| shape | pass | best config | tma | ms | TFLOP/s | torch._grouped_mm TFLOP/s | speedup |",
             "|---|---|---|---|---|---|---|---|"]
    for key, info in summary.items():
        if key == "_elapsed":
            continue
        ok = [r for r in rows if (r.shape, r.pass_) == key and r.status == "ok"]
        torch_ms = info["torch_ms"]
        torch_tf = f"{info['flop'] / torch_ms / 1e9:.1f}" if torch_ms else "n/a"
        if not ok:
            lines.append(f"| {key[0]} | {key[1]} | none timed | - | - | - | {torch_tf} | - |")
            continue
        b = min(ok, key=lambda r: r.ms)
        speed = f"{torch_ms / b.ms:.2f}x" if torch_ms else "n/a"
        lines.append(f"| {key[0]} | {key[1]} | `{b.cfg!r}` | {b.tma} | {b.ms:.3f} | {b.tflops:.1f} | {torch_tf} | "
                     f"{speed} |")
    return "\n".join(lines)


def full_listing(rows: list[Row], summary: dict, header: str) -> str:
    lines = [header, ""]
    for key, info in summary.items():
        if key == "_elapsed":
            continue
        torch_ms = info["torch_ms"]
        lines.append(f"== {key[0]} {key[1]}: torch._grouped_mm "
                     + (f"{torch_ms:.3f} ms {info['flop'] / torch_ms / 1e9:.1f} TFLOP/s (error {info['torch_err']:.3g})"
                        if torch_ms else (info["note"] or "n/a")))
        for r in sorted((r for r in rows if (r.shape, r.pass_) == key),
                        key=lambda r: (r.status != "ok", r.ms if r.status == "ok" else 0)):
            fig = (f"{r.ms:8.3f} ms {r.tflops:7.1f} TFLOP/s "
                   + (f"{torch_ms / r.ms:5.2f}x " if torch_ms else "")) if r.status == "ok" else ""
            lines.append(f"  {label(r.cfg, r.tma):100s} {r.status:7s} {fig}{r.note}")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-time budget of the whole sweep")
    parser.add_argument("--shapes", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                        default=list(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--passes", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                        default=list(PASSES), help=f"of {', '.join(PASSES)}")
    parser.add_argument("--rep-ms", type=int, default=100, help="do_bench repetition time per candidate (ms)")
    parser.add_argument("--compile-workers", type=int, default=None,
                        help="processes compiling candidates ahead of timing (default: CPUs - 2, at most 12; 0: none)")
    parser.add_argument("--max-candidates", type=int, default=0, help="candidates per (shape, pass); 0: all")
    parser.add_argument("--out", type=Path, default=None,
                        help="file of the whole sweep (default: profiles/<gpu>/tune_grouped_gemm.txt on a GPU)")
    parser.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if bad := set(args.shapes) - SHAPES.keys():
        parser.error(f"unknown shapes {sorted(bad)}; choose from {', '.join(SHAPES)}")
    if bad := set(args.passes) - set(PASSES):
        parser.error(f"unknown passes {sorted(bad)}; choose from {', '.join(PASSES)}")
    if args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    return args


def main(argv=None) -> tuple[list[Row], dict]:
    args = parse_args(argv)
    if args.device.type != "cuda":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors
    from benchmarks.common import git_sha, gpu_slug

    import triton

    gpu = torch.cuda.get_device_name(args.device) if args.device.type == "cuda" else "cpu"
    header = (f"tune_grouped_gemm on {gpu}, torch {torch.__version__}, triton {triton.__version__}, git {git_sha()}, "
              f"budget {args.budget_s:.0f} s, do_bench rep {args.rep_ms} ms (best three re-timed at {4 * args.rep_ms} "
              "ms)")
    print(header)
    rows, summary = sweep(args)
    table = best_table(rows, summary)
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "wrong", "failed", "skipped")}
    tail = (f"{len(rows)} candidates: {counts['ok']} timed, {counts['wrong']} wrong, {counts['failed']} failed, "
            f"{counts['skipped']} skipped (budget); {summary['_elapsed']:.0f} s")
    out = args.out
    if out is None and args.device.type == "cuda":
        out = REPO / "profiles" / gpu_slug(args.device) / "tune_grouped_gemm.txt"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(full_listing(rows, summary, header) + "\n" + table + "\n\n" + tail + "\n")
        print(f"wrote {out}")
    print()
    print(table)
    print()
    print(tail)
    return rows, summary


if __name__ == "__main__":
    main()
