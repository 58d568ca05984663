"""Bias + GELU (tanh) and SwiGLU throughput, forward and forward+backward, against the same-run copy roofline: the MLP
activations of GPT-2- and Llama / Mixtral-shaped models.

Shapes: h, y, dy, dh (M, N), bias (N,); bf16 on CUDA, fp32 on CPU (smoke runs only). Cases: GPT-350M's fc output
16384 x 4096 (micro-batch 16 x 1024 tokens), GPT-1.3B's 8192 x 8192, and a 2**26-element sweep of N; without a bias
("gelu" cases): nanoGPT's shakespeare_char fc output 16384 x 1536 (64 x 256 tokens) and GPT-350M's.

Bytes a fused pass must move, e = bytes per element of h:
    fwd      = read h + write y                           2*M*N*e
    fwd+bwd  = fwd + read h + read dy + write dh          3*M*N*e   (the bias gradient rides along)
Unfused, the bias gradient is a further read of dh (M*N*e): torch eager moves 6*M*N*e (plus the bias add's pass).
GB/s = bytes / median time, also as a fraction of the copy roofline. Every provider's y, dh and dbias are checked
against the fp32 reference first; a wrong provider is reported and skipped.

SwiGLU: h (M, 2F) interleaved (gate 2i, up 2i + 1), y (M, F). Cases: Llama-7B's MLP (16384 x 2*11008), a Mixtral
expert's rows (16384 routed rows x 2*14336), DeepSeek-style fine-grained experts (32768 x 2*1408) and a 2**26-element
sweep of F. Bytes of a fused pass:
    fwd      = read h + write y                           3*M*F*e
    fwd+bwd  = fwd + read h + read dy + write dh          8*M*F*e
torch eager runs silu on the gate view and multiplies; its backward fills two zeroed buffers of h's size.

    python -m benchmarks.bench_activation [--quick] [--providers torch,compile,megakern-triton] [--graph] [--no-save]
"""

import torch
import torch.nn.functional as F

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                         measure_copy_gbps, parse_args, record, report_failure)
else:  # python benchmarks/bench_activation.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                        measure_copy_gbps, parse_args, record, report_failure)

MODES = ("fwd", "fwd+bwd")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def shapes(device: torch.device, quick: bool) -> list[tuple[int, int, bool]]:
    """(M, N, with a bias) of the GELU cases."""
    if device.type != "cuda":
        return [(64, 96, True), (33, 200, True), (33, 72, False)]
    sweep = () if quick else (1024, 3072, 16384)
    biased = [(16384, 4096), (8192, 8192), *((2**26 // n, n) for n in sweep)]
    plain = [(16384, 1536)] + ([] if quick else [(16384, 4096)])
    return list(dict.fromkeys([(m, n, True) for m, n in biased] + [(m, n, False) for m, n in plain]))


def bytes_moved(mode: str, rows: int, cols: int, esize: int, bias: bool = True) -> int:
    act, vec = rows * cols * esize, (cols * esize if bias else 0)
    return 2 * act + vec if mode == "fwd" else 5 * act + 2 * vec


def swiglu_shapes(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    """(M, F) of the SwiGLU cases (h is M x 2F)."""
    if device.type != "cuda":
        return [(64, 48), (33, 100)]
    sweep = () if quick else (1024, 4096, 16384)
    return list(dict.fromkeys([(16384, 11008), (16384, 14336), (32768, 1408), *((2**25 // f, f) for f in sweep)]))


def swiglu_bytes(mode: str, rows: int, units: int, esize: int) -> int:
    return (3 if mode == "fwd" else 8) * rows * units * esize


def _eager(h, b):
    return F.gelu(h if b is None else h + b, approximate="tanh")


def _eager_swiglu(h):
    return F.silu(h[..., 0::2]) * h[..., 1::2]


def _load_torch(device):
    return _eager


def _load_compile(device):
    torch.compiler.reset()
    return torch.compile(_eager, dynamic=False)


def _load_megakern(backend: str):
    def load(device):
        import megakern

        if reason := megakern.available_backends(device).get(backend, f"megakern has no {backend!r} backend"):
            raise Unavailable(reason)
        return lambda h, b: megakern.bias_gelu(h, b, backend=backend)

    return load


PROVIDERS = {"torch": _load_torch, "compile": _load_compile, "megakern-triton": _load_megakern("triton")}


def _load_swiglu_torch(device):
    return _eager_swiglu


def _load_swiglu_compile(device):
    torch.compiler.reset()
    return torch.compile(_eager_swiglu, dynamic=False)


def _load_swiglu_megakern(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    return lambda h: megakern.swiglu(h, backend="triton")


SWIGLU_PROVIDERS = {"torch": _load_swiglu_torch, "compile": _load_swiglu_compile,
                    "megakern-triton": _load_swiglu_megakern}


def _outputs(fn, h, b, dy):
    y = fn(h, b)
    return (y, *torch.autograd.grad(y, (h,) if b is None else (h, b), dy))


def main(argv: list[str] | None = None) -> Results:
    args = parse_args(__doc__.splitlines()[0], argv)
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 1e-3 if dtype == torch.float32 else 0.03
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, 'activation', args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    torch.manual_seed(0)
    for rows, cols, bias in shapes(device, args.quick):
        case = f"{'bias_gelu' if bias else 'gelu'} {rows}x{cols} {DTYPE_NAMES[dtype]}"
        h = (2 * torch.randn(rows, cols, device=device)).to(dtype).requires_grad_()
        b = (0.5 * torch.randn(cols, device=device)).to(dtype).requires_grad_() if bias else None
        leaves = (h, b) if bias else (h,)
        dy = torch.randn_like(h)
        ref = _outputs(_eager, h.detach().float().requires_grad_(),
                       b.detach().float().requires_grad_() if bias else None, dy.float())
        for name, fn in providers.items():
            try:
                check_outputs(("y", "dh", "dbias")[:len(ref)], _outputs(fn, h, b, dy), ref, tol)
                for mode in MODES:
                    step = (lambda: fn(h, b)) if mode == "fwd" else (lambda: torch.autograd.grad(fn(h, b), leaves, dy))
                    t = bench(step, device=device, graph=args.graph)
                    gbps = bytes_moved(mode, rows, cols, h.element_size(), bias) / (t["median"] * 1e-3) / 1e9
                    record(results, case, mode + (" graph" if args.graph else ""), name, t, "GB/s", gbps)
            except Exception as e:
                report_failure(name, case, e)
    bench_swiglu(args, results, device, dtype, tol)
    file_rows(results, 'activation', args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


def bench_swiglu(args, results: Results, device, dtype, tol: float) -> None:
    providers = load_providers(SWIGLU_PROVIDERS, device, args.providers)
    for rows, units in swiglu_shapes(device, args.quick):
        case = f"swiglu {rows}x{2 * units} {DTYPE_NAMES[dtype]}"
        h = (2 * torch.randn(rows, 2 * units, device=device)).to(dtype).requires_grad_()
        dy = torch.randn(rows, units, device=device).to(dtype)
        h32 = h.detach().float().requires_grad_()
        y32 = _eager_swiglu(h32)
        ref = (y32, *torch.autograd.grad(y32, h32, dy.float()))
        for name, fn in providers.items():
            try:
                y = fn(h)
                check_outputs(("y", "dh"), (y, *torch.autograd.grad(y, h, dy)), ref, tol)
                del y
                for mode in MODES:
                    step = (lambda: fn(h)) if mode == "fwd" else (lambda: torch.autograd.grad(fn(h), h, dy))
                    t = bench(step, device=device, graph=args.graph)
                    gbps = swiglu_bytes(mode, rows, units, h.element_size()) / (t["median"] * 1e-3) / 1e9
                    record(results, case, mode + (" graph" if args.graph else ""), name, t, "GB/s", gbps)
            except Exception as e:
                report_failure(name, case, e)
            finally:
                if device.type == "cuda":
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
