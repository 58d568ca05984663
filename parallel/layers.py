"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding.

With tp ranks, a Linear y = x W^T + b, W (N, K):
- column parallel: W split by rows (output features), rank r holds W[r*N/tp : (r+1)*N/tp] and b's same slice; input
  x whole (``copy_to_tp``: its gradient is summed over ranks), output y's feature shard (B, T, N/tp);
- row parallel: W split by columns (input features), rank r holds W[:, r*K/tp : (r+1)*K/tp]; input x's feature
  shard, partial products summed over ranks (``reduce_from_tp``), then + b (whole on every rank).
A column layer followed by a row layer (attention qkv -> proj, MLP fc -> proj) needs one all-reduce forward and
one backward. Under sequence parallel the column layer all-gathers the token shards of its input
(``gather_from_sp``) and the row layer reduce-scatters its output back to them (``reduce_scatter_to_sp``).

The row layer's matmul + reduction go through ``self.gemm_reduce(x, weight, group, sequence_parallel, seq_dim,
bias=...)`` (default ``linear_reduce``: F.linear, then all-reduce or reduce-scatter, then the bias): the seam where
the overlapped GEMM + reduce-scatter (``overlap.gemm_reduce_scatter``) plugs in without touching the layer. Both
layers add their bias in the product's dtype, as F.linear does under autocast (a bf16 output, not bf16 + fp32).

Each layer lists its sharded parameters in ``tp_shard_dims`` ({name: dim of the full tensor that is split}) and
its parameters whose gradients are partial over the tp group (``sp_partial``: a bias added to token shards):
the parallel plan reads both (gradient reduction, checkpoints, clipping). ``from_linear`` / ``from_embedding``
build the layer from a full module, keeping this rank's slice of its parameters.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakern.parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, group_rank, group_size,
                                        reduce_from_tp, reduce_scatter_to_sp, scatter_to_tp)


def _local(size: int, group, what: str) -> int:
    n = group_size(group)
    if size % n:
        raise ValueError(f"{what}: {size} is not divisible by the tensor-parallel size {n}")
    return size // n


def linear_reduce(x: torch.Tensor, weight: torch.Tensor, group, sequence_parallel: bool, seq_dim: int,
                  bias: torch.Tensor | None = None):
    """The row-parallel layer's default GEMM + reduction: x @ weight^T summed over ``group`` (all-reduce), or its
    token shard under sequence parallel (reduce-scatter along ``seq_dim``); then + ``bias`` (whole on every rank) in
    the product's dtype. A fused, overlapped kernel replaces this with the same signature and semantics."""
    y = F.linear(x, weight)
    y = reduce_scatter_to_sp(y, group, seq_dim) if sequence_parallel else reduce_from_tp(y, group, inplace=True)
    return y if bias is None else y + bias.to(y.dtype)


def _fp8_gemm(layer: nn.Module, recipe) -> nn.Module:
    """A megakern.fp8.Linear computing ``layer``'s local product x W_local^T in FP8 (no bias: the layer adds it),
    sharing the layer's weight; its scaling state is this rank's (the amaxes are reduced over the ranks by
    ParallelModel.update_fp8_scales)."""
    from megakern import fp8

    out_local, in_local = layer.weight.shape
    gemm = fp8.Linear(in_local, out_local, bias=False, recipe=recipe, device=layer.weight.device,
                      dtype=layer.weight.dtype)
    gemm.weight = layer.weight
    return gemm


class ColumnParallelLinear(nn.Module):
    """y[..., shard] = x W_shard^T + b_shard: weight (out_features / tp, in_features).

    ``gather_output``: all-gather y's features (the full output on every rank; rarely wanted).
    ``sequence_parallel``: x is this rank's token shard (sequence dim ``seq_dim``); it is all-gathered first.
    ``input_is_gathered``: x already entered the tensor-parallel region (the caller applied copy_to_tp /
    gather_from_sp itself, e.g. once for several layers reading the same input).
    ``gather_gemm``: under sequence parallel, the all-gather + GEMM ``gather_gemm(x, weight, group, seq_dim,
    bias=...)`` (e.g. overlap.all_gather_gemm) in place of gather_from_sp, then the matmul.
    """

    tp_shard_dims = {"weight": 0, "bias": 0}
    sp_partial: tuple[str, ...] = ()

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 input_is_gathered: bool = False, gather_gemm=None, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        self.input_is_gathered = input_is_gathered
        self.gather_gemm = gather_gemm
        self.fp8_gemm = None
        local = _local(out_features, group, "ColumnParallelLinear out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(local, device=device, dtype=dtype)) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> ColumnParallelLinear:
        """This rank's rows of a full Linear (copied)."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        n, r = layer.weight.shape[0], group_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[r * n:(r + 1) * n])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias[r * n:(r + 1) * n])
        return layer

    def _columns(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """This rank's columns x W_shard^T (+ ``bias``), the input entered / gathered first."""
        fused = (self.gather_gemm is not None and self.sequence_parallel and not self.input_is_gathered
                 and self.fp8_gemm is None)
        if fused:  # the all-gather under the GEMM, the bias in its epilogue (in the product's dtype, as F.linear:
            # under autocast an fp32 bias added after would turn the bf16 product, and attention after it, fp32)
            return self.gather_gemm(x, self.weight, self.group, self.seq_dim, bias=bias)
        if not self.input_is_gathered:
            x = gather_from_sp(x, self.group, self.seq_dim) if self.sequence_parallel else copy_to_tp(x, self.group)
        if self.fp8_gemm is not None:
            y = self.fp8_gemm(x)
            return y if bias is None else y + bias
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._columns(x, self.bias)
        return gather_from_tp(y, self.group, -1) if self.gather_output else y

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The forward without the bias (this rank's columns of x W^T), for a caller that adds ``self.bias`` in a
        fused pass of its own (the MLP's megakern.bias_gelu, whose backward also makes the bias gradient)."""
        if self.gather_output:
            raise ValueError("ColumnParallelLinear.product: the layer gathers its output (gather_output=True); the "
                             "bias must be added before the gather, so call the layer itself")
        return self._columns(x, None)

    def use_fp8(self, recipe) -> None:
        """Compute the local product in FP8 with ``recipe`` (a megakern.fp8 recipe)."""
        self.fp8_gemm = _fp8_gemm(self, recipe)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (local {self.weight.shape[0]}), "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = sum_ranks x_shard W_shard^T + b: weight (out_features, in_features / tp), bias whole.

    ``input_is_parallel``: x holds this rank's feature shard (the output of a column-parallel layer); else x is
    whole and is split first. ``sequence_parallel``: y is reduce-scattered to this rank's token shard.
    ``gemm_reduce``: the GEMM + reduction + bias (``linear_reduce`` unless a fused kernel is given).
    """

    tp_shard_dims = {"weight": 1}

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, group=None,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 gemm_reduce=None, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        self.gemm_reduce = gemm_reduce or linear_reduce
        self.fp8_gemm = None
        local = _local(in_features, group, "RowParallelLinear in_features")
        self.weight = nn.Parameter(torch.empty(out_features, local, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None

    @property
    def sp_partial(self) -> tuple[str, ...]:
        """Under sequence parallel the bias meets only this rank's tokens: its gradient is a partial sum."""
        return ("bias",) if self.sequence_parallel and self.bias is not None else ()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> RowParallelLinear:
        """This rank's columns of a full Linear (copied); the bias whole."""
        layer = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, group=group,
                    device=linear.weight.device, dtype=linear.weight.dtype, **kwargs)
        k, r = layer.weight.shape[1], group_rank(group)
        with torch.no_grad():
            layer.weight.copy_(linear.weight[:, r * k:(r + 1) * k])
            if layer.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group, -1)
        if self.fp8_gemm is not None:  # the FP8 product, then the reduction
            y = self.fp8_gemm(x)
            y = (reduce_scatter_to_sp(y, self.group, self.seq_dim) if self.sequence_parallel
                 else reduce_from_tp(y, self.group, inplace=True))
            return y if self.bias is None else y + self.bias
        return self.gemm_reduce(x, self.weight, self.group, self.sequence_parallel, self.seq_dim, bias=self.bias)

    def use_fp8(self, recipe) -> None:
        """Compute the local product in FP8 with ``recipe`` (a megakern.fp8 recipe), then reduce it (a fused
        GEMM + reduce-scatter, ``gemm_reduce``, is then not used)."""
        self.fp8_gemm = _fp8_gemm(self, recipe)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding whose rows (the vocabulary) are split over tp: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Each rank looks up the ids in its range (zeros elsewhere) and the partial results are summed over the group
    (all-reduce; under ``sequence_parallel`` a reduce-scatter to this rank's shard of dim ``seq_dim``). Ids outside
    [0, num_embeddings) fail an assertion (asynchronous on a GPU: no host sync), never a silent zero row.
    """

    tp_shard_dims = {"weight": 0}
    sp_partial: tuple[str, ...] = ()

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, sequence_parallel: bool = False,
                 seq_dim: int = 1, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        local = _local(num_embeddings, group, "VocabParallelEmbedding num_embeddings")
        self.start = group_rank(group) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, device=device, dtype=dtype))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, group, **kwargs) -> VocabParallelEmbedding:
        layer = cls(emb.num_embeddings, emb.embedding_dim, group=group, device=emb.weight.device,
                    dtype=emb.weight.dtype, **kwargs)
        n = layer.weight.shape[0]
        with torch.no_grad():
            layer.weight.copy_(emb.weight[layer.start:layer.start + n])
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"VocabParallelEmbedding: ids must be int32/int64, got {idx.dtype}")
        n = self.weight.shape[0]
        torch._assert_async(((idx >= 0) & (idx < self.num_embeddings)).all(),
                            f"VocabParallelEmbedding: token ids outside [0, {self.num_embeddings})")
        if group_size(self.group) == 1:
            out = F.embedding(idx, self.weight)
        else:
            outside = (idx < self.start) | (idx >= self.start + n)
            local = (idx - self.start).masked_fill(outside, 0)
            out = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sp(out, self.group, self.seq_dim)
        return reduce_from_tp(out, self.group, inplace=True)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows {self.start}.."
                f"{self.start + self.weight.shape[0] - 1} here), sequence_parallel={self.sequence_parallel}")
