"""The embedding table's gradient (the backward of the token lookup), at the vocabularies and widths of common models
with a step's tokens, against the same-run copy roofline.

    torch            aten::embedding_dense_backward (a zero fill of the table, a sort, segment sums, a scatter)
    megakern-triton  megakern.embedding_grad: the ids sorted, then one Triton pass writing every row once

Token ids follow a Zipf law over the vocabulary (exponent 1.1: a few ids take most tokens, most rows none), as text
does. GB/s counts the table's gradient written once and the lookup's gradient read once (the least any backward
moves). Both providers' tables must agree with the fp32 sums before they are timed. ``--geometries R:T:B:W,...``
adds megakern-triton at other launch geometries (rows a program, gradient rows a step, columns, warps), each a
provider of its own, for tuning.

    python -m benchmarks.bench_embedding [--quick] [--providers ...] [--graph] [--no-save] [--geometries ...]
"""

import torch

if __package__:
    from .common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                         measure_copy_gbps, parse_args, record, report_failure)
else:  # python benchmarks/bench_embedding.py
    from common import (Results, Unavailable, bench, check_outputs, file_rows, keep_rows_on_exit, load_providers,
                        measure_copy_gbps, parse_args, record, report_failure)

# (name, padded vocabulary, width, tokens a step)
SHAPES = (("gpt-char", 128, 384, 16384), ("gpt-350m", 50304, 1024, 16384), ("llama-1b", 128256, 2048, 8192),
          ("qwen-7b", 152064, 3584, 8192), ("llama-8b", 128256, 4096, 8192), ("llama-8b-b1", 128256, 4096, 4096))
CPU_SHAPES = (("tiny", 29, 40, 120), ("tiny-wide", 13, 130, 64))
ZIPF = 1.1


def _load_torch(device):
    return lambda grad, ids, rows: torch.ops.aten.embedding_dense_backward(grad, ids, rows, -1, False)


def _triton_loader(**launch):
    def load(device):
        import megakern

        if reason := megakern.available_backends(device)["triton"]:
            raise Unavailable(reason)
        from megakern.embedding import embedding_grad

        return lambda grad, ids, rows: embedding_grad(grad, ids, rows, backend="triton", **launch)
    return load


PROVIDERS = {"torch": _load_torch, "megakern-triton": _triton_loader()}


def _geometries(parser) -> None:
    parser.add_argument("--geometries", default="",
                        help="comma-separated ROWS:TOK:BLOCK_C:WARPS, each timed as a provider of its own")


def zipf_ids(vocab: int, tokens: int, device, gen: torch.Generator) -> torch.Tensor:
    """tokens ids over [0, vocab), P(rank r) ~ 1 / r^ZIPF, the ranks shuffled over the ids."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64, device=device) ** ZIPF
    ranks = torch.multinomial(weights, tokens, replacement=True, generator=gen)
    return torch.randperm(vocab, device=device, generator=gen)[ranks]


def main(argv: list[str] | None = None) -> Results:
    args = parse_args(__doc__.splitlines()[0], argv, _geometries)
    device = args.device
    loaders = dict(PROVIDERS)
    for text in filter(None, (g.strip() for g in args.geometries.split(","))):
        rows, tok, block, warps = (int(v) for v in text.split(":"))
        loaders[f"megakern-triton {text}"] = _triton_loader(rows=rows, tok=tok, block_c=block, warps=warps)
    if args.providers is not None:
        args.providers |= {name for name in loaders if name.startswith("megakern-triton ")}
    providers = load_providers(loaders, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, "embedding", args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    shapes = CPU_SHAPES if device.type != "cuda" else SHAPES[2::2] if args.quick else SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    for name, vocab, width, tokens in shapes:
        ids = zipf_ids(vocab, tokens, device, gen)
        grad = torch.randn(tokens, width, device=device, dtype=torch.bfloat16, generator=gen)
        want = torch.zeros(vocab, width, device=device).index_add_(0, ids, grad.float())
        case = f"embedding {name} {vocab}x{width} {tokens} tokens bf16"
        nbytes = (vocab + tokens) * width * grad.element_size()
        for provider, fn in providers.items():
            try:
                # torch's CPU kernel sums bf16 rows in bf16 (its CUDA one in fp32)
                check_outputs([provider], [fn(grad, ids, vocab)], [want], tol=1e-2 if device.type == "cuda" else 5e-2)
                t = bench(lambda: fn(grad, ids, vocab), device=device, graph=args.graph)
                record(results, case, "bwd" + (" graph" if args.graph else ""), provider, t, "GB/s",
                       nbytes / (t["median"] * 1e-3) / 1e9)
            except Exception as e:
                report_failure(provider, case, e)
    file_rows(results, "embedding", args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
