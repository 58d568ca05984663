"""FP8 casts (megakern.fp8.quantize): effective bandwidth against the same-run copy roofline.

x (M, N) bf16 on CUDA (fp32 on CPU, smoke runs only) to E4M3. Modes:
    delayed      per-tensor scale given (from the amax history), x's amax recorded in the same pass
    delayed+T    the same, also writing the (N, M) transposed copy (the weight-gradient GEMM's operand)
    current      per-tensor scale from x's own amax (amax, then the cast)
    row          a scale per row
    block        a scale per 1 x 128 run of a row
    tile         a scale per 128 x 128 tile
Effective bytes = read x once + write each FP8 output (1 byte an element) + the scales (4 bytes each): what a
one-pass kernel must move; a two-pass cast (current scaling) moves more and shows a lower effective GB/s. GB/s =
bytes / median time; every figure is also a fraction of the copy roofline.

Providers: 'torch' (megakern.fp8.quantize_ref, eager), 'compile' (the same reference under torch.compile),
'megakern-triton', 'megakern-cuda' (per tensor). Before timing, each megakern provider's FP8 bytes and scales are
checked against the reference; on a GPU they must be equal (on CPU the interpreter's fp8 rounding differs, see
tests/test_fp8.py, so only the scales are). The compiled reference is held to the scales within 1e-6 (Inductor's
division rounds its own way).

GEMMs (case 'fp8 gemm MxNxK', modes by scaling): out (M, N) bf16 = A (M, K) . B (N, K)^T, TFLOP/s = 2 M N K / time,
against the same-run bf16 matmul roofline: 'cublas' (bf16 torch.matmul, mode 'bf16'), 'scaled-mm' (torch._scaled_mm:
tensor, row), 'megakern-triton' (tensor, row, block 1x128 / 128x128). Each FP8 product is checked against the
dequantized fp32 product first.

Linear (case 'fp8 linear TxIN->OUT'): fp8.Linear (delayed scaling) against bf16 nn.Linear, forward and forward +
backward, TFLOP/s with 2 T IN OUT per GEMM (1 forward, 3 forward + backward).

    python -m benchmarks.bench_fp8 [--quick] [--providers compile,megakern-triton,cublas,scaled-mm] [--no-save]
                                   [--graph]
"""

from typing import Callable

import torch

if __package__:
    from .common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                         measure_matmul_tflops, parse_args, record, report_failure)
else:  # python benchmarks/bench_fp8.py
    from common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                        measure_matmul_tflops, parse_args, record, report_failure)

MODES = ("delayed", "delayed+T", "current", "row", "block", "tile")
FP8 = torch.float8_e4m3fn


def shapes(device: torch.device, quick: bool) -> list[tuple[int, int]]:
    if device.type != "cuda":
        return [(64, 96)]
    return [(16384, 8192)] if quick else [(16384, 8192), (8192, 8192), (16384, 4096), (4096, 14336)]


def bytes_moved(mode: str, m: int, n: int, esize: int) -> int:
    """Bytes a one-pass cast must move (formula in the module docstring)."""
    scales = {"row": m, "block": m * -(-n // 128), "tile": -(-m // 128) * -(-n // 128)}.get(mode, 1)
    return m * n * esize + m * n * (2 if mode == "delayed+T" else 1) + 4 * scales


def _kwargs(mode: str, x: torch.Tensor) -> dict:
    """quantize's arguments for ``mode`` (fresh scale / amax tensors)."""
    if mode.startswith("delayed"):
        return dict(scale=torch.tensor([0.37], device=x.device), transpose=mode == "delayed+T")
    if mode == "current":
        return {}
    return dict(granularity=mode, block=128)


def _load_torch(device):
    from megakern import fp8

    return lambda mode: (lambda x, kw: fp8.quantize_ref(x, FP8, **kw))


def _load_compile(device):
    from megakern import fp8

    def make(mode):
        torch.compiler.reset()
        return torch.compile(lambda x, kw: fp8.quantize_ref(x, FP8, **kw), dynamic=False)

    return make


def _load_megakern(device):
    import megakern
    from megakern import fp8

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    return lambda mode: (lambda x, kw: fp8.quantize(x, FP8, backend="triton", **kw))


def _load_megakern_cuda(device):
    import megakern
    from megakern import _fp8_cuda, fp8

    if reason := megakern.available_backends(device)["cuda"] or (device.type == "cuda" and _fp8_cuda.problem()):
        raise Unavailable(reason)

    def make(mode):
        if mode not in ("delayed", "current"):
            raise Unavailable("the CUDA cast is per tensor, without the transposed copy")
        return lambda x, kw: fp8.quantize(x, FP8, backend="cuda", **kw)

    return make


PROVIDERS = {"torch": _load_torch, "compile": _load_compile, "megakern-triton": _load_megakern,
             "megakern-cuda": _load_megakern_cuda}


# ---- GEMM ----------------------------------------------------------------------------------------------------------
def gemm_shapes(device: torch.device, quick: bool) -> list[tuple[int, int, int]]:
    """(M, N, K): 8192^3 and the GEMMs of a transformer layer at 16384 tokens."""
    if device.type != "cuda":
        return [(64, 48, 64)]
    shapes = [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 14336, 4096), (16384, 4096, 14336),
              (16384, 8192, 8192)]
    return shapes[:1] if quick else shapes


def _gemm_providers(device) -> dict[str, tuple[str, ...]]:
    """provider -> the scalings it runs."""
    from megakern import fp8

    out = {"cublas": ("bf16",)}
    if not fp8.scaled_mm_problem(device):
        out["scaled-mm"] = ("tensor", "row")
    if not fp8._backend.triton_problem(device):
        out["megakern-triton"] = ("tensor", "row", "block")
    return out


def _gemm_operands(a: torch.Tensor, b: torch.Tensor, scaling: str):
    from megakern import fp8

    if scaling == "tensor":
        return fp8.quantize(a, FP8), fp8.quantize(b, FP8)
    if scaling == "row":
        return fp8.quantize(a, FP8, granularity="row"), fp8.quantize(b, FP8, granularity="row")
    return fp8.quantize(a, FP8, granularity="block"), fp8.quantize(b, FP8, granularity="tile")


def run_gemms(results: Results, device, args, wanted) -> None:
    from megakern import fp8

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    providers = {k: v for k, v in _gemm_providers(device).items() if wanted is None or k in wanted}
    for m, n, k in gemm_shapes(device, args.quick):
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(n, k, device=device, dtype=dtype) * 0.05
        name = f"fp8 gemm {m}x{n}x{k}"
        for pname, scalings in providers.items():
            for scaling in scalings:
                try:
                    if pname == "cublas":
                        fn = lambda: torch.matmul(a, b.t())  # noqa: E731
                    else:
                        qa, qb = _gemm_operands(a, b, scaling)
                        backend = "scaled_mm" if pname == "scaled-mm" else "triton"
                        out_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
                        fn = lambda qa=qa, qb=qb, backend=backend, out_dtype=out_dtype: fp8.gemm(  # noqa: E731
                            qa, qb, out_dtype=out_dtype, backend=backend)
                        want = fp8.gemm(qa, qb, out_dtype=torch.float32, backend="torch")
                        err = ((fn().float() - want).abs().max() / want.abs().max()).item()
                        if not err < 2e-2:
                            raise AssertionError(f"off the dequantized product: relative error {err:.3g}")
                    timing = bench(fn, device=device, graph=args.graph)
                    tflops = 2 * m * n * k / (timing["median"] * 1e-3) / 1e12
                    record(results, name, scaling + (" graph" if args.graph else ""), pname, timing, "TFLOP/s",
                           tflops)
                except Exception as e:
                    report_failure(pname, f"{name} {scaling}", e)
        a = b = None
        if device.type == "cuda":
            torch.cuda.empty_cache()


def run_linear(results: Results, device, args, wanted) -> None:
    """fp8.Linear against bf16 nn.Linear, forward and forward + backward."""
    from megakern import fp8

    t, fin, fout = (16384, 8192, 8192) if device.type == "cuda" else (64, 64, 48)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = f"fp8 linear {t}x{fin}->{fout}"
    torch.manual_seed(0)
    ref = torch.nn.Linear(fin, fout, device=device, dtype=dtype)
    lin = fp8.Linear(fin, fout, device=device, dtype=dtype, emulate=device.type != "cuda")
    lin.weight, lin.bias = ref.weight, ref.bias
    x = torch.randn(t, fin, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn(t, fout, device=device, dtype=dtype)
    for _ in range(2):  # scales that fit the data
        torch.autograd.grad(lin(x), (x, lin.weight, lin.bias), dy)
        fp8.update_scales(lin)
    for pname, module in (("torch", ref), ("megakern", lin)):
        if wanted is not None and pname not in wanted:
            continue
        for mode, gemms in (("fwd", 1), ("fwd+bwd", 3)):
            if mode == "fwd":
                fn = lambda module=module: module(x)  # noqa: E731
            else:
                fn = lambda module=module: torch.autograd.grad(module(x), (x, module.weight, module.bias), dy)  # noqa
            try:
                timing = bench(fn, device=device, graph=args.graph)
                tflops = gemms * 2 * t * fin * fout / (timing["median"] * 1e-3) / 1e12
                record(results, name, mode + (" graph" if args.graph else ""), pname, timing, "TFLOP/s", tflops)
            except Exception as e:
                report_failure(pname, f"{name} {mode}", e)


def _check(got, want, exact: bool) -> None:
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0)
    if not same(got.scale_inv.float(), want.scale_inv.float()):
        raise AssertionError("scale_inv differs from the reference")
    if exact:
        for name, a, b in (("data", got.data, want.data), ("data_t", got.data_t, want.data_t)):
            if (a is None) != (b is None) or (a is not None and not torch.equal(a.view(torch.uint8),
                                                                                 b.view(torch.uint8))):
                raise AssertionError(f"{name} differs from the reference")


def main(argv: list[str] | None = None) -> Results:
    args = parse_args(__doc__.splitlines()[0], argv)
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    results = Results(device)
    keep_rows_on_exit(results, 'fp8', args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    wanted = args.providers
    known = {*PROVIDERS, "cublas", "scaled-mm", "megakern"}
    if wanted is not None and (unknown := wanted - known):
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(known)}")
    cast_wanted = None if wanted is None else wanted & PROVIDERS.keys()
    providers = load_providers(PROVIDERS, device, cast_wanted) if cast_wanted is None or cast_wanted else {}
    from megakern import fp8

    torch.manual_seed(0)
    for m, n in shapes(device, args.quick):
        x = (torch.randn(m, n, device=device) * 3).to(dtype)
        for mode in MODES:
            name = f"fp8 {m}x{n} {'bf16' if dtype == torch.bfloat16 else 'fp32'} e4m3"
            kw = _kwargs(mode, x)
            ref = fp8.quantize_ref(x, FP8, **{k: v for k, v in kw.items()})
            for pname, make in providers.items():
                try:
                    fn: Callable = make(mode)
                    # also the warm-up (compilation)
                    _check(fn(x, kw), ref, exact=device.type == "cuda" and pname.startswith("megakern"))
                    timing = bench(lambda: fn(x, kw), device=device, graph=args.graph)
                    gbps = bytes_moved(mode, m, n, x.element_size()) / timing["median"] / 1e6
                    record(results, name, mode + (" graph" if args.graph else ""), pname, timing, "GB/s", gbps)
                except Exception as e:
                    report_failure(pname, f"{name} {mode}", e)
        x = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    run_gemms(results, device, args, wanted)
    run_linear(results, device, args, wanted)
    file_rows(results, 'fp8', args.out, args.no_save)
    print(results.markdown("GB/s"))
    print(results.markdown("TFLOP/s"))
    return results


if __name__ == "__main__":
    main()
