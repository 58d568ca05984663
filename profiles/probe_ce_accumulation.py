"""What the linear cross-entropy's weight gradient loses when it is accumulated in bf16 over token chunks (the route
that keeps only one chunk of logits, as liger does), against fp32 accumulation, both against fp64; and the memory
each route needs at the vocabularies the benchmarks sweep. CPU only; the arithmetic is the GPU kernels' (bf16
logits with fp32 accumulation, the softmax in fp32, a bf16 logits gradient, fp32 accumulation inside each GEMM).

    python profiles/probe_ce_accumulation.py [--tokens 4096] [--hidden 256] [--vocab 8192] [--chunks 1,2,4,8,16,32]
    python profiles/probe_ce_accumulation.py --memory

The first form prints, per chunk count, the largest and the root-mean-square error of dweight against fp64, as
multiples of the one-chunk error (the arithmetic of torch.compile's single GEMM, what the project's 2x rule holds a
kernel to). The second prints, at N = 8192 tokens, the bytes of the outputs (dweight, dx: what cut-cross-entropy's
extra memory is), 1.2x that, and the largest chunk of bf16 logits that fits beside them.
"""
from __future__ import annotations

import argparse

import torch


def _grad_w(x, w, y, chunks: int, accumulate: torch.dtype) -> torch.Tensor:
    """dweight of mean cross-entropy over ``chunks`` token chunks, the sum carried in ``accumulate`` between chunks
    (bf16: one rounding a chunk, as a GEMM with beta = 1 into a bf16 gradient)."""
    n = x.shape[0]
    dw = torch.zeros(w.shape, dtype=accumulate)
    for idx in torch.arange(n).chunk(chunks):
        xc = x[idx].float()
        logits = (xc @ w.float().T).to(torch.bfloat16).float()
        p = torch.softmax(logits, -1)
        p[torch.arange(len(idx)), y[idx]] -= 1
        g = (p / n).to(torch.bfloat16).float()
        dw = (dw.float() + g.T @ xc).to(accumulate)
    return dw.to(torch.bfloat16)


def accuracy(tokens: int, hidden: int, vocab: int, chunk_counts: list[int], seed: int = 0) -> None:
    torch.manual_seed(seed)
    x = torch.randn(tokens, hidden, dtype=torch.float64).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, dtype=torch.float64) * hidden ** -0.5).to(torch.bfloat16)
    y = torch.randint(0, vocab, (tokens,))
    p = torch.softmax(x.double() @ w.double().T, -1)
    p[torch.arange(tokens), y] -= 1
    ref = (p / tokens).T @ x.double()
    base = (_grad_w(x, w, y, 1, torch.float32).double() - ref).abs()
    bmax, brms = base.max().item(), base.pow(2).mean().sqrt().item()
    print(f"N {tokens}, C {hidden}, V {vocab}: one chunk, max error {bmax:.3e}, rms {brms:.3e}")
    print("| chunks | bf16 accumulation, max / rms (x one chunk) | fp32 accumulation, max / rms |")
    print("|---|---|---|")
    for k in chunk_counts:
        row = []
        for acc in (torch.bfloat16, torch.float32):
            e = (_grad_w(x, w, y, k, acc).double() - ref).abs()
            row.append(f"{e.max().item() / bmax:.2f} / {e.pow(2).mean().sqrt().item() / brms:.2f}")
        print(f"| {k} | {row[0]} | {row[1]} |")


def memory(tokens: int = 8192) -> None:
    gib = 2.0 ** 30
    print(f"N {tokens}, bf16: outputs (dweight + dx), 1.2x, and the bf16 logits chunk that fits in the 0.2x beside")
    print("| C | V | outputs GiB | 1.2x GiB | logits of all tokens GiB | chunk that fits, tokens | chunks |")
    print("|---|---|---|---|---|---|---|")
    for c in (1024, 4096):
        for v in (50304, 128256, 151936):
            out = (v * c + tokens * c) * 2
            fits = int(0.2 * out // (v * 2))
            print(f"| {c} | {v} | {out / gib:.2f} | {1.2 * out / gib:.2f} | {tokens * v * 2 / gib:.2f} | {fits} | "
                  f"{-(-tokens // max(fits, 1))} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--chunks", default="1,2,4,8,16,32")
    ap.add_argument("--memory", action="store_true", help="the memory table alone")
    args = ap.parse_args()
    if args.memory:
        memory()
        return
    accuracy(args.tokens, args.hidden, args.vocab, [int(k) for k in args.chunks.split(",")])


if __name__ == "__main__":
    main()
