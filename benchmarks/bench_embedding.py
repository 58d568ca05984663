"""The token embedding's weight gradient (megakern.embedding's backward), as the GPT's wte takes it in every step, at
common vocabularies and widths, against torch's (F.embedding's backward: a zero fill, a sort, a sum per run) and the
same-run copy roofline.

    torch            F.embedding's backward
    megakern-triton  megakern.embedding: a stable sort of the ids, a binary search per id, one Triton pass writing
                     every row of the (V, C) gradient once

Timed: the gather and its backward. GB/s counts one write of the (V, C) gradient and one read of the (N, C) output
gradient; both providers must agree within the rounding of the sums before they are timed.

    python -m benchmarks.bench_embedding [--quick] [--providers ...] [--graph] [--no-save]
"""

import torch

if __package__:
    from .common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                         parse_args, record, report_failure)
else:  # python benchmarks/bench_embedding.py
    from common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                        parse_args, record, report_failure)

# (vocabulary, width, tokens)
SHAPES = ((50304, 1024, 16384), (32000, 4096, 8192), (128256, 2048, 8192), (128256, 4096, 8192),
          (151936, 3584, 8192), (128256, 8192, 8192))
CPU_SHAPES = ((97, 24, 40), (5, 16, 33))


def _loader(backend: str):
    def load(device):
        import megakern

        if backend == "triton" and (reason := megakern.available_backends(device)["triton"]):
            raise Unavailable(reason)

        def run(idx, weight, grad_out):
            weight.grad = None
            megakern.embedding(idx, weight, backend=backend).backward(grad_out)
            return weight.grad

        return run

    return load


PROVIDERS = {"torch": _loader("torch"), "megakern-triton": _loader("triton")}


def main(argv: list[str] | None = None) -> Results:
    args = parse_args(__doc__.splitlines()[0], argv)
    device = args.device
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, "embedding", args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    shapes = CPU_SHAPES if device.type != "cuda" else SHAPES[1:4] if args.quick else SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    for vocab, cols, tokens in shapes:
        case = f"wte V{vocab} C{cols} N{tokens} bf16"
        weight = torch.randn(vocab, cols, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(True)
        idx = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        grad_out = torch.randn(tokens, cols, device=device, dtype=torch.bfloat16, generator=gen)
        nbytes = (vocab + tokens) * cols * weight.element_size()
        want = None
        for name, run in providers.items():
            try:
                got = run(idx, weight, grad_out).float()
                if want is None:
                    want = got
                elif not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
                    raise AssertionError("the weight gradient differs from the first provider's")
                t = bench(lambda: run(idx, weight, grad_out), device=device, graph=args.graph)
                record(results, case, "backward" + (" graph" if args.graph else ""), name, t, "GB/s",
                       nbytes / (t["median"] * 1e-3) / 1e9)
            except Exception as e:
                report_failure(name, case, e)
    file_rows(results, "embedding", args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
