"""Training throughput: megakern's training step against the same model in Hugging Face transformers (GPT-350M's
shape against GPT2LMHeadModel by default; Llama and Mixtral presets against LlamaForCausalLM / MixtralForCausalLM).

Shape (GPT-2 medium): 24 layers, hidden 1024, 16 heads, sequence 1024, vocabulary 50304, micro-batch 16, bf16,
learned positions, tied embeddings, no dropout. One step = forward + loss + backward + clip the gradient norm to
1.0 + AdamW (fused) + zero the gradients, on one device.

Providers, each built fresh and freed before the next:
- ``megakern``: ``megakern.train.Trainer.train_step``, the training program's own step (bf16 weights with fp32
  master weights, megakern's kernels, fused linear cross-entropy; data from the training program's loader, pinned and
  copied without blocking). No host-device sync in the step: a non-finite step is skipped by fused AdamW on the
  device and its (loss, norm, skipped) figures go to pinned memory behind an event, read by the training loop one
  step later (here never); ``megakern-graph`` the same step captured in a CUDA graph after 2 eager steps and
  replayed (train.cuda_graph=true: one launch per step); ``megakern-compile`` the same under torch.compile
  (train.compile=true); ``megakern`` itself runs eager (train.cuda_graph=false), ``megakern-default`` with the
  training program's defaults (train.cuda_graph=auto: what a user gets without asking), ``megakern-single-pass``
  those defaults with the single-pass attention backward (model.deterministic_attention=false).
- ``hf-eager`` / ``hf-compile``: the same model in transformers (GPT2LMHeadModel here; for another preset the
  family megakern.models.hf exports it as, built from that export's config: LlamaForCausalLM for llama-1b /
  llama-8b, MixtralForCausalLM for moe-mixtral; skipped with the reason for a preset no family matches), its default
  attention (SDPA), fp32 weights under bf16 autocast (the mixed precision of HF's Trainer with bf16=True), fused
  AdamW, ``use_cache=False``, no host sync; eager or torch.compile'd. Skipped with the reason where transformers is
  not installed.
- ``plain-eager`` / ``plain-compile``: the GPT-2 family shapes (LayerNorm, GELU, learned positions, tied
  embeddings) as a plain PyTorch model laid out as nanoGPT's model.py (benchmarks/plain_gpt.py: SDPA attention, one
  qkv projection), trained as nanoGPT's loop trains it: fp32 weights under bf16 autocast, fused AdamW, clipping;
  eager or torch.compile'd. Other families are skipped with the reason.

Figures per provider: tok/s = micro_batch * seq / (median step time over the timed steps, warm-up steps
excluded; CUDA events recorded between consecutive steps, so the time of a step is the device's when the host keeps
ahead and the host's when it does not: the throughput a run gets), model TFLOP/s = tok/s * F, MFU = model FLOP/s / the
GPU's dense bf16 peak (megakern.train.log.PEAK_BF16_FLOPS), peak GiB = torch.cuda.max_memory_allocated over the provider's
run.
F = megakern's GPT.flops_per_token(seq) for every provider (same architecture): 6 N (N = matmul weights, the tied
output projection included) + 12 * n_layer * n_embd * seq (attention; the causal half not discounted), 2.42 GFLOP per
token for this shape. TFLOP/s rows also get a fraction of the same-run bf16 matmul roofline.

``--model gpt-char``: a small model, nanoGPT's shakespeare_char shape (6 layers, hidden 384, 6 heads, sequence 256,
micro-batch 64, no biases), with the byte vocabulary (257) of megakern's default corpus on every side: where a
step is a few milliseconds and host overhead decides (``--providers megakern,megakern-default,plain-compile``).
``--gpu-busy`` adds each provider's GPU busy time a step (5 more steps under torch.profiler, the union of the GPU
ops' intervals): how much of a host-bound step the GPU works, so that the same step is comparable across hosts.

Other models (``--model PRESET``, e.g. moe-mixtral): the megakern providers at the preset's shape (moe-mixtral: 16
layers, C 1024, 8 experts of F 3584, top-2; sequence 2048, micro-batch 8 on a GPU: 16k tokens a step), F = the
model's own flops_per_token (6 x active parameters: k of E experts, the routers, plus attention); with
``--dense-equivalent`` also the dense model of the same active parameters (no experts, MLP hidden (top_k + shared) x
moe_ffn_hidden = 7168 for moe-mixtral), through the same step, and the two MFUs compared. llama-1b runs T 2048 with
micro-batch 4 (Llama-3.2-1B's shape), llama-8b T 4096 with micro-batch 2; ``--n-layer N`` keeps N of a preset's
layers (Llama-3-8B's layer shape on one GPU: ``--model llama-8b --n-layer 4``).

Not measured: building a provider (model, data, first Triton / Inductor compilation) and its warm-up steps; both
are printed per provider ("setup", "warm-up") with the whole run's wall time, and an estimate of the run's length
is printed first (setup times from cold compile caches; a second run is faster).

    python -m benchmarks.bench_train                       # the 350M shape, all providers (~5 min on an H200)
    python -m benchmarks.bench_train --quick               # megakern, hf-eager, hf-compile; 3 + 8 steps (~2 min)
    python -m benchmarks.bench_train --quick --skip-compile    # megakern, hf-eager (~1 min)
    python -m benchmarks.bench_train --providers megakern,hf-compile --steps 30
    python -m benchmarks.bench_train --quick --providers megakern,megakern-graph,hf-compile
    python -m benchmarks.bench_train --model llama-1b --quick   # megakern against LlamaForCausalLM (+ compile)
    python -m benchmarks.bench_train --model llama-8b --n-layer 4 --quick
    python -m benchmarks.bench_train --model moe-mixtral --dense-equivalent --quick   # MoE MFU and its dense twin
    python -m benchmarks.bench_train --model moe-mixtral --micro-batch 4 --seq 4096 --providers megakern,megakern-graph
    python -m benchmarks.bench_train --model gpt-char --providers megakern,megakern-default,plain-compile
    python -m benchmarks.bench_train --model gpt-char --providers megakern-default,plain-compile --gpu-busy
    python -m benchmarks.bench_train --tiny --device cpu   # smoke test of the machinery (fp32, a tiny shape)
    python -m benchmarks.bench_train --device cpu --model moe-mixtral --dense-equivalent   # the same, tiny MoE
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__:
    from .common import (RESULTS_DIR, Results, Unavailable, file_rows, keep_rows_on_exit, load_providers,
                         measure_matmul_tflops, report_failure)
else:  # python benchmarks/bench_train.py
    from common import (RESULTS_DIR, Results, Unavailable, file_rows, keep_rows_on_exit, load_providers,
                        measure_matmul_tflops, report_failure)

BENCH = "train"


@dataclass(frozen=True)
class Shape:
    n_layer: int
    n_embd: int
    n_head: int
    seq: int
    vocab: int
    micro_batch: int
    preset: str = "gpt-350m"
    """The GPTConfig preset the other fields and ``overrides`` are applied to."""
    overrides: tuple = ()
    """More GPTConfig fields, (name, value) pairs (the MoE and dense-equivalent shapes)."""
    label: str = "gpt"

    @property
    def name(self) -> str:
        return f"{self.label} {self.n_layer}x{self.n_embd} h{self.n_head} T{self.seq} V{self.vocab} B{self.micro_batch}"


GPT_350M = Shape(n_layer=24, n_embd=1024, n_head=16, seq=1024, vocab=50304, micro_batch=16)
TINY = Shape(n_layer=2, n_embd=64, n_head=2, seq=64, vocab=257, micro_batch=2)
DEFAULT_MODEL = "gpt-350m"
# shapes by name beside the GPTConfig presets: a small character-level model (nanoGPT's shakespeare_char shape, the
# byte vocabulary of the default corpus)
BENCH_SHAPES = {"gpt-char": Shape(n_layer=6, n_embd=384, n_head=6, seq=256, vocab=257, micro_batch=64,
                                  preset="gpt-tiny", overrides=(("bias", False),), label="gpt-char")}
# (sequence, micro-batch) of a preset on one 80 GB GPU: 16k tokens per micro-batch
PRESET_BATCH = {"moe-mixtral": (2048, 8), "moe-deepseek": (2048, 8), "llama-1b": (2048, 4), "llama-8b": (4096, 2)}


def preset_shape(name: str, tiny: bool = False, seq: int | None = None, micro_batch: int | None = None) -> Shape:
    """A preset's shape (the tiny one keeps its structure: experts, top-k, router, dense blocks; sizes shrunk)."""
    from megakern.models.gpt import GPTConfig

    c = GPTConfig.preset(name)
    overrides = {}
    if tiny:
        overrides = dict(n_kv_head=1 if c.n_kv_head < c.n_head else 2, ffn_hidden=128)
        if c.n_experts:
            overrides["moe_ffn_hidden"] = 64
        dims = dict(n_layer=2, n_embd=64, n_head=2, vocab=257)
        default_seq, default_batch = 64, 2
    else:
        dims = dict(n_layer=c.n_layer, n_embd=c.n_embd, n_head=c.n_head, vocab=c.vocab_size)
        default_seq, default_batch = PRESET_BATCH.get(name, (min(c.max_seqlen, 2048), 8))
    label = name + (f" E{c.n_experts} k{c.moe_top_k} F{overrides.get('moe_ffn_hidden', c.moe_ffn_hidden)}"
                    if c.n_experts else "")
    return Shape(**dims, seq=seq or default_seq, micro_batch=micro_batch or default_batch, preset=name,
                 overrides=tuple(sorted(overrides.items())), label=label)


def dense_equivalent(shape: Shape) -> Shape:
    """The same model with dense MLPs of the hidden size a token uses in an MoE block: (top_k + shared experts) x
    moe_ffn_hidden, so the active parameters match up to the routers' (every block of the dense model takes it: exact
    for presets whose blocks are all MoE, as moe-mixtral)."""
    c = _gpt_config(shape, _config_cls())
    if not c.n_experts:
        raise ValueError(f"{shape.preset} has no experts: no dense equivalent to take")
    overrides = dict(shape.overrides)
    overrides.update(n_experts=0, ffn_hidden=(c.moe_top_k + c.moe_shared_experts) * c.moe_ffn_hidden)
    return Shape(**{**shape.__dict__, "overrides": tuple(sorted(overrides.items())),
                    "label": f"{shape.preset} dense F{overrides['ffn_hidden']}"})


def _config_cls():
    from megakern.models.gpt import GPTConfig

    return GPTConfig


def meta_model(shape: Shape):
    """megakern's GPT of ``shape`` on the meta device (shapes and counts, no memory)."""
    from megakern.models.gpt import GPT

    with torch.device("meta"):
        return GPT(_gpt_config(shape, _config_cls()))


def flops_per_token(shape: Shape) -> float:
    """megakern GPT's count for this shape (built on the meta device: no memory); MoE: active parameters."""
    return meta_model(shape).flops_per_token(shape.seq)


def _gpt_config(shape: Shape, cls):
    return cls.preset(shape.preset, n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                      max_seqlen=shape.seq, vocab_size=shape.vocab, dropout=0.0, **dict(shape.overrides))


class Step:
    """A provider's model and optimizer: ``step()`` runs one training step; ``close()`` frees it."""

    def step(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class MegakernStep(Step):
    """megakern's training step; ``graph`` None leaves train.cuda_graph at the training program's default; ``extra``:
    more config overrides ("section.key=value")."""

    def __init__(self, shape: Shape, device: torch.device, compile: bool, graph: bool | None = False,
                 extra: tuple[str, ...] = ()):
        from megakern.config import load_config
        from megakern.train import Trainer

        self._tmp = tempfile.TemporaryDirectory(prefix="bench_train-")
        precision = "bf16" if device.type == "cuda" else "fp32"
        overrides = [f"model.{k}={v}" for k, v in (("n_layer", shape.n_layer), ("n_embd", shape.n_embd),
                                                   ("n_head", shape.n_head), ("max_seqlen", shape.seq),
                                                   ("vocab_size", shape.vocab), ("dropout", 0.0))]
        overrides += [f"model.{k}={'null' if v is None else v}" for k, v in shape.overrides]
        overrides += [f"model.preset={shape.preset}", f"train.micro_batch_size={shape.micro_batch}",
                      f"train.device={device}",
                      f"train.precision={precision}", f"train.compile={str(compile).lower()}", "train.steps=1000",
                      "train.grad_clip=1.0", "optim.fused=auto", "data.max_epochs=1000", "data.num_workers=1",
                      "eval.every=0", "checkpoint.final=false", "train.sample_tokens=0", "log.tensorboard=false",
                      "log.progress=false", f"log.run_dir={self._tmp.name}"]
        if graph is not None:
            overrides += [f"train.cuda_graph={str(graph).lower()}", "train.cuda_graph_warmup=2"]
        overrides += list(extra)
        self.trainer = Trainer(load_config(None, overrides), stream=open(Path(self._tmp.name) / "console", "w"))
        self.batches = self.trainer.batches(self.trainer.data.train, 0, shape.micro_batch)

    def step(self) -> None:
        self.trainer.train_step(self.batches)
        self.trainer.step += 1

    def close(self) -> None:
        self.trainer.logger.close()
        del self.trainer, self.batches
        self._tmp.cleanup()


def hf_config(shape: Shape):
    """The transformers config of the same model as the megakern GPT of ``shape``: GPT-2 for the gpt presets, else the
    Hugging Face family megakern.models.hf exports the preset as (Llama, Mixtral, ...); Unavailable where there is
    none (e.g. moe-deepseek's sigmoid router)."""
    import transformers

    from megakern.models import hf

    config = _gpt_config(shape, _config_cls())
    try:
        family = hf.family_of(config)
    except ValueError as exc:
        raise Unavailable(f"no Hugging Face model of {shape.preset}: {exc}") from None
    fields = hf.config_to_hf(config, family, torch.float32)
    fields["use_cache"] = False
    for key in ("rope_scaling", "rope_parameters"):  # a scaled RoPE's context (original x factor), not the bench's T
        scaling = fields.get(key) or {}
        if "original_max_position_embeddings" in scaling:
            fields["max_position_embeddings"] = int(scaling["original_max_position_embeddings"] *
                                                    scaling.get("factor", 1.0))
    model_type = fields.pop("model_type")
    fields.pop("architectures", None)
    return transformers.AutoConfig.for_model(model_type, **fields)


class HFStep(Step):
    """A transformers causal LM's training step: fp32 weights under bf16 autocast on a GPU, fused AdamW, clipping;
    ``build`` makes the model (here the preset's Hugging Face family), ``prepare`` may change it before the optimizer
    is made (bench_hf_patch's patches)."""

    def __init__(self, shape, device: torch.device, compile: bool):
        torch.manual_seed(0)
        self.model = self.build(shape).to(device).train()
        self.prepare(shape)
        self.forward = torch.compile(self.model) if compile else self.model
        fused = {"fused": True} if device.type == "cuda" else {"foreach": True}
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                           **fused)
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda"
                         else contextlib.nullcontext())
        generator = torch.Generator(device=device).manual_seed(0)
        self.tokens = torch.randint(0, self.token_bound(shape), (shape.micro_batch, shape.seq), device=device,
                                    generator=generator)

    def build(self, shape):
        import transformers

        return transformers.AutoModelForCausalLM.from_config(hf_config(shape))

    def prepare(self, shape) -> None:
        pass

    def token_bound(self, shape) -> int:
        return min(shape.vocab, 50257)

    def step(self) -> None:
        with self.autocast:
            loss = self.forward(input_ids=self.tokens, labels=self.tokens, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        del self.model, self.forward, self.optimizer, self.tokens


class PlainStep(HFStep):
    """benchmarks/plain_gpt.py's model of a GPT-2 family shape, trained as HFStep trains its model."""

    def build(self, shape):
        if __package__:
            from .plain_gpt import PlainGPT
        else:  # python benchmarks/bench_train.py
            from plain_gpt import PlainGPT

        c = _gpt_config(shape, _config_cls())
        family = dict(norm="layernorm", position="learned", activation="gelu", tie_embeddings=True, n_experts=0,
                      ffn_hidden=4 * c.n_embd, n_kv_head=c.n_head, parallel_residual=False)
        differ = [f"{k}={getattr(c, k)!r}" for k, v in family.items() if getattr(c, k) != v]
        if differ:
            raise Unavailable(f"the plain GPT is GPT-2's family; {shape.preset} has {', '.join(differ)}")
        return PlainGPT(c.n_layer, c.n_embd, c.n_head, c.padded_vocab, shape.seq, c.bias)

    def step(self) -> None:
        with self.autocast:
            loss = self.forward(self.tokens, self.tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _megakern(compile: bool, graph: bool | None = False, extra: tuple[str, ...] = ()):
    def load(device):
        import megakern.train  # noqa: F401 (import errors name what is missing)

        if graph is True and device.type != "cuda":
            raise Unavailable("CUDA graphs need a CUDA device")
        return lambda shape: MegakernStep(shape, device, compile, graph, extra)

    return load


def need_transformers() -> None:
    """Unavailable (the reason) where transformers cannot build the HF providers' models."""
    try:
        import transformers
    except ImportError:
        raise Unavailable("transformers is not installed (pip install transformers)") from None
    if not hasattr(transformers, "AutoModelForCausalLM"):
        raise Unavailable(f"transformers {transformers.__version__} has no AutoModelForCausalLM")


def _hf(compile: bool):
    def load(device):
        need_transformers()
        return lambda shape: HFStep(shape, device, compile)

    return load


def _plain(compile: bool):
    def load(device):
        return lambda shape: PlainStep(shape, device, compile)

    return load


PROVIDERS = {"megakern": _megakern(False), "megakern-graph": _megakern(False, graph=True),
             "megakern-default": _megakern(False, graph=None), "megakern-compile": _megakern(True),
             "megakern-single-pass": _megakern(False, graph=None, extra=("model.deterministic_attention=false",)),
             "hf-eager": _hf(False), "hf-compile": _hf(True), "plain-eager": _plain(False),
             "plain-compile": _plain(True)}
# rough seconds to build a provider at the 350M shape on an H200 with cold compile caches (first Triton compiles of
# megakern's kernels, Inductor for the compiled ones), and of one step: for the printed estimate of a run's length
QUICK_PROVIDERS = ("megakern", "hf-eager", "hf-compile")  # megakern and the target's baseline (hf-compile)
SETUP_S = {"megakern": 45.0, "megakern-graph": 50.0, "megakern-default": 50.0, "megakern-single-pass": 50.0,
           "megakern-compile": 120.0,
           "hf-eager": 10.0, "hf-compile": 75.0, "plain-eager": 5.0, "plain-compile": 60.0}
STEP_S = 0.15


def estimate_seconds(names, warmup: int, steps: int, tiny: bool) -> float:
    """A rough wall-time estimate of a run over ``names`` (the tiny shape: a few seconds per provider)."""
    per_step = 0.02 if tiny else STEP_S
    return sum((2.0 if tiny else SETUP_S.get(n, 60.0)) + (warmup + steps) * per_step for n in names)


def time_steps(step: Step, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Milliseconds of each of ``steps`` timed steps after ``warmup`` untimed ones: CUDA events between consecutive
    steps (the device's time per step once the queue is steady), or perf_counter_ns on a CPU."""
    for _ in range(warmup):
        step.step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        events[0].record()
        for i in range(steps):
            step.step()
            events[i + 1].record()
        torch.cuda.synchronize(device)
        return [events[i].elapsed_time(events[i + 1]) for i in range(steps)]
    times = []
    for _ in range(steps):
        start = time.perf_counter_ns()
        step.step()
        times.append((time.perf_counter_ns() - start) / 1e6)
    return times


def gpu_busy_ms(step: Step, device: torch.device, steps: int) -> float | None:
    """The GPU's busy time a step, in ms: ``steps`` more steps under torch.profiler, between two synchronizations, and
    the length of the union of their GPU ops' intervals (megakern.train.timeline) over ``steps``. The timed steps'
    median less this is the time a step the GPU waits (for its host, mostly); None without CUDA."""
    if device.type != "cuda":
        return None
    from megakern.train import timeline

    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step.step()
        torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        found = timeline.analyze(timeline.load(path))  # no step ranges: the whole window as one
    if not found:
        return None
    window = found[0]
    return (window.compute_busy + window.comm_busy - window.overlapped) / 1e3 / steps


def run_provider(name: str, build, shape: Shape, device: torch.device, warmup: int, steps: int,
                 busy: bool = False) -> dict:
    """{'ms': median step, 'p20', 'p80', 'GiB': peak memory, 'setup_s', 'run_s': wall seconds to build it and to
    run its warm-up and timed steps, 'busy_ms': the GPU's busy time a step where ``busy`` (gpu_busy_ms, else None)}
    of one provider, its model freed afterwards."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    step = build(shape)
    built = time.perf_counter()
    try:
        times = time_steps(step, device, warmup, steps)
        busy_ms = gpu_busy_ms(step, device, min(steps, 5)) if busy else None
    finally:
        step.close()
        del step
    done = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    deciles = statistics.quantiles(times, n=10, method="inclusive") if len(times) > 1 else times * 9
    return {"ms": statistics.median(times), "p20": deciles[1], "p80": deciles[7], "GiB": peak,
            "setup_s": built - start, "run_s": done - built, "busy_ms": busy_ms}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=torch.device, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--providers", type=lambda s: {p.strip() for p in s.split(",") if p.strip()},
                        help=f"comma-separated, from {', '.join(PROVIDERS)} (default: all)")
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (smoke test; the default on a CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer steps (3 warm-up, 8 timed) and, unless --providers says otherwise, megakern, "
                             "hf-eager and hf-compile only: about 2 minutes")
    parser.add_argument("--skip-compile", action="store_true",
                        help="leave out the torch.compile providers (megakern-compile, hf-compile): their compilation "
                             "is most of a quick run's time")
    parser.add_argument("--graph", action="store_true",
                        help="accepted for scripts/device_check.sh; does not apply (whole training steps are timed)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 8; tiny 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 20; tiny 3)")
    parser.add_argument("--micro-batch", type=int, default=None, help="override the shape's micro-batch")
    parser.add_argument("--seq", type=int, default=None, help="override the shape's sequence length")
    parser.add_argument("--n-layer", type=int, default=None,
                        help="override the preset's layer count (a large model's layer shape on one GPU: "
                             "--model llama-8b --n-layer 4)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"a GPTConfig preset (default {DEFAULT_MODEL}: the GPT-2 medium shape against HF) or "
                             f"{', '.join(BENCH_SHAPES)} (a small model, nanoGPT's character shape); others "
                             "run the megakern providers at the preset's shape, e.g. moe-mixtral (sequence 2048, "
                             "micro-batch 8 on a GPU)")
    parser.add_argument("--dense-equivalent", action="store_true",
                        help="also the dense model with the same active parameters (MLP hidden = (top_k + shared) x "
                             "moe_ffn_hidden, no experts)")
    parser.add_argument("--gpu-busy", action="store_true",
                        help="also each provider's GPU busy time a step (5 more steps under torch.profiler): what the "
                             "step costs the GPU, apart from the time it waits for its host")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results root (default: {RESULTS_DIR} for a GPU run; a CPU run files no rows without it)")
    parser.add_argument("--no-save", action="store_true", help="print the table, write no CSV rows")
    return parser.parse_args(argv)


def main(argv=None) -> Results:
    args = parse_args(argv)
    device = args.device
    tiny = args.tiny or device.type != "cuda"
    if args.model == DEFAULT_MODEL or args.model in BENCH_SHAPES:
        shape = BENCH_SHAPES.get(args.model, GPT_350M)
        if tiny:
            shape = Shape(**{**TINY.__dict__, "overrides": shape.overrides})
        if args.micro_batch or args.seq:
            shape = Shape(**{**shape.__dict__, "micro_batch": args.micro_batch or shape.micro_batch,
                             "seq": args.seq or shape.seq})
    else:
        try:
            shape = preset_shape(args.model, tiny, args.seq, args.micro_batch)
        except ValueError as exc:
            raise SystemExit(f"--model: {exc}") from None
    if args.n_layer is not None:
        if args.n_layer < 1:
            raise SystemExit(f"--n-layer must be >= 1, got {args.n_layer}")
        shape = Shape(**{**shape.__dict__, "n_layer": args.n_layer})
    shapes = [shape]
    if args.dense_equivalent:
        try:
            shapes.append(dense_equivalent(shape))
        except ValueError as exc:
            raise SystemExit(f"--dense-equivalent: {exc}") from None
    warmup = args.warmup if args.warmup is not None else (1 if tiny else 3 if args.quick else 8)
    steps = args.steps if args.steps is not None else (3 if tiny else 8 if args.quick else 20)
    if args.graph:
        print("bench_train: --graph does not apply (whole training steps are timed, CUDA events between steps)")
    if steps < 1 or warmup < 0:
        raise SystemExit("--steps must be >= 1 and --warmup >= 0")
    from megakern.train.log import peak_flops

    peak, peak_note = peak_flops(device)
    dtype = "bf16" if device.type == "cuda" else "fp32"
    cases = []
    for sh in shapes:
        model = meta_model(sh)
        fpt = model.flops_per_token(sh.seq)
        case = f"{sh.name} {dtype}"
        cases.append((sh, case, fpt))
        params = (f"{model.num_params() / 1e6:.1f}M parameters, {model.num_params(active=True) / 1e6:.1f}M active"
                  if model.config.n_experts else f"{model.num_params() / 1e6:.1f}M parameters")
        print(f"{case}: {params}, {fpt / 1e9:.3f} GFLOP per token, {sh.micro_batch * sh.seq} tokens per step, "
              f"{warmup} warm-up + {steps} timed steps; "
              f"peak {'n/a (' + peak_note + ')' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}")
        del model

    wanted = set(args.providers or (QUICK_PROVIDERS if args.quick else PROVIDERS))
    if args.skip_compile:
        wanted = {n for n in wanted if not n.endswith("-compile")}
        if not wanted:
            raise SystemExit("--skip-compile leaves no provider to run")
    names = [n for n in PROVIDERS if n in wanted]
    print(f"estimated run time: about {len(shapes) * estimate_seconds(names, warmup, steps, tiny) / 60:.1f} min for "
          f"{', '.join(names)}{f' x {len(shapes)} models' if len(shapes) > 1 else ''} (cold compile caches)")
    began = time.perf_counter()
    results = Results(device)
    keep_rows_on_exit(results, BENCH, args.out, args.no_save)
    results.add_roofline("TFLOP/s", measure_matmul_tflops(device))
    providers = load_providers(PROVIDERS, device, wanted)
    mfus = {}
    for sh, case, fpt in cases:
        tokens = sh.micro_batch * sh.seq
        for name, build in providers.items():
            try:
                figures = run_provider(name, build, sh, device, warmup, steps, busy=args.gpu_busy)
            except Exception as exc:  # one provider failing (OOM, a compile error) does not stop the others
                report_failure(name, case, exc)
                continue
            tok_s = tokens / (figures["ms"] / 1e3)
            tflops = tok_s * fpt / 1e12
            results.add(case, "train step", name, "ms", figures["ms"])
            results.add(case, "train step", name, "tok/s", tok_s)
            results.add(case, "train step", name, "TFLOP/s", tflops)
            if peak is not None:
                results.add(case, "train step", name, "MFU", tok_s * fpt / peak)
                mfus[case, name] = tok_s * fpt / peak
            if device.type == "cuda":
                results.add(case, "train step", name, "GiB", figures["GiB"])
            mfu = f"{100 * tok_s * fpt / peak:.1f}%" if peak else "n/a"
            print(f"{name:<18} {figures['ms']:9.2f} ms [p20 {figures['p20']:.2f}, p80 {figures['p80']:.2f}] "
                  f"{tok_s:12.0f} tok/s {tflops:8.1f} TFLOP/s MFU {mfu} peak {figures['GiB']:.2f} GiB "
                  f"(setup {figures['setup_s']:.0f} s, steps {figures['run_s']:.1f} s)")
            if figures["busy_ms"] is not None:
                results.add(case, "train step", name, "GPU busy ms", figures["busy_ms"])
                print(f"{'':<18} GPU busy {figures['busy_ms']:.2f} ms a step ({figures['busy_ms'] / figures['ms']:.2f} "
                      "of it; the rest waits, mostly for the host)")
            elif args.gpu_busy:
                print(f"{'':<18} GPU busy: n/a (no CUDA device)")
    if len(cases) > 1:
        for name in providers:
            moe_mfu, dense_mfu = mfus.get((cases[0][1], name)), mfus.get((cases[1][1], name))
            if moe_mfu is not None and dense_mfu is not None:
                print(f"{name}: MoE MFU {100 * moe_mfu:.1f}% (active parameters) vs the dense equivalent's "
                      f"{100 * dense_mfu:.1f}% ({moe_mfu / dense_mfu:.2f}x)")
    print(f"run time: {time.perf_counter() - began:.0f} s")
    file_rows(results, BENCH, args.out, args.no_save)
    for metric in ("tok/s", "TFLOP/s", "MFU", "GiB"):
        if any(f[3] == metric for f in results.figures):
            print()
            print(results.markdown(metric))
    return results


if __name__ == "__main__":
    main()
