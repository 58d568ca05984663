"""RMSNorm and LayerNorm throughput, forward and forward+backward, against the same-run copy roofline.

Shapes: x, y, dy, dx (N, C); weight and bias (C,); bf16 on CUDA, fp32 on CPU (smoke runs only).
Cases: the headline N x C = 16384 x 8192 and a sweep of C with N = 2**27 // C (each (N, C) tensor is
256 MiB in bf16).

Bytes moved, e = bytes per element of x; stats = one fp32 per row each: rstd (rmsnorm), mean and rstd
(layernorm):
    fwd      = read x + write y                  2*N*C*e
             + read weight (+ bias)              C*e per parameter
             + write stats                       4*N per statistic
    fwd+bwd  = fwd
             + read x + read dy + write dx       3*N*C*e
             + read weight, write dweight (+ dbias)
             + read stats
GB/s = bytes / median time; every figure is also given as a fraction of the copy roofline.

Providers: torch (eager), compile (torch.compile), megakern-torch / -triton / -cuda, liger (liger_kernel, where
installed) and quack (quack-kernels' RMSNorm, where installed: ../shared/peers/README.md; it has no LayerNorm with
bias and autograd).

Both modes run on inputs that require grad, as in training: 'fwd' is the training forward, 'fwd+bwd'
adds torch.autograd.grad of y w.r.t. x, weight (and bias) for a fixed random dy. Before timing, each
provider's y and gradients are checked against the fp32 torch reference; a wrong provider is reported
and skipped.

    python -m benchmarks.bench_norm [--quick] [--providers torch,megakern-triton] [--no-save] [--graph]
                                    [--hidden 16384,32768] [--ops rmsnorm]

With --graph every provider is timed by CUDA-graph replay instead (modes 'fwd graph', 'fwd+bwd graph'): GPU
time without host launch overhead, which eager autograd timings include when the host falls behind.

(`python benchmarks/bench_norm.py` works too, but finds megakern only where it is installed.)
"""

import importlib

import torch
import torch.nn.functional as F

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer,
                         int_list, load_providers, measure_copy_gbps, parse_args, record, report_failure)
else:  # python benchmarks/bench_norm.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer,
                        int_list, load_providers, measure_copy_gbps, parse_args, record, report_failure)

OPS = ("rmsnorm", "layernorm")
MODES = ("fwd", "fwd+bwd")
EPS = {"rmsnorm": 1e-6, "layernorm": 1e-5}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


def shapes(device: torch.device, quick: bool, hidden=None) -> list[tuple[int, int]]:
    """(N, C) cases: the headline 16384x8192, then the C sweep at 2**27 elements per tensor (powers of two and the
    model widths between them that are not: 3072, 5120, 12288); ``hidden`` (--hidden): only those C, at 2**27
    elements."""
    if device.type != "cuda":
        return [(64, 256), (16, 1024)]
    if hidden:
        return [(2**27 // c, c) for c in hidden]
    sweep = (1024, 32768) if quick else (1024, 2048, 3072, 4096, 5120, 8192, 12288, 16384, 32768)
    return list(dict.fromkeys([(16384, 8192), *((2**27 // c, c) for c in sweep)]))


def bytes_moved(op: str, mode: str, rows: int, hidden: int, esize: int) -> int:
    """Bytes a fused kernel must move for one call (formula in the module docstring)."""
    params = stats = 1 if op == "rmsnorm" else 2  # weight (+ bias); rstd (+ mean) per row
    act = rows * hidden * esize  # one (N, C) tensor
    fwd = 2 * act + params * hidden * esize + 4 * rows * stats
    bwd = 3 * act + (1 + params) * hidden * esize + 4 * rows * stats
    return fwd if mode == "fwd" else fwd + bwd


def _eager(op: str):
    if op == "rmsnorm":
        return lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS[op])
    return lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS[op])


# Provider loaders: loader(device) -> make(op) -> fn(x, weight, bias); bias is None for rmsnorm.
def _load_torch(device):
    return _eager


def _load_compile(device):
    def make(op):
        torch.compiler.reset()  # fresh cache per case: no recompile limit hit, no dynamic-shape graph
        return torch.compile(_eager(op), dynamic=False)

    return make


def _load_megakern(backend: str):
    def load(device):
        import megakern

        if reason := megakern.available_backends(device).get(backend, f"megakern has no {backend!r} backend"):
            raise Unavailable(reason)

        def make(op):
            if op == "rmsnorm":
                return lambda x, w, b: megakern.rms_norm(x, w, EPS[op], backend=backend)
            return lambda x, w, b: megakern.layer_norm(x, w, b, EPS[op], backend=backend)

        return make

    return load


def _load_liger(device):
    if device.type != "cuda":
        raise Unavailable("liger_kernel's Triton kernels need CUDA")
    # The submodules hold liger's default Triton kernels (liger_kernel.ops may swap in other impls).
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def make(op):
        if op == "rmsnorm":
            # As LigerRMSNorm (offset 0, llama casting) but in_place=False: in place, the backward would
            # overwrite the fixed dy that every timed run reuses.
            return lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS[op], 0.0, "llama", False)
        return lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS[op])

    return make


def _load_quack(device):
    """quack-kernels' RMSNorm (CuTe DSL, with autograd); it has no LayerNorm with autograd and bias. On the GPU
    machines it comes as ../shared/peers/README.md says."""
    quack = import_peer(device, "quack-kernels", lambda: importlib.import_module("quack"))

    def make(op):
        if op != "rmsnorm":
            raise Unavailable("quack has no LayerNorm with bias and autograd")
        return lambda x, w, b: quack.rmsnorm(x, w, eps=EPS[op])

    return make


PROVIDERS = {
    "torch": _load_torch,
    "compile": _load_compile,
    "megakern-torch": _load_megakern("torch"),
    "megakern-triton": _load_megakern("triton"),
    "megakern-cuda": _load_megakern("cuda"),
    "liger": _load_liger,
    "quack": _load_quack,
}


def _step(fn, mode, x, w, b, dy):
    """The timed call: the forward, or the forward and the gradients of y w.r.t. x, weight (and bias)."""
    if mode == "fwd":
        return lambda: fn(x, w, b)
    params = [t for t in (x, w, b) if t is not None]
    return lambda: torch.autograd.grad(fn(x, w, b), params, dy)


def _outputs(fn, x, w, b, dy):
    """y, dx, dweight (and dbias)."""
    y = fn(x, w, b)
    return (y, *torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], dy))


def main(argv: list[str] | None = None) -> Results:
    def extra(parser):
        parser.add_argument("--hidden", type=int_list,
                            help="comma-separated hidden sizes (2**27 elements each) instead of the sweep")
        parser.add_argument("--ops", type=lambda text: tuple(v.strip() for v in text.split(",")), default=OPS,
                            help=f"comma-separated ops (default: {','.join(OPS)})")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if unknown := set(args.ops) - set(OPS):
        raise SystemExit(f"bench_norm: unknown op(s) {sorted(unknown)}; known: {', '.join(OPS)}")
    device = args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 1e-3 if dtype == torch.float32 else 0.1
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, 'norm', args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    torch.manual_seed(0)
    for op in args.ops:
        for rows, hidden in shapes(device, args.quick, args.hidden):
            case = f"{op} {rows}x{hidden} {DTYPE_NAMES[dtype]}"
            x = torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True)
            w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_()
            b = (0.1 * torch.randn(hidden, device=device)).to(dtype).requires_grad_() if op == "layernorm" else None
            dy = torch.randn_like(x)
            inputs = (x, w, b, dy)
            ref = _outputs(_eager(op), *(None if t is None else t.detach().float().requires_grad_(t.requires_grad)
                                         for t in inputs))
            for name, make in providers.items():
                try:
                    fn = make(op)
                    # also the warm-up (compilation, autotuning)
                    check_outputs(("y", "dx", "dweight", "dbias"), _outputs(fn, *inputs), ref, tol)
                    for mode in MODES:
                        t = bench(_step(fn, mode, *inputs), device=device, graph=args.graph)
                        gbps = bytes_moved(op, mode, rows, hidden, x.element_size()) / (t["median"] * 1e-3) / 1e9
                        record(results, case, mode + (" graph" if args.graph else ""), name, t, "GB/s", gbps)
                except Exception as e:
                    report_failure(name, case, e)
    file_rows(results, 'norm', args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
