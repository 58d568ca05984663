"""megakern's training program: a GPT built from megakern's kernels, trained on one device (or under torchrun).

    python -m megakern.train                                   # gpt-tiny on the default corpus: minutes on a CPU
    megakern-train --config configs/gpt-125m.yaml optim.lr=6e-4 train.steps=5000
    megakern-train --config configs/gpt-tiny.yaml --profile    # a few steps under torch.profiler -> profiles/
    megakern-train --help-config                               # every config key, its type, default and doc

Flow: config (megakern.config) -> data (megakern.data: the default corpus or PREFIX.bin/.idx files, split by
documents into train / held-out, GPTDataset or BlendedDataset, PretrainingSampler) -> model (GPT on the meta device,
materialized and initialized once) -> precision (fp32 | bf16 autocast | bf16 weights with fp32 master weights) ->
optional FP8 linears and torch.compile -> megakern.parallel.parallelize where ranks > 1 -> AdamW + LR schedule ->
resume from a checkpoint -> the loop -> final eval, checkpoint and a text sample.

One optimizer step, with A = global_batch / (micro_batch x data-parallel size) accumulation steps:

    for each of A micro-batches:   data -> forward (loss, mean over its tokens) -> backward of loss / A
    grad norm (clipped to train.grad_clip) -> found_inf = loss or norm not finite (on the device)
    finite: AdamW step at the schedule's lr;  not finite: the step is skipped and counted, and
    train.max_nonfinite skipped steps in a row stop the run with an error saying what to change

No host-device sync in a step on one device with fused AdamW (the default on CUDA): the model is told the data
pipeline checked every token id (``check_values=False``), fused AdamW skips the update itself when found_inf is set
(the same device-side skip as torch.amp.GradScaler's), and (loss, norm, skipped) travel to pinned host memory behind
an event, read after the next step is queued: the log, the skip count and the halt run one step behind the device.
The same holds over several ranks (megakern.parallel), where loss and norm are reduced over every group so that all
ranks skip alike. Other optimizers (foreach, for-loop, ZeRO-1's) read the figures at the end of each step and skip
the update on the host. Because nothing is read, the whole step can be captured in a CUDA graph and replayed
(``train.cuda_graph``: StepGraph), which takes the host's launch cost out of the step; over several ranks too
(tensor, context and DDP data parallelism), with their NCCL collectives in the graph.

Over several ranks (torchrun) the model is megakern.parallel's ParallelModel: a rank draws its whole step batch
(A micro-batches) and ``forward_backward`` cuts it into parallel.microbatches (pipeline micro-batches or
accumulation), returning the global mean loss; clipping spans every group. Checkpoints hold the single model's names
and shapes, so a run may resume under another layout (or in one process). Each rank's dropout RNG tracker
(megakern.parallel.rng) is saved with its RNG states and restored under the same layout, so a resumed run draws
the uninterrupted run's masks; under another layout it starts from the seed again (one log line says so).

Every stage is checked before step 1 (the numbers are contracts of docs/contracts.md): the config's keys and types,
the run directory (named by rank 0 for every rank, every rank seeing the same paths, and locked for the run's life:
megakern.run_dir), the log sinks (29), the samples the run needs against what the data holds within data.max_epochs
(26) and what eval reads against the held-out set, eval lengths against model.max_seqlen (28), DataLoader workers
against the CPUs (32) and a timeout on their batches (2), the data fingerprint against a resumed checkpoint's (34)
and across data-parallel ranks (12). An error is one ``megakern-train: error:`` line and, once the run directory
exists, the same line in train.log.

During the run: after every step each rank stats the data files (11, 34; a few microseconds) and the ranks vote, in
one host-side all-reduce read a step later (megakern.stopping), on whether to stop: a change found by any rank stops
every rank before a checkpoint can record data the run did not train on (found at most two steps late; before a
checkpoint the vote is settled at once); a SIGTERM / SIGINT received by any rank finishes the step on every rank,
saves a checkpoint and exits with EXIT_INTERRUPTED (75). After the
first step, an eval micro-batch larger than a training one is tried once on GPUs (28). A resume keeps the
checkpoint's LR schedule unless schedule.on_resume=config, and says what it does from there. Each step's time is its
own, on this rank's clock or CUDA events (StepClock; 1, 9).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import gc
import hashlib
import json
import math
import os
import random
import sys
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megakern import _nvtx, _timeline
from megakern._log import LoggerError, RunLogger, WandbOptions, format_count, memory_gib, peak_flops
from megakern.checkpoint import (CheckpointError, CheckpointManager, checkpoint_keys, init_optimizer_state,
                                 load_optimizer_state_dict, optimizer_state_dict)
from megakern.config import ConfigError, TrainConfig, describe_fields, load_config, to_dict, to_yaml
from megakern.data import (BlendedDataset, DataError, GPTDataset, IndexedDataset, PretrainingSampler,
                           build_dataloader, check_ranks_agree, ensure_default_dataset, load_tokenizer)
from megakern.run_dir import RunDirError, claim_run_dirs
from megakern.schedule import LRSchedule
from megakern.stopping import EXIT_INTERRUPTED, Interrupted, StopSignals, StopVote

# Model fields that do not change the parameters: a checkpoint loads across changes of these.
RUNTIME_MODEL_FIELDS = ("kernels", "recompute", "ce_chunk", "dropout")


class TrainingHalted(RuntimeError):
    """The run stopped on purpose (too many non-finite steps); the message says why and what to try."""


def _agreed(exc: Exception) -> Exception:
    """Mark an error that every rank raises alike, from a vote (the step watchdog has nothing to diagnose)."""
    exc.agreed = True
    return exc


# ---------------------------------------------------------------------------------------------------------------
# Data: documents split into train / held-out, samples, batches.

class DocumentSubset:
    """Some documents of an IndexedDataset, seen as a dataset of its own (what GPTDataset reads: sizes, get,
    num_tokens, fingerprint, prefix, check_unmodified)."""

    def __init__(self, indexed: IndexedDataset, docs: np.ndarray, split: str):
        self.indexed, self.docs, self.split = indexed, np.asarray(docs, dtype=np.int64), split
        self.sizes = indexed.sizes[self.docs]
        self.num_tokens = int(self.sizes.sum())
        self.prefix = indexed.prefix.with_name(f"{indexed.prefix.name}-{split}")
        digest = hashlib.sha256(indexed.fingerprint.encode() + self.docs.tobytes()).hexdigest()
        self.fingerprint = digest[:16]

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.indexed.get(int(self.docs[doc]), offset, length)

    def check_unmodified(self) -> None:
        self.indexed.check_unmodified()


def split_documents(indexed: IndexedDataset, valid_fraction: float, seed: int) -> tuple[DocumentSubset, ...]:
    """(train, valid): a seeded permutation of the documents, the first round(valid_fraction * D) (at least one)
    held out; each part keeps the documents' original order."""
    n = len(indexed)
    if n < 2:
        raise DataError(f"{indexed.prefix}: {n} document(s); holding out data.valid_fraction needs at least 2")
    perm = np.random.default_rng((seed, 2)).permutation(n)
    n_valid = min(max(1, round(valid_fraction * n)), n - 1)
    return (DocumentSubset(indexed, np.sort(perm[n_valid:]), "train"),
            DocumentSubset(indexed, np.sort(perm[:n_valid]), "valid"))


@dataclass
class Data:
    """What the run reads: datasets, tokenizer and the fingerprint recorded in checkpoints."""

    train: torch.utils.data.Dataset
    valid: torch.utils.data.Dataset
    tokenizer: object
    fingerprint: str
    description: str


def _dataset_prefixes(config: TrainConfig, log) -> tuple[list[Path], object]:
    """The dataset prefixes and their common tokenizer."""
    d = config.data
    if not d.paths:
        tokenizer = load_tokenizer(d.tokenizer)
        prefix = ensure_default_dataset(d.cache_dir, tokenizer)
        log(f"data: the default corpus, {tokenizer.name} tokens, at {prefix}")
        return [prefix], tokenizer
    prefixes, tokenizer = [Path(p) for p in d.paths], None
    for prefix in prefixes:
        spec = prefix.with_name(prefix.name + ".tokenizer.json")
        try:
            this = load_tokenizer(json.loads(spec.read_text()))
        except FileNotFoundError:
            raise DataError(f"{spec}: missing; datasets from megakern.data.preprocess carry their tokenizer there")
        if tokenizer is not None and this.name != tokenizer.name:
            raise DataError(f"{prefix} was tokenized by {this.name}, {prefixes[0]} by {tokenizer.name}; a run "
                            "needs one tokenizer")
        tokenizer = this
    return prefixes, tokenizer


def build_data(config: TrainConfig, *, seq_length: int, eval_seq_length: int, train_samples: int,
               eval_samples: int, log=print) -> Data:
    """Train and held-out datasets for the run (checks in the module doc); DataError or ConfigError naming keys."""
    d, seed = config.data, config.train.seed
    prefixes, tokenizer = _dataset_prefixes(config, log)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size {config.model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids ({tokenizer.name}); set model.vocab_size={tokenizer.vocab_size}")
    splits = [split_documents(IndexedDataset(p, vocab_size=tokenizer.vocab_size), d.valid_fraction, d.split_seed)
              for p in prefixes]
    cache = d.index_cache_dir

    if len(prefixes) == 1:
        train_docs, valid_docs = splits[0]
        per_epoch = (train_docs.num_tokens - 1) // seq_length
        if per_epoch < 1:
            raise DataError(f"{prefixes[0]}: {train_docs.num_tokens} training tokens, fewer than one sample of "
                            f"{seq_length} + 1")
        epochs = -(-train_samples // per_epoch)
        if epochs > d.max_epochs:  # contract 26 (docs/contracts.md): say so now, not after an endless or repeated pass
            global_batch = max(train_samples // max(config.train.steps, 1), 1)
            fits = d.max_epochs * per_epoch // global_batch
            fix = (f"lower train.steps to {fits}" if fits >= 1 else
                   f"the data holds fewer samples than one step's global batch of {global_batch}: lower "
                   "train.global_batch_size or train.seq_length, or add data")
            raise DataError(
                f"the run needs {train_samples} samples (train.steps x global batch) of {seq_length} tokens; the "
                f"training split holds {per_epoch} per epoch ({train_docs.num_tokens} tokens), so {epochs} epochs, "
                f"but data.max_epochs={d.max_epochs}: set data.max_epochs={epochs} to repeat the data, or {fix}")
        # whole epochs, so that the sample order (and the fingerprint) does not depend on train.steps
        train = GPTDataset(train_docs, seq_length, epochs * per_epoch, seed, cache_dir=cache, max_epochs=epochs,
                           name=train_docs.prefix.name)
        with _held_out(config, eval_samples, eval_seq_length):
            valid = GPTDataset(valid_docs, eval_seq_length, eval_samples, seed, cache_dir=cache,
                               name=valid_docs.prefix.name + f"-{eval_seq_length}")
        description = (f"{train_docs.prefix.name}: {len(train_docs)} documents, {format_count(train_docs.num_tokens)} "
                       f"tokens ({len(valid_docs)} documents held out), {len(train)} samples of {seq_length} "
                       f"({epochs} epoch{'s' * (epochs > 1)})")
    else:
        weights = d.weights or [1.0] * len(prefixes)

        def factories(part: int, length: int, max_epochs: int, suffix: str):
            return [functools.partial(_component, s[part], length, cache, max_epochs, s[part].prefix.name + suffix)
                    for s in splits]

        try:
            train = BlendedDataset(factories(0, seq_length, d.max_epochs, ""), weights, train_samples, seed=seed,
                                   allow_extreme=d.allow_extreme_weights)
            with _held_out(config, eval_samples, eval_seq_length):
                valid = BlendedDataset(factories(1, eval_seq_length, 1, f"-{eval_seq_length}"), weights,
                                       eval_samples, seed=seed, allow_extreme=d.allow_extreme_weights)
        except ValueError as exc:
            if isinstance(exc, DataError):
                raise
            message = (f"data.weights {weights}: {exc}".replace("pass allow_extreme=True",
                                                                 "set data.allow_extreme_weights=true")
                       .replace("raise num_samples", "raise train.steps or train.global_batch_size"))
            raise ConfigError(message) from None
        description = "blend:\n" + train.describe()
    # what fixes the training samples' order (the held-out set depends on eval sizes, not recorded)
    fingerprint = hashlib.sha256(f"{train.fingerprint}:{tokenizer.name}".encode()).hexdigest()
    return Data(train, valid, tokenizer, fingerprint[:32], description)


@contextlib.contextmanager
def _held_out(config: TrainConfig, eval_samples: int, eval_seq_length: int):
    """A DataError building the held-out set says which keys change what eval reads (eval reads the same samples
    every time, so it never repeats documents: data.max_epochs is for training)."""
    try:
        yield
    except DataError as exc:
        e, d = config.eval, config.data
        raise DataError(f"the held-out set cannot supply what eval reads ({eval_samples} samples of {eval_seq_length} "
                        f"tokens: eval.batches {e.batches} x micro-batch x data-parallel ranks): {exc}. Lower "
                        f"eval.batches or eval.micro_batch_size, shorten eval.seq_length, hold out more documents "
                        f"(data.valid_fraction, now {d.valid_fraction:g}), or set eval.every=0 to train without "
                        "eval") from None


def _component(docs: DocumentSubset, seq_length: int, cache, max_epochs: int, name: str, count: int, seed: int):
    return GPTDataset(docs, seq_length, count, seed, cache_dir=cache, max_epochs=max_epochs, name=name)


@dataclass
class Batch:
    """One micro-batch on the device: inputs and targets (B, T) int64; with packed documents cu_seqlens
    (ndocs + 1,) int32 over the B * T tokens and its longest document."""

    inputs: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None

    def model_kwargs(self) -> dict:
        return {} if self.cu_seqlens is None else {"cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen}


def document_offsets(inputs: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) of the documents in (B, T) ``inputs`` flattened: a document ends after each eod token and
    at each row's end; and the longest document's length."""
    B, T = inputs.shape
    flat = inputs.reshape(-1)
    ends = torch.nonzero(flat == eod_id).flatten() + 1
    rows = torch.arange(1, B + 1, dtype=ends.dtype) * T
    bounds = torch.unique(torch.cat([torch.zeros(1, dtype=ends.dtype), ends, rows]))
    return bounds.to(torch.int32), int(torch.diff(bounds).max())


def to_batch(sample: dict, device: torch.device, eod_id: int | None) -> Batch:
    tokens = sample["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cu, longest = document_offsets(inputs, eod_id) if eod_id is not None else (None, None)
    non_blocking = device.type == "cuda"
    return Batch(inputs.to(device, non_blocking=non_blocking), targets.to(device, non_blocking=non_blocking),
                 None if cu is None else cu.to(device, non_blocking=non_blocking), longest)


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, optimizer.

def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={name!r} but CUDA is not available (torch {torch.__version__})")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision != "fp32" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"train.precision={precision!r}: {torch.cuda.get_device_name(device)} has no bf16")
    return precision


EMBEDDINGS = ("wte.weight", "wpe.weight")


def param_groups(named_parameters, config, *, tied: bool) -> list[dict]:
    """AdamW groups from (name, parameter) pairs: matrices decayed (the embeddings wte/wpe, and a tied output head,
    only with optim.decay_embeddings), norm weights and biases not. Each parameter once."""
    embeddings = EMBEDDINGS + (("lm_head.weight",) if tied else ())
    decay, no_decay, seen = [], [], set()
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim >= 2 and (config.decay_embeddings or name not in embeddings):
            decay.append(p)
        else:
            no_decay.append(p)
    return [{"params": decay, "weight_decay": config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def optimizer_impl(config, device: torch.device, precision: str, parallel: bool) -> str:
    """optim.fused resolved: 'auto' takes megakern's master-weight AdamW for bf16 weights with fp32 masters on one
    CUDA device (Triton), torch's fused kernel elsewhere on CUDA, foreach on other devices. 'megakern' where it
    cannot run is a ConfigError."""
    from megakern import _backend

    impl = config.fused
    if impl == "auto":
        megakern_ok = (device.type == "cuda" and precision == "bf16" and not parallel
                       and not _backend.triton_problem(device))
        return "megakern" if megakern_ok else "fused" if device.type == "cuda" else "foreach"
    if impl == "megakern":
        if precision != "bf16":
            raise ConfigError(f"optim.fused=megakern updates fp32 master weights and writes the bf16 weights: it "
                              f"needs train.precision=bf16 (this run is {precision})")
        problem = _backend.triton_problem(device)
        if problem:
            raise ConfigError(f"optim.fused=megakern runs a Triton kernel, which cannot run here: {problem}")
    return impl


def optimizer_kwargs(config, impl: str) -> dict:
    """torch.optim.AdamW's arguments for implementation ``impl`` (optimizer_impl's resolution of optim.fused).
    'megakern' builds a fused torch AdamW, which holds the state and hyperparameters MasterAdamW steps with (and
    steps by itself where MasterAdamW does not run, e.g. to initialize state for a checkpoint load)."""
    kwargs = {"fused": True} if impl in ("fused", "megakern") else {"foreach": impl == "foreach"}
    return dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, **kwargs)


def fp8_recipe(name: str):
    from megakern import fp8

    return {"delayed": fp8.DelayedScaling, "current": fp8.CurrentScaling, "block": fp8.BlockScaling}[name]()


# ---------------------------------------------------------------------------------------------------------------
# Distributed: world size 1 needs nothing; more ranks go through megakern.parallel.

@dataclass
class Dist:
    """This process's place: global rank and world size, the data-parallel rank and size the sampler uses, and
    megakern.parallel's mesh (None for a single process)."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    mesh: object = None

    @property
    def writer(self) -> bool:
        return self.rank == 0


def setup_distributed(config: TrainConfig, device: torch.device) -> Dist:
    """One process with every parallel size 1: no process group. Otherwise (torchrun, or sizes > 1)
    megakern.parallel's ParallelDims builds the groups, with the rendezvous timeout and a check that every rank
    runs the same config."""
    p = config.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and max(p.tp, p.pp, p.cp) == 1 and p.dp in (-1, 1) and not dist.is_initialized():
        return Dist()
    if world == 1 and not dist.is_initialized():
        raise ConfigError(f"parallel sizes tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} need several ranks; launch with "
                          f"torchrun --nproc-per-node N -m megakern.train ...")
    try:
        from megakern.parallel import ParallelDims
    except ImportError as exc:
        raise ConfigError(f"a run over {world} ranks (parallel: tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp}) needs "
                          f"megakern.parallel, which cannot be imported ({exc})") from None
    try:
        mesh = ParallelDims(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp).build(
            device.type, timeout=p.init_timeout_s, agree={"config": to_dict(config)})
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None
    return Dist(rank=mesh.rank, world=mesh.dims.world_size, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp, mesh=mesh)


def describe_layout(layout: Mapping) -> str:
    return (f"{layout['world']} ranks (tp {layout['tp']}, pp {layout['pp']}, cp {layout['cp']}, dp {layout['dp']}"
            f"{', sequence parallel' if layout['sequence_parallel'] else ''}, stages {layout['stages']}) at rank "
            f"{layout['rank']}")


def restore_dropout_rng(tracker, saved: Mapping | None, layout: Mapping, log) -> bool:
    """Give this rank's dropout RNG tracker the states it saved, when the checkpoint was written under the same
    layout and seed: the resumed run then draws the masks the uninterrupted run would. Otherwise (another layout,
    another seed, or a checkpoint without tracker states: older, or from one process) the tracker starts again from
    its seed, and ``log`` gets one line saying why. ``saved``: the checkpoint's {"layout", "tracker"} of this rank
    (``Trainer.save``); ``layout``: this rank's. Returns whether the saved states were restored."""
    if saved is not None and not (isinstance(saved, Mapping) and isinstance(saved.get("layout"), Mapping)
                                  and isinstance(saved.get("tracker"), Mapping)):
        got = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise CheckpointError(f"the checkpoint's dropout RNG states of rank {layout['rank']} are malformed: want "
                              f"a dict of 'layout' and 'tracker' dicts, got {got}")
    if saved is None:
        why = "the checkpoint has no dropout RNG tracker states (saved by one process or an older megakern)"
    elif dict(saved["layout"]) != dict(layout):
        why = (f"the checkpoint was saved by {describe_layout(saved['layout'])}, this run is "
               f"{describe_layout(layout)}")
    elif saved["tracker"].get("seed") != tracker.seed:
        why = f"the checkpoint's tracker seed is {saved['tracker'].get('seed')}"
    else:
        try:
            tracker.load_state_dict(saved["tracker"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's dropout RNG states of rank {layout['rank']} do not load: "
                                  f"{exc}") from None
        return True
    tracker.load_state_dict({"seed": tracker.seed, "states": {}})
    log(f"note: dropout RNG tracker re-seeded from seed {tracker.seed} (masks differ from the uninterrupted run's): "
        f"{why}")
    return False


# ---------------------------------------------------------------------------------------------------------------

@dataclass
class RunResult:
    """What ``Trainer.run`` returns: per-step training losses, eval losses, counters and the final sample."""

    losses: dict[int, float] = field(default_factory=dict)   # step (1-based) -> loss, skipped steps included
    eval_losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    final_step: int = 0
    checkpoint: str | None = None
    sample: str | None = None
    profile_dir: str | None = None
    stopped_by: str | None = None  # 'SIGTERM' / 'SIGINT' when a signal stopped the run (after saving)


@dataclass
class StepFigures:
    """One optimizer step's figures on their way to the host: ``values`` (3,) fp32 = (loss, gradient norm, 1.0 if
    the step was skipped); on CUDA a pinned host copy behind ``event``, so reading them waits for this step only,
    not for the steps queued after it. ``time``: the step's duration (StepClock), attached by the loop."""

    step: int
    values: torch.Tensor
    event: object = None
    timeout: float | None = None  # seconds to wait for the event before calling the step stalled (graph replays)
    time: "StepTime | None" = None

    def read(self) -> tuple[float, float, bool]:
        """(loss, norm, stepped), waiting for the step if it is still running."""
        if self.event is not None:
            if self.timeout is None:
                self.event.synchronize()
            else:
                wait_for_event(self.event, self.timeout, f"step {self.step}")
        loss, norm, skipped = self.values.tolist()
        return loss, norm, skipped == 0


@dataclass
class StepTime:
    """When one step began and ended (perf_counter_ns on the host, or CUDA events on the step's stream) and when
    the step before it ended, if it ran back to back with this one."""

    begin: object
    end: object
    previous_end: object = None

    def ns(self) -> int:
        """The step's duration in ns: from the end of the step before it (back to back: so the host's time
        between steps counts) or from its own beginning (the first step, or the first after an eval or a save),
        to its end. Waits for the end on CUDA."""
        start = self.previous_end if self.previous_end is not None else self.begin
        if isinstance(self.end, int):
            return self.end - start
        self.end.synchronize()
        return round(start.elapsed_time(self.end) * 1e6)


class StepClock:
    """Times steps as the device runs them (contracts 1 and 9, docs/contracts.md: this rank's own monotonic clock
    or CUDA events, integer ns): ``begin()`` before a step is queued, ``end()`` after, giving its StepTime;
    ``pause()`` after anything that is not a step (eval, a checkpoint), so the next step is timed from its own
    beginning. On CUDA the step's queued work runs after ``end()`` returns: events time it on the device, where it
    runs, instead of crediting it to the step whose figures happen to be read then."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._begin = self._last_end = None

    def _now(self):
        if not self.cuda:
            return time.perf_counter_ns()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def begin(self) -> None:
        self._begin = self._now()

    def end(self) -> StepTime:
        end = self._now()
        timed = StepTime(self._begin, end, self._last_end)
        self._last_end = end
        return timed

    def pause(self) -> None:
        self._last_end = None


def wait_for_event(event, timeout: float, what: str) -> None:
    """Wait for a CUDA event, polling, and raise if it has not completed after ``timeout`` seconds. For CUDA-graph
    replays over several ranks: NCCL's watchdog does not watch collectives captured in a graph, so a stalled or lost
    rank would otherwise leave the others waiting forever without a word."""
    deadline = time.monotonic() + timeout
    pause = 1e-5
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the replayed CUDA graph has not finished after {timeout:g} s "
                               "(parallel.init_timeout_s): a rank is stalled or gone; its collectives, captured in the "
                               "graph, are not watched by NCCL's watchdog")
        time.sleep(pause)
        pause = min(2 * pause, 1e-3)


def device_skip(optimizer) -> bool:
    """Whether ``optimizer`` skips a step by itself when its ``found_inf`` attribute holds a nonzero tensor: torch's
    Adam / AdamW with fused=True in every group (what torch.amp.GradScaler relies on)."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and all(g.get("fused") for g in optimizer.param_groups))


def parallel_graph_problems(config: TrainConfig, world: int) -> list[str]:
    """Why ``config``'s train.cuda_graph cannot run over ``world`` ranks (empty: it can, or no graph is asked)."""
    c, p = config, config.parallel
    if not c.train.cuda_graph:
        return []
    problems, why = [], "train.cuda_graph over several ranks captures tensor, context and DDP data parallelism"
    dp_ranks = world // (p.tp * p.pp)  # dp x cp
    if p.pp > 1:
        problems.append(f"{why}; not parallel.pp={p.pp} (the pipeline schedule runs on the host between "
                        "micro-batches)")
    if p.dp_shard == "fsdp" and dp_ranks > 1:
        problems.append(f"{why}; not FSDP2 over dp x cp = {dp_ranks} ranks (its hooks allocate and synchronize "
                        "streams on the host each step): use parallel.dp_shard=ddp")
    if p.zero1:
        problems.append(f"{why}; not parallel.zero1 (its optimizer steps on the host)")
    if c.model.dropout:
        problems.append(f"{why}; not dropout (model.dropout={c.model.dropout}: the RNG tracker switches generator "
                        "states on the host)")
    if p.dp_shard == "ddp" and dp_ranks > 1 and p.pp == 1 and c.train.cuda_graph_warmup < 11:
        problems.append(f"train.cuda_graph with DDP needs train.cuda_graph_warmup >= 11, got "
                        f"{c.train.cuda_graph_warmup} (DDP's reducer reads timings on the host in its first 10 "
                        "iterations)")
    return problems


class StepGraph:
    """The training step captured once in a CUDA graph and replayed (``train.cuda_graph``).

    The first ``warmup`` steps run eagerly: they compile the kernels, create the optimizer's state, warm the
    allocator (and over several ranks create NCCL's communicators, which a capture cannot). The next step is
    captured with its batches in static device buffers, then replayed; every later step copies its batches into
    those buffers and replays, one launch instead of the step's thousands. What changes from step to step lives in
    device memory: the batches, the learning rate (a tensor the trainer fills before each step), the skip flag
    (computed inside the graph); nothing is read on the host. Eval and checkpoints run eagerly between replays on
    the same parameters and optimizer state.

    One process: the step's ``accum`` micro-batches. Over several ranks (megakern.parallel, tensor / context /
    DDP data parallel): the rank's whole step batch, one draw, which ``forward_backward`` cuts into micro-batches;
    its collectives (NCCL) are captured with the compute and replayed on every rank alike. The capture runs on the
    trainer's ``capture_stream``, the stream DDP was built on (DDP keeps autograd nodes made on that stream).
    """

    def __init__(self, trainer: "Trainer", warmup: int):
        self.trainer, self.warmup = trainer, warmup
        self.graph = None
        self.inputs = self.targets = self.values = None
        self.draws = 1 if trainer.parallel else trainer.accum  # samples drawn per step

    def step(self, batches) -> StepFigures:
        t = self.trainer
        samples = [next(batches) for _ in range(self.draws)]
        if self.graph is None and self.warmup > 0:
            self.warmup -= 1
            return t._eager_step(samples)
        with t._range("data"):
            tokens = [s["tokens"] for s in samples]
            if self.inputs is None:
                shape = (self.draws, *tokens[0][:, :-1].shape)
                self.inputs = torch.empty(shape, dtype=tokens[0].dtype, device=t.device)
                self.targets = torch.empty(shape, dtype=tokens[0].dtype, device=t.device)
            for i, tok in enumerate(tokens):
                if tok[:, :-1].shape != self.inputs.shape[1:]:
                    raise RuntimeError(f"train.cuda_graph: a batch of shape {tuple(tok[:, :-1].shape)} after "
                                       f"the captured {tuple(self.inputs.shape[1:])}: the graph needs fixed shapes")
                self.inputs[i].copy_(tok[:, :-1], non_blocking=True)
                self.targets[i].copy_(tok[:, 1:], non_blocking=True)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        figures = t._to_host(self.values)
        if t.parallel:  # captured collectives are not watched by NCCL's watchdog: the wait for the figures is
            figures.timeout = t.config.parallel.init_timeout_s
        return figures

    def release(self) -> None:
        """Drop the captured graph and its memory pool once the device is done with it (a later step captures
        again). Over several ranks this must come before the process group is destroyed: NCCL's teardown waits on
        the work a live graph holds, and would hang."""
        if self.graph is not None:
            torch.cuda.synchronize(self.trainer.device)
            self.graph.reset()
            self.graph = self.values = None

    def _capture(self) -> None:
        t = self.trainer
        batches = [Batch(self.inputs[i], self.targets[i]) for i in range(self.draws)]
        torch.cuda.synchronize(t.device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks back to the driver: the graph has its own pool
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the data loader's pin-memory thread may allocate while the main thread captures. No garbage
        # collection inside: it may free a pinned host tensor, whose free records an event on the stream that used
        # it (the legacy stream), which invalidates the capture (triton.testing's cuda_graph_without_gc does the same)
        gc.collect()
        gc.disable()
        try:
            with torch.cuda.graph(self.graph, stream=t.capture_stream, capture_error_mode="thread_local"):
                self.values = t._graph_body(batches)
        finally:
            gc.enable()
        if t.master_step is not None:
            t.master_step.flush()  # its pointer tables, built during the capture, written before the first replay
        t.log(f"step {t.step + 1}: captured the training step in a CUDA graph "
              f"({t.microbatches if t.parallel else t.accum} micro-batch(es))")


class Trainer:
    """Builds everything a run needs from ``config`` (failing before step 1 on anything that would fail later) and
    runs it with ``run()``. ``profile``: run log.profile_wait + warmup + active steps under torch.profiler and stop.
    """

    def __init__(self, config: TrainConfig, *, profile: bool = False, stream=None,
                 signals: StopSignals | None = None):
        self.config, self.profiling = config, profile
        c, t = config, config.train
        t0 = time.perf_counter_ns()
        self.device = resolve_device(t.device, int(os.environ.get("LOCAL_RANK", "0")))
        self.env = setup_distributed(c, self.device)
        self.parallel = self.env.mesh is not None
        self.precision = resolve_precision(t.precision, self.device)
        if self.parallel:
            self._check_parallel_options()
        # SIGTERM / SIGINT requests (main() installs the handlers; a Trainer made elsewhere gets none)
        self.signals = signals if signals is not None else StopSignals()
        self.vote = self.watchdog = self._vote_in_flight = None

        # run directory: named by rank 0 for every rank and locked for the run's life (a second run is refused
        # before it writes anything); then the logger (contract 29, docs/contracts.md: every sink checked now)
        self.dirs = claim_run_dirs(c.log.run_dir, c.checkpoint.dir, writer=self.env.writer,
                                   distributed=dist.is_available() and dist.is_initialized())
        self.run_dir, self.ckpt_dir = self.dirs.run_dir, self.dirs.ckpt_dir
        try:
            wandb = None if not c.log.wandb else WandbOptions(
                c.log.wandb_project, entity=c.log.wandb_entity, name=c.log.wandb_name or self.run_dir.name,
                mode=c.log.wandb_mode)
            self.logger = RunLogger(self.run_dir, tensorboard=c.log.tensorboard, progress=c.log.progress,
                                    total_steps=t.steps, enabled=self.env.writer, stream=stream, wandb=wandb,
                                    run_config=to_dict(c))
        except BaseException:
            self.dirs.release()
            raise
        self.log = self.logger.line
        try:
            self._setup(t0)
        except BaseException as exc:  # the reason reaches train.log too, then everything is released
            self._log_error(exc)
            self.close(failed=True)
            raise

    def _setup(self, t0: int) -> None:
        """Everything after the run directory and the logger (the rest of the constructor)."""
        c, t = self.config, self.config.train
        for note in self.dirs.notes():
            self.log(note)
        self.config_yaml = to_yaml(c)
        if self.env.writer:
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
            self.log("resolved config:\n" + self.config_yaml.rstrip())
            layout = (f"{self.env.world} ranks (tp {c.parallel.tp}, pp {c.parallel.pp}, cp {c.parallel.cp}, dp "
                      f"{self.env.dp_size})" if self.parallel else "1 process")
            self.log(f"run directory {self.run_dir} (checkpoints in {self.ckpt_dir}); device {self.device}, "
                     f"precision {self.precision}, {layout}")
        # every rank votes after each step on stopping (a signal on any rank, data changed on any rank)
        self.vote = StopVote(self.env.world > 1, timeout=datetime.timedelta(seconds=c.parallel.init_timeout_s))
        self._vote_in_flight = None

        # batch arithmetic: a step is accum micro-batches of micro_batch_size on each data-parallel rank
        self.seq_length = t.seq_length or c.model.max_seqlen
        self.eval_seq_length = c.eval.seq_length or self.seq_length
        micro_total = t.micro_batch_size * self.env.dp_size
        self.global_batch = t.global_batch_size or micro_total
        if self.global_batch % micro_total:
            raise ConfigError(f"train.global_batch_size {self.global_batch} is not a multiple of train.micro_batch_size "
                              f"{t.micro_batch_size} x data-parallel size {self.env.dp_size} = {micro_total}")
        self.accum = self.global_batch // micro_total
        self.eval_mbs = c.eval.micro_batch_size or t.micro_batch_size
        # megakern.parallel takes a rank's whole step batch and cuts it into its micro-batches itself
        self.microbatches = (c.parallel.microbatches or self.accum) if self.parallel else 1
        self.draw = t.micro_batch_size * self.accum if self.parallel else t.micro_batch_size
        self.eval_draw = self.eval_mbs * self.microbatches
        if self.parallel and self.draw % self.microbatches:
            raise ConfigError(f"parallel.microbatches {self.microbatches} does not divide a rank's step batch of "
                              f"{self.draw} sequences (train.global_batch_size / data-parallel size)")
        self.tokens_per_step = self.global_batch * self.seq_length

        # seeds: the same weights on every rank; dropout streams differ per rank
        torch.manual_seed(t.seed + self.env.rank)
        random.seed(t.seed + self.env.rank)
        np.random.seed((t.seed + self.env.rank) % 2**32)

        # data
        self.data = build_data(c, seq_length=self.seq_length, eval_seq_length=self.eval_seq_length,
                               train_samples=t.steps * self.global_batch,
                               eval_samples=c.eval.batches * self.eval_draw * self.env.dp_size, log=self.log)
        self.log(f"data: {self.data.description}; fingerprint {self.data.fingerprint}")
        self.eod_id = self.data.tokenizer.eod_id if c.data.packed_documents else None
        try:  # the final sample's prompt, checked now rather than after the run
            self.prompt_ids = self.data.tokenizer.encode(t.sample_prompt) or [self.data.tokenizer.eod_id]
        except ValueError as exc:
            raise ConfigError(f"train.sample_prompt {t.sample_prompt!r}: {exc}") from None

        # model: built on the meta device, materialized once (whole, or this rank's shards), seeded init
        from megakern.models.gpt import GPT

        with torch.device("meta"):
            model = GPT(c.model)
        self.flops_per_token = model.flops_per_token(self.seq_length)
        n_params, n_body = model.num_params(), model.num_params(exclude_embeddings=True)
        generator = torch.Generator().manual_seed(t.seed)
        # the stream a CUDA-graph step is captured on; DDP is built on it (it keeps the parameters' autograd
        # accumulator nodes, which record the stream they were made on: another stream would join the capture)
        self.capture_stream = (torch.cuda.Stream(self.device) if t.cuda_graph and self.device.type == "cuda"
                               else None)
        if self.parallel:
            from megakern.parallel import parallelize

            try:
                fsdp_dtype = c.parallel.fsdp_param_dtype
                if fsdp_dtype == "auto":
                    fsdp_dtype = "bfloat16" if self.precision == "bf16-autocast" else "float32"
                with (torch.cuda.stream(self.capture_stream) if self.capture_stream is not None
                      else contextlib.nullcontext()):
                    self.pmodel = parallelize(model, self.env.mesh, c.parallel, generator=generator,
                                              microbatches=self.microbatches, fsdp_param_dtype=fsdp_dtype)
                if self.capture_stream is not None:
                    torch.cuda.current_stream(self.device).wait_stream(self.capture_stream)
                if self.pmodel.fsdp and fsdp_dtype != "float32":
                    self.log(f"FSDP2: blocks' parameters all-gathered and computed in {fsdp_dtype}, fp32 shards "
                             "updated, gradients reduced in fp32")
            except ValueError as exc:
                raise ConfigError(f"parallel: {exc}") from None
            self.model = self.pmodel.gpts[0]
            named = list(self.pmodel.named_parameters())
        else:
            self.pmodel = None
            model.to_empty(device=self.device)
            model.init_weights(generator=generator)
            if t.fp8 != "none":
                from megakern import fp8

                fp8.convert_linears(model.blocks, recipe=fp8_recipe(t.fp8))
            self.model = model
            named = list(model.named_parameters())
        self.has_fp8 = any(type(m).__module__ == "megakern.fp8" and type(m).__name__ == "Linear"
                           for m in self.model.modules())
        self.peak, peak_note = peak_flops(self.device)
        if self.peak is None:
            self.log(f"MFU: n/a ({peak_note})")

        # precision: bf16 parameters get fp32 master weights, which the optimizer updates
        groups = param_groups(named, c.optim, tied=c.model.tie_embeddings)
        self.names = {}
        for name, p in named:
            self.names.setdefault(p, name)
        self.masters = None
        if self.precision == "bf16":
            self.masters = {}
            for g in groups:
                g["params"] = [self.masters.setdefault(p, p.detach().float().clone().requires_grad_())
                               for p in g["params"]]
            with torch.no_grad():
                for p in self.masters:
                    p.data = p.data.to(torch.bfloat16)
            self.opt_names = {m: self.names[p] for p, m in self.masters.items()}
        else:
            self.opt_names = dict(self.names)
        # (a CUDA graph cannot keep autocast's cache of casts between captures: it is off there)
        self.autocast = (torch.autocast(self.device.type, dtype=torch.bfloat16, cache_enabled=not t.cuda_graph)
                         if self.precision == "bf16-autocast" else contextlib.nullcontext())

        self.forward = torch.compile(self.model) if t.compile else self.model
        self.optim_impl = optimizer_impl(c.optim, self.device, self.precision, self.parallel)
        kwargs = optimizer_kwargs(c.optim, self.optim_impl)
        if t.cuda_graph:  # the step and the learning rate on the device (one tensor, every group), read by the graph
            kwargs.update(capturable=True, lr=torch.tensor(float(kwargs["lr"]), device=self.device))
        self.optimizer = (self.pmodel.build_optimizer(torch.optim.AdamW, params=groups, **kwargs) if self.parallel
                          else torch.optim.AdamW(groups, **kwargs))
        self.schedule = LRSchedule(c.schedule, lr=c.optim.lr, total_steps=t.steps)
        # a non-finite step is skipped by the fused optimizer on the device (no sync), else on the host
        # (over several ranks too: loss and norm are reduced over every group, so all ranks skip alike)
        self.device_skip = device_skip(self.optimizer)
        # bf16 weights: one pass updates the masters and writes the weights, reading the bf16 gradients themselves
        # when there is one micro-batch a step (megakern.optim; else the fp32 master gradients accumulated)
        self.master_step = None
        if self.optim_impl == "megakern":
            from megakern.optim import MasterAdamW

            self.master_step = MasterAdamW(self.optimizer, {m: p for p, m in self.masters.items()})
        self._clip_divisor = None  # the fused optimizer's grad_scale when it does the clipping (_micro_steps)
        self.step_graph = None
        if t.cuda_graph:
            problems = [why for bad, why in (
                (self.device.type != "cuda", f"a CUDA device (train.device is {self.device})"),
                (not self.device_skip, "fused AdamW (optim.fused auto or fused)"),
                (t.compile, "no train.compile"), (self.has_fp8, "no FP8 (train.fp8=none)"),
                (self.eod_id is not None, "fixed shapes: no data.packed_documents")) if bad]
            if problems:
                raise ConfigError("train.cuda_graph needs " + ", ".join(problems))
            self.step_graph = StepGraph(self, t.cuda_graph_warmup)
        self.log(f"model: {n_params / 1e6:.2f}M parameters ({n_body / 1e6:.2f}M without embeddings), "
                 f"{self.flops_per_token / 1e6:.1f} MFLOP per token; global batch {self.global_batch} x "
                 f"{self.seq_length} tokens = {self.accum} accumulation step(s) of {t.micro_batch_size} x "
                 f"{self.env.dp_size} data-parallel rank(s)")

        # checkpoints and resume; then every rank must agree on the data and where it starts (contract 12)
        self.manager = CheckpointManager(self.ckpt_dir, keep=c.checkpoint.keep, log=self.log)
        self.manager.remove_leftovers()  # what killed saves and removals left (hidden names; one log line each)
        self.step, self.consumed_samples, self.nonfinite_total = 0, 0, 0
        self._resume()
        check_ranks_agree(self.data.fingerprint, self.consumed_samples, timeout=c.parallel.init_timeout_s)
        self.log(f"ready in {(time.perf_counter_ns() - t0) / 1e9:.1f} s")

    def _check_parallel_options(self) -> None:
        """What the single-process trainer supports and megakern.parallel runs do not (yet): refused by name."""
        c, problems = self.config, []
        if self.config.train.precision == "auto":
            self.precision = "bf16-autocast" if self.precision == "bf16" else self.precision
        if self.precision == "bf16":
            problems.append("train.precision=bf16 (fp32 master weights) is single-process only; use bf16-autocast")
        if c.train.fp8 != "none":
            problems.append("train.fp8 is single-process only")
        if c.train.compile:
            problems.append("train.compile is single-process only")
        problems += parallel_graph_problems(c, self.env.world)
        if c.data.packed_documents:
            problems.append("data.packed_documents is single-process only")
        if c.parallel.fsdp_param_dtype == "bfloat16" and self.precision != "bf16-autocast":
            problems.append(f"parallel.fsdp_param_dtype=bfloat16 computes under bf16 autocast; train.precision is "
                            f"{self.precision} (use bf16-autocast, or fsdp_param_dtype auto / float32)")
        if problems:
            raise ConfigError(f"a run over {self.env.world} ranks: " + "; ".join(problems))

    # -- checkpoints ----------------------------------------------------------------------------------------------
    def _tensor_tree(self, saved_keys: set[str] | None = None) -> dict:
        """The DCP tree: {"model": {name: parameter}, "optim": {...}, "master": {name: fp32 master} (bf16 runs),
        "buffers": {...} (FP8 scaling state)}, in the single model's names (and, in parallel runs, full shapes
        as DTensors), so checkpoints move between layouts. For a load (``saved_keys``: the checkpoint's keys), the
        weights this run trains (masters, or the parameters) load from the checkpoint's masters when it has them,
        else from its model."""
        loading = saved_keys is not None
        if self.parallel:
            tree = self.pmodel.checkpoint_state(self.optimizer, for_load=loading)
        else:
            if loading:
                init_optimizer_state(self.optimizer)
            params = {name: p.detach() for p, name in self.names.items()}
            tree = {"model": params, "optim": optimizer_state_dict(self.optimizer, self.opt_names)}
            if self.masters is not None:
                tree["master"] = {self.names[p]: m.detach() for p, m in self.masters.items()}
            buffers = {k: v for k, v in self.model.state_dict().items() if k not in params}
            if buffers:
                tree["buffers"] = buffers
        if not loading:
            return tree
        trained = tree.pop("master") if "master" in tree else tree["model"]
        tree.pop("model")
        source = "master" if any(k.startswith("master.") for k in saved_keys) else "model"
        tree[source] = trained
        if "buffers" in tree and not any(k.startswith("buffers.") for k in saved_keys):
            self.log("note: the checkpoint has no FP8 scaling state; it starts fresh")
            tree.pop("buffers")
        return tree

    def _state(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "global_batch": self.global_batch,
                "seq_length": self.seq_length, "data_fingerprint": self.data.fingerprint,
                "schedule": self.schedule.state_dict(), "nonfinite_total": self.nonfinite_total,
                "precision": self.precision, "world_size": self.env.world, "dp_size": self.env.dp_size,
                "config": to_dict(self.config)}

    def _rng_layout(self) -> dict:
        """What fixes which dropout streams this rank's tracker holds (its rank's place and the regions/stages)."""
        pm = self.pmodel
        return {"world": self.env.world, "rank": self.env.rank, "tp": pm.tp, "pp": pm.pp, "cp": pm.cp, "dp": pm.dp,
                "sequence_parallel": bool(pm.sequence_parallel), "stages": [int(s) for s in pm.stage_indices]}

    def save(self, asynchronous: bool | None = None) -> Path:
        """Checkpoint this step (every rank). ``asynchronous`` (default checkpoint.async_save): the tensors are
        staged into CPU memory now and written in the background (the next save, the run's end or a stop waits
        for it and raises its failure); the final save and a signal's save are synchronous. Returns the
        checkpoint's directory (complete once a background save has finished)."""
        asynchronous = self.config.checkpoint.async_save if asynchronous is None else asynchronous
        # a parallel rank's dropout RNG tracker goes with its RNG states (restored by _resume under the same layout)
        rank_state = ({"dropout_rng": {"layout": self._rng_layout(), "tracker": self.pmodel.rng.state_dict()}}
                      if self.parallel else None)
        saved = self.manager.save(self.step, self._tensor_tree(), state=self._state(),
                                  files={"config.yaml": self.config_yaml}, rank_state=rank_state,
                                  asynchronous=asynchronous)
        if asynchronous:
            self.log(f"checkpoint: {saved.path} (writing in the background)")
            return saved.path
        self.log(f"checkpoint: {saved}")
        return saved

    def _resume(self) -> None:
        c = self.config.checkpoint
        if c.resume is None:
            return
        if c.resume == "auto":
            path = self.manager.latest()
            if path is None:
                self.log(f"checkpoint.resume=auto: no checkpoint in {self.ckpt_dir}; starting fresh")
                return
        else:
            path = CheckpointManager.resolve(c.resume)
            if path is None:
                raise CheckpointError(f"checkpoint.resume={c.resume!r}: no complete checkpoint there")
        self._check_compatible(path)
        tree = self._tensor_tree(saved_keys=checkpoint_keys(path))
        state = self.manager.load(path, tree, verify=c.verify)
        if not self.parallel:
            load_optimizer_state_dict(self.optimizer, self.opt_names, tree["optim"])
        else:  # the dropout masks continue where the checkpoint's run stopped (same layout), else restart from the seed
            rank_state = state["rank_state"] or {}
            saved = rank_state.get("dropout_rng") if isinstance(rank_state, Mapping) else rank_state
            restore_dropout_rng(self.pmodel.rng, saved, self._rng_layout(),
                                self.log if self.config.model.dropout else (lambda line: None))
        if self.masters is not None:
            self._copy_masters()
        if state["data_fingerprint"] != self.data.fingerprint:  # contract 34
            message = (f"the data's fingerprint {self.data.fingerprint} differs from the checkpoint's "
                       f"{state['data_fingerprint']} ({path}): other files, split, seed or sequence length, so the "
                       "sample order would not continue the checkpoint's")
            if not self.config.data.allow_fingerprint_change:
                raise DataError(message + "; set data.allow_fingerprint_change=true to resume anyway")
            warnings.warn(message, stacklevel=2)
        self._resume_schedule(state["schedule"], int(state["step"]), path)
        if state["global_batch"] != self.global_batch:
            self.log(f"note: global batch {self.global_batch}, the checkpoint's was {state['global_batch']}")
        if state.get("world_size", 1) != self.env.world:
            self.log(f"note: {self.env.world} rank(s), the checkpoint was saved by {state['world_size']}")
        self.step, self.consumed_samples = int(state["step"]), int(state["consumed_samples"])
        self.nonfinite_total = int(state.get("nonfinite_total", 0))
        if self.consumed_samples + (self.config.train.steps - self.step) * self.global_batch > len(self.data.train):
            raise DataError(f"resuming at step {self.step} ({self.consumed_samples} samples consumed) to step "
                            f"{self.config.train.steps} needs more samples than the data's {len(self.data.train)}")
        elsewhere = ("" if Path(os.path.abspath(path)).parent == Path(os.path.abspath(self.ckpt_dir)) else
                     f" (the checkpoint's own directory {path.parent} is only read)")
        self.log(f"resumed from {path} at step {self.step} ({self.consumed_samples} samples consumed); this run "
                 f"logs to {self.run_dir} and saves checkpoints to {self.ckpt_dir}{elsewhere}")
        self.log(f"LR schedule from here: {self.schedule.describe(self.step)}")

    def _resume_schedule(self, saved, step: int, path: Path) -> None:
        """schedule.on_resume: keep the checkpoint's schedule (default) or apply this run's; log what changed."""
        mine = self.schedule
        differences = mine.differences(saved) if isinstance(saved, Mapping) else ["(unreadable)"]
        if self.config.schedule.on_resume == "config":
            if differences:
                try:
                    before = f"{LRSchedule.from_state(dict(saved))(step):.3e}"
                except (ValueError, TypeError):
                    before = "unknown"
                self.log(f"note: schedule.on_resume=config: this run's LR schedule applies from step {step + 1} "
                         f"(lr {mine(step):.3e}; the checkpoint's schedule would give {before}); it differs in: "
                         + "; ".join(differences))
            return
        try:
            self.schedule = LRSchedule.from_state(dict(saved))
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{path}: the checkpoint's LR schedule cannot be rebuilt ({exc}); set "
                                  "schedule.on_resume=config to follow this run's schedule") from None
        if differences:
            self.log("note: this run's LR schedule keys differ from the checkpoint's (" + "; ".join(differences)
                     + "); the checkpoint's schedule is kept (schedule.on_resume=checkpoint), set "
                     "schedule.on_resume=config to apply this run's from the resumed step")
        end = self.schedule.kwargs["total_steps"]
        if self.config.train.steps > end:
            self.log(f"note: train.steps {self.config.train.steps} runs past the checkpoint's schedule, which ends at "
                     f"step {end}: steps {end + 1}..{self.config.train.steps} run at its final lr "
                     f"{self.schedule(end):.3e} (to extend the decay, e.g. a WSD run, set schedule.on_resume=config)")

    def _check_compatible(self, path: Path) -> None:
        """CheckpointError naming the model fields that differ (before DCP reports mismatched shapes)."""
        from megakern.config import read_yaml

        saved = read_yaml(path / "config.yaml").get("model", {})
        now = to_dict(self.config)["model"]
        differ = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in now.items()
                  if k not in RUNTIME_MODEL_FIELDS and saved.get(k) != v]
        if differ:
            raise CheckpointError(f"{path} holds another model:\n  " + "\n  ".join(differ))

    @torch.no_grad()
    def _accumulate_master_grads(self, first: bool) -> None:
        """fp32 master gradients (allocated once) += the bf16 gradients of this micro-batch (= on the first); the
        bf16 gradients are then dropped. With megakern's master step and one micro-batch a step there is nothing to
        accumulate: it reads the bf16 gradients."""
        if self.master_step is not None and self.accum == 1:
            return
        pairs = [(m, p.grad) for p, m in self.masters.items() if p.grad is not None]
        if first:
            for p, m in self.masters.items():
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
                elif p.grad is None:  # unused in this micro-batch
                    m.grad.zero_()
            torch._foreach_copy_([m.grad for m, _ in pairs], [g for _, g in pairs])
        else:
            torch._foreach_add_([m.grad for m, _ in pairs], [g for _, g in pairs])
        for p in self.masters:
            p.grad = None

    @torch.no_grad()
    def _copy_masters(self) -> None:
        """bf16 parameters <- their fp32 master weights (round to nearest even)."""
        torch._foreach_copy_(list(self.masters), list(self.masters.values()))

    def model_module(self) -> torch.nn.Module:
        """The single-device GPT (a parallel run's first local chunk)."""
        return self.model

    # -- the loop -------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _range(self, name: str):
        """An NVTX range (for Nsight Systems) and, when profiling, a torch.profiler range."""
        with _nvtx.annotate(f"train.{name}"):
            if self.profiling:
                with torch.profiler.record_function(name):
                    yield
            else:
                yield

    def _batches(self, dataset, consumed: int, micro_batch_size: int):
        sampler = PretrainingSampler(len(dataset), consumed, micro_batch_size, self.env.dp_rank, self.env.dp_size)
        with warnings.catch_warnings(record=True) as caught:  # contract 32: the cap is logged, not just warned
            warnings.simplefilter("always")
            loader = build_dataloader(dataset, sampler, num_workers=self.config.data.num_workers,
                                      timeout=self.config.data.loader_timeout_s)
        # the loader's own generator: making an iterator would otherwise draw from the global RNG (dropout's)
        loader.generator = torch.Generator().manual_seed(self.config.train.seed)
        for w in caught:
            self.log(f"note: {w.message}")
        return iter(loader)

    def train_step(self, batches) -> StepFigures:
        """One optimizer step, queued: its (loss, gradient norm, stepped) figures, ``.read()`` on the host. The loss
        is the mean over the global batch."""
        lr = self.schedule(self.step)
        for g in self.optimizer.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # a CUDA-graph step reads it from device memory
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        if self.step_graph is not None:
            return self.step_graph.step(batches)
        if self.parallel:
            return self._eager_step([next(batches)])
        return self._finish_step(self._micro_steps(self._micro_batches(batches)))

    def _eager_step(self, samples: list[dict]) -> StepFigures:
        """The step on host-drawn samples: ``accum`` micro-batches in one process, the rank's step batch in a
        parallel run."""
        with self._range("data"):
            batches = [to_batch(s, self.device, self.eod_id) for s in samples]
        return self._finish_step(self._step_figures(batches))

    def _graph_body(self, batches: list[Batch]) -> torch.Tensor:
        """What StepGraph captures: the step on device-resident batches, with the optimizer's device-side skip."""
        return self._device_step(self._step_figures(batches))

    def _step_figures(self, batches: list[Batch]) -> list[torch.Tensor]:
        """Forward and backward of the step's batches and the clipping: [mean loss, norm (, FP8's flag)]. In a
        parallel run, ``batches`` is the rank's step batch, which forward_backward cuts into micro-batches."""
        if not self.parallel:
            return self._micro_steps(iter(batches))
        clip = self.config.train.grad_clip
        with self._range("forward_backward"), self.autocast:
            loss = self.pmodel.forward_backward(batches[0].inputs, batches[0].targets, check_values=False)
        with self._range("optimizer"):
            norm = self.pmodel.clip_grad_norm_(clip if clip > 0 else math.inf)
        return [loss.float(), norm.float()]

    def _micro_batches(self, batches):
        """The step's accum micro-batches, each moved to the device when the loop reaches it."""
        for _ in range(self.accum):
            with self._range("data"):
                batch = to_batch(next(batches), self.device, self.eod_id)
            yield batch

    def _micro_steps(self, micro_batches) -> list[torch.Tensor]:
        """Forward and backward of each micro-batch, then the gradient norm (clipped): the step's figures [mean
        loss, norm (, FP8's non-finite flag)] on the device."""
        model, accum, clip = self.forward, self.accum, self.config.train.grad_clip
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float32)
        for micro, batch in enumerate(micro_batches):
            with self._range("forward"), self.autocast:
                loss = model(batch.inputs, batch.targets, **batch.model_kwargs(), check_values=False)
            with self._range("backward"):
                (loss / accum).backward()
            loss_sum += loss.detach().float()
            if self.masters is not None:
                self._accumulate_master_grads(first=micro == 0)
        with self._range("optimizer"):
            if self.master_step is not None and self.accum == 1:  # the bf16 gradients themselves
                params = list(self.masters)
            elif self.masters is not None:
                params = list(self.masters.values())
            else:
                params = [p for g in self.optimizer.param_groups for p in g["params"]]
            grads = [p for p in params if p.grad is not None]
            self._clip_divisor = None
            if clip > 0 and not self.device_skip:
                norm = torch.nn.utils.clip_grad_norm_(grads, clip, foreach=True)
            else:
                from megakern.optim import total_norm

                norm = total_norm([p.grad for p in grads]).to(self.device)  # summed in fp32 (bf16 gradients too)
                if clip > 0:
                    # the fused optimizer divides the gradients by its grad_scale as it reads them: clipping rides
                    # in the update instead of a pass over every gradient (clip_grad_norm_'s coefficient, as a
                    # divisor)
                    self._clip_divisor = torch.clamp((norm.float() + 1e-6) / clip, min=1.0)
            figures = [loss_sum / accum, norm.float()]
            if self.has_fp8:
                from megakern import fp8

                figures.append(fp8.update_scales(self.model).to(self.device, torch.float32))
            return figures

    def _finish_step(self, figures: list[torch.Tensor]) -> StepFigures:
        """The optimizer step, skipped if loss or norm is not finite (or the FP8 flag, a third figure, is set): on the
        device with a fused optimizer (no sync), else after reading the figures on the host."""
        if self.device_skip:
            return self._to_host(self._device_step(figures))
        values = self._step_values(figures)
        result = StepFigures(self.step + 1, values.cpu())  # the host sync
        if result.read()[2]:
            self._optimizer_step()
            if self.masters is not None:
                self._copy_masters()
        if self.masters is None:  # the masters' gradients are overwritten by the next step's first micro-batch
            self.optimizer.zero_grad(set_to_none=True)
        return result

    def _step_values(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """(loss, norm, 1.0 if the step must be skipped) as one fp32 (3,) device tensor."""
        loss, norm = (f.to(self.device, torch.float32).reshape(()) for f in figures[:2])
        bad = ~(torch.isfinite(loss) & torch.isfinite(norm))
        if len(figures) > 2:
            bad = bad | (figures[2].to(self.device).reshape(()) != 0)
        return torch.stack([loss, norm, bad.to(torch.float32)])

    def _device_step(self, figures: list[torch.Tensor]) -> torch.Tensor:
        """The fused optimizer's step, which skips itself on the device when the step is bad; nothing is read on
        the host (this is what a CUDA-graph step captures). Returns the step's values."""
        values = self._step_values(figures)
        if self.master_step is not None:  # masters, moments and bf16 weights in one pass; skipped on values[2]
            self.master_step.step(grad_scale=self._clip_divisor, found_inf=values[2])
            for p in self.masters:
                p.grad = None
            return values
        # 0-d fp32 device tensors: the clipping divisor (see _micro_steps) and the skip flag
        self.optimizer.grad_scale, self.optimizer.found_inf = self._clip_divisor, values[2]
        try:
            self._optimizer_step()
        finally:
            self.optimizer.grad_scale = self.optimizer.found_inf = None
        if self.masters is not None:  # after a skipped step the masters are unchanged: an exact no-op
            self._copy_masters()
        else:  # the masters' gradients are overwritten by the next step's first micro-batch
            self.optimizer.zero_grad(set_to_none=True)
        return values

    def _optimizer_step(self) -> None:
        """optimizer.step(); over FSDP2's DTensor shards it runs on their local tensors (the same update, without
        DTensor's per-call dispatch: see megakern.parallel.data_parallel.local_shards)."""
        if self.parallel and self.pmodel.fsdp:
            from megakern.parallel.data_parallel import local_shards

            with local_shards(self.optimizer):
                self.optimizer.step()
        else:
            self.optimizer.step()

    def _to_host(self, values: torch.Tensor) -> StepFigures:
        """The step's figures copied to the host without waiting: into pinned memory behind an event on CUDA."""
        if values.device.type != "cuda":
            return StepFigures(self.step + 1, values.cpu())
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        host.copy_(values, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return StepFigures(self.step + 1, host, event)

    def _set_training(self, mode: bool) -> None:
        (self.pmodel if self.parallel else self.model).train(mode)

    @torch.no_grad()
    def evaluate(self, batches: int | None = None) -> torch.Tensor:
        """Mean held-out loss over eval.batches micro-batches (the same samples every time; ``batches``: the first
        so many) of every data-parallel rank: a float32 scalar on the CPU (contract 33, docs/contracts.md). The
        model's train/eval mode is restored."""
        count = self.config.eval.batches if batches is None else batches
        was_training = self.model.training
        self._set_training(False)
        try:
            total = torch.zeros((), device=self.device, dtype=torch.float32)
            draws = self._batches(self.data.valid, 0, self.eval_draw)
            for _ in range(count):
                batch = to_batch(next(draws), self.device, self.eod_id)
                with self.autocast:
                    if self.parallel:
                        total += self.pmodel.eval_loss(batch.inputs, batch.targets, check_values=False).float()
                    else:
                        total += self.forward(batch.inputs, batch.targets, **batch.model_kwargs()).float()
            total /= count
            if self.env.dp_size > 1 and not self.parallel:
                dist.all_reduce(total, op=dist.ReduceOp.AVG)
            return total.cpu()
        finally:
            self._set_training(was_training)

    def sample(self) -> str | None:
        """The final sample: train.sample_tokens tokens after train.sample_prompt, decoded."""
        t = self.config.train
        if t.sample_tokens == 0:
            return None
        if self.parallel:
            p = self.config.parallel
            if max(p.tp, p.pp, p.cp) > 1 or p.dp_shard != "ddp":
                self.log("sample: skipped, the model is sharded over ranks (tp/pp/cp or FSDP)")
                return None
            if not self.env.writer:
                return None
        from megakern.models.generate import generate

        tok, prompt = self.data.tokenizer, self.prompt_ids
        length = min(t.sample_tokens, self.config.model.max_seqlen - len(prompt))
        if length < 1:
            self.log(f"sample: skipped, the prompt's {len(prompt)} tokens fill model.max_seqlen")
            return None
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(t.seed)
        with self.autocast:
            out = generate(self.model_module(), idx, length, temperature=t.sample_temperature, top_k=t.sample_top_k,
                           generator=gen, eos_id=tok.eod_id)
        return tok.decode(out[0, len(prompt):].tolist())

    def run(self) -> RunResult:
        """Train from the current step to train.steps (or profile a few steps); see the module doc. Everything the
        run holds (log sinks, the run directory's lock, the vote's group) is released at the end, also when the run
        stops on an error (which goes to the log file too) or on a second signal."""
        failed = True
        try:
            result = self._run()
            if self.step_graph is not None:
                self.step_graph.release()
            failed = False
            return result
        except BaseException as exc:
            self._log_error(exc)
            raise
        finally:
            self.close(failed=failed)

    def close(self, failed: bool = False) -> None:
        """Release what the run holds: the watchdog, the vote's process group, the log sinks (``failed``: the run
        ended on an error, which a Weights & Biases run records), the directories' locks. Idempotent; ``run()``
        and a failed constructor call it."""
        if getattr(self, "manager", None) is not None and self.manager.pending is not None:
            try:  # a background save still running (the run stopped on an error): it ends before anything else
                self.manager.wait()
            except CheckpointError as exc:
                self.log(f"error: {exc}")
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
            self.watchdog = None
        if getattr(self, "vote", None) is not None:
            self.vote.close()
            self.vote = None
        if getattr(self, "logger", None) is not None:
            self.logger.close(failed=failed)
        if getattr(self, "dirs", None) is not None:
            self.dirs.release()

    def _log_error(self, exc: BaseException) -> None:
        if isinstance(exc, (KeyboardInterrupt, Interrupted)):
            self.log(f"stopped: {exc or type(exc).__name__} (no checkpoint written by this stop)")
        else:
            self.log(f"error: {type(exc).__name__}: {exc}")

    def _between_steps(self, sync: bool = False) -> str | None:
        """After every step, on every rank alike: the data files unchanged here (a stat) and the ranks' vote on
        stopping (megakern.stopping). Over several ranks a step's vote is read after the next step is queued, so
        its latency hides behind that step (a signal or a change stops the run one step later); ``sync`` (before a
        checkpoint, at the run's end) settles the vote in flight and votes now. A change any rank sees raises
        DataError on every rank, naming the file and the rank. Returns the signal that stops the run (received by
        any rank), or None."""
        error = None
        try:
            self.data.train.check_unmodified()
            self.data.valid.check_unmodified()
        except DataError as exc:
            error = str(exc)
        if self.vote is None:
            return None
        votes = [self._vote_in_flight.result()] if self._vote_in_flight is not None else []
        self._vote_in_flight = None
        if sync or self.env.world == 1:  # (one process: the vote is its own, at once)
            votes.append(self.vote.agree(self.signals.received, error))
        else:
            self._vote_in_flight = self.vote.start(self.signals.received, error)
        errors = {r: m for v in votes for r, m in (v.errors or {}).items()}
        if errors:
            where = "; ".join(f"rank {r}: {m}" if self.env.world > 1 else m for r, m in sorted(errors.items()))
            raise _agreed(DataError(f"{where}; stopped after step {self.step}, no checkpoint of it written"))
        voted = next((v for v in votes if v.signal), None)
        if voted is None:
            return None
        if voted.signal_rank is not None and not self.signals.received:
            self.log(f"rank {voted.signal_rank} received {voted.signal}")
        return voted.signal

    def _run(self) -> RunResult:
        c, result = self.config, RunResult()
        first_step = self.step
        if self.step >= c.train.steps:
            self.log(f"nothing to do: step {self.step} >= train.steps {c.train.steps}")
        batches = self._batches(self.data.train, self.consumed_samples, self.draw)
        profiler = self._profiler() if self.profiling else None
        last = self.step + (c.log.profile_wait + c.log.profile_warmup + c.log.profile_active) if profiler else None
        self._consecutive, self._window = 0, [0, 0, []]  # window: ns, tokens, losses since the last log line
        clock = StepClock(self.device)
        self._set_training(True)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.signals.graceful = True  # from here a first signal finishes the step and saves (stopping.py)
        self.watchdog = self._start_watchdog()
        try:
            return self._loop(result, batches, profiler, last, clock, first_step)
        finally:
            self.signals.graceful = False

    def _loop(self, result: RunResult, batches, profiler, last, clock: StepClock, first_step: int) -> RunResult:
        """The steps, then the final eval, checkpoint and sample (``_run`` sets up). ``pending``: the step whose
        figures are still on their way, read once the next step is queued. Each step, eval and save is a phase of
        the step watchdog (over several ranks)."""
        c, pending, stop = self.config, None, None
        try:
            if profiler is not None:
                profiler.start()
            while self.step < c.train.steps and (last is None or self.step < last):
                with self._watched("step", self.step + 1):
                    clock.begin()
                    figures = self.train_step(batches)
                    lr = self.schedule(self.step)
                    self.step += 1
                    self.consumed_samples += self.global_batch
                    figures.time = clock.end()
                    if profiler is not None:
                        profiler.step()
                    if pending is not None:  # the previous step's figures: read now that this step is queued
                        self._report(result, *pending)
                    pending = (figures, lr)
                    due_eval = c.eval.every and self.step % c.eval.every == 0 and self.step < c.train.steps
                    due_save = (c.checkpoint.every and self.step % c.checkpoint.every == 0
                                and self.step < c.train.steps)
                    # (before a checkpoint, and at the last step, the vote is settled now)
                    stop = self._between_steps(sync=bool(due_save) or self.step >= c.train.steps
                                               or (last is not None and self.step >= last))
                    if self.step == first_step + 1 and not stop and profiler is None and self._eval_is_larger():
                        self._report(result, *pending)  # (the probe may stop the run: step 1 is logged first)
                        pending = None
                        self._check_eval_memory()
                        clock.pause()
                    if stop or (profiler is None and (due_eval or due_save)):
                        self._report(result, *pending)
                        pending = None
                if stop:
                    break
                if profiler is None and (due_eval or due_save):
                    if due_eval:
                        with self._watched("eval", self.step):
                            self._eval(result)
                    if due_save:
                        with self._watched("checkpoint", self.step):
                            result.checkpoint = str(self.save())
                    clock.pause()  # eval and saving are not training time
            if pending is not None:
                with self._watched("step", self.step):
                    self._report(result, *pending)
        finally:
            if profiler is not None:
                profiler.stop()
        result.final_step = self.step
        if stop:
            return self._stop_on_signal(result, stop, first_step, profiler is not None)
        if profiler is not None:
            result.profile_dir = str(self._write_profile(profiler))
            return result
        if self.step == first_step:
            return result
        if c.eval.every:
            with self._watched("eval", self.step):
                self._eval(result)
        with self._watched("checkpoint", self.step):
            if c.checkpoint.final or (c.checkpoint.every and self.step % c.checkpoint.every == 0):
                self._between_steps(sync=True)  # (eval read the files too: checked again before a checkpoint)
                result.checkpoint = str(self.save(asynchronous=False))
            self.manager.wait()  # a background save still running: the run is done when it is (its failure raises)
        result.sample = self.sample()
        if result.sample is not None:
            self.log(f"sample ({len(result.sample)} characters after {c.train.sample_prompt!r}):\n"
                     f"{c.train.sample_prompt}{result.sample}")
            self.logger.text("sample", c.train.sample_prompt + result.sample, self.step)
        return result

    def _start_watchdog(self):
        """Over several ranks, unless parallel.step_timeout_s is null: the step watchdog
        (megakern.parallel.watchdog), which names the ranks a hung step waits for and ends every rank (exit code
        124). The first steps (compilation; with a CUDA graph, its warm-up and capture), evals and saves get
        parallel.init_timeout_s."""
        c, p = self.config, self.config.parallel
        if not self.parallel or p.step_timeout_s is None:
            return None
        from megakern.parallel import StepWatchdog

        timeout = min(p.step_timeout_s, 0.9 * p.init_timeout_s)  # before the collectives' own timeout
        if timeout < p.step_timeout_s:
            self.log(f"note: the step watchdog times steps out after {timeout:g} s, 90% of parallel.init_timeout_s "
                     f"(parallel.step_timeout_s is {p.step_timeout_s:g})")
        return StepWatchdog(self.env.mesh, timeout_s=timeout, first_timeout_s=0.9 * p.init_timeout_s,
                            log=self.log if self.env.writer else None,
                            first_steps=c.train.cuda_graph_warmup + 1 if c.train.cuda_graph else 1,
                            on_timeout=lambda text: self.logger.close(failed=True)).start()

    @contextlib.contextmanager
    def _watched(self, name: str, step: int):
        """One phase of the step watchdog (a step, an eval, a checkpoint save); nothing without one. An error that
        every rank raises alike (a vote's, a halt on the reduced figures: ``agreed``) ends the phase plainly; any
        other goes through the watchdog, which names what the other ranks were doing."""
        if self.watchdog is None:
            yield
            return
        self.watchdog.begin_phase(name, step)
        try:
            yield
        except Exception as exc:
            if isinstance(exc, TrainingHalted) or getattr(exc, "agreed", False):
                self.watchdog.end_phase(name, step)
            else:
                self.watchdog.failed(exc)
            raise
        self.watchdog.end_phase(name, step)

    def _eval_is_larger(self) -> bool:
        """Whether eval runs on a CUDA device with micro-batches of more tokens than training's (_check_eval_memory)."""
        c = self.config
        return bool(c.eval.every) and self.device.type == "cuda" and (
            self.eval_mbs * self.eval_seq_length > c.train.micro_batch_size * self.seq_length)

    def _check_eval_memory(self) -> None:
        """Contract 28 (docs/contracts.md): when eval's micro-batches hold more tokens than training's (a longer
        eval.seq_length or a larger eval.micro_batch_size) on a CUDA device, one eval micro-batch runs right after
        the run's first step, when the optimizer's state and the allocator's pools exist: running out of memory
        there stops the run now with the keys to change, rather than at the first eval, perhaps hours in. Every
        rank agrees (one rank's failure stops all)."""
        c = self.config
        error = None
        try:
            self.evaluate(batches=1)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            error = (f"eval's micro-batch of {self.eval_mbs} x {self.eval_seq_length} tokens (training's: "
                     f"{c.train.micro_batch_size} x {self.seq_length}) does not fit in the memory training leaves "
                     f"({str(exc).splitlines()[0]}); lower eval.micro_batch_size or eval.seq_length")
        vote = self.vote.agree(None, error)
        if vote.errors:
            raise _agreed(ConfigError("; ".join(f"rank {r}: {m}" if self.env.world > 1 else m
                                                for r, m in sorted(vote.errors.items()))))
        self.log(f"eval memory: a micro-batch of {self.eval_mbs} x {self.eval_seq_length} tokens fits beside "
                 f"training ({memory_gib(self.device)[0]:.2f} GiB peak)")

    def _stop_on_signal(self, result: RunResult, signal_name: str, first_step: int, profiling: bool) -> RunResult:
        """The loop stopped on ``signal_name`` after a complete step: save (every rank), log, and say how to go on."""
        result.stopped_by = signal_name
        if profiling or self.step == first_step:
            why = "profiling" if profiling else f"no step was trained since step {first_step}"
            self.log(f"stopped by {signal_name} after step {self.step}: no checkpoint written ({why})")
            return result
        self.log(f"{signal_name}: step {self.step} finished; saving a checkpoint before stopping")
        with self._watched("checkpoint", self.step):
            self._between_steps(sync=True)  # the vote still in flight settled: the files checked up to this step
            result.checkpoint = str(self.save(asynchronous=False))
        self.log(f"stopped by {signal_name} after step {self.step}: checkpoint {result.checkpoint}; continue with "
                 f"checkpoint.resume={self.ckpt_dir} (exit code {EXIT_INTERRUPTED})")
        return result

    def _report(self, result: RunResult, figures: StepFigures, lr: float) -> None:
        """Read one step's figures (waiting for that step only), count a skipped step (TrainingHalted after
        train.max_nonfinite in a row), log and record them, with the step's own duration."""
        c, step = self.config, figures.step
        loss, norm, stepped = figures.read()
        elapsed = figures.time.ns() if figures.time is not None else 0
        result.losses[step] = loss
        if not stepped:
            self._consecutive += 1
            self.nonfinite_total += 1
            result.skipped_steps.append(step)
            self.log(f"step {step}: non-finite loss {loss} or gradient norm {norm}; step skipped "
                     f"({self._consecutive} in a row, {self.nonfinite_total} in all)")
            if self._consecutive >= c.train.max_nonfinite:
                raise TrainingHalted(
                    f"{self._consecutive} steps in a row (steps {step - self._consecutive + 1}..{step}) had a "
                    f"non-finite loss or gradient norm (train.max_nonfinite={c.train.max_nonfinite}); "
                    f"stopping. Try a lower optim.lr (now {c.optim.lr:g}) or longer schedule.warmup_steps, "
                    f"train.grad_clip, or check the data; the last checkpoint is in {self.ckpt_dir}")
        else:
            self._consecutive = 0
        window = self._window
        window[0] += elapsed
        window[1] += self.tokens_per_step
        window[2].append(loss)
        tok_s = window[1] / (max(window[0], 1) / 1e9)
        mfu = (self.flops_per_token * tok_s / self.env.world / self.peak) if self.peak else None
        mem, mem_what = memory_gib(self.device)
        self.logger.progress(step, f"loss {loss:.4f} lr {lr:.2e} {format_count(tok_s)} tok/s MFU "
                             f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} {mem:.2f} GiB")
        self.logger.record(step, {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm,
                                  "perf/tokens_per_s": tok_s, "perf/mfu": mfu, "perf/memory_gib": mem,
                                  "perf/step_ms": elapsed / 1e6})
        if step % c.log.every == 0 or step == c.train.steps:
            self.log(f"step {step:>6}/{c.train.steps} | loss {sum(window[2]) / len(window[2]):.4f} | "
                     f"lr {lr:.3e} | grad norm {norm:.3f} | {format_count(tok_s)} tok/s | MFU "
                     f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {mem_what} {mem:.2f} GiB")
            self._window = [0, 0, []]

    def _eval(self, result: RunResult) -> None:
        loss = float(self.evaluate())
        result.eval_losses[self.step] = loss
        self.logger.record(self.step, {"eval/loss": loss})
        self.log(f"step {self.step:>6} | eval loss {loss:.4f} (held out, {self.config.eval.batches} x "
                 f"{self.eval_mbs} x {self.eval_seq_length})")

    # -- profiling ------------------------------------------------------------------------------------------------
    def _profiler(self):
        lg = self.config.log
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # a CUDA build of torch on a machine without a GPU: libkineto's GPU enumeration logs a spurious
            # "gpuGetDeviceCount failed" ERROR when the profiler starts, whatever the activities; its log level is
            # read then (an explicit KINETO_LOG_LEVEL is kept)
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        schedule = torch.profiler.schedule(wait=lg.profile_wait, warmup=lg.profile_warmup, active=lg.profile_active,
                                           repeat=1)
        return torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=True)

    def _write_profile(self, profiler) -> Path:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        c = self.config.model
        rank = f"-rank{dist.get_rank()}" if dist.is_available() and dist.is_initialized() else ""
        out = Path(self.config.log.profile_dir) / f"train-{c.n_layer}x{c.n_embd}-{self.device.type}-{stamp}{rank}"
        out.mkdir(parents=True, exist_ok=True)
        profiler.export_chrome_trace(str(out / "trace.json"))
        on_gpu = self.device.type == "cuda"
        sort = "self_device_time_total" if on_gpu else "self_cpu_time_total"
        events = profiler.key_averages()
        trace = _timeline.load(out / "trace.json")
        timeline = ""
        if on_gpu:  # the split of each step's GPU time, then the GPU time by launching op
            timeline = _timeline.report(_timeline.analyze(trace)) + "\n" + _timeline.sources(trace, top=40)
        if timeline:
            (out / "timeline.txt").write_text(timeline + "\n")
        lines = [f"# megakern-train --profile: {self.config.log.profile_active} steps of {self.global_batch} x "
                 f"{self.seq_length} tokens, {self.device} ({torch.cuda.get_device_name(self.device) if on_gpu else 'cpu'}), "
                 f"precision {self.precision}, torch {torch.__version__}",
                 "# ranges: data, forward, backward, optimizer (also NVTX ranges train.* for Nsight Systems)",
                 _timeline.host_summary(trace), *([timeline] if timeline else []), "",
                 events.table(sort_by=sort, row_limit=40, max_name_column_width=80)]
        if on_gpu:  # the host's side too: launches, synchronizations, Python-side overheads
            lines += ["", "# host (sorted by self CPU time)",
                      events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=80)]
        (out / "kernels.txt").write_text("\n".join(lines))
        self.log(f"profile: {out / 'trace.json'} (chrome://tracing or ui.perfetto.dev), {out / 'kernels.txt'}")
        return out


# ---------------------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megakern-train", description="Train a GPT built from megakern's kernels. Config: defaults (gpt-tiny "
        "on the default corpus), then --config FILE, then key=value overrides (optim.lr=3e-4 model.n_layer=12).")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides (see --help-config)")
    parser.add_argument("--config", type=Path, help="a YAML file of sections (configs/*.yaml)")
    parser.add_argument("--profile", action="store_true",
                        help="run log.profile_wait + warmup + active steps under torch.profiler, write a trace and a "
                             "top-kernels table into log.profile_dir, and stop")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_args(argv)


def _expected_errors() -> tuple[type[BaseException], ...]:
    """The errors a run reports as one ``megakern-train: error:`` line (and a log line): bad config, data,
    checkpoints, log sinks, run directories, a halted run, and megakern.parallel's start-up failures (a rank that
    never joined, ranks that disagree)."""
    errors: tuple = (ConfigError, DataError, CheckpointError, LoggerError, TrainingHalted, RunDirError)
    try:
        from megakern.parallel.dims import DisagreementError, RendezvousError

        errors += (RendezvousError, DisagreementError)
    except ImportError:
        pass
    return errors


def main(argv=None) -> int:
    """The console script. Exit codes: 0 done; 1 an error (one line on stderr, and in train.log once the run
    directory exists); 2 a config error; EXIT_INTERRUPTED (75) stopped by SIGTERM / SIGINT after saving a
    checkpoint, or by a second signal without one."""
    args = parse_args(argv)
    trainer = None
    signals = StopSignals(log=lambda line: print(f"megakern-train: {line}", file=sys.stderr, flush=True))
    try:
        if args.help_config:
            print(describe_fields())
            return 0
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(config), end="")
            return 0
        signals.install()
        trainer = Trainer(config, profile=args.profile, signals=signals)
        result = trainer.run()  # (releases a CUDA-graph step: NCCL's teardown would wait on a live graph's work)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank done with its collectives before any tears its process group down
        return EXIT_INTERRUPTED if result.stopped_by else 0
    except _expected_errors() as exc:
        print(f"megakern-train: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"megakern-train: stopped: {exc or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signals.restore()
        live_graph = getattr(getattr(trainer, "step_graph", None), "graph", None) is not None
        if dist.is_available() and dist.is_initialized() and not live_graph:
            dist.destroy_process_group()  # (after an error with a live graph: left to the exit, which aborts NCCL)
            # the process groups' objects (and gloo's worker threads) live on while the trainer's groups and meshes
            # reference them: collected here, while the interpreter is alive. Left to the exit, a gloo worker could
            # still be freeing the last collectives' tensors during finalization, and aborted the process
            # ("terminate called without an active exception") after a complete run
            trainer = None
            gc.collect()


if __name__ == "__main__":
    sys.exit(main())
