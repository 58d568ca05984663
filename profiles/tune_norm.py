"""Launch-geometry sweep for the norm kernels, and host overhead per call.

Times the kernel-level launchers (no autograd) of megakern._norm_triton and megakern._norm_cuda over their tuning
knobs, bf16, against the copy roofline measured in the same run, and the host time of one public call on a tiny
input (what a launch costs the CPU). The defaults in the launchers are set from this table.

    python profiles/tune_norm.py [--hidden 8192,16384] [--residual]

``--residual``: the backward also reads the gradient of the residual stream (the fused residual add of a pre-norm
block, as in training: one more M x N read), and the sweep covers more programs per SM.
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench, host_us, measure_copy_gbps
from megakern import _norm_cuda, _norm_triton



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--hidden", default="1024,4096,8192")
    parser.add_argument("--residual", action="store_true")
    args = parser.parse_args()
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy roofline {copy:.0f} GB/s")
    rows_total = 2**27
    for n in map(int, args.hidden.split(",")):
        m = rows_total // n
        x = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = 1 + 0.1 * torch.randn(n, device=dev, dtype=torch.bfloat16)
        b = 0.1 * torch.randn(n, device=dev, dtype=torch.bfloat16)
        act = x.numel() * 2
        for op, is_rms, bias in (("rms", True, None), ("ln", False, b)):
            _, _, mean, rstd = _norm_triton.fwd(x, None, w, bias, 1e-5, is_rms)
            runs = []
            for warps, rows_pp in ((4, 1), (8, 1), (16, 1), (4, 2), (8, 2), (16, 2), (16, 4), (4, 4), (8, 8)):
                runs.append((f"triton fwd warps={warps} rows/program={rows_pp}", 2 * act,
                             lambda warps=warps, rows_pp=rows_pp: _norm_triton.fwd(
                                 x, None, w, bias, 1e-5, is_rms, num_warps=warps, rows_per_program=rows_pp)))
            if not is_rms:  # LayerNorm's statistics in one reduction, at the table's geometry and its neighbours
                for warps, rows_pp in ((4, 2), (4, 1), (8, 1), (8, 2)):
                    runs.append((f"triton fwd one-pass warps={warps} rows/program={rows_pp}", 2 * act,
                                 lambda warps=warps, rows_pp=rows_pp: _norm_triton.fwd(
                                     x, None, w, bias, 1e-5, is_rms, num_warps=warps, rows_per_program=rows_pp,
                                     one_pass=True)))
            if n >= 8192:  # the two-pass forward for wide rows: (warps, chunk, stages)
                for warps, chunk, stages in ((4, 2048, 2), (8, 4096, 2), (8, 2048, 3), (16, 8192, 2), (4, 4096, 3)):
                    runs.append((f"triton fwd wide warps={warps} chunk={chunk} stages={stages}", 2 * act,
                                 lambda warps=warps, chunk=chunk, stages=stages: _norm_triton.fwd(
                                     x, None, w, bias, 1e-5, is_rms, num_warps=warps, wide=True, chunk=chunk,
                                     stages=stages)))
            runs.append(("cuda fwd default " + str(_norm_cuda.launch_config(n, x.dtype, False)), 2 * act,
                         lambda: _norm_cuda.fwd(x, None, w, bias, 1e-5, is_rms)))
            dres = torch.randn_like(x) if args.residual else None
            bwd_bytes = (4 if args.residual else 3) * act
            # (warps, programs per SM, rows per step, prefetch of the next step's rows)
            geometries = [(16, 1, 1, False), (16, 1, 2, False), (8, 1, 2, False), (8, 1, 4, False), (4, 1, 4, False),
                          (4, 4, 2, False), (32, 1, 1, False), (max(4, n // 256), 1, 1, True),
                          (max(4, n // 256), max(1, 8192 // n), 1, True),
                          (max(4, n // 256), max(1, 4096 // n), 1, True),
                          (max(4, n // 512), max(1, 8192 // n), 1, True)]
            if args.residual:
                geometries += [(4, 2, 4, False), (4, 4, 4, False), (4, 8, 4, False), (4, 4, 2, False),
                               (4, 8, 2, False), (8, 4, 4, False), (8, 2, 4, False), (4, 4, 8, False),
                               (2, 8, 4, False), (4, 16, 2, False)]
            for warps, per_sm, block_m, prefetch in geometries:
                runs.append((f"triton bwd warps={warps} per_sm={per_sm} rows/step={block_m} prefetch={int(prefetch)}",
                             bwd_bytes,
                             lambda warps=warps, per_sm=per_sm, block_m=block_m, prefetch=prefetch: _norm_triton.bwd(
                                 dy, x, dres, w, mean, rstd, is_rms, x.dtype if args.residual else None, True,
                                 not is_rms, num_warps=warps, programs_per_sm=per_sm, rows_per_step=block_m,
                                 prefetch=prefetch)))
            if not is_rms:  # the table's geometry with LayerNorm's two row sums in one reduction
                runs.append(("triton bwd default geometry, paired sums", bwd_bytes,
                             lambda: _norm_triton.bwd(dy, x, dres, w, mean, rstd, is_rms,
                                                      x.dtype if args.residual else None, True, True,
                                                      paired=True)))
                runs.append(("triton bwd default geometry", bwd_bytes,
                             lambda: _norm_triton.bwd(dy, x, dres, w, mean, rstd, is_rms,
                                                      x.dtype if args.residual else None, True, True)))
            if n >= 8192:  # the two-pass kernel for wide rows: (warps, programs per SM, chunk, stages)
                for warps, per_sm, chunk, stages in ((8, 2, 4096, 2), (8, 4, 4096, 2), (4, 4, 2048, 2), (8, 2, 2048, 3),
                                                     (16, 2, 8192, 2), (16, 1, 8192, 2), (8, 4, 2048, 2),
                                                     (4, 8, 1024, 3), (8, 2, 4096, 3), (16, 2, 4096, 2)):
                    runs.append((f"triton bwd wide warps={warps} per_sm={per_sm} chunk={chunk} stages={stages}",
                                 bwd_bytes,
                                 lambda warps=warps, per_sm=per_sm, chunk=chunk, stages=stages: _norm_triton.bwd(
                                     dy, x, dres, w, mean, rstd, is_rms, x.dtype if args.residual else None, True,
                                     not is_rms, num_warps=warps, programs_per_sm=per_sm, wide=True, chunk=chunk,
                                     stages=stages)))
            runs.append(("cuda bwd default " + str(_norm_cuda.launch_config(n, x.dtype, True)), bwd_bytes,
                         lambda: _norm_cuda.bwd(dy, x, dres, w, mean, rstd, is_rms, x.dtype if args.residual else None,
                                                True, not is_rms)))
            for name, nbytes, fn in runs:
                try:
                    t = bench(fn, device=dev)["median"]
                except Exception as exc:  # a geometry the kernel rejects: report it, keep sweeping
                    print(f"{op} {m}x{n} {name:55} failed: {str(exc).splitlines()[0][:80]}")
                    continue
                gbps = nbytes / t / 1e6
                print(f"{op} {m}x{n} {name:55} {t * 1e3:8.1f} us {gbps:6.0f} GB/s {gbps / copy:5.2f}")
    import megakern

    xs = torch.randn(4, 1024, device=dev, dtype=torch.bfloat16)
    ws = torch.ones(1024, device=dev, dtype=torch.bfloat16)
    for backend in ("torch", "triton", "cuda"):
        us = host_us(lambda: megakern.rms_norm(xs, ws, backend=backend))
        xg = xs.clone().requires_grad_()
        us_g = host_us(lambda: megakern.rms_norm(xg, ws, backend=backend))
        print(f"host per call, rms_norm 4x1024 [{backend}]: {us:6.1f} us (no grad) {us_g:6.1f} us (x requires grad)")
    print(f"  kernel-only launch of triton fwd: {host_us(lambda: _norm_triton.fwd(xs, None, ws, None, 1e-6, True)):6.1f} us,"
          f" cuda fwd: {host_us(lambda: _norm_cuda.fwd(xs, None, ws, None, 1e-6, True)):6.1f} us")


if __name__ == "__main__":
    main()
