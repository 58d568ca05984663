"""Does a norm forward's speed follow its code or its rows' addresses? The Triton forward at its launch table's
geometry, by CUDA-graph replay, on rows read at their own width (contiguous) and on the same rows read from a wider
buffer (row stride hidden + pad, the output contiguous as always), with a plain copy of the same bytes as the roof.

LayerNorm's forward runs the same compiled kernel at hidden 11264 and 12288 (two tiles of 8192 + 4096, 4 warps,
the same registers), yet measured 0.94 and 0.84 of copy: if the padded stride moves 12288, its rows' addresses are
the cause (how DRAM channels take a stride of 24 KiB), not the kernel's instructions.

    python profiles/probe_norm_rows.py --hidden 11264,12288 --pads 0,64,128 [--ops rms,ln] [--mib 64]

Bytes counted: x read once, y written once (the statistics are a float a row). Fraction: of the same-run copy.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench, int_list, measure_copy_gbps
from megakern import _norm_triton


def rows_view(rows: int, hidden: int, pad: int, device, dtype=torch.bfloat16) -> torch.Tensor:
    """(rows, hidden) random values, row stride hidden + pad (a slice of a wider buffer when pad > 0)."""
    if pad < 0:
        raise ValueError(f"probe_norm_rows: pad must be >= 0, got {pad}")
    buffer = torch.randn(rows, hidden + pad, device=device, dtype=dtype)
    return buffer[:, :hidden]


def probe(hidden: int, pad: int, is_rms: bool, rows: int, device, rep_ms: int = 200) -> dict:
    """{'ms', 'gbps'} of the Triton forward at ``hidden`` on ``rows`` rows of stride hidden + pad (bf16)."""
    x = rows_view(rows, hidden, pad, device)
    weight = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    bias = None if is_rms else torch.randn(hidden, device=device, dtype=torch.bfloat16)

    def run():
        return _norm_triton.fwd(x, None, weight, bias, 1e-5, is_rms)

    y = run()[0]  # compiled before timing; checked against torch in fp32
    ref = (torch.nn.functional.rms_norm(x.float(), (hidden,), weight.float(), 1e-5) if is_rms else
           torch.nn.functional.layer_norm(x.float(), (hidden,), weight.float(), bias.float(), 1e-5))
    err = (y.float() - ref).abs().max().item()
    if err > 0.05 * max(1.0, ref.abs().max().item()):
        raise AssertionError(f"probe_norm_rows: hidden {hidden} pad {pad}: output off by {err}")
    ms = bench(run, device=device, rep_ms=rep_ms, graph=torch.device(device).type == "cuda")["median"]
    return {"ms": ms, "gbps": 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_list, default=[11264, 12288])
    parser.add_argument("--pads", type=int_list, default=[0, 64, 128])
    parser.add_argument("--ops", default="rms,ln", help="comma-separated: rms, ln")
    parser.add_argument("--mib", type=int, default=64, help="MiB of bf16 input a case")
    parser.add_argument("--rep-ms", type=int, default=200)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(ops) - {"rms", "ln"})
    if unknown:
        raise SystemExit(f"probe_norm_rows: unknown --ops {unknown}; known: rms, ln")
    copy = measure_copy_gbps(args.device)
    print(f"copy {copy:.0f} GB/s; Triton forward at the launch table's geometry, graph replay on CUDA")
    for op in ops:
        for hidden in args.hidden:
            for pad in args.pads:
                rows = max(1, args.mib * 2**20 // (2 * hidden))
                r = probe(hidden, pad, op == "rms", rows, args.device, args.rep_ms)
                print(f"{op:3s} hidden {hidden:6d} stride {hidden + pad:6d}  {r['ms'] * 1e3:8.1f} us  "
                      f"{r['gbps']:6.0f} GB/s  {r['gbps'] / copy:.2f}")


if __name__ == "__main__":
    main()
