"""megakern-generate: text from a megakern-train checkpoint or a Hugging Face directory, with megakern's KV-cache
generation (megakern.models.generate).

    megakern-generate runs/<run>/checkpoints --prompt "def fib(" --max-new-tokens 64 --temperature 0.8 --top-p 0.95
    megakern-generate hf:path/to/hf-dir --prompts-file prompts.txt --temperature 0 --device cuda

The source: a checkpoint (a step directory, or a checkpoint directory's latest; its config.yaml gives the model and
the tokenizer: its data paths' recorded tokenizer, else data.tokenizer), or ``hf:DIR`` (config.json, safetensors and
tokenizer.json). ``--tokenizer SPEC`` ('byte', 'gpt2:DIR', 'hf:FILE') overrides the tokenizer; one whose vocabulary
exceeds the model's is refused.

Prompts (``--prompt``, repeatable, or ``--prompts-file``: one a line) of the same token length run as one batch; the
KV cache of each batch is sized and checked against free memory before its first token (a clear error where it does
not fit). ``--max-new-tokens`` is bounded by the model's context (the prompt + new tokens <= max_seqlen, checked);
``--stop`` ids (default: the tokenizer's end-of-document id) are checked against the tokenizer and the model. Sampling:
``--temperature`` (0: greedy), ``--top-k``, ``--top-p``, ``--seed``. On a GPU the model runs in bf16 with the fast
kernels (``--dtype`` to change it). Prints each completion, then tokens/s of the whole run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tokenizer_of_checkpoint(config):
    from megakern.data.tokenizers import Tokenizer, load_tokenizer

    if config.data.paths:
        recorded = Path(f"{config.data.paths[0]}.tokenizer.json")
        return Tokenizer.from_config(json.loads(recorded.read_text()))
    return load_tokenizer(config.data.tokenizer)


def load_source(source: str, *, dtype: torch.dtype, device: torch.device, tokenizer_spec: str | None = None,
                eod_token: str | None = None):
    """(model on ``device`` in ``dtype``, tokenizer) of ``source`` (a checkpoint or 'hf:DIR')."""
    from megakern.data.tokenizers import HFTokenizer, load_tokenizer

    if source.startswith("hf:"):
        from megakern.models import hf

        root = Path(source[3:])
        model, _ = hf.load(root, dtype=dtype, device=device)
        tokenizer = None if tokenizer_spec else HFTokenizer(root / "tokenizer.json", eod_token=eod_token)
    else:
        from megakern.config import load_config
        from megakern.models.export import read_checkpoint

        model, _, found = read_checkpoint(source)
        model.to(device=device, dtype=dtype)
        tokenizer = None if tokenizer_spec else _tokenizer_of_checkpoint(load_config(found / "config.yaml"))
    if tokenizer_spec:
        tokenizer = load_tokenizer(tokenizer_spec, eod_token=eod_token)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"the tokenizer ({tokenizer.name}) makes {tokenizer.vocab_size} ids, more than the model's "
                         f"vocabulary ({model.config.vocab_size})")
    return model, tokenizer


def _batches(prompts: list[list[int]]) -> list[list[int]]:
    """Indices of the prompts grouped by token length (a batch shares one length: no padding)."""
    groups: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        groups.setdefault(len(ids), []).append(i)
    return list(groups.values())


def run(model, tokenizer, texts: list[str], *, max_new_tokens: int, temperature: float, top_k, top_p, seed: int,
        stop: list[int] | None) -> tuple[list[str], int, float]:
    """(completions, new tokens, seconds) of ``texts``."""
    from megakern.models.generate import generate

    device = model.wte.weight.device
    encoded = [tokenizer.encode(t) for t in texts]
    empty = [i for i, ids in enumerate(encoded) if not ids]
    if empty:
        raise ValueError(f"prompt {empty[0] + 1} encodes to no tokens")
    stops = [tokenizer.eod_id] if stop is None else stop
    bad = [s for s in stops if not 0 <= s < tokenizer.vocab_size]
    if bad:
        raise ValueError(f"stop id {bad[0]} is not a token of the tokenizer [0, {tokenizer.vocab_size})")
    generator = torch.Generator(device=device).manual_seed(seed)
    out: list[str | None] = [None] * len(texts)
    new_tokens, start = 0, time.perf_counter()
    for group in _batches(encoded):
        idx = torch.tensor([encoded[i] for i in group], dtype=torch.long, device=device)
        tokens = generate(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                          generator=generator, eos_id=stops)
        for row, i in enumerate(group):
            new = tokens[row, idx.shape[1]:].tolist()
            cut = next((j for j, t in enumerate(new) if t in stops), None)  # up to, without, the first stop id
            new = new if cut is None else new[:cut]
            new_tokens += len(new)
            out[i] = tokenizer.decode(new)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, new_tokens, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="megakern-generate", description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a checkpoint (step directory or checkpoint directory) or hf:DIR")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts-file", type=Path, help="prompts, one a line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop", type=int, action="append", default=None,
                        help="a stop id (repeatable; default: the tokenizer's end-of-document id)")
    parser.add_argument("--tokenizer", default=None, help="'byte', 'gpt2:DIR' or 'hf:FILE' (default: the source's)")
    parser.add_argument("--eod-token", default=None, help="the end-of-document token of an hf tokenizer")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="default: bfloat16 on a GPU, float32 on a CPU")
    args = parser.parse_args(argv)
    from megakern.checkpoint import CheckpointError

    texts = list(args.prompt)
    try:
        if args.prompts_file is not None:
            texts += [line for line in args.prompts_file.read_text().splitlines() if line.strip()]
        if not texts:
            raise ValueError("no prompt: give --prompt TEXT or --prompts-file FILE")
        device = torch.device(args.device)
        dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
        model, tokenizer = load_source(args.source, dtype=dtype, device=device, tokenizer_spec=args.tokenizer,
                                       eod_token=args.eod_token)
        completions, n, seconds = run(model, tokenizer, texts, max_new_tokens=args.max_new_tokens,
                                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                      seed=args.seed, stop=args.stop)
    except (ValueError, TypeError, OSError, MemoryError, CheckpointError) as exc:
        print(f"megakern-generate: {exc}", file=sys.stderr)
        return 2
    for text, completion in zip(texts, completions):
        print(f"=== {text}\n{text}{completion}")
    print(f"megakern-generate: {len(texts)} prompts, {n} new tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} "
          f"tok/s) on {model.wte.weight.device}, {model.wte.weight.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
