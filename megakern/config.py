"""Run configuration: dataclasses with a docstring per field, a YAML file, dotted overrides, strict types.

A run is one ``TrainConfig``: sections ``model`` (``megakern.models.gpt.GPTConfig``), ``data``, ``train`` (the
loop), ``optim``, ``schedule``, ``eval``, ``checkpoint``, ``log`` and ``parallel``. It is built in three layers,
each applied over the previous one:

    defaults (the dataclasses; the model is the 'gpt-tiny' preset)
    -> a YAML file (``configs/*.yaml``): ``{section: {field: value}}``
    -> command-line overrides: ``optim.lr=3e-4 model.n_layer=12 model.kernels.attention=triton``

``model.preset=NAME`` (in the file or on the command line) restarts the model section from that preset before the
file's and the command line's other model keys are applied. Every key must name a field: an unknown key, or a value
of the wrong type, is a ``ConfigError`` naming the dotted key (with the closest known keys). Command-line values
are parsed as YAML scalars/flow collections (``true``, ``null``, ``[0.9, 0.95]``, ``{attention: triton}``); a
field of type str takes the text as written. Floats also accept the spellings PyYAML reads as strings (``3e-4``).

The resolved config (every field, after all layers) is printed at start-up, written to the run directory
(``config.yaml``) and into every checkpoint; ``load_config(that_file)`` rebuilds the same config.
``describe_fields()`` lists every key with its type, default and docstring (``megakern-train --help-config``).
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import math
import textwrap
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

FORMAT_VERSION = 1  # of the resolved config dict; checkpoints record it


class ConfigError(ValueError):
    """A config key that does not exist, a value of the wrong type, or values that do not fit together."""


def _yaml():
    try:
        import yaml
    except ImportError:
        raise ConfigError("reading or writing YAML configs needs PyYAML: pip install pyyaml") from None
    return yaml


def _default_model():
    from megakern.models.gpt import GPTConfig

    return GPTConfig.preset(DEFAULT_PRESET)


@dataclass
class DataConfig:
    """Where training samples come from, and how they are split and batched."""

    paths: list[str] = field(default_factory=list)
    """Dataset prefixes (PREFIX.bin/.idx/.tokenizer.json from ``megakern.data.preprocess``); empty: the default
    corpus (the Python standard library's sources), tokenized by ``tokenizer`` into ``cache_dir`` on first use."""
    weights: list[float] | None = None
    """Blend weights, one per path (normalized); None: a single path, or equal weights."""
    tokenizer: str = "byte"
    """Tokenizer spec for the default corpus ('byte', 'char:FILE', 'gpt2:DIR', 'hf:FILE'), and for Megatron-LM
    datasets in ``paths`` (MMIDIDX .bin/.idx, which record none); megakern's own datasets carry theirs
    (PREFIX.tokenizer.json)."""
    cache_dir: str | None = None
    """Where the default corpus is tokenized; None: $MEGAKERN_CACHE/data or ~/.cache/megakern/data."""
    index_cache_dir: str | None = None
    """Where the sample index arrays are cached between runs; None: built in memory each run."""
    valid_paths: list[str] = field(default_factory=list)
    """Separate validation datasets (prefixes as in ``paths``, the same tokenizer): eval reads them, training reads
    every document of ``paths`` (nothing is held out); empty: ``valid_fraction`` of ``paths`` is held out."""
    valid_weights: list[float] | None = None
    """Blend weights of ``valid_paths``, one per path; None: equal weights."""
    valid_fraction: float = 0.05
    """Fraction of each dataset's documents held out for eval (chosen by a seeded permutation of documents), when
    ``valid_paths`` is empty."""
    split_seed: int = 1234
    """Seed of the train/valid document split (fixed across runs, so resumes see the same split)."""
    max_epochs: int = 1
    """Passes over the training documents the run may take; more is an error at start-up that gives the count."""
    packed_documents: bool = False
    """Attention stays within documents: cu_seqlens and position ids from the end-of-document tokens of each
    micro-batch (documents otherwise run across sample boundaries in one causal window)."""
    whole_documents: bool = False
    """Each sample holds whole documents (SFT examples), packed in a seeded order into samples of seq_length + 1
    tokens and padded with token 0, which is never trained, instead of windows of the document stream that cut
    documents at sample boundaries (Megatron's GPTDataset); every document must fit one sample (megakern.data.preprocess
    --format sft --max-length)."""
    loss_mask: bool = True
    """Train only the targets that a dataset's loss mask keeps (PREFIX.mask.bin of SFT data from
    ``megakern.data.preprocess --format sft``: the responses), the others being ignored by the loss; false trains every
    token of them too (axolotl's train_on_inputs). Datasets without a mask train every token either way."""
    num_workers: int = 1
    """DataLoader worker processes; capped to the usable CPUs with a warning."""
    loader_timeout_s: float = 600.0
    """Seconds to wait for a batch from the DataLoader's worker processes (num_workers >= 1); a worker stuck reading
    (e.g. a hung network filesystem) or gone stops the run with an error naming the dataset."""
    allow_fingerprint_change: bool = False
    """Resume even if the data's fingerprint differs from the checkpoint's (other files, seed, split or length:
    the sample order will not continue the checkpoint's)."""
    allow_extreme_weights: bool = False
    """Accept blend weights whose largest / smallest ratio exceeds 1e4 (almost certainly a typo otherwise, e.g.
    1e6 : 0.001); the mix is printed at start-up either way."""


@dataclass
class LoopConfig:
    """The training loop (section ``train``)."""

    steps: int = 300
    """Optimizer steps of the whole run (resumed runs continue up to it)."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on each data-parallel rank."""
    global_batch_size: int | None = None
    """Sequences per optimizer step over all ranks; a multiple of micro_batch_size x data-parallel size, the
    quotient being the gradient-accumulation steps. None: micro_batch_size x data-parallel size (no accumulation)."""
    seq_length: int | None = None
    """Tokens per training sequence; None: model.max_seqlen."""
    device: str = "auto"
    """'auto' (cuda when available, else cpu), 'cpu', 'cuda' or 'cuda:N'."""
    precision: Literal["auto", "fp32", "bf16-autocast", "bf16"] = "auto"
    """'fp32'; 'bf16-autocast': fp32 weights, bf16 compute under torch.autocast; 'bf16': bf16 weights and
    gradients with fp32 master weights and fp32 gradient accumulation in the optimizer; 'auto': 'bf16' on CUDA,
    'fp32' on CPU."""
    seed: int = 1234
    """Seed of the weights' initialization, dropout and sampling (the data order has data.split_seed and this)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping (the norm is still logged)."""
    max_nonfinite: int = 5
    """Steps with a non-finite loss or gradient norm are skipped and counted; this many in a row stop the run."""
    compile: bool = False
    """torch.compile the model (the megakern ops are custom ops or run between graphs)."""
    cuda_graph: bool | Literal["auto"] = "auto"
    """Capture the whole step (micro-batches' forward and backward, clipping, fused AdamW, skip) in a CUDA graph
    after cuda_graph_warmup eager steps, then replay it: one launch per step instead of thousands, for steps the host
    cannot launch as fast as the GPU runs them. CUDA, fused AdamW, fixed shapes (not with packed documents, FP8 or
    compile). Over several ranks: tensor (+ sequence, + tp_comm_overlap), context and DDP data parallelism, their
    NCCL collectives captured too (not pipeline stages, FSDP2, ZeRO-1 or dropout); a replay that does not finish
    within parallel.init_timeout_s stops the run with an error. 'auto' (the default): on wherever the run can be
    captured and has steps after the warm-up, else eager, with one log line saying which and why; true where the
    run cannot be captured is a ConfigError naming what it lacks."""
    cuda_graph_warmup: int = 3
    """Eager steps before the capture (kernel compilation, optimizer state, NCCL communicators, allocator warm-up);
    >= 1, and >= 11 with DDP (its reducer reads timings on the host in its first 10 iterations)."""
    fp8: Literal["none", "delayed", "current", "block"] = "none"
    """Convert the blocks' linear layers to megakern.fp8.Linear with this recipe (the output head stays)."""
    sample_tokens: int = 200
    """Tokens generated from the trained model at the end (0: no sample)."""
    sample_prompt: str = "def "
    """Prompt of the final sample."""
    sample_temperature: float = 0.8
    """Sampling temperature of the final sample."""
    sample_top_k: int | None = 40
    """Top-k of the final sample; None: the whole vocabulary."""


@dataclass
class OptimConfig:
    """AdamW with decoupled weight decay."""

    lr: float = 2e-3
    """Peak learning rate (reached at the end of warmup)."""
    weight_decay: float = 0.1
    """Decoupled weight decay of matrices; norms' weights and biases are never decayed."""
    decay_embeddings: bool = True
    """Decay the embedding tables (and a tied output head) too, as GPT-2/Megatron do; False as OLMo 2 does."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    fused: Literal["auto", "megakern", "fused", "foreach", "for-loop"] = "auto"
    """AdamW's implementation. 'megakern': one Triton pass that updates the fp32 masters from the bf16 gradients
    and writes the bf16 weights (train.precision=bf16 only; megakern.optim.MasterAdamW); 'fused' | 'foreach' |
    'for-loop': torch.optim.AdamW's. 'auto': megakern for bf16 weights on one CUDA device, else fused on CUDA and
    foreach elsewhere."""


@dataclass
class ScheduleConfig:
    """Learning rate: linear warmup from 0 to optim.lr, then a decay to min_lr."""

    warmup_steps: int = 30
    """Steps of linear warmup below the peak (step s < warmup_steps has lr = optim.lr * (s + 1) / (warmup_steps + 1));
    step warmup_steps runs at optim.lr."""
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Shape after warmup: cosine or linear to min_lr over the remaining steps; 'wsd' (warmup-stable-decay) stays
    at optim.lr and decays over the last wsd_decay_fraction of the steps; 'constant' stays at optim.lr."""
    min_lr: float = 2e-4
    """Learning rate at the last step (cosine, linear, wsd)."""
    wsd_decay_fraction: float = 0.2
    """Fraction of train.steps that WSD's decay takes."""
    wsd_decay_shape: Literal["linear", "cosine", "1-sqrt"] = "1-sqrt"
    """WSD's decay curve from optim.lr to min_lr."""
    on_resume: Literal["checkpoint", "config"] = "checkpoint"
    """Which schedule a resumed run follows: 'checkpoint' keeps the checkpoint's (its peak, warmup, decay and
    length: a larger train.steps runs the extra steps at the schedule's final lr, and a changed schedule key is only
    noted); 'config' applies this run's keys and train.steps from the resumed step on (how a WSD run is extended:
    its decay moves to the new end). The log states what the schedule does from the resumed step either way."""


@dataclass
class EvalConfig:
    """Held-out loss during training."""

    every: int = 100
    """Steps between evals (and one at the end); 0: never."""
    batches: int = 8
    """Micro-batches per eval (the same held-out samples each time)."""
    micro_batch_size: int | None = None
    """Sequences per eval micro-batch; None: train.micro_batch_size."""
    seq_length: int | None = None
    """Tokens per eval sequence; None: the training seq_length. Must not exceed model.max_seqlen."""


@dataclass
class CheckpointConfig:
    """Checkpoints (torch.distributed.checkpoint), written atomically and verified."""

    dir: str | None = None
    """Checkpoint directory; None: <run dir>/checkpoints."""
    every: int = 0
    """Steps between checkpoints; 0: only the final one."""
    final: bool = True
    """Save a checkpoint at the end of the run."""
    keep: int = 3
    """Complete checkpoints kept (the oldest removed after a successful save); 0 keeps all."""
    resume: str | None = None
    """A checkpoint to resume from: a step directory, a checkpoint directory (its 'latest'), or 'auto' (this run's
    checkpoint directory if it holds one, else start fresh)."""
    verify: bool = True
    """Check every file's sha256 against the manifest when loading."""
    async_save: bool = False
    """Save in the background: the tensors are copied into CPU memory (host RAM for one more copy of this rank's
    shards) and the run goes on while torch.distributed.checkpoint's async_save writes them and the same commit
    protocol completes; the next save, the end of the run, or a stop waits for it, and its failure stops the run
    there."""


@dataclass
class LogConfig:
    """Console, log file, TensorBoard and profiles."""

    run_dir: str | None = None
    """Where the run writes config.yaml, train.log, TensorBoard events and checkpoints; None: runs/<date-time>."""
    every: int = 10
    """Steps between log lines (loss, lr, tok/s, MFU, memory); the progress bar updates every step."""
    progress: bool = True
    """Show a progress bar (tqdm) on the console when it is a terminal (piped output gets the log lines)."""
    tensorboard: bool = True
    """Write TensorBoard scalars to the run directory (needs the tensorboard package; checked at start-up)."""
    wandb: bool = False
    """Also log to Weights & Biases (the writer rank; needs the wandb package and, online, credentials: checked at
    start-up). Its files go to <run dir>/wandb."""
    wandb_project: str = "megakern"
    """Weights & Biases project."""
    wandb_entity: str | None = None
    """Weights & Biases entity (user or team); None: the account's default."""
    wandb_name: str | None = None
    """Name of the Weights & Biases run; None: the run directory's name."""
    wandb_mode: Literal["online", "offline"] = "online"
    """'online' streams to the server (needs WANDB_API_KEY or a netrc entry from `wandb login`); 'offline' writes
    the run locally for a later `wandb sync`."""
    profile_dir: str = "profiles"
    """Where --profile writes its trace and kernel table (a new subdirectory per run)."""
    profile_wait: int = 1
    """--profile: steps run before the profiler records (skipping the first step's one-time costs)."""
    profile_warmup: int = 1
    """--profile: steps recorded but discarded (the profiler's own warm-up)."""
    profile_active: int = 3
    """--profile: steps profiled."""


@dataclass
class ParallelConfig:
    """Parallel layout and its choices (megakern.parallel: the sizes build the mesh, the rest is what
    ``parallelize`` applies); all ones and dp=-1 is plain data parallelism over the world."""

    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size."""
    dp: int = -1
    """Data-parallel size; -1: the world size divided by tp x pp x cp."""
    cp: int = 1
    """Context-parallel size (ring attention)."""
    ep: int = 1
    """Expert-parallel size: the experts of MoE layers split over ep ranks carved out of the dp x cp ranks (ep must
    divide dp x cp and model.n_experts); tokens travel to their experts by all-to-all. Under dp_shard='fsdp' the
    experts are sharded over the dp x cp / ep ranks that hold the same ones; not with zero1."""
    sequence_parallel: bool = True
    """With tp > 1: shard the norms' and dropout's activations along the sequence over the tp ranks (Megatron's
    sequence parallelism); false keeps them whole on every tp rank."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    """Pipeline schedule."""
    pp_stages_per_rank: int | None = None
    """Pipeline stages (model chunks) per pipeline rank; None: 2 for interleaved-1f1b, else 1."""
    dp_shard: Literal["ddp", "fsdp"] = "fsdp"
    """Data parallelism by replication (DDP) or sharding (FSDP2)."""
    zero1: bool = False
    """With dp_shard='ddp': shard the optimizer state over the data-parallel ranks (ZeroRedundancyOptimizer); FSDP2
    already shards it."""
    tp_comm_overlap: bool | Literal["auto"] = "auto"
    """With tp > 1 and sequence parallelism: the sequence-parallel collectives overlapped with the GEMMs beside them,
    forward and backward (megakern.parallel.overlap): the row-parallel layers' GEMM + reduce-scatter, and with a
    'symmetric' implementation the column-parallel layers' all-gather + GEMM too. 'auto': on, through symmetric
    memory, where it measured faster: a CUDA-graph step (train.cuda_graph) of tensor parallelism alone over NCCL
    ranks of one host; off elsewhere (eager, the fused ops' host work outweighs what they hide; beside other
    parallel dims, not yet measured). The log says which and why."""
    tp_overlap_impl: Literal["auto", "ring", "symmetric", "symmetric-kernel"] = "auto"
    """With tp_comm_overlap: 'ring', a ring of NCCL transfers behind chunked matmuls (any backend); 'symmetric',
    peer-to-peer copies through symmetric memory under the GEMMs, signalled between the ranks, for the row and the
    column layers (NCCL ranks of one host); 'symmetric-kernel', the same with every GEMM + reduce-scatter done by a
    Triton GEMM that stores its output tiles into the owners' buffers (megakern.gemm_scatter; slower than
    'symmetric' where measured); 'auto': 'symmetric' in a CUDA-graph step where symmetric memory can be used, else
    'ring'."""
    tp_overlap_pieces: int = 2
    """With tp_overlap_impl='symmetric': runs of rows (1 to 4) each block of a GEMM + reduce-scatter is computed,
    signalled and pulled in; a peer starts pulling after the first run's GEMM, and the own block's GEMMs add each
    pulled run as it lands (docs/parallelism.md). 1: whole blocks."""
    tp_overlap_signals: Literal["stream", "kernel"] = "stream"
    """With tp_overlap_impl='symmetric': how a rank tells a peer that data is in place: 'stream', a stream memory
    operation (no SM taken: it goes out while a GEMM fills every SM), or 'kernel', torch's put_signal kernel, which
    starts only once an SM is free (docs/parallelism.md)."""
    tp_overlap_gather: Literal["pull", "push"] = "push"
    """With tp_overlap_impl='symmetric*': how a column layer's all-gather moves the input shards it keeps for dW:
    'pull', each rank stages its shard in its symmetric buffer and signals, each peer pulls it by copy engine; 'push',
    each rank pushes its shard straight into every peer's buffer by copy engine, the peer waits for it right before
    the GEMM that reads it and copies it out to keep it (docs/parallelism.md)."""
    fsdp_param_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """With dp_shard='fsdp': the dtype the blocks' parameters are all-gathered and computed in (their fp32 shards
    are what the optimizer updates; gradients are reduced in fp32); auto: bfloat16 under bf16-autocast, else
    float32."""
    microbatches: int | None = None
    """Micro-batches a step (pipeline micro-batches, or gradient accumulation without pp); None: the
    gradient-accumulation steps (the trainer), or pp under pipeline parallelism (megakern.parallel.parallelize)."""
    init_timeout_s: float = 600.0
    """Timeout of process-group initialization and collectives (an error names the missing ranks)."""
    step_timeout_s: float | None = 300.0
    """The step watchdog's timeout: a rank inside one step longer than this ends the run, every rank with exit code
    124, after naming the ranks that did not arrive (alive and stuck in step N, or gone). Capped at 90% of
    init_timeout_s (the collectives' own timeout, which names no rank, must not fire first); the first steps
    (compilation, CUDA-graph capture, NCCL communicators), evals and checkpoint saves get init_timeout_s. None: no
    watchdog."""


DEFAULT_PRESET = "gpt-tiny"


@dataclass
class TrainConfig:
    """A whole run: one field per section (see the module doc)."""

    model: Any = field(default_factory=_default_model)
    """The model (megakern.models.gpt.GPTConfig); 'model.preset' picks a named preset."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and held-out data."""
    train: LoopConfig = field(default_factory=LoopConfig)
    """The training loop."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The optimizer."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The learning-rate schedule."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Held-out evaluation."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging and profiling."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""

    def validate(self) -> TrainConfig:
        """ConfigError naming the keys when values that do not depend on the machine do not fit together."""
        problems = []
        if hasattr(self.model, "validate"):
            try:
                self.model.validate()
            except ValueError as exc:
                problems.append(f"model: {exc}")
        t, o, s, e, d = self.train, self.optim, self.schedule, self.eval, self.data

        def need(ok: bool, message: str):
            if not ok:
                problems.append(message)

        need(t.steps >= 1, f"train.steps must be >= 1, got {t.steps}")
        need(t.micro_batch_size >= 1, f"train.micro_batch_size must be >= 1, got {t.micro_batch_size}")
        need(t.cuda_graph_warmup >= 1, f"train.cuda_graph_warmup must be >= 1, got {t.cuda_graph_warmup}")
        need(t.cuda_graph in (True, False, "auto"), f"train.cuda_graph must be true, false or auto, got "
                                                     f"{t.cuda_graph!r}")
        need(t.global_batch_size is None or t.global_batch_size >= 1,
             f"train.global_batch_size must be >= 1 or null, got {t.global_batch_size}")
        need(t.global_batch_size is None or t.global_batch_size % t.micro_batch_size == 0,
             f"train.global_batch_size {t.global_batch_size} is not a multiple of train.micro_batch_size "
             f"{t.micro_batch_size}")
        max_seqlen = getattr(self.model, "max_seqlen", None)
        seq = t.seq_length if t.seq_length is not None else max_seqlen
        need(t.seq_length is None or t.seq_length >= 1, f"train.seq_length must be >= 1, got {t.seq_length}")
        if max_seqlen is not None and seq is not None:
            need(seq <= max_seqlen, f"train.seq_length {seq} exceeds model.max_seqlen {max_seqlen}")
            eval_seq = e.seq_length if e.seq_length is not None else seq
            need(eval_seq <= max_seqlen, f"eval.seq_length {eval_seq} exceeds model.max_seqlen {max_seqlen} "
                                         "(positions beyond it were never trained and are not allocated)")
        need(e.seq_length is None or e.seq_length >= 1, f"eval.seq_length must be >= 1, got {e.seq_length}")
        need(t.device == "auto" or t.device == "cpu" or t.device.split(":")[0] == "cuda",
             f"train.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {t.device!r}")
        need(t.grad_clip >= 0 and math.isfinite(t.grad_clip), f"train.grad_clip must be >= 0, got {t.grad_clip}")
        need(t.max_nonfinite >= 1, f"train.max_nonfinite must be >= 1, got {t.max_nonfinite}")
        need(t.sample_tokens >= 0, f"train.sample_tokens must be >= 0, got {t.sample_tokens}")
        need(t.sample_temperature > 0, f"train.sample_temperature must be > 0, got {t.sample_temperature}")
        need(t.sample_top_k is None or t.sample_top_k >= 1, f"train.sample_top_k must be >= 1, got {t.sample_top_k}")
        need(o.lr > 0 and math.isfinite(o.lr), f"optim.lr must be a finite number > 0, got {o.lr}")
        need(o.weight_decay >= 0, f"optim.weight_decay must be >= 0, got {o.weight_decay}")
        need(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, f"optim.beta1/beta2 must be in [0, 1), got {o.beta1}, {o.beta2}")
        need(o.eps > 0, f"optim.eps must be > 0, got {o.eps}")
        need(s.warmup_steps >= 0, f"schedule.warmup_steps must be >= 0, got {s.warmup_steps}")
        need(0 <= s.min_lr <= o.lr, f"schedule.min_lr {s.min_lr} must be in [0, optim.lr={o.lr}]")
        need(0 < s.wsd_decay_fraction <= 1, f"schedule.wsd_decay_fraction must be in (0, 1], got "
                                            f"{s.wsd_decay_fraction}")
        need(e.every >= 0 and e.batches >= 1, f"eval.every must be >= 0 and eval.batches >= 1, got {e.every}, "
                                              f"{e.batches}")
        need(e.micro_batch_size is None or e.micro_batch_size >= 1,
             f"eval.micro_batch_size must be >= 1 or null, got {e.micro_batch_size}")
        need(0 < d.valid_fraction < 1, f"data.valid_fraction must be in (0, 1), got {d.valid_fraction}")
        need(d.max_epochs >= 1, f"data.max_epochs must be >= 1, got {d.max_epochs}")
        need(d.num_workers >= 0, f"data.num_workers must be >= 0, got {d.num_workers}")
        need(0 < d.loader_timeout_s < math.inf, f"data.loader_timeout_s must be a finite number > 0, got "
                                                f"{d.loader_timeout_s}")
        need(d.weights is None or len(d.weights) == max(len(d.paths), 1),
             f"data.weights has {len(d.weights or [])} entries for {len(d.paths)} data.paths")
        need(not d.valid_paths or d.paths, "data.valid_paths needs data.paths (the default corpus holds out its own)")
        need(d.valid_weights is None or len(d.valid_weights) == len(d.valid_paths),
             f"data.valid_weights has {len(d.valid_weights or [])} entries for {len(d.valid_paths)} data.valid_paths")
        need(not set(map(str, d.valid_paths)) & set(map(str, d.paths)),
             f"data.valid_paths {sorted(set(map(str, d.valid_paths)) & set(map(str, d.paths)))} also in data.paths: "
             "the model would be evaluated on its training documents")
        c = self.checkpoint
        need(c.every >= 0 and c.keep >= 0, f"checkpoint.every and checkpoint.keep must be >= 0, got {c.every}, "
                                           f"{c.keep}")
        lg = self.log
        need(lg.every >= 1, f"log.every must be >= 1, got {lg.every}")
        need(not lg.wandb or bool(lg.wandb_project.strip()), "log.wandb=true needs a log.wandb_project")
        need(lg.profile_wait >= 0 and lg.profile_warmup >= 0 and lg.profile_active >= 1,
             "log.profile_wait/warmup must be >= 0 and log.profile_active >= 1")
        p = self.parallel
        for name in ("tp", "pp", "cp", "ep"):
            need(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
        experts = getattr(self.model, "n_experts", 0) or 0
        if p.ep > 1:
            need(experts > 0, f"parallel.ep={p.ep} splits the experts of MoE layers, but the model has none "
                              "(model.n_experts=0)")
            need(experts <= 0 or experts % p.ep == 0,
                 f"parallel.ep={p.ep} does not divide model.n_experts={experts} (each ep rank holds n_experts / ep "
                 "experts)")
        need(p.dp == -1 or p.dp >= 1, f"parallel.dp must be >= 1 or -1, got {p.dp}")
        need(p.init_timeout_s > 0, f"parallel.init_timeout_s must be > 0, got {p.init_timeout_s}")
        need(p.step_timeout_s is None or p.step_timeout_s > 0,
             f"parallel.step_timeout_s must be > 0 (or null: no step watchdog), got {p.step_timeout_s}")
        if problems:
            raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
        return self


# ---------------------------------------------------------------------------------------------------------------
# Types: every field's annotation is resolved on its own class, and each value is checked against it.

def _is_section(value) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _hints(cls) -> dict[str, Any]:
    """Field name -> resolved annotation; sections of TrainConfig are typed by their (default) instance."""
    module = inspect.getmodule(cls)
    namespace = dict(vars(module)) if module else {}
    hints = {}
    for f in dataclasses.fields(cls):
        tp = f.type
        if isinstance(tp, str):
            try:
                tp = eval(tp, namespace)  # noqa: S307 (annotations of our own or the model's dataclasses)
            except Exception:
                tp = Any
        hints[f.name] = tp
    return hints


def _type_name(tp) -> str:
    if tp is Any:
        return "any"
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _union_args(tp):
    origin = typing.get_origin(tp)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        return typing.get_args(tp)
    return None


def _coerce(value, tp, key: str):
    """``value`` checked against annotation ``tp`` (ints accepted for floats; PyYAML's '3e-4' strings too)."""
    def wrong(expected: str | None = None):
        return ConfigError(f"config key '{key}': expected {expected or _type_name(tp)}, got {value!r} "
                           f"({type(value).__name__})")

    if tp is Any:
        return value
    if (members := _union_args(tp)) is not None:
        if value is None and type(None) in members:
            return None
        errors = []
        for member in members:
            if member is type(None):
                continue
            try:
                return _coerce(value, member, key)
            except ConfigError as exc:
                errors.append(exc)
        if len(errors) == 1:  # X | None: X's own, more specific message
            raise errors[0]
        raise wrong()
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        if value in args and not isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected one of {', '.join(repr(a) for a in args)}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise wrong("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise wrong("an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise wrong("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong("a string")
    if tp is type(None):
        if value is None:
            return None
        raise wrong("null")
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise wrong("a list")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise wrong(f"a list of {len(args)} items")
            return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [_coerce(v, item, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise wrong("a mapping")
        kt, vt = args if args else (Any, Any)
        return {_coerce(k, kt, f"{key} key"): _coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise wrong()
    return value


def _accepts_str(tp) -> bool:
    if tp is str or tp is Any:
        return True
    if (members := _union_args(tp)) is not None:
        return any(_accepts_str(m) for m in members)
    return typing.get_origin(tp) is Literal and any(isinstance(a, str) for a in typing.get_args(tp))


def _parse_cli_value(text: str, tp, key: str):
    """A command-line value: as written for str fields (unless it is 'null' for an optional one), else YAML."""
    if _accepts_str(tp):
        members = _union_args(tp) or (tp,)
        if text in ("null", "None", "~") and type(None) in members:
            return None
        literal = [a for m in members if typing.get_origin(m) is Literal for a in typing.get_args(m)]
        if str in members or Any in members or text in literal:
            return text
    try:
        return _yaml().safe_load(text) if text.strip() else text
    except Exception as exc:
        raise ConfigError(f"config key '{key}': cannot parse {text!r} ({exc})") from None


# ---------------------------------------------------------------------------------------------------------------
# Building a config from layers of dicts.

def all_keys(config) -> list[str]:
    """Every dotted key of ``config`` (an instance), sections expanded."""
    keys = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if _is_section(value):
            keys += [f"{f.name}.{k}" for k in all_keys(value)]
        else:
            keys.append(f.name)
    return keys


def _unknown(key: str, known: list[str]) -> ConfigError:
    leaf = key.rsplit(".", 1)[-1]
    close = [k for k in known if k.rsplit(".", 1)[-1] == leaf] or difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    hint = f" (did you mean {', '.join(repr(k) for k in close[:3])}?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _apply(section, values: dict, prefix: str, root_keys: list[str]):
    """A copy of dataclass instance ``section`` with ``values`` ({field: value or nested dict}) applied."""
    if not isinstance(values, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.')}': expected a mapping of fields, got {values!r}")
    hints = _hints(type(section))
    changes = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if not isinstance(name, str) or name not in hints:
            raise _unknown(key, root_keys)
        current = getattr(section, name)
        if _is_section(current):
            changes[name] = _apply(current, value, key + ".", root_keys)
        else:
            changes[name] = _coerce(value, hints[name], key)
    return dataclasses.replace(section, **changes) if changes else section


def _nest(dotted: dict[str, Any]) -> dict:
    """{'a.b.c': v} -> {'a': {'b': {'c': v}}}."""
    nested: dict = {}
    for key, value in dotted.items():
        node = nested
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key '{key}' is given twice (as a value and as a section)")
        node[leaf] = value
    return nested


def parse_overrides(overrides, config) -> dict:
    """Command-line ``key=value`` strings -> a nested dict, each value parsed for its field's type."""
    known = all_keys(config)
    dotted: dict[str, Any] = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. optim.lr=3e-4)")
        tp, into_dict = _field_type(config, key)
        if tp is None:
            raise _unknown(key, known)
        value = _parse_cli_value(text, tp, key)
        if into_dict is not None:  # model.kernels.attention=triton: one entry of a dict field
            whole = dotted.get(into_dict)
            if whole is None:
                whole = dict(_get(config, into_dict) or {})
            whole[key[len(into_dict) + 1:]] = value
            dotted[into_dict] = whole
        else:
            dotted[key] = value
    return _nest(dotted)


def _get(config, key: str):
    for part in key.split("."):
        config = getattr(config, part)
    return config


def _field_type(config, key: str):
    """(annotation, None) of a field's dotted key; (value annotation, the dict field's key) for an entry of a dict
    field; (None, None) if there is no such key."""
    parts = key.split(".")
    node = config
    for i, part in enumerate(parts):
        if part == "preset" and i == 1 and parts[0] == "model":
            return (str, None) if i == len(parts) - 1 else (None, None)
        if not dataclasses.is_dataclass(node) or part not in {f.name for f in dataclasses.fields(node)}:
            return None, None
        tp = _hints(type(node))[part]
        value = getattr(node, part)
        if i == len(parts) - 1:
            return (Any if _is_section(value) else tp), None
        if _is_section(value):
            node = value
            continue
        base = _union_args(tp) or (tp,)
        dicts = [m for m in base if m is dict or typing.get_origin(m) is dict]
        if dicts and i == len(parts) - 2:
            args = typing.get_args(dicts[0])
            return (args[1] if args else Any), ".".join(parts[:i + 1])
        return None, None
    return None, None


def _build_model(base_model, layers: list[dict], known: list[str], use_preset: bool):
    """The model section: ``preset(name, **keys)`` with the preset named last (default DEFAULT_PRESET) and the model
    keys of every layer in order, so that fields a preset derives (ffn_hidden from n_embd, n_kv_head from n_head)
    follow the overrides unless given themselves. With ``use_preset=False`` and no preset named, the keys replace
    fields of ``base_model``."""
    cls, hints = type(base_model), _hints(type(base_model))
    name, keys = None, {}
    for layer in layers:
        if not isinstance(layer, dict):
            raise ConfigError(f"config key 'model': expected a mapping of fields, got {layer!r}")
        for key, value in layer.items():
            if key == "preset":
                if not isinstance(value, str):
                    raise ConfigError(f"config key 'model.preset': expected a preset name, got {value!r}")
                name = value
            elif key not in hints:
                raise _unknown(f"model.{key}", known)
            else:
                keys[key] = _coerce(value, hints[key], f"model.{key}")
    try:
        if keys.get("init_from") is not None:  # the architecture of a Hugging Face checkpoint: its config.json
            if name is not None:
                raise ConfigError(f"model.preset {name!r} and model.init_from {keys['init_from']!r} both set: the "
                                  "architecture of a Hugging Face checkpoint is its config.json (drop the preset)")
            source = keys["init_from"]
            if not isinstance(source, str) or not source.startswith("hf:"):
                raise ConfigError(f"config key 'model.init_from': expected 'hf:DIR', got {source!r}")
            from megakern.models.hf import read_config

            return dataclasses.replace(read_config(source[3:]), **keys).validate()
        if name is None and not use_preset:
            return dataclasses.replace(base_model, **keys)
        return cls.preset(name or DEFAULT_PRESET, **keys)
    except (TypeError, ValueError, OSError) as exc:
        raise ConfigError(f"model: {exc}") from None


def read_yaml(path) -> dict:
    """The mapping in a YAML file; ConfigError naming the file if it is missing, unreadable or not a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror or exc}") from None
    try:
        data = _yaml().safe_load(text)
    except Exception as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a mapping of sections, got {type(data).__name__}")
    return data


def load_config(path=None, overrides=(), *, base: TrainConfig | None = None) -> TrainConfig:
    """The run's config: ``base`` (default ``TrainConfig()``), then the YAML file at ``path`` (or None), then the
    ``key=value`` overrides, then ``validate()``. ConfigError names any bad key or value.

    The model section is rebuilt from its preset (``model.preset``, default 'gpt-tiny') with every model key of the
    file and the command line, unless ``base`` is given and no preset is named (then the keys replace base's)."""
    start = TrainConfig() if base is None else base
    file_layer = read_yaml(path) if path is not None else {}
    if "format_version" in file_layer:  # a resolved config written by a run
        version = file_layer.pop("format_version")
        if version != FORMAT_VERSION:
            raise ConfigError(f"config file {path}: format_version {version}; this megakern reads {FORMAT_VERSION}")
    cli_layer = parse_overrides(list(overrides), start)
    known = all_keys(start)
    layers = [file_layer, cli_layer]
    model = _build_model(start.model, [layer.pop("model") for layer in layers if "model" in layer], known,
                         use_preset=base is None)
    config = dataclasses.replace(start, model=model)
    for layer in layers:
        config = _apply(config, layer, "", known)
    return config.validate()


def to_dict(config) -> dict:
    """The config as plain dicts/lists/scalars (tuples as lists), with its format version."""
    def plain(value):
        if _is_section(value):
            return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return {"format_version": FORMAT_VERSION, **plain(config)}


def to_yaml(config) -> str:
    """The resolved config as YAML (``load_config`` reads it back to an equal config)."""
    return _yaml().safe_dump(to_dict(config), sort_keys=False, default_flow_style=False, width=120)


def from_dict(data: dict, *, base: TrainConfig | None = None) -> TrainConfig:
    """The config that ``to_dict`` produced (checked like a file)."""
    data = dict(data)
    version = data.pop("format_version", FORMAT_VERSION)
    if version != FORMAT_VERSION:
        raise ConfigError(f"config format_version {version}; this megakern reads {FORMAT_VERSION}")
    base = TrainConfig() if base is None else base
    return _apply(base, data, "", all_keys(base)).validate()


# ---------------------------------------------------------------------------------------------------------------
# Field docstrings (the string literal after each field), for --help-config.

def field_docs(cls) -> dict[str, str]:
    """{field: docstring} of a dataclass whose fields are each followed by a string literal."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def describe_fields(config=None) -> str:
    """Every key: type, default (the value in ``config``) and docstring, section by section."""
    config = TrainConfig() if config is None else config
    lines = []

    def walk(section, prefix):
        docs, hints = field_docs(type(section)), _hints(type(section))
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if _is_section(value):
                lines.append(f"\n[{prefix}{f.name}] {docs.get(f.name, '')}")
                walk(value, f"{prefix}{f.name}.")
            else:
                lines.append(f"  {prefix}{f.name}: {_type_name(hints[f.name])} = {value!r}")
                if f.name in docs:
                    lines.append(textwrap.fill(docs[f.name], 116, initial_indent="      ",
                                               subsequent_indent="      "))

    walk(config, "")
    return "\n".join(lines).lstrip("\n")


def __getattr__(name: str):
    """``ModelConfig``: the model section's class, megakern.models.gpt.GPTConfig (imported on first use)."""
    if name == "ModelConfig":
        from megakern.models.gpt import GPTConfig

        return GPTConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
