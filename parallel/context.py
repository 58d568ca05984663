"""Context parallelism: the sequence split over the cp group, with ring attention.

Load-balanced causal split: a sequence of T tokens is cut into 2*cp chunks of c = T / (2*cp); rank i holds chunks i
and 2*cp-1-i, side by side (its local sequence of 2c tokens). Under a causal mask every rank then does the same
work: an early chunk (few keys to see) is paired with a late one (many).

Ring attention (rank i, cp = n; kv blocks travel i -> i+1 around the ring, so at step s rank i holds the keys and
values of rank r = (i - s) mod n):
- s = 0, its own kv: causal attention of its 2c queries over its 2c keys (chunk i sees itself causally; chunk
  2n-1-i sees chunk i fully and itself causally; chunk i never sees the later chunk);
- r < i: both query chunks see r's first chunk (chunk r < i) fully and its second (2n-1-r > 2n-1-i) not at all;
- r > i: only the second query chunk (2n-1-i) sees anything, and it sees both of r's chunks fully.
Partial results (out, lse) are combined with ``megakern.merge_attention`` in fp32. The next kv block is sent
while the current one is computed (``batch_isend_irecv``).

Backward recomputes each block from the final out and lse (flash-attention's backward with the merged
statistics gives each block's exact share of dq, dk, dv); kv blocks go around the ring again and their dk, dv
accumulators (fp32) travel with them, returning to their owner after n hops. The blocks run on
``megakern.attention``'s public ``attention_forward`` / ``attention_backward``: its kernels (Triton or Gluon on GPUs)
or the fp32 torch reference (CPU), whichever attention picks.

Positions: rank i's tokens have positions ``cp_positions(T, n, i)`` (pass them as position_ids so rotary or
learned positions see the true ones). Packed documents (cu_seqlens) and sliding windows are not supported under
cp > 1 (a clear error).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

import megakern
from megakern.attention import attention_backward, attention_forward, merge_attention
from megakern.parallel.mappings import all_gather, group_rank, group_size


# ---- the split -------------------------------------------------------------------------------------------------
def cp_positions(seqlen: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """Positions (int64, (seqlen / cp,)) of the tokens rank ``rank`` holds: chunks rank and 2*cp-1-rank."""
    if seqlen % (2 * cp):
        raise ValueError(f"context parallel: sequence length {seqlen} is not divisible by 2*cp = {2 * cp}")
    c = seqlen // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def cp_shard(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of the full sequence along ``dim`` (no autograd communication: the input is whole on
    every rank, e.g. token ids or a position table)."""
    n = group_size(group)
    if n == 1:
        return x
    rank, seqlen = group_rank(group), x.shape[dim]
    if seqlen % (2 * n):
        raise ValueError(f"context parallel: dim {dim} of shape {tuple(x.shape)} ({seqlen}) is not divisible by "
                         f"2*cp = {2 * n}")
    chunks = x.chunk(2 * n, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * n - 1 - rank]], dim=dim)


def cp_unshard(x: torch.Tensor, group, dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's two chunks (all-gather and reorder; no autograd)."""
    n = group_size(group)
    if n == 1:
        return x
    gathered = all_gather(x.detach(), group, dim).chunk(2 * n, dim=dim)  # rank r's chunks at 2r, 2r+1
    order = [None] * (2 * n)
    for r in range(n):
        order[r], order[2 * n - 1 - r] = gathered[2 * r], gathered[2 * r + 1]
    return torch.cat(order, dim=dim)


# ---- attention blocks --------------------------------------------------------------------------------------------
def _block_fwd(q, k, v, causal: bool, scale: float, backend):
    """(out, lse) of one block, no autograd."""
    return attention_forward(q, k, v, causal=causal, softmax_scale=scale, backend=backend)


def _block_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, backend, deterministic: bool):
    """(dq, dk, dv) of one block given the final out and lse, no autograd: fp32 (fp64 for fp64) from the torch
    reference, q's dtype from the kernels."""
    return attention_backward(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale, deterministic=deterministic,
                              backend=backend)


# ---- the ring ----------------------------------------------------------------------------------------------------
class _Ring:
    """Send to the next rank of the group, receive from the previous one, asynchronously."""

    def __init__(self, group):
        n, r = group_size(group), group_rank(group)
        self.group = group
        self.next = dist.get_global_rank(group, (r + 1) % n)
        self.prev = dist.get_global_rank(group, (r - 1) % n)

    def shift(self, send: torch.Tensor):
        recv = torch.empty_like(send)
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, self.next, self.group),
                                       dist.P2POp(dist.irecv, recv, self.prev, self.group)])
        return recv, reqs

    @staticmethod
    def wait(reqs) -> None:
        for req in reqs:
            req.wait()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, scale, backend, deterministic):
        n, i = group_size(group), group_rank(group)
        c = q.shape[1] // 2
        ring = _Ring(group)
        kv = torch.stack([k, v])
        out = lse = None
        for s in range(n):
            if s + 1 < n:
                nxt, reqs = ring.shift(kv)
            r = (i - s) % n
            if s == 0:
                o, lse = _block_fwd(q, k, v, True, scale, backend)
                out = o.to(torch.promote_types(o.dtype, torch.float32))  # accumulate in fp32 (fp64 for fp64)
            elif r < i:
                o, l = _block_fwd(q, kv[0][:, :c], kv[1][:, :c], False, scale, backend)
                out, lse = merge_attention(out, lse, o, l)
            else:
                o, l = _block_fwd(q[:, c:], kv[0], kv[1], False, scale, backend)
                out[:, c:], lse[..., c:] = merge_attention(out[:, c:], lse[..., c:], o, l)
            if s + 1 < n:
                ring.wait(reqs)
                kv = nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.scale, ctx.backend, ctx.deterministic = group, scale, backend, deterministic
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale, backend, det = ctx.group, ctx.scale, ctx.backend, ctx.deterministic
        n, i = group_size(group), group_rank(group)
        c = q.shape[1] // 2
        ring = _Ring(group)
        dout = dout.contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)  # accumulators of the kv block held
        dkv_reqs = None
        for s in range(n):
            if s + 1 < n:
                nxt, kv_reqs = ring.shift(kv)
            r = (i - s) % n
            if s == 0:
                dq_, dk_, dv_ = _block_bwd(dout, q, k, v, out, lse, True, scale, backend, det)
                dq += dq_
                dkv[0] += dk_
                dkv[1] += dv_
            else:
                if r < i:
                    dq_, dk_, dv_ = _block_bwd(dout, q, kv[0][:, :c], kv[1][:, :c], out, lse, False, scale,
                                               backend, det)
                    dq += dq_
                else:
                    dq_, dk_, dv_ = _block_bwd(dout[:, c:], q[:, c:], kv[0], kv[1], out[:, c:], lse[..., c:], False,
                                               scale, backend, det)
                    dq[:, c:] += dq_
                ring.wait(dkv_reqs)  # the accumulators of this kv block, from the previous rank
                dkv = dkv_recv
                part = slice(None, c) if r < i else slice(None)
                dkv[0][:, part] += dk_
                dkv[1][:, part] += dv_
            dkv_recv, dkv_reqs = ring.shift(dkv)  # on to the next rank; after n hops it is back with its owner
            if s + 1 < n:
                ring.wait(kv_reqs)
                kv = nxt
        ring.wait(dkv_reqs)
        return dq.to(q.dtype), dkv_recv[0].to(k.dtype), dkv_recv[1].to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group, *, softmax_scale: float | None = None, backend=None, deterministic: bool = True):
    """Causal attention of this rank's queries over the whole (context-parallel) sequence.

    q (B, 2c, nh, hs), k and v (B, 2c, nkv, hs): this rank's two chunks (``cp_shard``). Returns out like q.
    """
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if group_size(group) == 1:
        return megakern.attention(q, k, v, causal=True, softmax_scale=scale, backend=backend,
                                  deterministic=deterministic)
    if q.dim() != 4:
        raise ValueError(f"ring_attention: q must be (batch, seq, heads, head_dim), got {tuple(q.shape)} (packed "
                         "documents are not supported under context parallel)")
    if q.shape[1] % 2 or k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want an even "
                         "local sequence (two chunks) shared by q, k and v")
    return _RingAttention.apply(q, k, v, group, scale, backend, deterministic)


class RingAttention(nn.Module):
    """``attn.core`` for context parallelism: ``forward(q, k, v, *, cu_seqlens=None, max_seqlen=None)``."""

    def __init__(self, group, *, softmax_scale: float | None = None, backend=None, deterministic: bool = True):
        super().__init__()
        self.group, self.softmax_scale, self.backend, self.deterministic = group, softmax_scale, backend, deterministic

    def forward(self, q, k, v, *, cu_seqlens=None, max_seqlen=None):
        if cu_seqlens is not None:
            raise ValueError("RingAttention: packed documents (cu_seqlens) are not supported under context "
                             "parallel; use cp=1 or unpacked batches")
        return ring_attention(q, k, v, self.group, softmax_scale=self.softmax_scale, backend=self.backend,
                              deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return f"cp={group_size(self.group)}, backend={self.backend}"
