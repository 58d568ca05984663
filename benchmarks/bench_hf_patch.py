"""A Hugging Face model's training step with megakern's kernels patched in (``megakern.models.hf_patch.patch``)
against the same model unpatched, liger_kernel's patch and torch.compile, in the same run.

Models (transformers' own classes, random weights; ``--shapes``, comma-separated):
- ``llama-1b``: LlamaForCausalLM at Llama-3.2-1B's shape: 16 layers, hidden 2048, GQA 32:8, ffn 8192, vocabulary
  128256, tied embeddings, T 2048, micro-batch 4.
- ``qwen2-0.5b``: Qwen2ForCausalLM at Qwen2.5-0.5B's shape: 24 layers, hidden 896, GQA 14:2 (head dim 64), qkv
  biases, ffn 4864, vocabulary 151936, tied embeddings, T 2048, micro-batch 8.
- ``mistral-7b-4l``: MistralForCausalLM with Mistral-7B's layers, four of them: hidden 4096, GQA 32:8, ffn 14336,
  vocabulary 32768, T 4096, micro-batch 2.

One step = forward with labels (``use_cache=False``) + backward + clip the gradient norm to 1.0 + fused AdamW + zero
the gradients; fp32 weights under bf16 autocast (HF Trainer's bf16=True); the attention implementation SDPA. Timing
as bench_train (CUDA events between consecutive steps, median over the timed steps after the warm-up).

Providers: ``hf`` (unpatched), ``hf-megakern`` (patched: RMSNorm, rotary + attention, SwiGLU, fused linear
cross-entropy), ``hf-liger`` (liger_kernel's ``apply_liger_kernel_to_<family>`` on the instance, where installed),
``hf-compile`` (the unpatched model under torch.compile). tok/s, MFU (6 N + attention FLOPs per token against the
card's dense bf16 peak) and peak GiB per provider.

    python -m benchmarks.bench_hf_patch                         # every shape and provider (~6 min on an H200)
    python -m benchmarks.bench_hf_patch --shapes llama-1b --providers hf,hf-megakern
    python -m benchmarks.bench_hf_patch --tiny --device cpu     # smoke test of the machinery
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__:
    from .bench_train import HFStep, need_transformers, run_provider
    from .common import (Results, Unavailable, file_rows, keep_rows_on_exit, load_providers, measure_matmul_tflops,
                         report_failure)
else:  # python benchmarks/bench_hf_patch.py
    from bench_train import HFStep, need_transformers, run_provider
    from common import (Results, Unavailable, file_rows, keep_rows_on_exit, load_providers, measure_matmul_tflops,
                        report_failure)

BENCH = "hf_patch"


@dataclass(frozen=True)
class HFShape:
    name: str
    family: str
    n_layer: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    micro_batch: int
    tied: bool = False
    extra: tuple = ()

    def config(self):
        import transformers

        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "mistral": transformers.MistralConfig}[self.family]
        return cls(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.ffn,
                   num_hidden_layers=self.n_layer, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                   max_position_embeddings=self.seq, tie_word_embeddings=self.tied, attention_dropout=0.0,
                   use_cache=False, attn_implementation="sdpa", **dict(self.extra))

    def flops_per_token(self) -> float:
        """6 x the matmul weights (embedding lookup excluded, the output projection included) + 12 x layers x
        hidden x T for attention (causal half not discounted, as megakern's GPT.flops_per_token)."""
        hs = self.hidden // self.heads
        per_layer = self.hidden * hs * (self.heads * 2 + self.kv_heads * 2) + 3 * self.hidden * self.ffn
        n = self.n_layer * per_layer + self.vocab * self.hidden
        return 6 * n + 12 * self.n_layer * self.hidden * self.seq

    @property
    def case(self) -> str:
        return (f"{self.name} {self.n_layer}x{self.hidden} h{self.heads}:{self.kv_heads} F{self.ffn} V{self.vocab} "
                f"T{self.seq} B{self.micro_batch}")


SHAPES = {
    "llama-1b": HFShape("llama-1b", "llama", 16, 2048, 32, 8, 8192, 128256, 2048, 4, tied=True,
                        extra=(("rope_theta", 500000.0),)),
    "qwen2-0.5b": HFShape("qwen2-0.5b", "qwen2", 24, 896, 14, 2, 4864, 151936, 2048, 8, tied=True,
                          extra=(("rope_theta", 1e6),)),
    "mistral-7b-4l": HFShape("mistral-7b-4l", "mistral", 4, 4096, 32, 8, 14336, 32768, 4096, 2,
                             extra=(("sliding_window", None),)),
}
TINY = HFShape("tiny", "llama", 2, 64, 4, 2, 96, 257, 64, 2)


class HFPatchStep(HFStep):
    """bench_train's transformers step on the shape's own model, patched (``how``: 'megakern', 'liger'), compiled
    ('compile') or as it is ('plain')."""

    def __init__(self, shape: HFShape, device: torch.device, how: str):
        self.how, self._restore = how, None
        super().__init__(shape, device, compile=how == "compile")

    def build(self, shape: HFShape):
        import transformers

        transformers.logging.set_verbosity_error()
        return transformers.AutoModelForCausalLM.from_config(shape.config())

    def prepare(self, shape: HFShape) -> None:
        if self.how == "megakern":
            from megakern.models.hf_patch import patch

            patch(self.model)
        elif self.how == "liger":
            import liger_kernel.transformers as liger

            # liger's patch also replaces the modeling module's classes and functions and the causal LM class's
            # forward for the whole process: they are put back in close(), before the next provider builds a model
            self._restore = _snapshot(sys.modules[type(self.model).__module__])
            getattr(liger, f"apply_liger_kernel_to_{shape.family}")(model=self.model)

    def token_bound(self, shape: HFShape) -> int:
        return shape.vocab

    def close(self) -> None:
        super().close()
        if self._restore is not None:
            self._restore()


def _snapshot(module):
    """A function that puts back ``module``'s attributes and its classes' attributes as they are now."""
    names = dict(vars(module))
    classes = {c: dict(vars(c)) for c in names.values() if isinstance(c, type) and c.__module__ == module.__name__}

    def restore():
        for name in set(vars(module)) - set(names):
            delattr(module, name)
        for name, value in names.items():
            if vars(module).get(name) is not value:
                setattr(module, name, value)
        for cls, attrs in classes.items():
            for name in set(vars(cls)) - set(attrs):
                delattr(cls, name)
            for name, value in attrs.items():
                if vars(cls).get(name) is not value and name not in ("__dict__", "__weakref__"):
                    setattr(cls, name, value)

    return restore


def _provider(how: str):
    def load(device):
        need_transformers()
        if how == "liger":
            try:
                import liger_kernel.transformers  # noqa: F401
            except ImportError as exc:
                raise Unavailable(f"liger_kernel is not installed ({exc})") from None
        return lambda shape: HFPatchStep(shape, device, how)

    return load


PROVIDERS = {"hf": _provider("plain"), "hf-compile": _provider("compile"), "hf-megakern": _provider("megakern"),
             "hf-liger": _provider("liger")}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    parser.add_argument("--providers", type=lambda s: {p.strip() for p in s.split(",") if p.strip()},
                        help=f"comma-separated, from {', '.join(PROVIDERS)} (default: all)")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (smoke test; the default on a CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 15; tiny 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="results root (default: benchmarks/results for a GPU run; a CPU run files no rows "
                             "without it)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write no CSV rows")
    return parser.parse_args(argv)


def main(argv=None) -> Results:
    args = parse_args(argv)
    device = args.device
    tiny = args.tiny or device.type != "cuda"
    if tiny:
        shapes = [TINY]
    else:
        unknown = [s for s in args.shapes.split(",") if s not in SHAPES]
        if unknown:
            raise SystemExit(f"--shapes: unknown {unknown} (known: {', '.join(SHAPES)})")
        shapes = [SHAPES[s] for s in args.shapes.split(",")]
    warmup = args.warmup if args.warmup is not None else (1 if tiny else 5)
    steps = args.steps if args.steps is not None else (2 if tiny else 15)
    if steps < 1 or warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    from megakern.train.log import peak_flops

    peak, _ = peak_flops(device)
    results = Results(device)
    keep_rows_on_exit(results, BENCH, args.out, args.no_save)
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    providers = load_providers(PROVIDERS, device, args.providers or set(PROVIDERS))
    for shape in shapes:
        case = f"{shape.case} {'bf16-autocast' if device.type == 'cuda' else 'fp32'}"
        fpt = shape.flops_per_token()
        tokens = shape.micro_batch * shape.seq
        print(f"{case}: {fpt / 1e9:.2f} GFLOP per token, {tokens} tokens per step, {warmup} + {steps} steps")
        for name, build in providers.items():
            try:
                figures = run_provider(name, build, shape, device, warmup, steps)
            except Exception as exc:  # one provider failing (OOM, a missing patch function) does not stop the others
                report_failure(name, case, exc)
                continue
            tok_s = tokens / (figures["ms"] / 1e3)
            results.add(case, "train step", name, "ms", figures["ms"])
            results.add(case, "train step", name, "tok/s", tok_s)
            if peak is not None:
                results.add(case, "train step", name, "MFU", tok_s * fpt / peak)
            if device.type == "cuda":
                results.add(case, "train step", name, "GiB", figures["GiB"])
            mfu = f"{100 * tok_s * fpt / peak:.1f}%" if peak else "n/a"
            print(f"{name:<12} {figures['ms']:9.2f} ms [p20 {figures['p20']:.2f}, p80 {figures['p80']:.2f}] "
                  f"{tok_s:10.0f} tok/s MFU {mfu} peak {figures['GiB']:.2f} GiB (setup {figures['setup_s']:.0f} s)")
    file_rows(results, BENCH, args.out, args.no_save)
    for metric in ("tok/s", "MFU", "GiB"):
        if any(f[3] == metric for f in results.figures):
            print()
            print(results.markdown(metric))
    return results


if __name__ == "__main__":
    main()
