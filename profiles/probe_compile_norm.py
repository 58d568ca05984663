"""What torch.compile runs for a norm's forward: the Triton kernel Inductor generates for F.rms_norm and
F.layer_norm over bf16 rows of a given width, with the eps bench_norm uses (the function its compile provider
compiles), and the launch configuration its autotuner picked (XBLOCK rows a program, R0_BLOCK columns a step, warps,
stages).

torch.compile's RMSNorm forward reaches 0.97-0.98 of copy at hidden 9216-16384 on the H200 (bench_norm), where
megakern's register kernel reaches 0.91-0.96: the kernel and its configuration say how.

    python profiles/probe_compile_norm.py --hidden 12288,14336 [--ops rms,ln] [--mib 256] [--source]

Needs a CUDA device (Inductor's CPU backend writes C++, not Triton).
"""
from __future__ import annotations

import argparse
import gc

import torch
import torch.nn.functional as F

from benchmarks.bench_norm import EPS
from benchmarks.common import int_list

OPS = ("rms", "ln")


def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], w, EPS["rmsnorm"])


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w, b, EPS["layernorm"])


def kernel_source(code: str) -> str:
    """The Triton kernels (decorator to the end of the source string) in Inductor's output code."""
    parts, start = [], code.find("@triton_heuristics")
    while start >= 0:
        end = code.find("''', device_str", start)
        parts.append(code[start:end if end >= 0 else len(code)])
        start = code.find("@triton_heuristics", end if end >= 0 else len(code))
    return "\n".join(parts)


def picked_configs(seen: set) -> list[str]:
    """'kernel: config' of each Inductor autotuner alive and launched that ``seen`` does not hold yet."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    out = []
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, CachingAutotuner) or id(obj) in seen or not getattr(obj, "launchers", None):
                continue
        except ReferenceError:  # a dead weak proxy among the objects
            continue
        seen.add(id(obj))
        out.extend(f"{obj.fn.__name__}: {launcher.config}" for launcher in obj.launchers)
    return out


def probe(op: str, hidden: int, mib: int, device: str, seen: set) -> tuple[str, list[str]]:
    """(the generated kernels' source, the configurations picked) for ``op`` over bf16 rows of ``hidden``."""
    from torch._inductor.utils import run_and_get_code

    if hidden < 1 or mib < 1:
        raise ValueError(f"probe_compile_norm: hidden and mib must be >= 1, got {hidden} and {mib}")
    torch._dynamo.reset()
    rows = max(1, mib * 2**20 // (2 * hidden))
    x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(hidden, device=device, dtype=torch.bfloat16)
    args = (x, w) if op == "rms" else (x, w, torch.randn(hidden, device=device, dtype=torch.bfloat16))
    compiled = torch.compile(rms_norm if op == "rms" else layer_norm)
    _, code = run_and_get_code(compiled, *args)
    compiled(*args)
    return kernel_source("\n".join(code)), picked_configs(seen)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int_list, default=[9216, 12288, 14336, 16384])
    parser.add_argument("--ops", default="rms,ln")
    parser.add_argument("--mib", type=int, default=256, help="size of x in MiB (bf16)")
    parser.add_argument("--source", action="store_true", help="print the generated kernels too")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        raise SystemExit(f"probe_compile_norm: unknown --ops {unknown}; choose from {list(OPS)}")
    if not torch.device(args.device).type == "cuda" or not torch.cuda.is_available():
        raise SystemExit("probe_compile_norm: needs a CUDA device (Inductor writes Triton only for GPUs)")
    seen: set = set()
    for op in ops:
        for hidden in args.hidden:
            source, configs = probe(op, hidden, args.mib, args.device, seen)
            print(f"== {op} hidden {hidden}")
            for line in configs:
                print(f"picked {line}")
            if args.source:
                print(source)


if __name__ == "__main__":
    main()
