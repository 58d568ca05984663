"""The tensor-parallel (+ sequence-parallel) plan for megakern.models.gpt.GPT, applied to a built model in place.

Per block (tp ranks, group g):
- attention: qkv -> ColumnParallelLinear (rows are grouped per kv head, so rank r's rows are kv heads
  [r*nkv/tp, (r+1)*nkv/tp) with their query heads); n_head / n_kv_head become the local counts; proj ->
  RowParallelLinear. The attention core runs on the local heads unchanged.
- MLP: fc -> ColumnParallelLinear (swiglu's interleaved gate/up rows stay paired), proj -> RowParallelLinear.
- MoE MLP (models/moe.py): whole on every tp rank (its experts, router and shared experts: expert parallelism is
  what shards experts). Without sequence parallel every tp rank computes it on the same tokens (replicated, like
  the norms); under sequence parallel it routes this rank's token shard, its statistics and aux loss count the
  shards' sum (``shard_tokens``), and its gradients are partial sums over tp (``sp_partial``).
- The input of attn and of mlp enters the tensor-parallel region once, by a forward pre-hook: ``copy_to_tp``, or
  under sequence parallel ``gather_from_sp`` (the token shards all-gathered); the row layers leave it by an
  all-reduce, or a reduce-scatter back to the token shards. Under autocast the input is cast to the autocast
  dtype before it enters (the Linear would cast it first thing): the all-gather and its backward reduce-scatter
  (or copy_to_tp's backward all-reduce) move bf16, not fp32.
Embedding and head: wte -> VocabParallelEmbedding (under SP its reduce-scatter lands the embeddings on the
token shards, mappings' split of the (B, T) tokens; a learned position table's output, one row per token
(``GPT.positions_per_token``), is split to the same shard by a forward hook); norm_f's output
enters the region by a forward hook (copy / gather) and the head (lm_head, or the tied wte) gives this rank's
vocabulary columns of the logits. The loss is the GPT's own (its ``vocab_parallel_loss``, set here):
``vocab_parallel_linear_cross_entropy``, chunked over the tokens, never this rank's (tokens x vocab/tp) logits in
fp32 (a pipeline's last stage takes it too: its micro-batch's targets travel with it, pipeline.PipelineChunk).

Under sequence parallel the norms (and RowParallel biases) see only this rank's tokens: their gradients are
partial sums over the tp group, listed in the returned ``TPInfo.sp_partial`` and all-reduced after backward.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from megakern.parallel.cross_entropy import vocab_parallel_linear_cross_entropy
from megakern.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from megakern.parallel.mappings import all_reduce, copy_to_tp, gather_from_sp, group_size, scatter_to_sp


@dataclass
class TPInfo:
    """What the rest of the plan needs to know about the sharded model (names relative to the GPT)."""

    shard_dims: dict[str, int] = field(default_factory=dict)
    """Parameter name -> the dim of the full tensor split over tp (others are whole on every tp rank)."""
    sp_partial: set[str] = field(default_factory=set)
    """Parameters whose gradients are partial sums over tp (sequence parallel) and need an all-reduce."""


def _to_autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the autocast dtype when autocast is on for its device: attn and mlp start with a Linear, which casts
    its input so anyway; casting before the collective halves its bytes (and its backward's) and changes no value."""
    if x.is_floating_point() and torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        if x.dtype != dtype and x.element_size() > torch.empty((), dtype=dtype).element_size():
            return x.to(dtype)
    return x


def _enter_hook(group, sequence_parallel: bool, fused: bool = False):
    """``fused``: the block's column layer gathers its input itself (gather_gemm); only the autocast cast here."""
    def hook(module, args):
        x = _to_autocast_dtype(args[0])
        if not fused:
            x = gather_from_sp(x, group, 1) if sequence_parallel else copy_to_tp(x, group)
        return (x, *args[1:])

    return hook


def _norm_out_hook(group, sequence_parallel: bool):
    """The final norm's output into the tensor-parallel region, in the autocast dtype first (the head casts it so
    anyway: the gather and its backward's reduce-scatter move half the bytes)."""
    def hook(module, args, out):
        def enter(y):
            y = _to_autocast_dtype(y)
            return gather_from_sp(y, group, 1) if sequence_parallel else copy_to_tp(y, group)

        return (enter(out[0]), *out[1:]) if isinstance(out, tuple) else enter(out)

    return hook


def _split_positions_hook(group):
    def hook(module, args, out):  # (B, T, C): one row per token (GPT.positions_per_token)
        if out.dim() != 3:
            raise RuntimeError(f"tensor parallel: the learned positions came as {tuple(out.shape)}, not one row per "
                               "token (B, T, C): the token shards cannot split a table broadcast over the batch")
        return scatter_to_sp(out, group, 1)

    return hook


def apply_tensor_parallel(gpt: nn.Module, group, sequence_parallel: bool, gemm_reduce=None,
                          gather_gemm=None) -> TPInfo:
    """Shard ``gpt`` (a GPT or a pipeline stage of one) over ``group`` in place; returns its TPInfo.
    ``gemm_reduce``: the row-parallel layers' GEMM + reduction (layers.linear_reduce when None; e.g.
    overlap.gemm_reduce_scatter). ``gather_gemm``: under sequence parallel, the column layers of attention and the
    MLP (qkv, fc) take their input's token shard and gather it under their GEMM (e.g. overlap.all_gather_gemm;
    the attention and MLP modules then receive the shard and read the whole sequence's shape off their projection)."""
    info = TPInfo()
    tp = group_size(group)
    if tp == 1:
        return info
    fused = gather_gemm is not None and sequence_parallel
    column = (dict(sequence_parallel=True, gather_gemm=gather_gemm) if fused else dict(input_is_gathered=True))
    for bname, block in gpt.blocks.items():
        attn, mlp = block.attn, block.mlp
        for name, n in (("n_head", attn.n_head), ("n_kv_head", attn.n_kv_head)):
            if n % tp:
                raise ValueError(f"tensor parallel: block {bname} has {n} {name.replace('n_', '')}s, not divisible "
                                 f"by tp={tp}")
        attn.qkv = ColumnParallelLinear.from_linear(attn.qkv, group, **column)
        attn.proj = RowParallelLinear.from_linear(attn.proj, group, sequence_parallel=sequence_parallel,
                                                  gemm_reduce=gemm_reduce)
        attn.n_head, attn.n_kv_head = attn.n_head // tp, attn.n_kv_head // tp
        attn.register_forward_pre_hook(_enter_hook(group, sequence_parallel, fused))
        layers = [("attn.qkv", attn.qkv), ("attn.proj", attn.proj)]
        if getattr(mlp, "is_moe", False):
            if sequence_parallel:
                mlp.shard_tokens(functools.partial(all_reduce, group=group), tp)
                info.sp_partial.update(f"blocks.{bname}.mlp.{p}" for p, _ in mlp.named_parameters())
        else:
            mlp.fc = ColumnParallelLinear.from_linear(mlp.fc, group, **column)
            mlp.proj = RowParallelLinear.from_linear(mlp.proj, group, sequence_parallel=sequence_parallel,
                                                     gemm_reduce=gemm_reduce)
            mlp.register_forward_pre_hook(_enter_hook(group, sequence_parallel, fused))
            layers += [("mlp.fc", mlp.fc), ("mlp.proj", mlp.proj)]
        for lname, layer in layers:
            for pname, dim in layer.tp_shard_dims.items():
                if getattr(layer, pname) is not None:
                    info.shard_dims[f"blocks.{bname}.{lname}.{pname}"] = dim
            info.sp_partial.update(f"blocks.{bname}.{lname}.{p}" for p in layer.sp_partial)
        if sequence_parallel:
            for nname in ("attn_norm", "mlp_norm"):
                info.sp_partial.update(f"blocks.{bname}.{nname}.{p}" for p, _ in
                                       getattr(block, nname).named_parameters())
    if getattr(gpt, "wte", None) is not None:
        gpt.wte = VocabParallelEmbedding.from_embedding(gpt.wte, group, sequence_parallel=sequence_parallel)
        info.shard_dims["wte.weight"] = 0
        if sequence_parallel and getattr(gpt, "wpe", None) is not None:
            gpt.positions_per_token = True
            gpt.wpe.register_forward_hook(_split_positions_hook(group))
    if getattr(gpt, "norm_f", None) is not None:
        gpt.norm_f.register_forward_hook(_norm_out_hook(group, sequence_parallel))
        if sequence_parallel:
            info.sp_partial.update(f"norm_f.{p}" for p, _ in gpt.norm_f.named_parameters())
        if gpt.lm_head is not None:  # the model reads lm_head.weight (rows: the vocabulary)
            gpt.lm_head = ColumnParallelLinear.from_linear(gpt.lm_head, group, input_is_gathered=True)
            info.shard_dims["lm_head.weight"] = 0
        elif getattr(gpt, "wte", None) is None:
            raise ValueError("tensor parallel: a stage with norm_f but neither lm_head nor wte has no output "
                             "projection")
        gpt.vocab_parallel_loss = functools.partial(vocab_parallel_linear_cross_entropy, group=group)
    return info
