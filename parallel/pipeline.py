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

Packed documents: the schedules split every tensor of ``step``'s positional and keyword arguments along dim 0 and
replicate the rest, and hand each stage's forward its micro-batch's keyword arguments (on every pp rank: each
calls ``step(..., **kwargs)`` with the same ones). ``packed_microbatches`` makes them: ``cu_seqlens`` a (m, K) int32
table, row j micro-batch j's offsets (re-based to 0) padded with its last offset (empty documents at the end),
``max_seqlen`` the longest document of any micro-batch (an int, replicated), and optionally ``position_ids`` (m, L)
(context parallel's THD positions). ``PipelineChunk.forward(x, cu_seqlens=row, max_seqlen=..., position_ids=row)``
passes them to the GPT. A kwarg, not a per-chunk counter of micro-batches: the schedule's metadata inference runs one
extra forward on the first step, and the split keeps each micro-batch's packing with its tokens whatever order a
schedule runs them in.
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
    """A stage as the pipeline runs it: ``forward(x, cu_seqlens=None, max_seqlen=None, position_ids=None)`` =
    gpt(x, ...) inside the context ``rng_context()`` returns (the dropout RNG tracker's region for this stage; none
    by default). Without ``position_ids`` the attribute ``self.position_ids`` (the step's, context parallel) applies.

    ``cu_seqlens``: this micro-batch's row (1, K) (or (K,)) of ``packed_microbatches``' table: offsets of its packed
    documents in its B' * T tokens, trailing repeats (empty documents) allowed; ``max_seqlen`` the longest document
    (given: no host read); ``position_ids`` (1, L) or (L,): explicit positions (the THD layout of context parallel,
    where positions do not restart at the local documents' starts). ``targets`` (this micro-batch's): on the last
    stage (the one with the final norm) the output is the micro-batch's summed loss, taken by the model's own fused
    linear cross-entropy (vocab-parallel under tensor parallelism), not its logits; other stages ignore them."""

    def __init__(self, gpt: nn.Module, rng_context=None):
        super().__init__()
        self.gpt = gpt
        self.position_ids = None  # set by the ParallelModel for each step (context parallel)
        self.rng_context = rng_context or contextlib.nullcontext

    def forward(self, x, cu_seqlens=None, max_seqlen=None, position_ids=None, targets=None):
        pos = self.position_ids if position_ids is None else position_ids
        if cu_seqlens is not None:
            cu_seqlens = cu_seqlens.reshape(-1)
        if getattr(self.gpt, "norm_f", None) is None:
            targets = None
        loss = {} if targets is None else {"reduction": "sum"}
        with self.rng_context():
            # the position ids, packing and targets are the ParallelModel's own: no host read of their range
            if cu_seqlens is None:
                out = self.gpt(x, targets, position_ids=pos, check_values=False, **loss)
            elif pos is None:
                out = self.gpt(x, targets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, check_values=False, **loss)
            else:
                out = self.gpt(x, targets, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, position_ids=pos,
                               check_values=False, **loss)
        # the summed loss as a (1,) tensor: the schedule concatenates the micro-batches' outputs
        return out if targets is None else out.reshape(1)


def packed_microbatches(cu_seqlens: list[torch.Tensor], *, position_ids: torch.Tensor | None = None,
                        max_seqlen: int | None = None, device=None) -> dict:
    """The keyword arguments of ``schedule.step`` for packed micro-batches (see the module docstring).

    ``cu_seqlens``: one 1-D int32 tensor per micro-batch, its documents' offsets from 0 to its token count (equal for
    all: the schedule splits the batch evenly); ``position_ids`` (m, L) or None; ``max_seqlen`` their longest
    document (None: read, one host read). Returns {"cu_seqlens": (m, K) int32 on ``device``, "max_seqlen": int
    [, "position_ids": (m, L)]}."""
    if not isinstance(cu_seqlens, (list, tuple)) or not cu_seqlens:
        raise ValueError("packed_microbatches: cu_seqlens must be a non-empty list, one tensor per micro-batch")
    rows, longest, total = [], 0, None
    for j, cu in enumerate(cu_seqlens):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            raise TypeError(f"packed_microbatches: micro-batch {j}'s cu_seqlens must be a 1-D torch.int32 tensor of "
                            ">= 2 offsets")
        offsets = cu.tolist()
        if offsets[0] != 0 or any(b < a for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"packed_microbatches: micro-batch {j}'s cu_seqlens must start at 0 and not decrease, "
                             f"got {offsets[:16]}")
        if total is not None and offsets[-1] != total:
            raise ValueError(f"packed_microbatches: micro-batch {j} holds {offsets[-1]} tokens, micro-batch 0 "
                             f"{total}; the schedule splits the batch into equal micro-batches")
        total = offsets[-1]
        longest = max(longest, max(b - a for a, b in zip(offsets, offsets[1:])))
        rows.append(offsets)
    width = max(len(r) for r in rows)
    table = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int32, device=device)
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(f"packed_microbatches: max_seqlen {max_seqlen} < the longest document ({longest})")
    out = {"cu_seqlens": table, "max_seqlen": int(max_seqlen if max_seqlen is not None else longest)}
    if position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[0] != len(rows):
            raise ValueError(f"packed_microbatches: position_ids must be (m={len(rows)}, L), got "
                             f"{tuple(position_ids.shape)}")
        out["position_ids"] = position_ids
    return out


def build_schedule(name: str, submods: list[nn.Module], stage_indices: list[int], num_stages: int, device, group,
                   n_microbatches: int, loss_fn):
    """The schedule over this rank's stages (submods: the PipelineChunks, wrapped by DDP/FSDP where used)."""
    stages = [PipelineStage(mod, idx, num_stages, device, group=group) for mod, idx in zip(submods, stage_indices)]
    cls = SCHEDULES[name]
    if name == "interleaved-1f1b":
        return cls(stages, n_microbatches, loss_fn=loss_fn, scale_grads=False)
    return cls(stages[0], n_microbatches, loss_fn=loss_fn, scale_grads=False)
