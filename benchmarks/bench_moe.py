"""Mixture-of-Experts kernels: the grouped GEMM (TFLOP/s) and the token permutation (GB/s), with same-run rooflines.

Sections (``--sections``, default all), each filing rows under the bench name ``moe``:

gemm: the experts' GEMM out[rows of e] = x[rows of e] @ w[e], x (M, K), w (E, K, F), bf16, M routed rows split over
the experts by a random top-k routing (route_plan of uniform router choices, so counts differ by expert):
    E=8    K 4096 -> F 14336, 16384 tokens top-2 (32768 rows)     Mixtral-8x7B's w1
    E=64   K 2048 -> F 1408,  8192 tokens top-4 (32768 rows)      DeepSeek-MoE-16B's experts
    E=128  K 2048 -> F 768,   4096 tokens top-8 (32768 rows)      fine-grained (Qwen3-MoE-30B's experts)
FLOPs over the rows routed (offsets[E]):
    fwd = 2 * rows * K * F;    bwd (dX and dW) = 4 * rows * K * F
TFLOP/s = FLOPs / median time, also as a fraction of the same-run bf16 matmul roofline (8192^3). The backward is
timed alone: autograd.grad of one forward's output, the graph retained.
Providers: megakern-triton (megakern.moe.grouped_mm, backend "triton": offsets on the device, never read on the
host); torch (torch._grouped_mm: int32 ends of the groups, dims 16-byte aligned; rows past the last end are left
unwritten); cublas (a loop of torch matmuls over the experts, its row ranges read on the host once, outside the
timing: a model would pay that sync every step).

moves: permute and unpermute (the weighted combine), forward and backward, bf16 rows, fp32 combine weights:
    Mixtral layer: 8192 tokens, C 4096, E 8, top-2;    DeepSeek-style: 8192 tokens, C 2048, E 64, top-6
Bytes moved, R = N k sorted rows, R' = offsets[E] kept ones, C columns of b bytes (indices 8 bytes, weights 4):
    permute fwd     R' C b read + R C b written + 8 R
    permute bwd     R' C b read + N C b written + 8 R          (dx: each token's rows summed)
    unpermute fwd   R' C b read + N C b written + 12 R         (position and weights)
    unpermute bwd   2 R' C b read + R C b written + 20 R       (dout rows, y; dy; order, weights, dweights)
GB/s = bytes / median time, also as a fraction of the same-run copy roofline (target 0.85).
Providers: torch (megakern.moe's references under autograd), compile (the same under torch.compile),
megakern-triton.

Every provider's outputs are checked against the fp32 reference before it is timed; a wrong one is reported and
skipped.

    python -m benchmarks.bench_moe [--quick] [--sections gemm,moves] [--providers torch,megakern-triton]
"""

import argparse
from typing import NamedTuple

import torch

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, load_providers, measure_copy_gbps,
                         measure_matmul_tflops, parse_args, record, report_failure)
else:  # python benchmarks/bench_moe.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, load_providers, measure_copy_gbps,
                        measure_matmul_tflops, parse_args, record, report_failure)

from megakern import moe

BENCH = "moe"


class Routing(NamedTuple):
    """A routed batch: ``tokens`` tokens, each to ``top_k`` of ``experts`` experts."""
    name: str
    experts: int
    top_k: int
    tokens: int


def _plan(r: Routing, device) -> moe.RoutePlan:
    """Uniform router choices: top_k distinct experts per token."""
    idx = torch.rand(r.tokens, r.experts, device=device).argsort(dim=1)[:, :r.top_k]
    return moe.route_plan(idx, r.experts)


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


# ---- the grouped GEMM -----------------------------------------------------------------------------------------------
class Gemm(NamedTuple):
    routing: Routing
    k: int
    f: int


def gemm_cases(device, quick: bool) -> list[Gemm]:
    if device.type != "cuda":
        return [Gemm(Routing("tiny", 4, 2, 24), 32, 48)]
    cases = [Gemm(Routing("Mixtral E=8", 8, 2, 16384), 4096, 14336),
             Gemm(Routing("DeepSeek E=64", 64, 4, 8192), 2048, 1408),
             Gemm(Routing("fine E=128", 128, 8, 4096), 2048, 768)]
    return cases[:2] if quick else cases


def gemm_flops(rows: int, k: int, f: int, mode: str) -> int:
    return (2 if mode == "fwd" else 4) * rows * k * f


# loaders: loader(device) -> fn(x, w, offsets, bounds) -> out (M, F), differentiable; bounds: the offsets on the host
def _load_gemm_megakern(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    return lambda x, w, offsets, bounds: moe.grouped_mm(x, w, offsets, backend="triton")


def _load_gemm_torch(device):
    if not hasattr(torch, "_grouped_mm"):
        raise Unavailable(f"torch {torch.__version__} has no torch._grouped_mm")

    def fn(x, w, offsets, bounds):
        return torch._grouped_mm(x, w, offs=offsets[1:].to(torch.int32))

    return fn


def _load_gemm_cublas(device):
    def fn(x, w, offsets, bounds):
        parts = [x[bounds[e]:bounds[e + 1]] @ w[e] for e in range(w.shape[0])]
        parts.append(x.new_zeros(x.shape[0] - bounds[-1], w.shape[2]))
        return torch.cat(parts)

    return fn


GEMM_PROVIDERS = {"megakern-triton": _load_gemm_megakern, "torch": _load_gemm_torch, "cublas": _load_gemm_cublas}


def bench_gemm(args, results: Results, device) -> None:
    if not (providers := _providers("gemm", GEMM_PROVIDERS, args, device)):
        return
    dtype = _dtype(device)
    for case in gemm_cases(device, args.quick):
        r = case.routing
        plan = _plan(r, device)
        bounds = plan.offsets.tolist()
        rows, m = bounds[-1], plan.order.numel()
        name = f"{r.name} {case.k}->{case.f} rows={rows} {str(dtype).removeprefix('torch.')}"
        x = torch.randn(m, case.k, device=device).to(dtype).requires_grad_()
        w = (torch.randn(r.experts, case.k, case.f, device=device) * case.k ** -0.5).to(dtype).requires_grad_()
        g = torch.randn(m, case.f, device=device).to(dtype)
        g[rows:] = 0  # the rows past the last expert carry no gradient (the torch provider leaves them unwritten)
        ref = [t.detach() for t in _gemm_outputs(_gemm_ref, x, w, plan.offsets, bounds, g, rows, fp32=True)]
        for provider, fn in providers.items():
            try:
                check_outputs(("out", "dx", "dw"), _gemm_outputs(fn, x, w, plan.offsets, bounds, g, rows), ref, 0.05,
                              1e-3)
                for mode in ("fwd", "bwd"):
                    if mode == "fwd":
                        with torch.no_grad():
                            timing = bench(lambda: fn(x, w, plan.offsets, bounds), device=device, graph=args.graph)
                    else:
                        out = fn(x, w, plan.offsets, bounds)
                        timing = bench(lambda: torch.autograd.grad(out, (x, w), g, retain_graph=True), device=device,
                                       graph=args.graph)
                        del out
                    record(results, name, _mode(mode, args), provider, timing, "TFLOP/s",
                           gemm_flops(rows, case.k, case.f, mode) / (timing["median"] * 1e-3) / 1e12)
            except Exception as e:
                report_failure(provider, name, e)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _gemm_ref(x, w, offsets, bounds):
    return moe.grouped_mm_ref(x, w, offsets)


def _gemm_outputs(fn, x, w, offsets, bounds, g, rows, fp32=False):
    """(out[:rows], dx[:rows], dw) of one forward and backward (in fp32 leaves for the reference)."""
    if fp32:
        x, w = (t.detach().float().requires_grad_() for t in (x, w))
    out = fn(x, w, offsets, bounds)
    dx, dw = torch.autograd.grad(out, (x, w), g.to(out.dtype))
    return out[:rows], dx[:rows], dw


# ---- permute and unpermute ----------------------------------------------------------------------------------------
class Moves(NamedTuple):
    routing: Routing
    cols: int


def moves_cases(device, quick: bool) -> list[Moves]:
    if device.type != "cuda":
        return [Moves(Routing("tiny", 4, 2, 24), 40)]
    cases = [Moves(Routing("Mixtral E=8", 8, 2, 8192), 4096), Moves(Routing("DeepSeek E=64", 64, 6, 8192), 2048)]
    return cases[:1] if quick else cases


def moves_bytes(op: str, mode: str, tokens: int, top_k: int, kept: int, cols: int, itemsize: int) -> int:
    rows = tokens * top_k
    row = cols * itemsize
    if op == "permute":
        return kept * row + (rows if mode == "fwd" else tokens) * row + 8 * rows
    if mode == "fwd":
        return kept * row + tokens * row + 12 * rows
    return 2 * kept * row + rows * row + 20 * rows


# loaders: loader(device) -> (permute(x, plan), unpermute(y, weights, plan)), differentiable
def _load_moves_torch(device):
    return moe.permute_ref, moe.unpermute_ref


def _load_moves_compile(device):
    torch.compiler.reset()
    torch._functorch.config.donated_buffer = False  # the backward is timed with the graph retained
    return torch.compile(moe.permute_ref, dynamic=False), torch.compile(moe.unpermute_ref, dynamic=False)


def _load_moves_megakern(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    return (lambda x, plan: moe.permute(x, plan, backend="triton"),
            lambda y, w, plan: moe.unpermute(y, w, plan, backend="triton"))


MOVES_PROVIDERS = {"torch": _load_moves_torch, "compile": _load_moves_compile, "megakern-triton": _load_moves_megakern}


def bench_moves(args, results: Results, device) -> None:
    if not (providers := _providers("moves", MOVES_PROVIDERS, args, device)):
        return
    dtype = _dtype(device)
    for case in moves_cases(device, args.quick):
        r = case.routing
        plan = _plan(r, device)
        kept = int(plan.offsets[-1])
        name = f"{r.name} N={r.tokens} C={case.cols} k={r.top_k} {str(dtype).removeprefix('torch.')}"
        x = torch.randn(r.tokens, case.cols, device=device).to(dtype).requires_grad_()
        y = torch.randn(r.tokens * r.top_k, case.cols, device=device).to(dtype).requires_grad_()
        weights = torch.rand(r.tokens, r.top_k, device=device).requires_grad_()
        dp = torch.randn(y.shape, device=device).to(dtype)
        du = torch.randn(x.shape, device=device).to(dtype)
        ref_p = _moves_outputs(moe.permute_ref, (x,), plan, dp, fp32=True)
        ref_u = _moves_outputs(moe.unpermute_ref, (y, weights), plan, du, fp32=True)
        for provider, (permute, unpermute) in providers.items():
            try:
                check_outputs(("permute", "permute dx"), _moves_outputs(permute, (x,), plan, dp), ref_p, 0.02, 1e-3)
                check_outputs(("unpermute", "unpermute dy", "unpermute dweights"),
                              _moves_outputs(unpermute, (y, weights), plan, du), ref_u, 0.02, 1e-3)
                ops = (("permute", permute, (x,), dp), ("unpermute", unpermute, (y, weights), du))
                for op, fn, inputs, grad in ops:
                    for mode in ("fwd", "bwd"):
                        if mode == "fwd":
                            with torch.no_grad():
                                timing = bench(lambda: fn(*inputs, plan), device=device, graph=args.graph)
                        else:
                            out = fn(*inputs, plan)
                            timing = bench(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True),
                                           device=device, graph=args.graph)
                            del out
                        nbytes = moves_bytes(op, mode, r.tokens, r.top_k, kept, case.cols, x.element_size())
                        record(results, name, _mode(f"{op} {mode}", args), provider, timing, "GB/s",
                               nbytes / (timing["median"] * 1e-3) / 1e9)
            except Exception as e:
                report_failure(provider, name, e)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()


def _moves_outputs(fn, inputs, plan, grad, fp32=False):
    """The output and the gradient of every input (fp32 leaves for the reference)."""
    if fp32:
        inputs = tuple(t.detach().float().requires_grad_() for t in inputs)
    out = fn(*inputs, plan)
    return [out.detach(), *torch.autograd.grad(out, inputs, grad.to(out.dtype))]


# ---- the run ------------------------------------------------------------------------------------------------------
# section name -> (bench function, the roofline metric its figures are divided by)
SECTIONS = {"gemm": (bench_gemm, "TFLOP/s"), "moves": (bench_moves, "GB/s")}


def _providers(section: str, table: dict, args, device) -> dict:
    """The section's providers that load here, of those asked for (all when none is asked for)."""
    if args.providers and not args.providers & table.keys():
        print(f"skip section {section}: none of its providers ({', '.join(table)}) asked for")
        return {}
    return load_providers(table, device, args.providers & table.keys() if args.providers else None)


def _mode(mode: str, args) -> str:
    return mode + (" graph" if args.graph else "")


def main(argv: list[str] | None = None) -> Results:
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--sections", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                       default=list(SECTIONS), help=f"sections to run, of {', '.join(SECTIONS)}")
    known, rest = extra.parse_known_args(argv)
    if unknown := set(known.sections) - SECTIONS.keys():
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {sorted(SECTIONS)}")
    args = parse_args(__doc__.splitlines()[0], rest)
    offered = set().union(*(table.keys() for table in (GEMM_PROVIDERS, MOVES_PROVIDERS)))
    if args.providers and (unknown := args.providers - offered):
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(offered)}")
    device = args.device
    results = Results(device)
    metrics = [SECTIONS[s][1] for s in known.sections]
    if "TFLOP/s" in metrics:
        results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    if "GB/s" in metrics:
        results.add_roofline("GB/s", measure_copy_gbps(device))
    torch.manual_seed(0)
    for section in known.sections:
        SECTIONS[section][0](args, results, device)
    file_rows(results, BENCH, args.out, args.no_save)
    for metric in dict.fromkeys(metrics):
        print(results.markdown(metric))
        print()
    return results


if __name__ == "__main__":
    main()
