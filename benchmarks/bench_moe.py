"""Mixture-of-Experts kernels and layer: the grouped GEMM (TFLOP/s), the token permutation (GB/s) and the whole MoE
layer against Hugging Face's Mixtral block (TFLOP/s, tok/s), with same-run rooflines.

Sections (``--sections``, default all), each filing rows under the bench name ``moe``:

gemm: the experts' GEMM out[rows of e] = x[rows of e] @ w[e], x (M, K), w (E, K, F), bf16, M routed rows split over
the experts by a random top-k routing (route_plan of uniform router choices, so counts differ by expert):
    E=8    K 4096 -> F 14336, 16384 tokens top-2 (32768 rows)     Mixtral-8x7B's w1
    E=64   K 2048 -> F 1408,  8192 tokens top-4 (32768 rows)      DeepSeek-MoE-16B's experts
    E=128  K 2048 -> F 768,   4096 tokens top-8 (32768 rows)      fine-grained (Qwen3-MoE-30B's experts)
FLOPs over the rows routed (offsets[E]):
    fwd = 2 * rows * K * F;    bwd (dX and dW) = 4 * rows * K * F
TFLOP/s = FLOPs / median time, also as a fraction of the same-run bf16 matmul roofline (8192^3). The backward is
timed alone: autograd.grad of one forward's output, the graph retained (with ``--graph``: fwd+bwd, 6 rows K F, as
the moves section does).
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
GB/s = bytes / median time, also as a fraction of the same-run copy roofline (target 0.85). Eager, the backward is
timed alone (autograd.grad of one forward's output, the graph retained): at these sizes the host's autograd call can
take longer than the kernel. With ``--graph`` the modes are fwd and fwd+bwd (one captured forward and backward, its
bytes the sum of both), the GPU time without the host.
Providers: torch (megakern.moe's references under autograd), compile (the same under torch.compile),
megakern-triton.

layer: the MoE MLP forward and forward + backward (dx and every weight's gradient) at a Mixtral-8x7B layer's shape:
8192 tokens (1 x 8192 x C), C 4096, F 14336, E 8, top-2, softmax router renormalized over the k, SwiGLU experts,
bf16, training mode, router losses off (Hugging Face computes them outside the block). The same weights in both:
    megakern            megakern.models.moe.MoEMLP (route plan, permute, grouped GEMMs, unpermute; Triton kernels)
    hf-eager            transformers' MixtralSparseMoeBlock (MixtralConfig; its experts implementation is the one a
                        Mixtral model gets by default, named in the case: grouped_mm (torch._grouped_mm) on
                        transformers 5 where torch has it, the loop over experts on transformers 4; --hf-experts)
    megakern-compile, hf-compile    the same under torch.compile
FLOPs: the k experts' three matmuls per token, fwd = 2 N k (C 2F + F C), fwd+bwd = 3 fwd (router not counted).
Figures: TFLOP/s (and the fraction of the same-run matmul roofline), tok/s = N / median time, ms, GiB = peak memory
of one forward + backward beyond what was allocated before it; the speedup over hf-compile is printed.
The check: each provider's routing (its own rounding of the router logits) must match the fp32 reference's for
>= 98% of the tokens, and on those tokens out and dx must be within 0.03 of max |ref| (a token in 500 may be off).

Every provider's outputs are checked against the fp32 reference before it is timed; a wrong one is reported and
skipped.

    python -m benchmarks.bench_moe [--quick] [--sections gemm,moves,layer] [--providers torch,megakern-triton]
    python -m benchmarks.bench_moe --sections layer [--providers megakern,hf-compile] [--hf-experts eager]
    python -m benchmarks.bench_moe --device cpu --sections layer --providers megakern,hf-eager    # smoke test
"""

import argparse
from typing import NamedTuple

import torch
import torch.nn.functional as F

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                         measure_copy_gbps, measure_matmul_tflops, parse_args, peak_gib, record, report_failure)
else:  # python benchmarks/bench_moe.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                        measure_copy_gbps, measure_matmul_tflops, parse_args, peak_gib, record, report_failure)

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
    return {"fwd": 2, "bwd": 4, "fwd+bwd": 6}[mode] * rows * k * f


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
                for mode in ("fwd", "fwd+bwd" if args.graph else "bwd"):  # as bench_moves
                    if mode == "fwd":
                        with torch.no_grad():
                            timing = bench(lambda: fn(x, w, plan.offsets, bounds), device=device, graph=args.graph)
                    elif mode == "fwd+bwd":
                        timing = bench(lambda: torch.autograd.grad(fn(x, w, plan.offsets, bounds), (x, w), g),
                                       device=device, graph=True)
                    else:
                        out = fn(x, w, plan.offsets, bounds)
                        timing = bench(lambda: torch.autograd.grad(out, (x, w), g, retain_graph=True), device=device)
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
                    # a CUDA graph captures the backward only with its forward (autograd runs a backward op on its
                    # forward's stream): under --graph the second mode is the forward and backward together
                    for mode in ("fwd", "fwd+bwd" if args.graph else "bwd"):
                        if mode == "fwd":
                            with torch.no_grad():
                                timing = bench(lambda: fn(*inputs, plan), device=device, graph=args.graph)
                        elif mode == "fwd+bwd":
                            timing = bench(lambda: torch.autograd.grad(fn(*inputs, plan), inputs, grad),
                                           device=device, graph=True)
                        else:
                            out = fn(*inputs, plan)
                            timing = bench(lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True),
                                           device=device)
                            del out
                        nbytes = sum(moves_bytes(op, m, r.tokens, r.top_k, kept, case.cols, x.element_size())
                                     for m in mode.split("+"))
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


# ---- the whole MoE layer ------------------------------------------------------------------------------------------
class Layer(NamedTuple):
    routing: Routing
    hidden: int
    ffn: int


def layer_cases(device, quick: bool) -> list[Layer]:
    if device.type != "cuda":
        return [Layer(Routing("tiny layer", 4, 2, 24), 32, 48)]
    return [Layer(Routing("Mixtral-8x7B layer", 8, 2, 8192), 4096, 14336)]


def layer_flops(tokens: int, top_k: int, hidden: int, ffn: int, mode: str) -> int:
    """The k experts' three SwiGLU matmuls per token (gate and up C -> F, down F -> C); the backward twice the
    forward. The router's N C E and the elementwise work are not counted."""
    fwd = 2 * tokens * top_k * (hidden * 2 * ffn + ffn * hidden)
    return fwd if mode == "fwd" else 3 * fwd


def layer_weights(case: Layer, device, dtype) -> dict[str, torch.Tensor]:
    """Random weights in Hugging Face's layout, rounded to ``dtype``: gate (E, C), w1 / w3 (E, F, C) the experts'
    gate / up projections, w2 (E, C, F) the down projection; router logits and outputs of unit scale."""
    e, c, f = case.routing.experts, case.hidden, case.ffn
    g = torch.Generator(device=device).manual_seed(0)
    shapes = {"gate": ((e, c), c), "w1": ((e, f, c), c), "w3": ((e, f, c), c), "w2": ((e, c, f), f)}
    return {name: (torch.randn(shape, device=device, generator=g) * fan_in ** -0.5).to(dtype)
            for name, (shape, fan_in) in shapes.items()}


def layer_ref(x: torch.Tensor, w: dict, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, expert_idx) of the Mixtral block in fp32: softmax router, top-k renormalized, SwiGLU experts, a loop over
    the experts (differentiable in x)."""
    x2 = x.reshape(-1, x.shape[-1]).float()
    gate, w1, w3, w2 = (w[k].float() for k in ("gate", "w1", "w3", "w2"))
    probs = torch.softmax(x2 @ gate.t(), dim=-1)
    top, idx = probs.topk(top_k, dim=-1)
    weights = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(x2)
    for e in range(gate.shape[0]):
        tok, j = (idx == e).nonzero(as_tuple=True)
        if tok.numel():
            h = x2[tok]
            y = (F.silu(h @ w1[e].t()) * (h @ w3[e].t())) @ w2[e].t()
            out = out.index_add(0, tok, y * weights[tok, j, None])
    return out.view(x.shape), idx


class LayerUnderTest(NamedTuple):
    """A provider's layer: ``forward(x) -> out`` (x (1, N, C)), ``params`` (gradients timed with dx),
    ``route(x2) -> (N, k)`` its routing of x2 (N, C), computed eagerly (which tokens it sends where)."""
    forward: object
    params: list
    route: object


def _megakern_layer(case: Layer, w: dict, device, compile: bool) -> LayerUnderTest:
    import megakern
    from megakern.models.gpt import GPTConfig
    from megakern.models.moe import MoEMLP

    r = case.routing
    # the Triton kernels on a GPU; a CPU takes the default (the torch references: the interpreter is too slow here)
    kernels = ({"moe": "triton", "grouped_mm": "triton"}
               if device.type == "cuda" and not megakern.available_backends(device)["triton"] else {})
    config = GPTConfig(n_layer=1, n_embd=case.hidden, n_head=1, activation="swiglu", bias=False, n_experts=r.experts,
                       moe_top_k=r.top_k, moe_ffn_hidden=case.ffn, moe_router="softmax", moe_renormalize=True,
                       moe_aux_loss_coef=0.0, moe_z_loss_coef=0.0, dropout=0.0, kernels=kernels).validate()
    with torch.device(device):  # parameters made on the device (torch.empty), then cast
        layer = MoEMLP(config).to(dtype=w["w1"].dtype).train()
    with torch.no_grad():
        layer.router.weight.copy_(w["gate"])
        # w_in (E, C, 2F): columns 2i / 2i + 1 the gate / up of unit i
        layer.w_in.view(r.experts, case.hidden, case.ffn, 2).copy_(
            torch.stack([w["w1"].transpose(1, 2), w["w3"].transpose(1, 2)], dim=-1))
        layer.w_out.copy_(w["w2"].transpose(1, 2))
    forward = torch.compile(layer) if compile else layer

    def route(x2):
        with torch.no_grad():
            return layer.routing(layer.router.logits(x2)).expert_idx

    return LayerUnderTest(forward, list(layer.parameters()), route)


def _hf_experts_impl(choice: str, config) -> str | None:
    """The experts implementation to set on the config (transformers with ``_experts_implementation``), or None
    (older transformers: one implementation, the loop over experts)."""
    if not hasattr(config, "_experts_implementation"):
        if choice not in ("default", "eager"):
            raise Unavailable(f"this transformers has no experts implementations (asked for {choice!r})")
        return None
    if choice != "default":
        return choice
    # what a Mixtral model gets by default: torch's grouped GEMM where there is one
    return "grouped_mm" if hasattr(torch.nn.functional, "grouped_mm") or hasattr(torch, "_grouped_mm") else "eager"


def _copy_hf_weights(block, w: dict, case: Layer) -> None:
    """Hugging Face's block takes the weights in whichever layout the installed version has: a ModuleList of
    experts with w1 / w2 / w3 linears (transformers 4), or stacked gate_up_proj / down_proj (transformers 5:
    (E, 2F, C) gate then up, (E, C, F); transposed or interleaved where the experts say so)."""
    e, c, f = case.routing.experts, case.hidden, case.ffn
    experts = block.experts
    with torch.no_grad():
        block.gate.weight.copy_(w["gate"])
        if hasattr(experts, "gate_up_proj"):
            if getattr(experts, "is_concatenated", True):
                gate_up = torch.cat([w["w1"], w["w3"]], dim=1)                       # (E, 2F, C)
            else:
                gate_up = torch.stack([w["w1"], w["w3"]], dim=2).reshape(e, 2 * f, c)
            down = w["w2"]                                                           # (E, C, F)
            transposed = getattr(experts, "is_transposed", None)
            if transposed is None:
                transposed = tuple(experts.gate_up_proj.shape) == (e, c, 2 * f) and c != 2 * f
            if transposed:
                gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
            if experts.gate_up_proj.shape != gate_up.shape or experts.down_proj.shape != down.shape:
                raise Unavailable(f"unknown Mixtral experts layout: gate_up_proj {tuple(experts.gate_up_proj.shape)}, "
                                  f"down_proj {tuple(experts.down_proj.shape)}")
            experts.gate_up_proj.copy_(gate_up)
            experts.down_proj.copy_(down)
        else:
            for i, expert in enumerate(experts):
                expert.w1.weight.copy_(w["w1"][i])
                expert.w3.weight.copy_(w["w3"][i])
                expert.w2.weight.copy_(w["w2"][i])


def _hf_layer(case: Layer, w: dict, device, compile: bool, experts_choice: str) -> LayerUnderTest:
    from transformers import MixtralConfig
    from transformers.models.mixtral import modeling_mixtral

    r = case.routing
    config = MixtralConfig(hidden_size=case.hidden, intermediate_size=case.ffn, num_local_experts=r.experts,
                           num_experts_per_tok=r.top_k, router_jitter_noise=0.0, hidden_act="silu")
    impl = _hf_experts_impl(experts_choice, config)
    if impl is not None:
        config._experts_implementation = impl
    with torch.device(device):  # transformers 4 initializes its linears: on the device, not the host
        block = modeling_mixtral.MixtralSparseMoeBlock(config).to(dtype=w["w1"].dtype).train()
    _copy_hf_weights(block, w, case)
    module = torch.compile(block) if compile else block

    def forward(x):
        out = module(x)
        return out[0] if isinstance(out, tuple) else out  # transformers 4: (hidden, router_logits)

    def route(x2):
        # the block's own routing: bf16 logits (its dtype), softmax in fp32, top-k
        with torch.no_grad():
            probs = torch.softmax(F.linear(x2, block.gate.weight).float(), dim=-1)
            return probs.topk(r.top_k, dim=-1).indices

    return LayerUnderTest(forward, list(block.parameters()), route)


def _load_layer_megakern(compile: bool):
    def load(device):
        import megakern.models.moe  # noqa: F401 (import errors name what is missing)

        if compile:
            torch.compiler.reset()
        return lambda case, w, args: _megakern_layer(case, w, device, compile)

    return load


def _load_layer_hf(compile: bool):
    def load(device):
        try:
            import transformers
        except ImportError:
            raise Unavailable("transformers is not installed (pip install transformers)") from None
        try:
            from transformers.models.mixtral import modeling_mixtral
        except ImportError as exc:
            raise Unavailable(f"transformers {transformers.__version__} has no Mixtral: {exc}") from None
        if not hasattr(modeling_mixtral, "MixtralSparseMoeBlock"):
            raise Unavailable(f"transformers {transformers.__version__} has no MixtralSparseMoeBlock")
        if compile:
            torch.compiler.reset()
        return lambda case, w, args: _hf_layer(case, w, device, compile, args.hf_experts)

    return load


LAYER_PROVIDERS = {"megakern": _load_layer_megakern(False), "megakern-compile": _load_layer_megakern(True),
                   "hf-eager": _load_layer_hf(False), "hf-compile": _load_layer_hf(True)}
LAYER_BASELINE = "hf-compile"


def check_layer(name: str, outs, ref, route, ref_idx, tol: float) -> str:
    """Raise AssertionError unless the provider routes >= 98% of the tokens as the fp32 reference does and, on those
    tokens, its output and dx are within ``tol`` of the reference (scaled by max |ref|; a token in 500 may be off:
    a near tie of the router in the provider's own rounding). Returns a one-line summary."""
    same = (route.sort(dim=1).values == ref_idx.sort(dim=1).values).all(dim=1)
    n = same.numel()
    if same.float().mean().item() < 0.98:
        raise AssertionError(f"{name}: routes {n - int(same.sum())} of {n} tokens unlike the fp32 reference")
    notes = []
    for what, out, expected in zip(("out", "dx"), outs, ref):
        out, expected = out.reshape(n, -1)[same].float(), expected.reshape(n, -1)[same]
        err = (out - expected).abs().amax(dim=1) / expected.abs().max().clamp_min(1e-6)
        bad = int((~(err <= tol)).sum())  # NaN counts as bad
        if bad > max(1, n // 500):
            raise AssertionError(f"{name}: {what} is off the fp32 reference at {bad} of {int(same.sum())} tokens "
                                 f"(max scaled error {err.nan_to_num(float('inf')).max().item():.3g} > {tol})")
        notes.append(f"{what} max error {err.nan_to_num(float('inf')).max().item():.2g} ({bad} off)")
    return f"{int(same.sum())} of {n} tokens routed as the reference; " + ", ".join(notes)


def bench_layer(args, results: Results, device) -> None:
    if not (loaders := _providers("layer", LAYER_PROVIDERS, args, device, load=False)):
        return
    dtype = _dtype(device)
    for case in layer_cases(device, args.quick):
        r = case.routing
        w = layer_weights(case, device, dtype)
        x = torch.randn(1, r.tokens, case.hidden, device=device).to(dtype).requires_grad_()
        g = torch.randn(x.shape, device=device).to(dtype)
        x_ref = x.detach().float().requires_grad_()
        ref_out, ref_idx = layer_ref(x_ref, w, r.top_k)
        ref = [ref_out.detach(), torch.autograd.grad(ref_out, x_ref, g.float())[0]]
        del ref_out, x_ref
        impl = ""
        if {"hf-eager", "hf-compile"} & loaders.keys():
            try:
                from transformers import MixtralConfig, __version__ as tf_version

                impl = _hf_experts_impl(args.hf_experts, MixtralConfig()) or "loop"
                print(f"transformers {tf_version}: Mixtral experts implementation {impl!r}")
            except Exception as exc:
                impl = f"? ({type(exc).__name__})"
        name = (f"{r.name} N={r.tokens} C={case.hidden} F={case.ffn} E={r.experts} k={r.top_k} "
                f"{str(dtype).removeprefix('torch.')}" + (f" hf={impl}" if impl else ""))
        times = {}
        for provider, load in loaders.items():
            layer = None
            try:
                layer = load(device)(case, w, args)
                inputs = [x, *layer.params]
                out = layer.forward(x)
                dx = torch.autograd.grad(out, inputs, g)[0]
                summary = check_layer(provider, (out.detach(), dx), ref, layer.route(x.detach().view(r.tokens, -1)),
                                      ref_idx, 0.03 if dtype != torch.float32 else 1e-3)
                print(f"{provider}: {summary}")
                del out, dx
                for mode in ("fwd", "fwd+bwd"):
                    if mode == "fwd":
                        timing = bench(lambda: layer.forward(x), device=device)
                    else:
                        timing = bench(lambda: torch.autograd.grad(layer.forward(x), inputs, g), device=device)
                    times[provider, mode] = timing["median"]
                    record(results, name, mode, provider, timing, "TFLOP/s",
                           layer_flops(r.tokens, r.top_k, case.hidden, case.ffn, mode) / (timing["median"] * 1e-3)
                           / 1e12)
                    results.add(name, mode, provider, "tok/s", r.tokens / (timing["median"] * 1e-3))
                gib = peak_gib(lambda: torch.autograd.grad(layer.forward(x), inputs, g), device)
                if gib is not None:
                    results.add(name, "fwd+bwd", provider, "GiB", gib)
            except Exception as e:
                report_failure(provider, name, e)
            finally:
                layer = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        for mode in ("fwd", "fwd+bwd"):
            if (base := times.get((LAYER_BASELINE, mode))) is None:
                continue
            ratios = [f"{p} {base / t:.2f}x" for (p, m), t in times.items() if m == mode and p != LAYER_BASELINE]
            if ratios:
                print(f"speedup over {LAYER_BASELINE} ({mode}, {name}): {', '.join(ratios)}")


# ---- the run ------------------------------------------------------------------------------------------------------
# section name -> (bench function, the roofline metric its figures are divided by)
SECTIONS = {"gemm": (bench_gemm, "TFLOP/s"), "moves": (bench_moves, "GB/s"), "layer": (bench_layer, "TFLOP/s")}
# tables printed after a section's metric table
EXTRA_TABLES = {"layer": ("tok/s", "GiB")}


def _providers(section: str, table: dict, args, device, load: bool = True) -> dict:
    """The section's providers that load here, of those asked for (all when none is asked for); ``load`` False: their
    loaders, each called when its turn comes (a loader that builds or compiles a model frees the previous one's)."""
    if args.providers and not args.providers & table.keys():
        print(f"skip section {section}: none of its providers ({', '.join(table)}) asked for")
        return {}
    if not load:
        return {name: fn for name, fn in table.items() if not args.providers or name in args.providers}
    return load_providers(table, device, args.providers & table.keys() if args.providers else None)


def _mode(mode: str, args) -> str:
    return mode + (" graph" if args.graph else "")


def main(argv: list[str] | None = None) -> Results:
    def extra(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--sections", type=lambda s: [p.strip() for p in s.split(",") if p.strip()],
                            default=list(SECTIONS), help=f"sections to run, of {', '.join(SECTIONS)}")
        parser.add_argument("--hf-experts", default="default",
                            help="layer: the Hugging Face block's experts implementation (transformers 5: eager, "
                                 "grouped_mm, batched_mm; default: what a Mixtral model gets, grouped_mm where torch "
                                 "has it)")

    args = parse_args(__doc__.splitlines()[0], argv, extra)
    if unknown := set(args.sections) - SECTIONS.keys():
        raise SystemExit(f"unknown sections {sorted(unknown)}; choose from {sorted(SECTIONS)}")
    offered = set().union(*(table.keys() for table in (GEMM_PROVIDERS, MOVES_PROVIDERS, LAYER_PROVIDERS)))
    if args.providers and (unknown := args.providers - offered):
        raise SystemExit(f"unknown providers {sorted(unknown)}; choose from {sorted(offered)}")
    device = args.device
    results = Results(device)
    keep_rows_on_exit(results, BENCH, args.out, args.no_save)
    metrics = [SECTIONS[s][1] for s in args.sections]
    if "TFLOP/s" in metrics:
        results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    if "GB/s" in metrics:
        results.add_roofline("GB/s", measure_copy_gbps(device))
    torch.manual_seed(0)
    for section in args.sections:
        SECTIONS[section][0](args, results, device)
    file_rows(results, BENCH, args.out, args.no_save)
    extra_tables = [m for s in args.sections for m in EXTRA_TABLES.get(s, ())]
    for metric in dict.fromkeys(metrics + extra_tables):
        if any(f[3] == metric for f in results.figures):
            print(results.markdown(metric))
            print()
    return results


if __name__ == "__main__":
    main()
