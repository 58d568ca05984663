"""Block sweep for the cross-entropy kernel (megakern._cross_entropy_triton): (BLOCK_V, warps) on one chunk of
bf16 logits, the gradient written over them as the fused linear cross-entropy does, against the same-run copy
bandwidth. GB/s counts the 4 bytes an element a pass must move (read the logits once, write the gradient once; the
kernel reads a row twice, the second time mostly from L2). Each configuration's loss, log-sum-exp and gradient
must match the default's before it is timed, under graph replay (the kernel's GPU time, as in the training step's
CUDA graph). The winner becomes block_v's table.

    python profiles/tune_cross_entropy.py [--rows 8192] [--vocab 50304,128256,151936]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.common import bench, int_list, measure_copy_gbps
from megakern import _cross_entropy_triton as kern

CONFIGS = [(32768, 32), (32768, 16), (16384, 16), (16384, 32), (16384, 8), (8192, 8), (8192, 16), (8192, 4),
           (4096, 4), (4096, 8), (2048, 4)]
IGNORE_INDEX = -100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=8192, help="tokens in the chunk (default 8192)")
    parser.add_argument("--vocab", type=int_list, default=[50304, 128256, 151936])
    args = parser.parse_args()
    if args.rows < 1 or not args.vocab or min(args.vocab) < 1:
        raise SystemExit("tune_cross_entropy: --rows and every --vocab must be >= 1")
    dev = torch.device("cuda")
    copy = measure_copy_gbps(dev)
    print(f"copy {copy:.0f} GB/s; rows {args.rows}, bf16 logits")
    gen = torch.Generator(device=dev).manual_seed(0)
    for vocab in args.vocab:
        logits = (3 * torch.randn(args.rows, vocab, device=dev, generator=gen)).to(torch.bfloat16)
        targets = torch.randint(0, vocab, (args.rows,), device=dev, generator=gen)
        targets[torch.rand(args.rows, device=dev, generator=gen) < 0.05] = IGNORE_INDEX
        scale = torch.full((1,), 1.0 / args.rows, device=dev)
        default = kern.block_v(vocab, dev)
        work = logits.clone()
        ref_loss, ref_lse = kern.fwd(logits, targets, work, scale, IGNORE_INDEX, 0.0, None)
        ref_grad = work.clone()
        nbytes = 4 * args.rows * vocab
        for block, warps in CONFIGS:
            label = f"V {vocab:6} block {block:5} x {warps:2} warps{' (default)' if (block, warps) == default else ''}"
            work.copy_(logits)
            try:
                loss, lse = kern.fwd(work, targets, work, scale, IGNORE_INDEX, 0.0, None, block=block, warps=warps)
            except Exception as exc:  # a configuration the compiler refuses: say so, keep sweeping
                print(f"{label}  FAILED: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            ok = (torch.allclose(loss, ref_loss, rtol=1e-5, atol=1e-5) and torch.allclose(lse, ref_lse, rtol=1e-5,
                                                                                          atol=1e-5)
                  and torch.allclose(work.float(), ref_grad.float(), rtol=2e-2, atol=1e-6))
            if not ok:
                print(f"{label}  WRONG: off the default configuration's loss, lse or gradient")
                continue
            # timed in place, as the fused loss runs it (the gradient becomes the next call's logits: finite values)
            t = bench(lambda: kern.fwd(work, targets, work, scale, IGNORE_INDEX, 0.0, None, block=block,
                                       warps=warps), device=dev, graph=True)
            gbps = nbytes / (t["median"] * 1e-3) / 1e9
            print(f"{label}  {t['median'] * 1e3:8.1f} us  {gbps:6.0f} GB/s ({gbps / copy:.2f})", flush=True)


if __name__ == "__main__":
    main()
