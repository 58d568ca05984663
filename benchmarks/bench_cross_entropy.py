"""The language-model loss, forward + backward: logits = x @ W^T, cross-entropy against targets, gradients of x and W.

Shapes: x (N, C), W (V, C), targets (N,) with N = B * T = 16384 tokens (--tokens), C in (1024, 2048, 4096)
(--hidden), V in (50304, 128256, 151936) (GPT-2's padded vocabulary, Llama 3's, Qwen 2's);
bf16 on CUDA, fp32 on CPU (smoke runs only).

FLOPs: the three GEMMs, forward logits and the two gradients, 2 * N * C * V each:
    fwd+bwd = 6 * N * C * V        (the softmax is O(N * V), not counted)
TFLOP/s = FLOPs / median time, also as a fraction of the same-run bf16 matmul roofline. Peak memory (GiB): the
most memory allocated during one forward + backward beyond what the inputs already hold (CUDA only).

Providers:
- torch: logits = x @ W^T in bf16, then F.cross_entropy(logits.float(), targets) (what a plain model does);
- compile: the same function under torch.compile;
- liger: LigerFusedLinearCrossEntropyLoss (liger_kernel, when installed);
- cce: Apple's cut-cross-entropy `linear_cross_entropy(x, W, targets)` (when installed: ../shared/peers/README.md);
- quack: quack-kernels' `chunked_linear_cross_entropy` (when installed, likewise);
- megakern-triton: megakern.linear_cross_entropy(backend="triton") with its default chunk, and with each of
  --chunks (mode 'fwd+bwd chunk=<n>').
Before timing, each provider's loss and gradients are checked against the fp32 reference; a wrong provider is
reported and skipped.

    python -m benchmarks.bench_cross_entropy [--quick] [--providers torch,megakern-triton] [--chunks 1024,4096]
                                             [--tokens 8192] [--hidden 2048,4096]
"""

import argparse
import importlib

import torch
import torch.nn.functional as F

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer,
                         int_list, load_providers, measure_matmul_tflops, parse_args, peak_gib, record, report_failure)
else:  # python benchmarks/bench_cross_entropy.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer, int_list,
                        load_providers, measure_matmul_tflops, parse_args, peak_gib, record, report_failure)

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
IGNORED = 0.05  # fraction of targets set to ignore_index (-100), as padding would


HIDDEN = (1024, 2048, 4096)


def shapes(device: torch.device, quick: bool, tokens: int = 16384, hidden=HIDDEN) -> list[tuple[int, int, int]]:
    """(N, C, V) cases; ``tokens`` (--tokens): N on CUDA; ``hidden`` (--hidden): the values of C."""
    if device.type != "cuda":
        return [(13, 16, 67)]
    cases = [(tokens, c, v) for c in hidden for v in (50304, 128256, 151936)]
    return cases[:1] + cases[-1:] if quick else cases


def flops(n: int, c: int, v: int) -> int:
    return 6 * n * c * v


def _plain(x, w, t):
    return F.cross_entropy((x @ w.t()).float(), t, ignore_index=-100)


# Provider loaders: loader(device) -> make(chunk) -> fn(x, w, targets) -> loss
def _load_torch(device):
    return lambda chunk: _plain


def _load_compile(device):
    def make(chunk):
        torch.compiler.reset()
        return torch.compile(_plain, dynamic=False)

    return make


def _load_liger(device):
    if device.type != "cuda":
        raise Unavailable("liger_kernel's Triton kernels need CUDA")
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
    return lambda chunk: (lambda x, w, t: loss(w, x, t))


def _load_megakern(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)

    def make(chunk):
        return lambda x, w, t: megakern.linear_cross_entropy(x, w, t, chunk_size=chunk, backend="triton")

    return make


def _load_cce(device):
    """Apple's cut-cross-entropy (Triton; its default 'cce' implementation). On the GPU machines it comes as
    ../shared/peers/README.md says."""
    cce = import_peer(device, "cut-cross-entropy", lambda: importlib.import_module("cut_cross_entropy"))
    return lambda chunk: (lambda x, w, t: cce.linear_cross_entropy(x, w, t, ignore_index=-100))


def _load_quack(device):
    """quack-kernels' chunked linear cross-entropy (CuTe DSL; its default chunk). On the GPU machines it comes as
    ../shared/peers/README.md says."""
    lce = import_peer(device, "quack-kernels", lambda: importlib.import_module("quack.linear_cross_entropy"))
    return lambda chunk: (lambda x, w, t: lce.chunked_linear_cross_entropy(x, w, t, ignore_index=-100))


PROVIDERS = {"torch": _load_torch, "compile": _load_compile, "liger": _load_liger, "cce": _load_cce,
             "quack": _load_quack, "megakern-triton": _load_megakern}


def _outputs(fn, x, w, t):
    loss = fn(x, w, t)
    return (loss, *torch.autograd.grad(loss, (x, w)))


def main(argv: list[str] | None = None) -> Results:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--chunks", type=int_list, default=[],
                            help="megakern chunk sizes to time besides the default (tokens per chunk)")
        parser.add_argument("--tokens", type=int, default=16384,
                            help="N, the tokens of every CUDA case (default 16384)")
        parser.add_argument("--hidden", type=int_list, default=list(HIDDEN),
                            help="C, the hidden sizes of the CUDA cases (default 1024,2048,4096)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if args.tokens < 1:
        raise SystemExit(f"bench_cross_entropy: --tokens must be >= 1, got {args.tokens}")
    if not args.hidden or min(args.hidden) < 1:
        raise SystemExit(f"bench_cross_entropy: --hidden must list sizes >= 1, got {args.hidden}")
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 1e-3 if dtype == torch.float32 else 0.05
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, 'cross_entropy', args.out, args.no_save)
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    torch.manual_seed(0)
    for n, c, v in shapes(device, args.quick, args.tokens, args.hidden):
        case = f"N={n} C={c} V={v} {DTYPE_NAMES[dtype]}"
        x = torch.randn(n, c, device=device, dtype=dtype, requires_grad=True)
        w = (torch.randn(v, c, device=device) / c ** 0.5).to(dtype).requires_grad_()
        t = torch.randint(0, v, (n,), device=device)
        t[torch.rand(n, device=device) < IGNORED] = -100
        ref = _outputs(_plain, x.detach().float().requires_grad_(), w.detach().float().requires_grad_(), t)
        ref = [r.detach() for r in ref]
        for name, make in providers.items():
            chunks = [None] + (args.chunks if name == "megakern-triton" else [])
            for chunk in chunks:
                mode = "fwd+bwd" + (f" chunk={chunk}" if chunk else "") + (" graph" if args.graph else "")
                try:
                    fn = make(chunk)
                    # also the warm-up (compilation, autotuning)
                    check_outputs(("loss", "dx", "dweight"), _outputs(fn, x, w, t), ref, tol, 1e-3)

                    def step():
                        return torch.autograd.grad(fn(x, w, t), (x, w))

                    timing = bench(step, device=device, graph=args.graph)
                    record(results, case, mode, name, timing, "TFLOP/s", flops(n, c, v) / (timing["median"] * 1e-3)
                           / 1e12)
                    if (gib := peak_gib(step, device)) is not None:
                        results.add(case, mode, name, "GiB", gib)
                        print(f"{case:<34} {mode:<14} {name:<16} peak {gib:.3f} GiB")
                except Exception as e:
                    report_failure(name, case, e)
                finally:
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        del ref
    file_rows(results, 'cross_entropy', args.out, args.no_save)
    print(results.markdown("TFLOP/s"))
    if device.type == "cuda":
        print()
        print(results.markdown("GiB"))
    return results


if __name__ == "__main__":
    main()
