"""The cross-entropy's in-place gradient scale against another version of its module, in one process on one card:
the same bits at a factor of 1 and another, then each version timed at the output layers' weight-gradient shapes.

    git show REV:megakern/_cross_entropy_triton.py > /tmp/base_cross_entropy_triton.py
    python profiles/ab_ce_scale.py --base /tmp/base_cross_entropy_triton.py

A factor of 1 is what the fused linear cross-entropy's backward meets in a training step whose loss announced its
gradient (``linear_cross_entropy(grad_scale=)``): nothing to read or write, so its time is the launch's alone.
Timed by ``triton.testing.do_bench`` (median, 200 ms of calls); bf16 tensors.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from benchmarks.common import import_file
from megakern import _cross_entropy_triton as new

# (rows, columns): Llama-3 8B's and 1B's output layer, GPT-2's, and an input gradient of 8192 tokens at width 4096
SHAPES = ((128256, 4096), (128256, 2048), (50304, 1024), (8192, 4096))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="a copy of megakern/_cross_entropy_triton.py to compare with")
    args = parser.parse_args(argv)
    if not Path(args.base).is_file():
        raise SystemExit(f"ab_ce_scale: --base {args.base!r}: no such file")
    base = import_file(args.base, "base_cross_entropy_triton")
    if not hasattr(base, "scale"):
        raise SystemExit(f"ab_ce_scale: --base {args.base!r} has no scale: not a copy of the cross-entropy kernels")
    if not torch.cuda.is_available():
        raise SystemExit("ab_ce_scale: needs a CUDA device")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for shape in SHAPES:
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        for f in (1.0, 0.999):
            factor = torch.tensor([f], device="cuda")
            a, b = x.clone(), x.clone()
            base.scale(a, factor, inplace=True)
            new.scale(b, factor, inplace=True)
            if not torch.equal(a, b):
                raise SystemExit(f"ab_ce_scale: the versions differ at {shape}, factor {f}")
            times = [triton.testing.do_bench(lambda m=m: m.scale(x, factor, inplace=True), rep=200)
                     for m in (base, new)]
            print(f"in place {shape} factor {f}: base {times[0] * 1e3:7.1f} us | this {times[1] * 1e3:7.1f} us",
                  flush=True)


if __name__ == "__main__":
    main()
