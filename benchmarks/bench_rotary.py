"""Rotary position embeddings throughput, forward and forward+backward, against the same-run copy roofline.

Shapes: q (B, T, nh, hs), k (B, T, nkv, hs) in flash-attn's layout, positions 0 .. T - 1 of every sequence; bf16 on
CUDA, fp32 on CPU (smoke runs only). Cases: the headline q (8, 4096, 32, 128) + k (8, 4096, 8, 128) (Llama-3-8B at
4k tokens: GQA, full rotary, GPT-NeoX halves), then a sweep: GPT-J interleaved pairs, multi-head k, head dims 64 and
256, GPT-NeoX-20B's partial rotary (hs 96, rotary_dim 24), one long sequence; --quick: the headline, both layouts.
Case names read 'q8x4096x32x128 k8 rd128 neox bf16'.

Bytes moved, e = bytes per element of q and k, te = bytes per table entry, rd = rotary dim:
    fwd      = read q, k + write q_out, k_out          2 * B * T * (nh + nkv) * hs * e
             + read T rows of cos and sin once         2 * T * (rd / 2) * te
    fwd+bwd  = fwd + the same again                    (dq, dk from the gradients of q_out, k_out)
An out-of-place op moves whole heads even with partial rotary: the features past rd are copied. megakern reads fp32
half tables (T, rd / 2), te = 4; the torch and liger formulations read transformers' duplicated tables (T, rd) in
q's dtype, te = 2: the same table bytes. GB/s = bytes / median time; every figure is also given as a fraction of
the copy roofline measured in the same run.

Both modes run on inputs that require grad, as in training: 'fwd' is the training forward, 'fwd+bwd' adds
torch.autograd.grad of (q_out, k_out) w.r.t. (q, k) for fixed random gradients. Before timing, each provider's
outputs and gradients are checked against the fp32 torch reference (megakern.rotary_ref); a wrong provider is
reported and skipped.

Providers: 'torch' (transformers' apply_rotary_pos_emb formulation, eager, in q's dtype), 'compile' (the same under
torch.compile), 'liger' (liger_kernel's LigerRopeFunction where installed: full-rotary GPT-NeoX cases only),
'megakern-triton', 'megakern-cuda' (megakern.apply_rotary, out of place). liger takes transformers' arrangement,
(B, nh, T, hs) views over (B, T, nh, hs) memory, as a model's attention hands them over; it gets its own copies,
made before timing, because it rotates its inputs (and, in the backward, its incoming gradients) in place.

    python -m benchmarks.bench_rotary [--quick] [--providers compile,megakern-triton] [--no-save] [--graph] [--tune]

With --graph every provider is timed by CUDA-graph replay instead (modes 'fwd graph', 'fwd+bwd graph'). --tune
instead sweeps the launch parameters of megakern's kernels (forward kernel alone) on the headline, head dim 64 and
partial rotary cases (the CUDA kernel's too, unless --providers leaves megakern-cuda out) and prints them best
first per case, saving nothing.

(`python benchmarks/bench_rotary.py` works too, but finds megakern only where it is installed.)
"""

import dataclasses
import sys
from typing import Callable, NamedTuple

import torch

if __package__:
    from .common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                         parse_args, record, report_failure)
else:  # python benchmarks/bench_rotary.py
    from common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                        parse_args, record, report_failure)

MODES = ("fwd", "fwd+bwd")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# Largest error allowed against the fp32 reference, as a fraction of the reference's largest magnitude.
TOL = {torch.bfloat16: 0.02, torch.float32: 1e-5}


class Case(NamedTuple):
    b: int
    t: int
    nh: int
    nkv: int
    hs: int
    rd: int
    interleaved: bool

    def name(self, dtype: torch.dtype) -> str:
        layout = "interleaved" if self.interleaved else "neox"
        return f"q{self.b}x{self.t}x{self.nh}x{self.hs} k{self.nkv} rd{self.rd} {layout} {DTYPE_NAMES[dtype]}"


HEADLINE = Case(8, 4096, 32, 8, 128, 128, False)


def cases(device: torch.device, quick: bool) -> list[Case]:
    if device.type != "cuda":
        return [Case(2, 64, 4, 2, 32, 32, False), Case(2, 64, 4, 2, 32, 16, True)]
    if quick:
        return [HEADLINE, HEADLINE._replace(interleaved=True)]
    return [
        HEADLINE,
        HEADLINE._replace(interleaved=True),           # GPT-J pairs
        Case(8, 4096, 32, 32, 128, 128, False),         # multi-head k (Llama-2-7B)
        Case(16, 4096, 16, 4, 64, 64, False),           # head dim 64
        Case(4, 4096, 16, 16, 256, 256, False),         # head dim 256 (Gemma-7B)
        Case(8, 2048, 64, 64, 96, 24, False),           # partial rotary: GPT-NeoX-20B, rotary_pct 0.25
        Case(1, 32768, 32, 8, 128, 128, False),         # one long sequence
    ]


def bytes_moved(case: Case, mode: str, esize: int, table_esize: int) -> int:
    """Bytes a fused op must move for one call (formula in the module docstring)."""
    fwd = 2 * case.b * case.t * (case.nh + case.nkv) * case.hs * esize + 2 * case.t * (case.rd // 2) * table_esize
    return fwd if mode == "fwd" else 2 * fwd


class Provider(NamedTuple):
    """What a loader's make(case, dtype) returns: fn(q, k) -> (q_out, k_out) on tensors in ``layout``: 'bthd'
    (B, T, heads, hs) or 'hf' ((B, heads, T, hs) views over (B, T, heads, hs) memory, own copies)."""
    fn: Callable
    layout: str
    table_esize: int


# ---- providers ---------------------------------------------------------------------------------------------------
def _hf_tables(case: Case, dtype, device):
    """transformers' duplicated tables: cos, sin (T, rd) = cat(half, half) in q's dtype, as LlamaRotaryEmbedding."""
    from megakern import rotary_table

    cos, sin = rotary_table(case.t, case.rd, device=device)
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def _eager(case: Case, dtype, device) -> Callable:
    """Plain torch in (B, T, heads, hs): transformers' rotate_half formulation (GPT-J: pairs split out by view)."""
    cos, sin = _hf_tables(case, dtype, device)
    rd = case.rd
    if case.interleaved:
        c, s = cos[:, None, : rd // 2], sin[:, None, : rd // 2]  # (T, 1, rd / 2)

        def rotate(x):
            x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
            return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        c, s = cos[:, None, :], sin[:, None, :]  # (T, 1, rd)

        def rotate(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * c + torch.cat((-x2, x1), dim=-1) * s

    def one(x):
        if rd == x.shape[-1]:
            return rotate(x)
        return torch.cat((rotate(x[..., :rd]), x[..., rd:]), dim=-1)

    return lambda q, k: (one(q), one(k))


def _load_torch(device):
    return lambda case, dtype: Provider(_eager(case, dtype, device), "bthd", 2)


def _load_compile(device):
    def make(case, dtype):
        torch.compiler.reset()  # fresh cache per case: no recompile limit hit, no dynamic-shape graph
        return Provider(torch.compile(_eager(case, dtype, device), dynamic=False), "bthd", 2)

    return make


def _load_megakern(backend: str):
    def load(device):
        import megakern

        if reason := megakern.available_backends(device).get(backend, f"megakern has no {backend!r} backend"):
            raise Unavailable(reason)

        def make(case, dtype):
            cos, sin = megakern.rotary_table(case.t, case.rd, device=device)
            return Provider(lambda q, k: megakern.apply_rotary(q, k, cos, sin, interleaved=case.interleaved,
                                                               backend=backend), "bthd", 4)

        return make

    return load


def _load_liger(device):
    if device.type != "cuda":
        raise Unavailable("liger_kernel's Triton kernels need CUDA")
    from liger_kernel.ops.rope import LigerRopeFunction

    def make(case, dtype):
        if case.interleaved or case.rd != case.hs:
            raise Unavailable("liger's rope takes full-rotary GPT-NeoX halves only here")
        cos, sin = _hf_tables(case, dtype, device)
        return Provider(lambda q, k: LigerRopeFunction.apply(q, k, cos[None], sin[None]), "hf", 2)

    return make


PROVIDERS = {
    "torch": _load_torch,
    "compile": _load_compile,
    "liger": _load_liger,
    "megakern-triton": _load_megakern("triton"),
    "megakern-cuda": _load_megakern("cuda"),
}


# ---- inputs, reference, checks -----------------------------------------------------------------------------------
def _in_layout(x: torch.Tensor, layout: str, grad: bool) -> torch.Tensor:
    """An own copy of x (B, T, heads, hs): as is ('bthd'), or viewed (B, heads, T, hs) ('hf'); a leaf that
    requires grad when ``grad``."""
    y = x.detach().clone().requires_grad_(grad)
    return y if layout == "bthd" else y.transpose(1, 2)


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x if x._base is None else x._base


def _to_bthd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bthd" else x.transpose(1, 2)


def _reference(case: Case, q, k, dq, dk):
    """q_out, k_out, dq, dk in fp32, from megakern.rotary_ref on fp32 copies with the fp64-built fp32 table."""
    from megakern import rotary_ref, rotary_table

    cos, sin = rotary_table(case.t, case.rd, device=q.device)
    qf, kf = (x.detach().float().requires_grad_() for x in (q, k))
    q_out, k_out = rotary_ref(qf, kf, cos, sin, interleaved=case.interleaved)
    return (q_out.detach(), k_out.detach(), *torch.autograd.grad((q_out, k_out), (qf, kf), (dq.float(), dk.float())))


def _outputs(provider: Provider, q, k, dq, dk):
    """q_out, k_out, dq, dk in (B, T, heads, hs), from fresh copies of the inputs in the provider's layout."""
    qi, ki = (_in_layout(x, provider.layout, True) for x in (q, k))
    gq, gk = (_in_layout(x, provider.layout, False) for x in (dq, dk))
    q_out, k_out = provider.fn(qi, ki)
    grads = torch.autograd.grad((q_out, k_out), (_leaf(qi), _leaf(ki)), (gq, gk))
    return (_to_bthd(q_out, provider.layout), _to_bthd(k_out, provider.layout), *grads)


def _check(outs, ref, tol):
    """Raise if an output or a gradient is off the fp32 reference: max abs error > tol * max |ref|."""
    for name, out, expected in zip(("q_out", "k_out", "dq", "dk"), outs, ref):
        scale = expected.abs().max().clamp_min(torch.finfo(torch.float32).tiny)
        err = ((out.float() - expected).abs().max() / scale).item()
        if not err <= tol:  # catches NaN too
            raise AssertionError(f"{name} is off the fp32 reference: scaled max abs error {err:.3g} > {tol}")


def _step(provider: Provider, mode: str, q, k, dq, dk):
    """The timed call: the forward, or the forward and the gradients w.r.t. q and k."""
    if mode == "fwd":
        return lambda: provider.fn(q, k)
    leaves = (_leaf(q), _leaf(k))
    return lambda: torch.autograd.grad(provider.fn(q, k), leaves, (dq, dk))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- --tune: launch parameters of megakern's kernels ------------------------------------------------------------
TUNE_CASES = [HEADLINE, Case(16, 4096, 16, 4, 64, 64, False), Case(8, 2048, 64, 64, 96, 24, False)]


def tune(device: torch.device, copy_gbps: float, providers: set[str] | None) -> None:
    """Forward kernel alone, for each launch configuration, on the headline, head dim 64 and partial rotary (GPU)
    cases: Triton tiles, warps and whole-row tiles (both layouts on the headline), and, when megakern-cuda is among
    the providers (or none are named), the CUDA kernel's launch configurations (threads, heads a step, head runs)
    on each case. Printed best first per case, the launcher's default marked."""
    import megakern
    from megakern import _cuda, _rotary_cuda, _rotary_triton

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    status = megakern.available_backends(device)
    tune_cases = TUNE_CASES if device.type == "cuda" else [Case(2, 64, 4, 2, 32, 32, False), Case(2, 8, 2, 2, 24, 8,
                                                                                                  False)]
    for case in tune_cases:
        q = torch.randn(case.b, case.t, case.nh, case.hs, device=device, dtype=dtype)
        k = torch.randn(case.b, case.t, case.nkv, case.hs, device=device, dtype=dtype)
        cos, sin = megakern.rotary_table(case.t, case.rd, device=device)
        gb = bytes_moved(case, "fwd", q.element_size(), 4) / 1e9
        for interleaved in (False, True) if case == tune_cases[0] else (case.interleaved,):
            rows = []
            q_out, k_out = torch.empty_like(q), torch.empty_like(k)  # the launchers write out of place into these
            args = (q, k, q_out, k_out, cos, sin, None, None, None, 0, case.rd, interleaved, False, False)
            if not status["triton"]:
                default = _rotary_triton.launch_config(case.nh, case.nkv, case.hs, case.rd, interleaved, False,
                                                       _rotary_triton.gpu_model(device.index))
                for full_row in (False, True):
                    for tile in (2048, 4096, 8192):
                        for warps in (4, 8):
                            knobs = dict(num_warps=warps, tile=tile, full_row=full_row)
                            cfg = _rotary_triton.launch_config(case.nh, case.nkv, case.hs, case.rd, interleaved,
                                                               False, **knobs)
                            t = bench(lambda: _rotary_triton.fwd(*args, **knobs), device=device)
                            tiles = tuple(cfg[0][n] for n in ("BLOCK_T", "BLOCK_HQ", "BLOCK_HK"))
                            rows.append((gb / (t["median"] * 1e-3), f"triton full_row={full_row} tile={tile} "
                                         f"(BLOCK_T, BLOCK_HQ, BLOCK_HK, warps)={(*tiles, cfg[1])}"
                                         f"{' (default)' if cfg == default else ''}"))
            if not status["cuda"] and (not providers or "megakern-cuda" in providers):
                path = _cuda.choose_path()
                copy_rest = case.rd < case.hs  # out of place, as args run it
                heads, tokens = case.nh + case.nkv, case.b * case.t
                staged = _rotary_cuda.staged_rows(case.hs, case.rd, dtype, copy_rest)
                groups, narrow = _rotary_cuda.work_units(case.hs, case.rd, dtype, copy_rest, staged)
                default = _rotary_cuda.launch_config(heads, groups, tokens=tokens, narrow=narrow)
                for threads in (128, 256):
                    if staged and not _rotary_cuda.staged_rows(case.hs, case.rd, dtype, copy_rest, threads):
                        continue
                    for items in _rotary_cuda.ITEMS:
                        auto = _rotary_cuda.launch_config(heads, groups, threads, items, tokens=tokens,
                                                          narrow=narrow).head_runs
                        for runs in sorted({1, max(1, auto // 2), auto, min(heads, auto * 2)}):
                            cfg = _rotary_cuda.launch_config(heads, groups, threads, items, tokens=tokens,
                                                             head_runs=runs, narrow=narrow)
                            t = bench(lambda: _rotary_cuda.fwd(*args, path=path, config=cfg), device=device)
                            rows.append((gb / (t["median"] * 1e-3), f"cuda-{path} {cfg}"
                                         f"{' (default)' if cfg == default else ''}"))
                # the default geometry with the registers capped (NVRTC), so that more blocks fit an SM
                if path == "nvrtc" and not staged and not narrow:
                    for items in (2, 4):
                        for cap in (64, 72, 80, 96):
                            cfg = dataclasses.replace(_rotary_cuda.launch_config(heads, groups, items=items,
                                                                                 tokens=tokens), max_registers=cap)
                            t = bench(lambda: _rotary_cuda.fwd(*args, config=cfg), device=device)
                            rows.append((gb / (t["median"] * 1e-3), f"cuda-nvrtc {cfg}"))
            print(f"{case._replace(interleaved=interleaved).name(dtype)} fwd; copy roofline {copy_gbps:.0f} GB/s")
            for gbps, what in sorted(rows, reverse=True):
                print(f"{gbps:9.1f} GB/s ({gbps / copy_gbps:.3f})  {what}")
        q = k = q_out = k_out = None
        _free(device)


def main(argv: list[str] | None = None) -> Results:
    argv = list(sys.argv[1:] if argv is None else argv)
    tuning = "--tune" in argv
    args = parse_args(__doc__.splitlines()[0], [a for a in argv if a != "--tune"])
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = Results(device)
    keep_rows_on_exit(results, 'rotary', args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    if tuning:
        tune(device, results.rooflines["GB/s"], args.providers)
        return results
    providers = load_providers(PROVIDERS, device, args.providers)
    torch.manual_seed(0)
    for case in cases(device, args.quick):
        name = case.name(dtype)
        q = torch.randn(case.b, case.t, case.nh, case.hs, device=device, dtype=dtype)
        k = torch.randn(case.b, case.t, case.nkv, case.hs, device=device, dtype=dtype)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        ref = _reference(case, q, k, dq, dk)
        for pname, make in providers.items():
            inputs = None
            try:
                provider = make(case, dtype)
                _check(_outputs(provider, q, k, dq, dk), ref, TOL[dtype])  # also the warm-up (compilation)
                inputs = [_in_layout(x, provider.layout, grad) for x, grad in ((q, True), (k, True), (dq, False),
                                                                              (dk, False))]
                for mode in MODES:
                    timing = bench(_step(provider, mode, *inputs), device=device, graph=args.graph)
                    gbps = bytes_moved(case, mode, q.element_size(), provider.table_esize) / timing["median"] / 1e6
                    record(results, name, mode + (" graph" if args.graph else ""), pname, timing, "GB/s", gbps)
            except Exception as e:
                report_failure(pname, name, e)
            finally:
                inputs = None
                _free(device)
        q = k = dq = dk = ref = None
        _free(device)
    file_rows(results, 'rotary', args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
