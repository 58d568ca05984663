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
'megakern-triton'. Before timing, each provider's FP8 bytes and scales are checked against the reference; on a GPU
they must be equal (on CPU the interpreter's fp8 rounding differs, see tests/test_fp8.py, so only the scales are).

    python -m benchmarks.bench_fp8 [--quick] [--providers compile,megakern-triton] [--no-save] [--graph]
"""

from typing import Callable

import torch

if __package__:
    from .common import (Results, Unavailable, bench, load_providers, measure_copy_gbps, parse_args, record,
                         report_failure)
else:  # python benchmarks/bench_fp8.py
    from common import (Results, Unavailable, bench, load_providers, measure_copy_gbps, parse_args, record,
                        report_failure)

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


PROVIDERS = {"torch": _load_torch, "compile": _load_compile, "megakern-triton": _load_megakern}


def _check(got, want, exact: bool) -> None:
    if not torch.equal(got.scale_inv.float(), want.scale_inv.float()):
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
    results.add_roofline("GB/s", measure_copy_gbps(device))
    providers = load_providers(PROVIDERS, device, args.providers)
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
                    _check(fn(x, kw), ref, exact=device.type == "cuda")  # also the warm-up (compilation)
                    timing = bench(lambda: fn(x, kw), device=device, graph=args.graph)
                    gbps = bytes_moved(mode, m, n, x.element_size()) / timing["median"] / 1e6
                    record(results, name, mode + (" graph" if args.graph else ""), pname, timing, "GB/s", gbps)
                except Exception as e:
                    report_failure(pname, f"{name} {mode}", e)
        x = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.no_save:
        print(f"saved {results.save('fp8', args.out)}")
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
