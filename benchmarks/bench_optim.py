"""The optimizer step of bf16 training with fp32 master weights, over GPT-350M's parameters (or GPT-1.3B's, or those
of megakern's llama-1b preset: 1.50B in 99 tensors, the largest 262M; or of the llama-8b preset cut to 4 layers, as
bench_train's 8B layer shape: 1.92B in 27 tensors, the embedding and output layer 525M each), against the same-run
copy roofline.

Each provider does the whole step after the backward: bf16 gradients in, fp32 masters, both moments and the bf16
weights updated, with a clipping divisor (grad_scale) and a skip flag (found_inf) on the device, as the trainer runs
it:
    torch-fused   the bf16 gradients copied into fp32 master gradients (_foreach_copy_), torch's fused AdamW, the
                  masters copied into the bf16 weights (_foreach_copy_): 40 bytes a parameter
    megakern      megakern.optim.MasterAdamW: one Triton pass over pointer tables: 28 bytes a parameter
GB/s counts the 28 bytes a parameter a single pass must move (read master, moments, bf16 gradient; write master,
moments, bf16 weight) for every provider, so the figures compare times; the fraction is of the copy bandwidth.
Both providers start from the same state and must agree on the masters after one step before they are timed.

The clipping norm's sum of squares over the same bf16 gradients (case 'grad norm ...', mode 'sum of squares'; 2
bytes a parameter read): torch-fused takes torch._foreach_norm, as megakern.parallel.clip does by default,
megakern megakern.optim.SumOfSquares (one Triton launch per dtype), as the trainer does; they must agree within
1e-5 before they are timed.

    python -m benchmarks.bench_optim [--quick] [--model gpt-350m|gpt-1.3b|llama-1b|llama-8b-4l] [--providers ...]
                                     [--graph] [--untouched 0.97]
                                     [--no-save]
"""

import torch

if __package__:
    from .common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                         parse_args, record, report_failure)
else:  # python benchmarks/bench_optim.py
    from common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                        parse_args, record, report_failure)

BYTES_PER_PARAM = 28
GPT2_MODELS = {"gpt-350m": (24, 1024), "gpt-1.3b": (24, 2048)}
# megakern.models.gpt presets (name, overrides), their parameters' shapes as the model holds them
PRESET_MODELS = {"llama-1b": ("llama-1b", {}), "llama-8b-4l": ("llama-8b", {"n_layer": 4})}
MODELS = (*GPT2_MODELS, *PRESET_MODELS)


def shapes(model: str, device: torch.device) -> list[tuple[int, ...]]:
    """The parameter shapes of ``model``: GPT-2-style (vocabulary 50304, 1024 positions, biases, LayerNorm), or a
    megakern preset's (its model built on the meta device); a tiny model on CPU."""
    if model in PRESET_MODELS:
        from megakern.models.gpt import GPT, GPTConfig

        tiny = dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=128, vocab_size=512)
        name, overrides = PRESET_MODELS[model]
        config = GPTConfig.preset(name, **(overrides if device.type == "cuda" else tiny))
        with torch.device("meta"):
            return [tuple(p.shape) for p in GPT(config).parameters()]
    layers, d = GPT2_MODELS[model] if device.type == "cuda" else (2, 64)
    vocab, positions = (50304, 1024) if device.type == "cuda" else (512, 64)
    block = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return [(vocab, d), (positions, d), *block * layers, (d,), (d,)]


class State:
    """Masters, bf16 weights with bf16 gradients, an AdamW over the masters (two groups: matrices decayed), and
    the step's device scalars; a fresh copy of the same values per provider."""

    def __init__(self, shapes, device, seed: int = 0, untouched: float = 0.0):
        gen = torch.Generator(device=device).manual_seed(seed)
        self.masters = [torch.randn(s, device=device, generator=gen) * 0.02 for s in shapes]
        self.models = [m.to(torch.bfloat16) for m in self.masters]
        for w in self.models:
            w.grad = torch.randn(w.shape, device=device, generator=gen).to(torch.bfloat16)
        if untouched:  # the token embedding (the first tensor): rows no token of the step touched have zero gradients
            rows = self.models[0].grad
            rows[torch.rand(rows.shape[0], device=device, generator=gen) < untouched] = 0
        groups = [{"params": [m for m in self.masters if m.dim() > 1], "weight_decay": 0.1},
                  {"params": [m for m in self.masters if m.dim() == 1], "weight_decay": 0.0}]
        self.lr = torch.tensor(3e-4, device=device)
        self.optimizer = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.95), fused=True, capturable=True)
        self.grad_scale = torch.tensor(1.7, device=device)  # a clipping divisor
        self.found_inf = torch.zeros((), device=device)


def _load_torch_fused(device):
    def build(state: State):
        for m in state.masters:
            m.grad = torch.empty_like(m)

        def step():
            torch._foreach_copy_([m.grad for m in state.masters], [w.grad for w in state.models])
            state.optimizer.grad_scale, state.optimizer.found_inf = state.grad_scale, state.found_inf
            state.optimizer.step()
            torch._foreach_copy_(state.models, state.masters)

        return step

    def norm(grads):
        return lambda: torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()

    return {"step": build, "norm": norm}


def _load_megakern(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    from megakern.optim import MasterAdamW, SumOfSquares

    def build(state: State):
        step = MasterAdamW(state.optimizer, dict(zip(state.masters, state.models)),
                           **({} if device.type == "cuda" else {"block": 1024}))
        return lambda: step.step(grad_scale=state.grad_scale, found_inf=state.found_inf)

    def norm(grads):
        sumsq = SumOfSquares(**({} if device.type == "cuda" else {"block": 1024}))
        return lambda: sumsq(grads)

    return {"step": build, "norm": norm}


PROVIDERS = {"torch-fused": _load_torch_fused, "megakern": _load_megakern}


def norm_case(results: Results, providers: dict, params, model: str, numel: int, device, graph: bool) -> None:
    """The sum of squares of the model's bf16 gradients by each provider (see the module docstring)."""
    case = f"grad norm {model} {numel / 1e6:.1f}M"
    grads = State(params, device).models
    grads = [w.grad for w in grads]
    truth = sum(float(g.double().square().sum()) for g in grads)
    for name, ops in providers.items():
        try:
            fn = ops["norm"](grads)
            err = abs(float(fn()) - truth) / truth
            if not err <= 1e-5:
                raise AssertionError(f"sum of squares off the fp64 one by {err:.3g}")
            t = bench(fn, device=device, graph=graph)
            record(results, case, "sum of squares" + (" graph" if graph else ""), name, t, "GB/s",
                   2 * numel / (t["median"] * 1e-3) / 1e9)
        except Exception as e:
            report_failure(name, case, e)


def main(argv: list[str] | None = None) -> Results:
    def extra(p):
        p.add_argument("--model", choices=sorted(MODELS), action="append", help="parameter shapes (default: "
                       "gpt-350m, and gpt-1.3b and llama-1b without --quick)")
        p.add_argument("--untouched", type=float, default=0.0, help="the fraction of the token embedding's rows with a "
                       "zero gradient, as in a step whose tokens touch only some rows (default 0: random gradients "
                       "everywhere); their moments stay 0 from the first step on")
    args = parse_args(__doc__.splitlines()[0], argv, extra=extra)
    if not 0.0 <= args.untouched < 1.0:
        raise SystemExit(f"bench_optim: --untouched must be in [0, 1), got {args.untouched}")
    device = args.device
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, 'optim', args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    models = args.model or (["gpt-350m"] if args.quick else ["gpt-350m", "gpt-1.3b", "llama-1b"])
    for model in models:
        params = shapes(model, device)
        numel = sum(torch.Size(s).numel() for s in params)
        case = f"adamw masters {model} {numel / 1e6:.1f}M"
        case += f" untouched {args.untouched:g}" if args.untouched else ""
        reference = None
        for name, ops in providers.items():
            try:
                state = State(params, device, untouched=args.untouched)
                step = ops["step"](state)
                step()  # one step from the shared initial state: the providers must agree
                masters = torch.cat([m.reshape(-1) for m in state.masters])
                if reference is None:
                    reference = masters
                else:
                    err = ((masters - reference).abs().max() / reference.abs().max()).item()
                    if not err <= 1e-5:
                        raise AssertionError(f"masters off the first provider's after one step: {err:.3g}")
                t = bench(step, device=device, graph=args.graph)
                gbps = BYTES_PER_PARAM * numel / (t["median"] * 1e-3) / 1e9
                record(results, case, "step" + (" graph" if args.graph else ""), name, t, "GB/s", gbps)
                del state, step
            except Exception as e:
                report_failure(name, case, e)
        norm_case(results, providers, params, model, numel, device, args.graph)
    file_rows(results, 'optim', args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
