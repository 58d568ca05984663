"""The training step's matrix products at the shapes bench_train runs, one by one, against the same-run bf16 matmul
roofline: for each linear layer of the model (one block's projections, and the output layer), the forward
y = x W^T, the input gradient dx = dy W and the weight gradient dW = dy^T x, with the operands laid out as autograd
hands them to torch.mm (x and dy row-major (tokens, features), W (out, in)).

    cublas     torch.mm as the step runs it (torch's default BLAS backend)
    cublaslt   torch.mm with torch.backends.cuda.preferred_blas_library("cublaslt")

TFLOP/s counts 2 M N K; both providers must agree within bf16 rounding before they are timed. The sum over a step
(each block's products times the layer count, the output layer's once) is printed per provider.

    python -m benchmarks.bench_gemm [--quick] [--models llama-8b,llama-1b,gpt-350m] [--providers ...] [--graph]
                                    [--no-save]
"""
from __future__ import annotations

import contextlib

import torch

if __package__:
    from .bench_train import GPT_350M, TINY, Shape, meta_model, preset_shape
    from .common import (Results, bench, file_rows, keep_rows_on_exit, load_providers, measure_matmul_tflops,
                         parse_args, record, report_failure)
else:  # python benchmarks/bench_gemm.py
    from bench_train import GPT_350M, TINY, Shape, meta_model, preset_shape
    from common import (Results, bench, file_rows, keep_rows_on_exit, load_providers, measure_matmul_tflops,
                        parse_args, record, report_failure)

MODELS = ("llama-8b", "llama-1b", "gpt-350m")
PRODUCTS = ("forward", "input grad", "weight grad")


def model_shape(name: str, device: torch.device) -> Shape:
    """bench_train's shape of ``name`` (its sequence and micro-batch); a tiny one of the same structure on CPU."""
    if device.type != "cuda":
        return TINY if name == "gpt-350m" else preset_shape(name, tiny=True)
    return GPT_350M if name == "gpt-350m" else preset_shape(name)


def linears(shape: Shape) -> list[tuple[str, int, int]]:
    """(name, out features, in features) of the first block's linear weights and the output layer, as the model
    holds them (bench_train's model of ``shape``, built on the meta device)."""
    found, embedding = [], None
    for name, p in meta_model(shape).named_parameters():
        if name == "wte.weight":
            embedding = tuple(p.shape)
        if p.dim() == 2 and (name.startswith("blocks.0.") or name == "lm_head.weight"):
            found.append((name.removeprefix("blocks.0.").removesuffix(".weight"), *p.shape))
    if not any(name == "lm_head" for name, *_ in found):  # tied: the output layer is the embedding's weight
        found.append(("lm_head", *embedding))
    return found


def operands(product: str, m: int, n: int, k: int, device, dtype, gen):
    """(a, b) of ``torch.mm(a, b)`` for one product of a linear with weight (n, k) over m tokens."""
    def randn(*size):
        return torch.randn(*size, device=device, dtype=dtype, generator=gen)

    if product == "forward":  # x (m, k) @ W^T
        return randn(m, k), randn(n, k).t()
    if product == "input grad":  # dy (m, n) @ W (n, k)
        return randn(m, n), randn(n, k)
    return randn(m, n).t(), randn(m, k)  # dy^T (n, m) @ x (m, k)


def _blas(name: str):
    def load(device):
        @contextlib.contextmanager
        def chosen():
            if device.type != "cuda":
                yield
                return
            before = torch.backends.cuda.preferred_blas_library()
            torch.backends.cuda.preferred_blas_library(name)
            try:
                yield
            finally:
                torch.backends.cuda.preferred_blas_library(before)

        return chosen
    return load


PROVIDERS = {"cublas": _blas("cublas"), "cublaslt": _blas("cublaslt")}


def main(argv: list[str] | None = None) -> Results:
    def extra(parser):
        parser.add_argument("--models", type=lambda s: [m.strip() for m in s.split(",") if m.strip()],
                            default=None, help=f"comma-separated, of {', '.join(MODELS)} (default: all; --quick: "
                            "llama-8b)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    device = args.device
    models = args.models or (["llama-8b"] if args.quick else list(MODELS))
    for name in models:
        if name not in MODELS:
            raise SystemExit(f"--models: unknown {name!r}; expected some of {', '.join(MODELS)}")
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, "gemm", args.out, args.no_save)
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    mode = "step" + (" graph" if args.graph else "")
    for model in models:
        shape = model_shape(model, device)
        m = shape.micro_batch * shape.seq
        step_ms = dict.fromkeys(providers, 0.0)
        for layer, n, k in linears(shape):
            times = 1 if layer == "lm_head" else shape.n_layer
            for product in PRODUCTS:
                a, b = operands(product, m, n, k, device, dtype, gen)
                out = torch.empty(a.shape[0], b.shape[1], device=device, dtype=dtype)
                case = f"{model} {layer} {product} M{m} N{n} K{k}"
                want = None
                for provider, chosen in providers.items():
                    try:
                        with chosen():
                            got = torch.mm(a, b)
                            if want is None:
                                want = got.float()
                            else:
                                err = (got.float() - want).norm() / want.norm()
                                if not err <= 1e-2:
                                    raise AssertionError(f"off the first provider's product by {float(err):.3g}")
                            t = bench(lambda: torch.mm(a, b, out=out), device=device, graph=args.graph)
                        record(results, case, mode, provider, t, "TFLOP/s",
                               2 * m * n * k / (t["median"] * 1e-3) / 1e12)
                        step_ms[provider] += times * t["median"]
                    except Exception as e:
                        report_failure(provider, case, e)
                del a, b, out
        for provider, ms in step_ms.items():
            print(f"{model} ({shape.n_layer} layers, {m} tokens): the step's products {ms:.2f} ms with {provider}")
    file_rows(results, "gemm", args.out, args.no_save)
    print(results.markdown("TFLOP/s"))
    return results


if __name__ == "__main__":
    main()
