"""The fused qkv projection's rows moved between the grouped and the heads-major order (megakern.qkv_rows), as the
GPT's grouped-query projection does to its weight in every forward and to the weight's gradient in every backward,
at the qkv weights of common grouped-query shapes, against the same-run copy roofline.

    torch            two strided copies (megakern.qkv_order.qkv_rows_ref)
    megakern-triton  one Triton pass (each element read and written once)

GB/s counts one read and one write of the tensor; both providers must give the same tensor before they are timed.

    python -m benchmarks.bench_qkv_order [--quick] [--providers ...] [--graph] [--no-save]
"""

import torch

if __package__:
    from .common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                         parse_args, record, report_failure)
else:  # python benchmarks/bench_qkv_order.py
    from common import (Results, Unavailable, bench, file_rows, keep_rows_on_exit, load_providers, measure_copy_gbps,
                        parse_args, record, report_failure)

# (name, kv heads, query heads per kv head, head size, hidden): the qkv weight is (nkv * (g + 2) * hs, hidden)
SHAPES = (("llama-1b", 8, 4, 64, 2048), ("llama-8b", 8, 4, 128, 4096), ("qwen-7b", 4, 7, 128, 3584),
          ("llama-70b", 8, 8, 128, 8192))
CPU_SHAPES = (("tiny", 2, 3, 8, 40), ("tiny-mha", 3, 1, 16, 24))


def _load_torch(device):
    from megakern.qkv_order import qkv_rows

    return lambda w, nkv, g, hs, heads_major: qkv_rows(w, nkv, g, hs, heads_major, backend="torch")


def _load_triton(device):
    import megakern

    if reason := megakern.available_backends(device)["triton"]:
        raise Unavailable(reason)
    from megakern.qkv_order import qkv_rows

    return lambda w, nkv, g, hs, heads_major: qkv_rows(w, nkv, g, hs, heads_major, backend="triton")


PROVIDERS = {"torch": _load_torch, "megakern-triton": _load_triton}


def main(argv: list[str] | None = None) -> Results:
    args = parse_args(__doc__.splitlines()[0], argv)
    device = args.device
    providers = load_providers(PROVIDERS, device, args.providers)
    results = Results(device)
    keep_rows_on_exit(results, "qkv_order", args.out, args.no_save)
    results.add_roofline("GB/s", measure_copy_gbps(device))
    shapes = CPU_SHAPES if device.type != "cuda" else SHAPES[1:3] if args.quick else SHAPES
    gen = torch.Generator(device=device).manual_seed(0)
    for name, nkv, g, hs, hidden in shapes:
        w = torch.randn(nkv * (g + 2) * hs, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        for heads_major, mode in ((True, "to heads-major"), (False, "to grouped")):
            case = f"qkv {name} {w.shape[0]}x{hidden} bf16"
            want = None
            for provider, fn in providers.items():
                try:
                    got = fn(w, nkv, g, hs, heads_major)
                    if want is None:
                        want = got
                    elif not torch.equal(got, want):
                        raise AssertionError("rows differ from the first provider's")
                    t = bench(lambda: fn(w, nkv, g, hs, heads_major), device=device, graph=args.graph)
                    record(results, case, mode + (" graph" if args.graph else ""), provider, t, "GB/s",
                           2 * w.numel() * w.element_size() / (t["median"] * 1e-3) / 1e9)
                except Exception as e:
                    report_failure(provider, case, e)
    file_rows(results, "qkv_order", args.out, args.no_save)
    print(results.markdown("GB/s"))
    return results


if __name__ == "__main__":
    main()
