"""The CUDA norm forward's two kernels in one process on one card: the row-group kernel at its table geometry
(``launch_config``) and the team kernel at its geometry (``team_geometry``) and reading the row again from L1
(``reload``, a team a row rather than a persistent grid, at each chunk count a thread), beside the Triton forward, at
each hidden size; fraction of the same run's copy bandwidth. Which of the two CUDA kernels is the default at a width is
``team_config``'s table (megakern/_norm_cuda.py): this is the A/B that sets it.

    python profiles/ab_norm_fwd_team.py --hidden 1024,2048,4096,8192,12288,16384

Timed by CUDA-graph replay (``benchmarks.common.bench(graph=True)``, the best median of two windows); bf16 tensors of
2**27 elements, NVRTC path; both norms with a weight (and LayerNorm's bias), no residual.
"""
from __future__ import annotations

import argparse
import functools

import torch

from benchmarks.common import bench, measure_copy_gbps
from megakern import _norm_cuda, _norm_triton

ELEMENTS = 2**27


def reload_geometries(n: int) -> list[_norm_cuda.LaunchConfig]:
    """The team kernel reading the row again from L1 (``reload``), a team a row (``persistent=False``), at each chunk
    count a thread that covers a bf16 row of ``n`` within its bounds: one-warp teams, TEAM_WARP_ROWS a block, where a
    warp covers the row."""
    out = []
    for nv in _norm_cuda.TEAM_CHUNKS:
        threads = 32 * -(-n // (8 * 32 * nv))
        if threads <= _norm_cuda.TEAM_MAX_THREADS:
            out.append(_norm_cuda.LaunchConfig(nv, threads, _norm_cuda.TEAM_WARP_ROWS if threads == 32 else 1,
                                               team=True, prefetch=False, reload=True, persistent=False))
    return out


def widths_and_ops(script: str, hidden: str, ops: str) -> tuple[list[int], list[str]]:
    """The hidden sizes and ops of ``--hidden`` and ``--ops``, each width one the team kernel takes (bf16), on a machine
    with CUDA; else SystemExit naming the problem (``script`` names the tool)."""
    try:
        widths = [int(h) for h in hidden.split(",")]
    except ValueError:
        raise SystemExit(f"{script}: --hidden {hidden!r} is not a comma-separated list of integers")
    names = [op.strip() for op in ops.split(",") if op.strip()]
    if set(names) - {"rms", "ln"}:
        raise SystemExit(f"{script}: unknown op(s) {sorted(set(names) - {'rms', 'ln'})}; known: rms, ln")
    for n in widths:
        if n % 8 or _norm_cuda.team_geometry(n, torch.bfloat16) is None:
            raise SystemExit(f"{script}: the team kernel does not take bf16 rows of {n} (multiples of 8 up to "
                             f"{_norm_cuda.TEAM_MAX_THREADS * _norm_cuda.TEAM_CHUNKS[-1] * 8})")
    if not torch.cuda.is_available():
        raise SystemExit(f"{script}: needs a CUDA device")
    return widths, names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="1024,2048,3072,4096,5120,8192,12288,16384",
                        help="comma-separated hidden sizes (multiples of 8, at most the team kernel's widest row)")
    parser.add_argument("--ops", default="rms,ln", help="comma-separated: rms, ln")
    parser.add_argument("--rep-ms", type=int, default=300, help="timing window of each measurement")
    args = parser.parse_args(argv)
    hidden, ops = widths_and_ops("ab_norm_fwd_team", args.hidden, args.ops)
    device = torch.device("cuda")
    copy = measure_copy_gbps(device)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; fraction of copy, graph replay")
    for n in hidden:
        x = torch.randn(ELEMENTS // n, n, device=device, dtype=torch.bfloat16)
        w = torch.randn(n, device=device, dtype=torch.bfloat16)
        b = torch.randn(n, device=device, dtype=torch.bfloat16)
        nbytes = 2 * x.numel() * x.element_size()
        for op in ops:
            rms = op == "rms"
            bias = None if rms else b
            fwd = functools.partial(_norm_cuda.fwd, x, None, w, bias, 1e-5, rms, path="nvrtc")
            rows = _norm_cuda.launch_config(n, x.dtype, False)
            team = _norm_cuda.team_geometry(n, x.dtype)
            default = "team" if _norm_cuda.team_config(n, x.dtype, rms) else "row-group"
            line = f"{op:3s} {x.shape[0]}x{n} (default {default:9s})"
            runs = [("triton", lambda: _norm_triton.fwd(x, None, w, bias, 1e-5, rms)),
                    ("row-group", functools.partial(fwd, config=rows)), ("team", functools.partial(fwd, config=team))]
            runs += [(f"reload-row {g.nv}x{g.threads}", functools.partial(fwd, config=g)) for g in reload_geometries(n)]
            for label, fn in runs:
                t = min(bench(fn, graph=True, device=device, rep_ms=args.rep_ms)["median"] for _ in range(2)) * 1e-3
                line += f" | {label} {t * 1e6:6.1f} us {nbytes / t / 1e9 / copy:.3f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
