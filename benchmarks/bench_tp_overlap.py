"""Sequence-parallel tensor-parallel GEMMs with their collectives, on tp ranks: all-gather + GEMM (a column-parallel
layer's input) and GEMM + reduce-scatter (a row-parallel layer's output), fused and unfused.

Shapes: M tokens (the whole sequence over the group) in (8192, 16384, 32768), K = N in (4096, 8192) (or --shapes),
tp in --tp (default: 2 and 4 up to the GPUs here); bf16 on CUDA (NCCL), fp32 on CPU (gloo; smoke runs only).
    ag+gemm   x shard (M/tp, K) on each rank -> gather(x) (M, K) @ W_r^T, W_r (N/tp, K)      -> (M, N/tp)
    gemm+rs   x (M, K/tp) @ W_r^T, W_r (N, K/tp), summed over the ranks, rank r keeping rows r  -> (M/tp, N)
FLOPs per rank = 2 M K N / tp for either; TFLOP/s per GPU = FLOPs / median time (the slowest rank's), also as a
fraction of the same-run bf16 matmul roofline.

Providers:
- gemm: the local GEMM alone, on data already in place (for ag+gemm: over M gathered rows): the floor the fused
  ops aim at;
- unfused: NCCL's all-gather then the GEMM / the GEMM then NCCL's reduce-scatter (one stream, nothing hidden);
- torch-symm: PyTorch's async tensor parallelism, torch.ops.symm_mem.fused_all_gather_matmul /
  fused_matmul_reduce_scatter (symmetric memory, multicast off);
- megakern: megakern.parallel.overlap.all_gather_gemm / gemm_reduce_scatter with a SymmetricWorkspace (GEMM +
  reduce-scatter by its default: cuBLAS GEMMs, copy-engine pulls, each block in the workspace's rs_pieces runs, the
  partial sums or the inputs pulled, whichever moves fewer bytes: rs_route "auto");
- megakern-p1, -p4: the same with each reduce-scatter block in K runs of rows (rs_pieces = K; forward and
  backward), 1: whole blocks;
- megakern-partials, megakern-inputs (gemm+rs): the same with the route named (rs_route), whatever it moves;
- megakern-ksig: the same with the ranks signalling each other by torch's signal kernels (signals "kernel")
  instead of stream memory operations;
- megakern-pull (fwd+bwd): the all-gathers that keep their shards for dW (the forward's, when the weight needs a
  gradient) staging them in the own buffer for the peers to pull, instead of pushing them (gather "pull"); its fwd
  rows time the same ops as megakern's (no gradient, nothing kept);
- megakern-kernel (gemm+rs): the workspace's other GEMM + reduce-scatter, the Triton GEMM storing its tiles into
  the owners' buffers (megakern.gemm_scatter).
The workspace defers the joins of transfers whose sources outlive the op, as a ParallelModel's does; each graph
flushes them.
Modes: fwd (the op), fwd-graph (the op captured in a CUDA graph, two calls a replay, as a CUDA-graph training step
runs it: no host launch overhead), and fwd+bwd / fwd+bwd-graph for unfused and the megakern providers (the op and
its gradients: dX by the transposed op, dW; eager and graphed).
Besides the times, each fused provider's share of the collective it hides, (unfused - fused) / (unfused - gemm),
is printed and filed as metric "hidden" (modes fwd and fwd-graph).

Before timing, each provider's output is checked against the unfused one; a wrong provider is reported and skipped.
Every rank runs the same fixed number of calls (the collectives must pair up; triton's do_bench picks repetitions
per rank and would deadlock them): CUDA events around each call after a warm-up, the median / p20 / p80 of the
slowest rank.

    python -m benchmarks.bench_tp_overlap [--quick] [--tp 2,4] [--providers gemm,unfused,megakern]
    python -m benchmarks.bench_tp_overlap --device cpu --tp 2        # smoke test (gloo ranks)
"""

import argparse
import os

import torch
import torch.distributed as dist

if __package__:
    from .common import (Results, check_outputs, file_rows, init_rank, int_list, measure_matmul_tflops, parse_args,
                         record, report_failure, run_ranks, timed_on_ranks, tp_sizes)
else:  # python benchmarks/bench_tp_overlap.py
    from common import (Results, check_outputs, file_rows, init_rank, int_list, measure_matmul_tflops, parse_args,
                        record, report_failure, run_ranks, timed_on_ranks, tp_sizes)

# megakern with workspace settings other than the defaults (rs_pieces 2, rs_route "auto")
VARIANTS = {"megakern-p1": {"rs_pieces": 1}, "megakern-p4": {"rs_pieces": 4},
            "megakern-partials": {"rs_route": "partials"}, "megakern-inputs": {"rs_route": "inputs"},
            "megakern-ksig": {"signals": "kernel"}, "megakern-pull": {"gather": "pull"}}
PROVIDERS = ("gemm", "unfused", "torch-symm", "megakern", *VARIANTS, "megakern-kernel")
OPS = ("ag+gemm", "gemm+rs")
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def shapes(device: torch.device, quick: bool, given=None) -> list[tuple[int, int, int]]:
    """(M, K, N) cases (``given``: the --shapes list)."""
    if given:
        return given
    if device.type != "cuda":
        return [(24, 16, 8)]
    cases = [(m, k, k) for k in (4096, 8192) for m in (8192, 16384, 32768)]
    return [cases[0], cases[2]] if quick else cases


def _operands(op: str, m: int, k: int, n: int, tp: int, rank: int, device, dtype):
    g = torch.Generator(device=device).manual_seed(1 + rank)
    if op == "ag+gemm":
        x = torch.randn(m // tp, k, device=device, generator=g).to(dtype)
        w = (torch.randn(n // tp, k, device=device, generator=g) / k ** 0.5).to(dtype)
    else:
        x = torch.randn(m, k // tp, device=device, generator=g).to(dtype)
        w = (torch.randn(n, k // tp, device=device, generator=g) / k ** 0.5).to(dtype)
    return x, w


def _provider(name: str, op: str, group, ws, tp: int):
    """fn(x, w) -> the op's output, or None where the provider does not do this op here."""
    import torch.nn.functional as F

    from megakern.parallel.layers import linear_reduce
    from megakern.parallel.mappings import gather_from_sp
    from megakern.parallel.overlap import all_gather_gemm, gemm_reduce_scatter

    if name == "gemm":
        return lambda x, w: F.linear(x, w)
    if name == "unfused":
        if op == "ag+gemm":
            return lambda x, w: F.linear(gather_from_sp(x, group, 0), w)
        return lambda x, w: linear_reduce(x, w, group, True, 0)
    if name == "megakern":
        if op == "ag+gemm":
            return lambda x, w: all_gather_gemm(x, w, group, 0, workspace=ws)
        return lambda x, w: gemm_reduce_scatter(x, w, group, True, 0, workspace=ws)
    if name in VARIANTS:
        if ws is None or ("rs_route" in VARIANTS[name] and op == "ag+gemm"):
            return None
        if op == "ag+gemm":
            return _with(lambda x, w: all_gather_gemm(x, w, group, 0, workspace=ws), ws, VARIANTS[name])
        return _with(lambda x, w: gemm_reduce_scatter(x, w, group, True, 0, workspace=ws), ws, VARIANTS[name])
    if name == "megakern-kernel":
        if ws is None or op == "ag+gemm":
            return None

        def kernel_impl(x, w):
            ws.rs_impl = "kernel"
            try:
                return gemm_reduce_scatter(x, w, group, True, 0, workspace=ws)
            finally:
                ws.rs_impl = "copy"
        return kernel_impl
    if name == "torch-symm":
        if ws is None:
            return None
        group_name = group.group_name
        if op == "ag+gemm":
            return lambda x, w: torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], 0, group_name)[1][0]
        return lambda x, w: torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, group_name)
    raise ValueError(name)


def _with(fn, ws, settings: dict):
    """``fn`` run with the workspace's attributes set to ``settings`` (read as the ops are queued, so a step of forward
    and backward wraps both), then set back."""
    def run(*args):
        defaults = {key: getattr(ws, key) for key in settings}
        for key, value in settings.items():
            setattr(ws, key, value)
        try:
            return fn(*args)
        finally:
            for key, value in defaults.items():
                setattr(ws, key, value)
    return run


def _graphed(fn, ws):
    """A callable replaying a CUDA graph of two calls of ``fn`` (warmed up eagerly on a side stream first: symmetric
    buffers grow and kernels compile outside the capture); two calls keep the workspace's buffers alternating across
    replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
            fn()
            if ws is not None:
                ws.end_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
        fn()
        if ws is not None:  # the transfers whose joins the workspace deferred (defer_joins), as end_step would
            ws.flush()
    return graph.replay


def _rank(rank: int, tp: int, port: int, args, queue) -> None:
    os.environ.update({k: v for k, v in ENV.items() if k not in os.environ})
    device = init_rank(rank, tp, port, args.device.type)
    group = dist.group.WORLD
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ws = None
    if device.type == "cuda":
        from megakern.parallel.symmetric import SymmetricWorkspace

        ws = SymmetricWorkspace(group, device)
        ws.defer_joins = True  # as a ParallelModel's workspace; the graphs flush
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(group.group_name)
        except ImportError:
            pass
    calls, warmup = (30, 8) if device.type == "cuda" else (5, 1)
    figures = []  # (case, mode, provider, timing, tflops)
    for m, k, n in shapes(device, args.quick, args.shapes):
        for op in OPS:
            case = f"{op} M={m} K={k} N={n} tp={tp} {'bf16' if dtype == torch.bfloat16 else 'fp32'}"
            x, w = _operands(op, m, k, n, tp, rank, device, dtype)
            ref = _provider("unfused", op, group, ws, tp)(x, w)
            flops = 2 * m * k * n / tp
            for name in PROVIDERS:
                if args.providers and name not in args.providers:
                    continue
                fn = _provider(name, op, group, ws, tp)
                if fn is None:
                    continue
                if name == "gemm" and op == "ag+gemm":  # the GEMM over the gathered rows, already in place
                    x_full = x.repeat(tp, 1)
                    fn = (lambda f, xf: lambda x_, w_: f(xf, w_))(fn, x_full)
                try:
                    if name != "gemm":
                        check_outputs(("out",), (fn(x, w),), (ref,), 2e-2 if dtype == torch.bfloat16 else 1e-4,
                                      1e-2)
                    timing = timed_on_ranks(lambda: fn(x, w), device, calls, warmup, align=True)
                    figures.append((case, "fwd", name, timing, flops / (timing["median"] * 1e-3) / 1e12))
                    if device.type == "cuda":
                        replay = _graphed(lambda: fn(x, w), ws)
                        timing = {key: v / 2 for key, v in
                                  timed_on_ranks(replay, device, calls, warmup, align=True).items()}
                        figures.append((case, "fwd-graph", name, timing,
                                        flops / (timing["median"] * 1e-3) / 1e12))
                    if name in ("unfused", "megakern", *VARIANTS, "megakern-kernel"):
                        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                        dy = torch.randn_like(fn(xg, wg))

                        def step():
                            return torch.autograd.grad(fn(xg, wg), (xg, wg), dy)

                        if name in VARIANTS:
                            step = _with(step, ws, VARIANTS[name])

                        timing = timed_on_ranks(step, device, calls, warmup, align=True)
                        figures.append((case, "fwd+bwd", name, timing,
                                        3 * flops / (timing["median"] * 1e-3) / 1e12))
                        if device.type == "cuda":
                            replay = _graphed(step, ws)
                            timing = {key: v / 2 for key, v in
                                      timed_on_ranks(replay, device, calls, warmup, align=True).items()}
                            figures.append((case, "fwd+bwd-graph", name, timing,
                                            3 * flops / (timing["median"] * 1e-3) / 1e12))
                except Exception as e:  # every rank fails the same check, or the run is broken anyway
                    if rank == 0:
                        report_failure(name, case, e)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    roofline = measure_matmul_tflops(device) if rank == 0 and device.type == "cuda" else None
    if rank == 0:
        queue.put((figures, roofline))


def hidden_shares(figures) -> dict[tuple[str, str, str], float]:
    """{(case, mode, provider): (unfused - provider) / (unfused - gemm)} of the fwd and fwd-graph medians of the
    fused providers, where the three ran."""
    ms = {(case, mode, name): timing["median"] for case, mode, name, timing, _ in figures
          if mode in ("fwd", "fwd-graph")}
    out = {}
    for case, mode, name in ms:
        if name in ("gemm", "unfused") or not all((case, mode, p) in ms for p in ("gemm", "unfused")):
            continue
        exposed = ms[case, mode, "unfused"] - ms[case, mode, "gemm"]
        if exposed > 0:
            out[case, mode, name] = (ms[case, mode, "unfused"] - ms[case, mode, name]) / exposed
    return out


def _shape_list(text: str) -> list[tuple[int, int, int]]:
    out = []
    for item in text.split(":"):
        parts = item.split(",")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"--shapes: {item!r} is not M,K,N (three positive integers)")
        out.append(tuple(int(p) for p in parts))
    return out


def main(argv: list[str] | None = None) -> Results:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--tp", type=int_list, default=None,
                            help="tensor-parallel sizes (default: 2 and 4 up to the GPUs here; 2 on CPU)")
        parser.add_argument("--shapes", type=_shape_list, default=None, metavar="M,K,N[:M,K,N...]",
                            help="the (M, K, N) cases instead of the default sweep, e.g. a model's layers: "
                                 "GPT-1.3B at 4 x 2048 tokens 8192,2048,6144:8192,2048,8192:8192,8192,2048:"
                                 "8192,2048,2048 (qkv, fc, mlp proj, attention proj)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if args.providers and (unknown := args.providers - set(PROVIDERS)):
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(PROVIDERS)}")
    sizes = tp_sizes(args.tp, args.device, (2, 4), "bench_tp_overlap")
    results = Results(args.device)
    for tp in sizes:
        figures, roofline = run_ranks(_rank, tp, args)
        if roofline is not None and "TFLOP/s" not in results.rooflines:
            results.add_roofline("TFLOP/s", roofline)
        for case, mode, name, timing, tflops in figures:
            record(results, case, mode, name, timing, "TFLOP/s", tflops)
        for (case, mode, name), share in sorted(hidden_shares(figures).items() if args.device.type == "cuda" else []):
            results.add(case, mode, name, "hidden", share)
            print(f"{case:<44} {mode:<9} {name:<13} hides {share:6.1%} of the unfused collective")
    file_rows(results, "tp_overlap", args.out, args.no_save)
    print(results.markdown("TFLOP/s"))
    return results


if __name__ == "__main__":
    main()
