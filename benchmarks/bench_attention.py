"""Attention throughput, forward and forward+backward, against the same-run bf16 matmul roofline.

Shapes: q, k, v, out, dout (B, T, nh, hs) for megakern and flash_attn; (B, nh, T, hs) for SDPA. Each layout
gets its own contiguous copies of the same values, made before timing, so no transpose is timed. bf16 on
CUDA, fp32 on CPU (smoke runs only).
Cases on CUDA: head dim hs in (64, 128), model width nh * hs = 2048, sequence length T in 1k..16k with
B = max(1, 16384 // T) (16k tokens per batch), causal and non-causal, query heads per key/value head (the GQA
ratio) 1 and 4; --quick: hs 128, T in (1k, 4k, 16k), causal, ratio 1. --head-dims, --seqlens and --gqa pick
others (hs 96 and 256 included). Case names read 'attn hs128 T4096 B4 causal bf16', or with grouped key/value
heads 'attn hs128 T4096 B4 causal gqa16:4 bf16' (16 query heads, 4 key/value heads).

FLOPs, self-attention (Tq = Tk = T), matmuls only, 2 FLOPs per multiply-add:
    fwd      = 4 * B * nh * Tq * Tk * hs          S = Q K^T and O = P V, 2 * Tq * Tk * hs each (nh: query heads)
               / 2 when causal                     (half of the score matrix is masked out)
    bwd      = 2.5 * fwd                           dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q, and S again
    fwd+bwd  = 3.5 * fwd
TFLOP/s = FLOPs / median time; every figure is also given as a fraction of the bf16 matmul roofline.

Both modes run on inputs that require grad, as in training: 'fwd' is the training forward, 'fwd+bwd' adds
torch.autograd.grad of out w.r.t. q, k, v for a fixed random dout. Before timing, each provider's out and
gradients are checked against the fp32 SDPA math reference; a wrong provider is reported and skipped.

Providers: 'torch' (SDPA math backend; on CUDA only up to T = 4096), 'sdpa-flash', 'sdpa-cudnn',
'sdpa-efficient' (SDPA pinned to that backend with torch.nn.attention.sdpa_kernel), 'flash-attn'
(flash_attn.flash_attn_func, where installed), 'fa4' (FlashAttention-4, flash_attn.cute.flash_attn_func, where
installed: ../shared/peers/README.md) and 'megakern-triton' (megakern.attention, backend='triton').

    python -m benchmarks.bench_attention [--quick] [--providers sdpa-flash,megakern-triton] [--no-save] [--graph]
                                         [--head-dims 64] [--seqlens 1024,2048] [--gqa 1,4,8]

With --graph every provider is timed by CUDA-graph replay instead (modes 'fwd graph', 'fwd+bwd graph'): GPU
time without host launch overhead.

(`python benchmarks/bench_attention.py` works too, but finds megakern only where it is installed.)
"""

import importlib
import warnings
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer,
                         int_list, load_providers, measure_matmul_tflops, parse_args, record, report_failure)
else:  # python benchmarks/bench_attention.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, import_peer, int_list,
                        load_providers, measure_matmul_tflops, parse_args, record, report_failure)

MODES = ("fwd", "fwd+bwd")
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}
# Largest error allowed against the fp32 reference, as a fraction of the reference's largest magnitude.
TOL = {torch.bfloat16: 0.05, torch.float32: 1e-3}
WIDTH = 2048  # nh * hs on CUDA
TOKENS = 16384  # B * T on CUDA
MATH_MAX_T = 4096  # the 'torch' (SDPA math) provider materialises (T, T) scores: on CUDA only up to this T
REF_SCORES = 2**28  # the fp32 reference holds at most this many score elements (1 GiB) per chunk of heads


class Case(NamedTuple):
    """One shape: B sequences of T tokens, nh query heads and nkv key/value heads (nh // nkv query heads share
    one) of dim hs."""

    b: int
    t: int
    nh: int
    nkv: int
    hs: int
    causal: bool


def cases(device: torch.device, quick: bool, head_dims=None, seqlens=None, gqa=None) -> list[Case]:
    """The cases; ``head_dims`` / ``seqlens`` / ``gqa`` (--head-dims, --seqlens, --gqa) narrow the GPU matrix. A GQA
    ratio that does not divide a head dim's head count is left out of that head dim."""
    if device.type != "cuda":
        return [Case(1, 64, 2, 2, 32, True), Case(1, 64, 2, 2, 32, False), Case(1, 64, 4, 2, 32, True)]
    head_dims = head_dims or ((128,) if quick else (64, 128))
    seqlens = seqlens or ((1024, 4096, 16384) if quick else (1024, 2048, 4096, 8192, 16384))
    causals = (True,) if quick else (True, False)
    ratios = gqa or ((1,) if quick else (1, 4))
    return [Case(max(1, TOKENS // t), t, WIDTH // hs, WIDTH // hs // ratio, hs, causal)
            for hs in head_dims for ratio in ratios if (WIDTH // hs) % ratio == 0
            for t in seqlens for causal in causals]


def case_name(case: Case, dtype: torch.dtype) -> str:
    gqa = f" gqa{case.nh}:{case.nkv}" if case.nkv != case.nh else ""
    return (f"attn hs{case.hs} T{case.t} B{case.b} {'causal' if case.causal else 'noncausal'}{gqa} "
            f"{DTYPE_NAMES[dtype]}")


def flops(mode: str, b: int, nh: int, tq: int, tk: int, hs: int, causal: bool) -> float:
    """FLOPs of one call (formula in the module docstring); causal assumes tq == tk."""
    fwd = 4 * b * nh * tq * tk * hs
    if causal:
        fwd /= 2
    return fwd if mode == "fwd" else 3.5 * fwd  # fwd + bwd, bwd = 2.5 * fwd


class Provider(NamedTuple):
    """What a loader returns: fn(q, k, v, causal) -> out, on tensors in ``layout``: 'bthd' (B, T, nh, hs) or
    'bhtd' (B, nh, T, hs); cases with T > max_t are skipped."""

    layout: str
    fn: Callable
    max_t: int | None = None


def _explained(fn, *args):
    """fn(*args); if it raises, the warnings it gave join the message (SDPA says there why a backend declined)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = fn(*args)
        except Exception as e:
            notes = list(dict.fromkeys(" ".join(str(w.message).split()) for w in caught))
            if not notes:
                raise
            raise Unavailable(f"{type(e).__name__}: {e} ({'; '.join(notes)})") from e
    for w in caught:  # a call that worked keeps its warnings
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return result


def _dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _sdpa(backend: SDPBackend):
    def fn(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1])

    return fn


# Provider loaders: loader(device) -> Provider.
def _load_torch(device):
    return Provider("bhtd", _sdpa(SDPBackend.MATH), MATH_MAX_T if device.type == "cuda" else None)


def _load_sdpa(backend: SDPBackend):
    def load(device):
        fn = _sdpa(backend)
        q = torch.randn(1, 2, 128, 64, device=device, dtype=_dtype(device), requires_grad=True)
        _explained(fn, q, q, q, True)  # a backend that cannot run here at all is skipped once, with SDPA's reason
        return Provider("bhtd", fn)

    return load


def _load_flash_attn(device):
    if device.type != "cuda":
        raise Unavailable("flash_attn needs CUDA")
    from flash_attn import flash_attn_func

    return Provider("bthd", lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal))


def _load_megakern_triton(device):
    import megakern

    if not hasattr(megakern, "attention"):
        raise Unavailable("megakern has no attention (no megakern.attention in this install)")
    if reason := megakern.available_backends(device).get("triton", "megakern has no 'triton' backend"):
        raise Unavailable(reason)
    return Provider("bthd", lambda q, k, v, causal: megakern.attention(q, k, v, causal=causal, backend="triton"))


def _load_megakern_nondet(device):
    """megakern's attention with ``deterministic=False`` (the single-pass backward where it is the faster one)."""
    import megakern

    _load_megakern_triton(device)
    return Provider("bthd", lambda q, k, v, causal: megakern.attention(q, k, v, causal=causal, backend="triton",
                                                                       deterministic=False))


def _load_fa4(device):
    """FlashAttention-4 (flash-attn-4, CuTe DSL; sm90 forward and backward). On the GPU machines it comes as
    ../shared/peers/README.md says."""
    cute = import_peer(device, "flash-attn-4", lambda: importlib.import_module("flash_attn.cute"))
    # it returns (out, lse)
    return Provider("bthd", lambda q, k, v, causal: cute.flash_attn_func(q, k, v, causal=causal)[0])


PROVIDERS = {
    "torch": _load_torch,
    "sdpa-flash": _load_sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa-cudnn": _load_sdpa(SDPBackend.CUDNN_ATTENTION),
    "sdpa-efficient": _load_sdpa(SDPBackend.EFFICIENT_ATTENTION),
    "flash-attn": _load_flash_attn,
    "fa4": _load_fa4,
    "megakern-triton": _load_megakern_triton,
    "megakern-nondet": _load_megakern_nondet,
}


def _inputs(case: Case, device, dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    """The same q, k, v (leaves that require grad) and dout in both layouts, each its own contiguous tensor."""
    heads = (case.nh, case.nkv, case.nkv, case.nh)
    bthd = [torch.randn(case.b, case.t, h, case.hs, device=device, dtype=dtype) for h in heads]
    bhtd = [x.transpose(1, 2).contiguous() for x in bthd]
    return {layout: (*(x.requires_grad_() for x in xs[:3]), xs[3]) for layout, xs in (("bthd", bthd), ("bhtd", bhtd))}


def _reference(q, k, v, dout, causal) -> list[torch.Tensor]:
    """out, dq, dk, dv in fp32 from the SDPA math backend, all (B, heads, T, hs).

    Heads are independent, so they are done a few at a time: the math backend materialises the (Tq, Tk) scores,
    and a chunk holds at most REF_SCORES of them. Grouped key/value heads are repeated for their query heads, and
    their gradients summed over the group.
    """
    b, nh, tq, hs = q.shape
    nkv, tk = k.shape[1], k.shape[2]
    group = nh // nkv
    kv = [x.detach().repeat_interleave(group, dim=1) for x in (k, v)]
    flat = [x.detach().reshape(b * nh, x.shape[2], hs) for x in (q, *kv, dout)]
    outs = [torch.empty(x.shape, device=x.device, dtype=torch.float32) for x in (flat[0], *flat[:3])]
    step = max(1, REF_SCORES // (tq * tk))
    with sdpa_kernel(SDPBackend.MATH):
        for i in range(0, b * nh, step):
            qi, ki, vi = (x[i:i + step].to(torch.float32, copy=True).requires_grad_() for x in flat[:3])
            oi = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal)
            grads = torch.autograd.grad(oi, (qi, ki, vi), flat[3][i:i + step].float())
            for dst, src in zip(outs, (oi.detach(), *grads)):
                dst[i:i + step] = src
            del qi, ki, vi, oi, grads
    out, dq, dk, dv = (x.view(b, nh, x.shape[1], hs) for x in outs)
    dk, dv = (x.view(b, nkv, group, tk, hs).sum(2) for x in (dk, dv))
    return [out, dq, dk, dv]


def _outputs(fn, q, k, v, dout, causal):
    """out, dq, dk, dv."""
    out = fn(q, k, v, causal)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


def _step(fn, mode, q, k, v, dout, causal):
    """The timed call: the forward, or the forward and the gradients of out w.r.t. q, k, v."""
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    return lambda: torch.autograd.grad(fn(q, k, v, causal), (q, k, v), dout)


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> Results:
    def extra(parser):
        parser.add_argument("--head-dims", type=int_list, help="comma-separated head dims (default: 64,128; quick 128)")
        parser.add_argument("--seqlens", type=int_list, help="comma-separated sequence lengths")
        parser.add_argument("--gqa", type=int_list,
                            help="comma-separated query heads per key/value head (default: 1,4; quick 1)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    device = args.device
    dtype = _dtype(device)
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, 'attention', args.out, args.no_save)
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    torch.manual_seed(0)
    for shape in cases(device, args.quick, args.head_dims, args.seqlens, args.gqa):
        b, t, nh, hs, causal = shape.b, shape.t, shape.nh, shape.hs, shape.causal
        case = case_name(shape, dtype)
        inputs = ref = None
        try:
            inputs = _inputs(shape, device, dtype)
            ref = _reference(*inputs["bhtd"], causal)
        except Exception as e:
            report_failure("all providers", case, e)
        if ref is None:  # freed only here, once the exception and the frames it holds are gone
            inputs = None
            _free(device)
            continue
        for name, provider in providers.items():
            if provider.max_t is not None and t > provider.max_t:
                report_failure(name, case, Unavailable(f"run only up to T={provider.max_t} on {device.type}"))
                continue
            try:
                q, k, v, dout = inputs[provider.layout]
                outs = _explained(_outputs, provider.fn, q, k, v, dout, causal)  # also the warm-up (compilation)
                if provider.layout == "bthd":
                    outs = [x.transpose(1, 2) for x in outs]
                check_outputs(("out", "dq", "dk", "dv"), outs, ref, TOL[dtype], torch.finfo(torch.float32).tiny)
                outs = None
                for mode in MODES:
                    timing = bench(_step(provider.fn, mode, q, k, v, dout, causal), device=device, graph=args.graph)
                    tflops = flops(mode, b, nh, t, t, hs, causal) / (timing["median"] * 1e-3) / 1e12
                    record(results, case, mode + (" graph" if args.graph else ""), name, timing, "TFLOP/s", tflops)
            except Exception as e:
                report_failure(name, case, e)
            finally:
                q = k = v = dout = outs = None
                _free(device)
        inputs = ref = None
        _free(device)
    file_rows(results, 'attention', args.out, args.no_save)
    print(results.markdown("TFLOP/s"))
    return results


if __name__ == "__main__":
    main()
