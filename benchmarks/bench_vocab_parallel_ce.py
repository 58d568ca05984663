"""The tensor-parallel language-model loss, forward + backward, on tp ranks: each rank holds the (V/tp, C) shard of
the head's weight and the whole x (N, C) (replicated over the group, as after copy_to_tp / the sequence-parallel
all-gather); gradients of x (this rank's partial sum) and of the shard.

Shapes: N = B * T = 16384 tokens, C in (2048, 4096), V in (50304, 128256), tp in --tp (default: every power of two
up to the GPUs here); bf16 on CUDA (NCCL), fp32 on CPU (gloo, smoke runs only).

FLOPs per rank: the three GEMMs, forward logits and the two gradients, 2 * N * C * V/tp each:
    fwd+bwd = 6 * N * C * V / tp        (the softmax is O(N * V / tp), not counted)
TFLOP/s per GPU = FLOPs / median time (the slowest rank's), also as a fraction of the same-run bf16 matmul
roofline. Peak memory (GiB): the most memory rank 0 allocated during one forward + backward beyond what the
inputs already hold (CUDA only).

Providers:
- torch: local logits = x @ W_r^T in bf16, then megakern.parallel.vocab_parallel_cross_entropy (Megatron's form:
  an fp32 copy of the (N, V/tp) local logits, three collectives);
- megakern: megakern.parallel.cross_entropy.vocab_parallel_linear_cross_entropy, chunked (its default chunk, and
  each of --chunks as mode 'fwd+bwd chunk=<n>').
Before timing, each provider's loss and gradients are checked against the fp32 reference of this rank; a wrong
provider is reported and skipped. Every rank runs the same fixed number of calls (the collectives must pair up):
CUDA events around each call after a warm-up, the median / p20 / p80 of the slowest rank.

    python -m benchmarks.bench_vocab_parallel_ce [--quick] [--tp 2,4,8] [--chunks 1024,4096]
    python -m benchmarks.bench_vocab_parallel_ce --device cpu --tp 2        # smoke test (gloo ranks)
"""

import argparse

import torch
import torch.distributed as dist

if __package__:
    from .common import (Results, check_outputs, file_rows, init_rank, int_list, measure_matmul_tflops, parse_args,
                         peak_gib, record, report_failure, run_ranks, timed_on_ranks, tp_sizes)
else:  # python benchmarks/bench_vocab_parallel_ce.py
    from common import (Results, check_outputs, file_rows, init_rank, int_list, measure_matmul_tflops, parse_args,
                        peak_gib, record, report_failure, run_ranks, timed_on_ranks, tp_sizes)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
IGNORED = 0.05  # fraction of targets set to ignore_index (-100), as padding would
PROVIDERS = ("torch", "megakern")


def shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    """(N, C, V) cases."""
    if device.type != "cuda":
        return [(13, 16, 64)]
    cases = [(16384, c, v) for c in (2048, 4096) for v in (50304, 128256)]
    return cases[:1] + cases[-1:] if quick else cases


def _fn(name: str, group, chunk):
    from megakern.parallel.cross_entropy import vocab_parallel_cross_entropy, vocab_parallel_linear_cross_entropy

    if name == "torch":
        return lambda x, w, t: vocab_parallel_cross_entropy(x @ w.t(), t, group)
    return lambda x, w, t: vocab_parallel_linear_cross_entropy(x, w, t, group, chunk_size=chunk, check_targets=False)


def _rank(rank: int, tp: int, port: int, args, chunks, queue) -> None:
    device = init_rank(rank, tp, port, args.device.type)
    group = dist.group.WORLD
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 1e-3 if dtype == torch.float32 else 0.05
    calls, warmup = (20, 5) if device.type == "cuda" else (10, 2)
    figures = []  # (case, mode, provider, timing, tflops, gib)
    for n, c, v in shapes(device, args.quick):
        case = f"N={n} C={c} V={v} tp={tp} {DTYPE_NAMES[dtype]}"
        torch.manual_seed(0)  # the same inputs on every rank
        x = torch.randn(n, c, device=device, dtype=dtype, requires_grad=True)
        w_full = (torch.randn(v, c, device=device) / c ** 0.5).to(dtype)
        w = w_full[rank * v // tp:(rank + 1) * v // tp].clone().requires_grad_()
        del w_full
        t = torch.randint(0, v, (n,), device=device)
        t[torch.rand(n, device=device) < IGNORED] = -100
        from megakern.parallel.cross_entropy import vocab_parallel_cross_entropy

        x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
        ref = vocab_parallel_cross_entropy(x32 @ w32.t(), t, group)
        ref = [r.detach() for r in (ref, *torch.autograd.grad(ref, (x32, w32)))]
        del x32, w32
        for name in PROVIDERS:
            if args.providers and name not in args.providers:
                continue
            for chunk in [None] + (chunks if name == "megakern" else []):
                mode = "fwd+bwd" + (f" chunk={chunk}" if chunk else "")
                fn = _fn(name, group, chunk)

                def step():
                    return torch.autograd.grad(fn(x, w, t), (x, w))

                try:
                    loss = fn(x, w, t)
                    check_outputs(("loss", "dx (partial)", "dweight"), (loss, *torch.autograd.grad(loss, (x, w))),
                                  ref, tol, 1e-3)
                    timing = timed_on_ranks(step, device, calls, warmup)
                    tflops = 6 * n * c * (v // tp) / (timing["median"] * 1e-3) / 1e12
                    figures.append((case, mode, name, timing, tflops, peak_gib(step, device)))
                except Exception as e:  # every rank fails the same check, or the run is broken anyway
                    if rank == 0:
                        report_failure(name, case, e)
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del ref
    roofline = measure_matmul_tflops(device) if rank == 0 else None
    if rank == 0:
        queue.put((figures, roofline))


def main(argv: list[str] | None = None) -> Results:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--chunks", type=int_list, default=[],
                            help="megakern chunk sizes to time besides the default (tokens per chunk)")
        parser.add_argument("--tp", type=int_list, default=None,
                            help="tensor-parallel sizes (default: 2, 4, 8 up to the GPUs here; 2 on CPU)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if args.providers and (unknown := args.providers - set(PROVIDERS)):
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(PROVIDERS)}")
    sizes = tp_sizes(args.tp, args.device, (2, 4, 8), "bench_vocab_parallel_ce")
    results = Results(args.device)
    roofline = None
    for tp in sizes:
        figures, roofline = run_ranks(_rank, tp, args, args.chunks)
        if roofline is not None and "TFLOP/s" not in results.rooflines:  # before the figures: each prints its fraction
            results.add_roofline("TFLOP/s", roofline)
        for case, mode, name, timing, tflops, gib in figures:
            record(results, case, mode, name, timing, "TFLOP/s", tflops)
            if gib is not None:
                results.add(case, mode, name, "GiB", gib)
                print(f"{case:<40} {mode:<16} {name:<10} peak {gib:.3f} GiB (rank 0)")
    file_rows(results, "vocab_parallel_ce", args.out, args.no_save)
    print(results.markdown("TFLOP/s"))
    if args.device.type == "cuda":
        print()
        print(results.markdown("GiB"))
    return results


if __name__ == "__main__":
    main()
