"""GEMM overlapped with the sequence-parallel reduce-scatter (and, backward, with the all-gather): a ring of
point-to-point transfers, each hidden behind the next chunk's matmul.

Under sequence parallelism the row-parallel layer computes y = x W^T on this rank's feature shard of x (the whole
sequence) and reduce-scatters y along the sequence: the partial products of every rank summed, rank r keeping
chunk r. ``linear_reduce`` does the whole matmul, then one reduce-scatter, which nothing hides. Here the sequence is
cut into one chunk per rank and the chunks' partial sums travel around the ring (as Megatron-LM's and Transformer
Engine's tp-comm-overlap "ring exchange" do):

    step s = 0 .. n-1 on rank r: chunk c = (r - 1 - s) mod n
        acc = x_c W^T  (+ the accumulator received from rank r-1 for chunk c, when s > 0)
        send acc to rank r+1 (when s < n-1), and meanwhile compute step s+1's matmul
    after the last step acc is chunk r of the sum: this rank's output.

Each transfer (torch.distributed.batch_isend_irecv: NCCL's own stream on GPUs, gloo on CPUs) runs while the next
chunk's matmul does. The backward is the dual ring: the output gradient's chunks are all-gathered around the ring,
each chunk's input-gradient rows computed while the next chunk travels; the weight gradient is one matmul over the
gathered gradient at the end (summed in the GEMM's fp32 accumulator, as the unfused backward).

The sums follow the ring's order instead of NCCL's: equal within rounding to ``linear_reduce`` (tested on gloo
ranks against it, forward and every gradient). Partial sums travel in the output's dtype, as NCCL's reduce-scatter
sums in it.

``gemm_reduce_scatter(x, weight, group, sequence_parallel, seq_dim)`` has the signature of
``layers.linear_reduce``: pass it as RowParallelLinear's ``gemm_reduce`` (``parallel.tp_comm_overlap=true`` does so
for every row-parallel layer of the GPT). Without sequence parallelism (an all-reduce, not a reduce-scatter) or on a
group of one it is ``linear_reduce``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megakern.parallel.mappings import group_rank, group_size


def _peers(group) -> tuple[int, int, int, int]:
    """(n, rank in group, global rank of the next, global rank of the previous) in the group's ring."""
    n, r = group_size(group), group_rank(group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(n))
    return n, r, ranks[(r + 1) % n], ranks[(r - 1) % n]


def _exchange(send: torch.Tensor | None, recv: torch.Tensor | None, nxt: int, prev: int, group) -> list:
    """Starts sending ``send`` to ``nxt`` and receiving ``recv`` from ``prev``; returns the requests to wait on."""
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send, nxt, group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, prev, group))
    return dist.batch_isend_irecv(ops) if ops else []


def _chunks(t: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, ...]:
    if t.shape[dim] % n:
        raise ValueError(f"gemm_reduce_scatter: the sequence dim {dim} of a tensor of shape {tuple(t.shape)} is not "
                         f"divisible by the tensor-parallel size {n}")
    return t.chunk(n, dim)


def _chunk_linear(xc: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """xc @ weight^T. A chunk of the sequence of a (B, T, K) tensor is a strided view (B, T / n, K), which F.linear
    would copy to fold it into a matrix: a batched GEMM reads it in place (cuBLAS takes the batch stride)."""
    if xc.dim() == 3 and not xc.is_contiguous() and xc.stride(-1) == 1:
        return torch.bmm(xc, weight.t().unsqueeze(0).expand(xc.shape[0], -1, -1))
    return F.linear(xc, weight)


class _GemmReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, group, seq_dim):
        n, r, nxt, prev = _peers(group)
        seq_dim = seq_dim % x.dim()
        xs = _chunks(x, n, seq_dim)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.seq_dim = group, seq_dim
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # cast once here, not per chunk (and not as an expanded batch)
            weight = weight.to(torch.get_autocast_dtype(kind))
        acc = _chunk_linear(xs[(r - 1) % n], weight).contiguous()
        for s in range(1, n):
            incoming = torch.empty_like(acc)
            requests = _exchange(acc, incoming, nxt, prev, group)
            part = _chunk_linear(xs[(r - 1 - s) % n], weight)  # overlaps the transfer
            for req in requests:
                req.wait()
            acc = incoming.add_(part)
        return acc

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group, seq_dim = ctx.group, ctx.seq_dim
        n, r, nxt, prev = _peers(group)
        # under autocast the forward's matmuls ran in the autocast dtype, which is the gradient's: the backward's
        # run in it too (autograd runs this outside autocast)
        w = weight.to(grad.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        chunks, dxs = [None] * n, [None] * n
        current = grad.contiguous()
        # step s holds chunk (r - s) mod n of the output gradient: rank r starts with its own, then passes on what
        # it holds while computing that chunk's rows of the input gradient
        for s in range(n):
            c = (r - s) % n
            chunks[c] = current
            incoming = torch.empty_like(current) if s < n - 1 else None
            requests = _exchange(current if s < n - 1 else None, incoming, nxt, prev, group)
            if need_x:
                dxs[c] = current @ w
            for req in requests:
                req.wait()
            current = incoming
        dx = torch.cat(dxs, seq_dim) if need_x else None
        dw = None
        if need_w:  # one matmul over the gathered gradient: summed in the GEMM's own fp32 accumulator, as unfused
            full = torch.cat(chunks, seq_dim)
            dw = (full.reshape(-1, full.shape[-1]).t() @ x.to(grad.dtype).reshape(-1, x.shape[-1])).to(weight.dtype)
        return dx, dw, None, None


def gemm_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, sequence_parallel: bool,
                        seq_dim: int) -> torch.Tensor:
    """x @ weight^T reduce-scattered along ``seq_dim`` over ``group``, the transfers overlapped with the chunks'
    matmuls (see the module doc); ``layers.linear_reduce`` where there is no reduce-scatter to hide."""
    from megakern.parallel.layers import linear_reduce

    if not sequence_parallel or group_size(group) == 1:
        return linear_reduce(x, weight, group, sequence_parallel, seq_dim)
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"gemm_reduce_scatter: x of shape {tuple(x.shape)} does not fit weight of shape "
                         f"{tuple(weight.shape)} (last dims differ)")
    if x.dim() < 2 or (seq_dim % x.dim()) == x.dim() - 1:
        raise ValueError(f"gemm_reduce_scatter: seq_dim {seq_dim} must name a dimension of x {tuple(x.shape)} "
                         "other than the features (last)")
    return _GemmReduceScatter.apply(x, weight, group, seq_dim)
