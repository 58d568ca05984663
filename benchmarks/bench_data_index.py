"""Index build time of GPTDataset: doc_idx, sample_idx and shuffle_idx for a synthetic corpus.

The corpus is only its document sizes (no .bin): lognormal lengths (sigma 1, mean --mean-doc tokens, at least 1)
drawn until they hold --tokens tokens, so 1e9 tokens are about 1e6 documents. ``build_indices`` is timed for
--epochs passes over them at --seq-length: (epochs * tokens - 1) // seq_length samples. Figures: the median of
--repeats builds in seconds, and the peak memory the build allocates (tracemalloc, in a separate run: numpy
reports its buffers to it), beside the size of the arrays it returns. Host-only: the figure is the CPU's.

    python -m benchmarks.bench_data_index [--tokens 1e9] [--seq-length 2048] [--epochs 1] [--repeats 3]
"""

import argparse
import statistics
import time
import tracemalloc

import numpy as np

from megakern.data.gpt_dataset import build_indices


def document_sizes(tokens: int, mean_doc: float, seed: int) -> np.ndarray:
    """Lognormal document lengths (sigma 1, mean ``mean_doc``) adding up to exactly ``tokens``."""
    rng = np.random.default_rng(seed)
    chunks, total = [], 0
    while total < tokens:
        draws = rng.lognormal(np.log(mean_doc) - 0.5, 1.0, int(tokens / mean_doc) + 1)
        chunks.append(np.maximum(1, draws).astype(np.int64))
        total += int(chunks[-1].sum())
    sizes = np.concatenate(chunks)
    ends = np.cumsum(sizes)
    count = int(np.searchsorted(ends, tokens)) + 1
    sizes = sizes[:count].copy()
    sizes[-1] -= int(ends[count - 1]) - tokens
    return sizes


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=1e9, help="corpus size in tokens (default: %(default)g)")
    parser.add_argument("--mean-doc", type=float, default=1000.0, help="mean document length (default: %(default)g)")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--epochs", type=int, default=1, help="passes over the corpus the samples take")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)

    sizes = document_sizes(int(args.tokens), args.mean_doc, args.seed)
    num_samples = (args.epochs * int(sizes.sum()) - 1) // args.seq_length
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter_ns()
        indices = build_indices(sizes, args.seq_length, num_samples, args.seed)
        times.append((time.perf_counter_ns() - start) / 1e9)
    del indices
    tracemalloc.start()
    indices = build_indices(sizes, args.seq_length, num_samples, args.seed)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    row = {"tokens": int(sizes.sum()), "documents": len(sizes), "samples": num_samples,
           "epochs": len(indices.doc_idx) // len(sizes), "seconds": statistics.median(times),
           "peak MiB": peak / 2**20, "index MiB": sum(a.nbytes for a in indices) / 2**20}
    print(f"build_indices, seq_length {args.seq_length}, median of {args.repeats} (min {min(times):.3f} s)\n")
    print("| " + " | ".join(row) + " |\n|" + "---|" * len(row))
    print("| " + " | ".join(f"{v:,.4g}" if isinstance(v, float) else f"{v:,}" for v in row.values()) + " |")
    return [row]


if __name__ == "__main__":
    main()
