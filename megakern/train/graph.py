"""The training step in a CUDA graph (``train.cuda_graph``): StepGraph captures TrainStep's device step once and
replays it; ``resolve_cuda_graph`` decides 'auto'; ``check_graph`` says why a run cannot be captured
(``parallel_graph_problems``: over several ranks)."""
from __future__ import annotations

import dataclasses
import gc

import torch

from megakern.config import ConfigError, TrainConfig
from megakern.data import Batch, targets_of
from megakern.train.figures import StepFigures
from megakern.train.step import TrainStep


def _needs(config: TrainConfig, device: torch.device, fused_adamw: bool, fp8: bool, packed: bool) -> list[str]:
    """What a CUDA-graph step needs and a run on ``device`` lacks, worded for one log line or error: the device, an
    optimizer that skips a bad step by itself, no compile, no FP8, fixed shapes."""
    return [why for bad, why in (
        (device.type != "cuda", f"a CUDA device (train.device is {device})"),
        (not fused_adamw, f"fused AdamW (optim.fused is {config.optim.fused}; auto, megakern or fused)"),
        (config.train.compile, "no train.compile"), (fp8, f"no FP8 (train.fp8 is {config.train.fp8})"),
        (packed, "fixed shapes (data.packed_documents varies them)")) if bad]


def check_graph(config: TrainConfig, step: TrainStep) -> None:
    """ConfigError naming what train.cuda_graph needs and this run lacks (nothing when it can be captured)."""
    problems = _needs(config, step.device, step.device_skip, step.has_fp8, step.eod_id is not None)
    if problems:
        raise ConfigError("train.cuda_graph needs " + ", ".join(problems))


def parallel_graph_problems(config: TrainConfig, world: int) -> list[str]:
    """Why ``config``'s train.cuda_graph=true cannot run over ``world`` ranks (empty: it can, or no graph is asked;
    'auto' is decided by ``resolve_cuda_graph``)."""
    return _layout_problems(config, world) if config.train.cuda_graph is True else []


def _layout_problems(config: TrainConfig, world: int) -> list[str]:
    """What keeps ``config``'s layout over ``world`` ranks out of a CUDA graph."""
    c, p = config, config.parallel
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


def resolve_cuda_graph(config: TrainConfig, device: torch.device, world: int) -> tuple[TrainConfig, str | None]:
    """``config`` with train.cuda_graph 'auto' decided for this ``device`` and ``world`` ranks, and the log line that
    says what was decided and why (None when train.cuda_graph was given as true or false). 'auto' captures the
    step wherever train.cuda_graph=true would be accepted and some step follows the warm-up; the conditions are
    those ``check_graph`` and ``parallel_graph_problems`` check, read from the config."""
    t, p = config.train, config.parallel
    if t.cuda_graph != "auto":
        return config, None
    # what check_graph reads from the built step, foreseen from the config: fused AdamW (device_skip) wherever
    # optim.fused resolves to a fused torch AdamW on CUDA, FP8 layers, the packed documents' offsets
    needs = _needs(config, device, config.optim.fused in ("auto", "megakern", "fused"), t.fp8 != "none",
                   config.data.packed_documents)
    needs += [why for bad, why in (
        (p.ep > 1 and config.model.moe_capacity_factor is None,
         f"a capacity factor under parallel.ep={p.ep} (model.moe_capacity_factor: dropless dispatch reads its split "
         "sizes on the host)"),
        (t.steps <= t.cuda_graph_warmup,
         f"steps after the warm-up (train.steps {t.steps} <= train.cuda_graph_warmup {t.cuda_graph_warmup})"))
        if bad]
    layout = _layout_problems(config, world) if world > 1 else []
    on = not needs and not layout
    resolved = dataclasses.replace(config, train=dataclasses.replace(t, cuda_graph=on))
    if on:
        return resolved, (f"train.cuda_graph auto: the step is captured in a CUDA graph after "
                          f"{t.cuda_graph_warmup} eager step(s) and replayed (train.cuda_graph=false for eager steps)")
    why = (["a CUDA graph needs " + ", ".join(needs)] if needs else []) + layout
    return resolved, "train.cuda_graph auto: eager steps, because " + "; ".join(why)


class StepGraph:
    """The training step captured once in a CUDA graph and replayed (``train.cuda_graph``).

    The first ``warmup`` steps run eagerly: they compile the kernels, create the optimizer's state, warm the
    allocator (and over several ranks create NCCL's communicators, which a capture cannot). The next step is
    captured with its batches in static device buffers, then replayed; every later step copies its batches into
    those buffers and replays, one launch instead of the step's thousands. What changes from step to step lives in
    device memory: the batches, the learning rate (a tensor TrainStep.set_lr fills before each step), the skip flag
    (computed inside the graph); nothing is read on the host. Eval and checkpoints run eagerly between replays on
    the same parameters and optimizer state.

    One process: the step's ``accum`` micro-batches. Over several ranks (megakern.parallel, tensor / context /
    DDP data parallel): the rank's whole step batch, one draw, which ``forward_backward`` cuts into micro-batches;
    its collectives (NCCL) are captured with the compute and replayed on every rank alike, and the wait for a
    replay's figures is bounded by ``replay_timeout`` seconds (NCCL's watchdog does not watch captured collectives).
    The capture runs on the step's ``capture_stream``, the stream DDP was built on (DDP keeps autograd nodes made on
    that stream).
    """

    def __init__(self, step: TrainStep, warmup: int, *, log, replay_timeout: float | None = None):
        self.train_step, self.warmup, self.log, self.replay_timeout = step, warmup, log, replay_timeout
        self.graph = None
        self.inputs = self.targets = self.values = None

    def run(self, samples: list[dict], number: int) -> StepFigures:
        """Step ``number`` on ``samples`` (the step's draws): eagerly during the warm-up, else replayed."""
        t = self.train_step
        if self.graph is None and self.warmup > 0:
            self.warmup -= 1
            return t.run(samples, number)
        with t.range("data"):
            tokens = [s["tokens"] for s in samples]
            if self.inputs is None:
                shape = (len(tokens), *tokens[0][:, :-1].shape)
                self.inputs = torch.empty(shape, dtype=tokens[0].dtype, device=t.device)
                self.targets = torch.empty(shape, dtype=tokens[0].dtype, device=t.device)
            for i, (tok, sample) in enumerate(zip(tokens, samples)):
                if tok[:, :-1].shape != self.inputs.shape[1:]:
                    raise RuntimeError(f"train.cuda_graph: a batch of shape {tuple(tok[:, :-1].shape)} after "
                                       f"the captured {tuple(self.inputs.shape[1:])}: the graph needs fixed shapes")
                self.inputs[i].copy_(tok[:, :-1], non_blocking=True)
                self.targets[i].copy_(targets_of(sample), non_blocking=True)  # a loss mask's ignored targets too
        if self.graph is None:
            self._capture(number)
        self.graph.replay()
        figures = t.to_host(self.values, number)
        figures.timeout = self.replay_timeout
        return figures

    @property
    def live(self) -> bool:
        """Whether a captured graph (and the device work it holds) is alive."""
        return self.graph is not None

    def release(self) -> None:
        """Drop the captured graph and its memory pool once the device is done with it (a later step captures
        again). Over several ranks this must come before the process group is destroyed: NCCL's teardown waits on
        the work a live graph holds, and would hang."""
        if self.graph is not None:
            torch.cuda.synchronize(self.train_step.device)
            self.graph.reset()
            self.graph = self.values = None

    def _capture(self, number: int) -> None:
        t = self.train_step
        batches = [Batch(self.inputs[i], self.targets[i]) for i in range(self.inputs.shape[0])]
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
                self.values = t.device_step(t.figures(batches))
        finally:
            gc.enable()
        t.after_capture()
        self.log(f"step {number}: captured the training step in a CUDA graph "
                 f"({t.microbatches} micro-batch(es))")
