"""Pipeline parallelism: stages cut from a GPT, run by torch.distributed.pipelining's schedules.

With pp ranks and v stages per rank (v = 1 for GPipe and 1F1B, v >= 2 for interleaved 1F1B) there are S = pp * v
stages of n_layer / S consecutive blocks; rank p holds stages p, p + pp, ..., p + (v-1) pp (the looped layout
torch's ScheduleInterleaved1F1B expects). A stage is the GPT with the other stages' blocks deleted from
``blocks`` (FQNs stay those of the whole model), ``wte``/``wpe`` only on stage 0, ``norm_f`` and the head only on
stage S-1. With tied embeddings the last stage holds a copy of wte's weight as its head; the two copies' gradients
are summed after each step (``tied_group``), so they stay equal.

Each stage runs inside ``PipelineChunk``, which passes the step's position ids (context parallel) to every stage;
the last stage's output is the logits (this rank's vocabulary columns under tensor parallel) and the schedule's
loss function turns them into the loss. Micro-batches: the batch's dim 0 is split into ``n_microbatches``.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


def check_schedule(name: str, pp: int, stages_per_rank: int, n_microbatches: int) -> None:
    """Raise ValueError naming the numbers for a schedule that cannot run this layout."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline: unknown schedule {name!r}; schedules: {', '.join(SCHEDULES)}")
    if name == "interleaved-1f1b":
        if stages_per_rank < 2:
            raise ValueError(f"pipeline: interleaved-1f1b needs >= 2 stages per rank, got {stages_per_rank}")
        if n_microbatches < pp or n_microbatches % pp:
            raise ValueError(f"pipeline: interleaved-1f1b needs a multiple of pp={pp} micro-batches, got "
                             f"{n_microbatches}")
    elif stages_per_rank != 1:
        raise ValueError(f"pipeline: {name} runs one stage per rank, got stages_per_rank={stages_per_rank}")
    if name == "1f1b" and n_microbatches < pp:
        raise ValueError(f"pipeline: 1f1b needs at least pp={pp} micro-batches, got {n_microbatches}")


def stage_layout(n_layer: int, pp: int, stages_per_rank: int, pp_rank: int) -> list[tuple[int, range]]:
    """[(stage index, the blocks it holds)] for this pp rank."""
    stages = pp * stages_per_rank
    if n_layer % stages:
        raise ValueError(f"pipeline: {n_layer} layers do not split into {stages} stages of equal size")
    per = n_layer // stages
    return [(s, range(s * per, (s + 1) * per)) for s in (pp_rank + v * pp for v in range(stages_per_rank))]


def cut_stage(model: nn.Module, stage: int, num_stages: int, blocks: range, *, reuse: bool = False):
    """(the stage's GPT, whether its head is a copy of the tied wte weight). ``reuse``: cut ``model`` itself
    instead of a copy."""
    chunk = model if reuse else copy.deepcopy(model)
    for name in list(chunk.blocks.keys()):
        if int(name) not in blocks:
            del chunk.blocks[name]
    first, last = stage == 0, stage == num_stages - 1
    tied_copy = False
    if last and not first and chunk.lm_head is None:
        weight = chunk.wte.weight
        chunk.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device,
                                  dtype=weight.dtype)
        with torch.no_grad():
            chunk.lm_head.weight.copy_(weight)
        tied_copy = True
    if not first:
        chunk.wte = None
        chunk.wpe = None
    if not last:
        chunk.norm_f = None
        chunk.lm_head = None
    return chunk, tied_copy


class PipelineChunk(nn.Module):
    """A stage as the pipeline runs it: ``forward(x)`` = gpt(x, position_ids=self.position_ids), inside the context
    ``rng_context()`` returns (the dropout RNG tracker's region for this stage; none by default)."""

    def __init__(self, gpt: nn.Module, rng_context=None):
        super().__init__()
        self.gpt = gpt
        self.position_ids = None  # set by the ParallelModel for each step (context parallel)
        self.rng_context = rng_context or contextlib.nullcontext

    def forward(self, x):
        with self.rng_context():
            # the position ids are the ParallelModel's own (context-parallel shards): no host read of their range
            return self.gpt(x, position_ids=self.position_ids, check_values=False)


def build_schedule(name: str, submods: list[nn.Module], stage_indices: list[int], num_stages: int, device, group,
                   n_microbatches: int, loss_fn):
    """The schedule over this rank's stages (submods: the PipelineChunks, wrapped by DDP/FSDP where used)."""
    stages = [PipelineStage(mod, idx, num_stages, device, group=group) for mod, idx in zip(submods, stage_indices)]
    cls = SCHEDULES[name]
    if name == "interleaved-1f1b":
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
