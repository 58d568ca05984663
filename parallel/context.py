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
learned positions see the true ones). Sliding windows are not supported under cp > 1.

Packed documents (cu_seqlens), TransformerEngine's THD layout: the split above applied to every document on its own.
A document of n tokens is padded at its end to 2*cp*c tokens, c = ceil(n / (2*cp)), and cut into 2*cp chunks of c;
rank i holds chunks i and 2*cp-1-i of every document, side by side, as one local document of 2c tokens
(``cp_pack_layout`` / ``cp_shard_packed``). Pad tokens come after every real token of their document, so under the
causal mask no real query sees one (a pad key in chunk b is seen fully only by chunks after b, all pads); their
targets are ignore_index and they are dropped when unsharding, so the result is exact for any document lengths.
Every rank's local packing is the same (documents of 2c_d tokens, in order), so each rank reads the others' layout
from its own local cu_seqlens: all local offsets are even, and the halves of local document d are its two chunks.
Optionally the local sequence ends with one pad document (``multiple``: sequence parallel wants the local token
count divisible by tp; ``length``: equal micro-batch shapes for pipeline parallelism).

The ring over packed documents reorders the local tokens half-major (every document's first half, then every
document's second half: h = total / 2 tokens each) and keeps the three cases above, each one varlen call whose query
and key documents have equal lengths, as megakern.attention takes them (one cu_seqlens for q and kv):
- own kv: causal attention on the local documents (local cu_seqlens), in the model's order;
- r < i: all queries see r's first halves: q (half-major, 2n documents c_0 .. c_n-1, c_0 .. c_n-1) against
  [first halves, first halves] of r's kv, no mask;
- r > i: the second query halves see all of r's kv: [second halves, second halves] of q against r's kv
  (half-major), no mask; the two partial results of each query are merged.
Backward runs the same calls from the merged (out, lse), and r's dk, dv accumulators travel as above (the two
copies of r's first halves add up).
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
from torch import nn

import megakern
from megakern._checks import document_lengths
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


# ---- the split of packed documents (THD) ---------------------------------------------------------------------------
IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class CPPackedLayout:
    """One cp rank's share of a packed batch (see the module docstring): every document's chunks rank and 2*cp-1-rank
    (documents padded at their end to a multiple of 2*cp), then an optional pad document.

    ``tokens``: the flattened batch's token count (B * T); ``cu_seqlens`` (ndocs' + 1,) int32 local offsets (equal on
    every cp rank; all even under cp > 1); ``max_seqlen`` the longest local document; ``position_ids`` (L,) int64 each
    local token's position in its document (0 for pads); ``index`` (L,) int64 each local token's place in the
    flattened batch, -1 for a pad. Documents of no tokens are dropped.
    """
    tokens: int
    cp: int
    rank: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    position_ids: torch.Tensor
    index: torch.Tensor

    @property
    def length(self) -> int:
        """L, the local token count."""
        return self.index.numel()

    def shard(self, x: torch.Tensor, fill=0) -> torch.Tensor:
        """This rank's tokens of ``x`` ((B, T, ...) or (B * T, ...): token ids, targets, ...) as (L, ...); pads get
        ``fill`` (a valid token id for ids, ``IGNORE_INDEX`` for targets: ``shard_targets``)."""
        if x.dim() >= 2 and x.shape[0] != self.tokens and x.shape[0] * x.shape[1] == self.tokens:
            x = x.flatten(0, 1)
        if x.shape[0] != self.tokens:
            raise ValueError(f"CPPackedLayout.shard: x {tuple(x.shape)} does not hold the layout's {self.tokens} "
                             "tokens ((B, T, ...) or (B * T, ...))")
        index = self.index.to(x.device)
        pad = index < 0
        out = x.index_select(0, index.clamp(min=0))
        if fill is not None:
            out[pad] = fill
        return out

    def shard_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """``shard(targets)`` with pads ignored (``IGNORE_INDEX``): they add nothing to the loss or its token count."""
        return self.shard(targets, IGNORE_INDEX)

    def to(self, device) -> "CPPackedLayout":
        return dataclasses.replace(self, cu_seqlens=self.cu_seqlens.to(device),
                                   position_ids=self.position_ids.to(device), index=self.index.to(device))


def cp_pack_layout(cu_seqlens: torch.Tensor, tokens: int, cp: int, rank: int, *, multiple: int = 1,
                   length: int | None = None, device=None) -> CPPackedLayout:
    """The layout of rank ``rank`` of ``cp`` for packed documents ``cu_seqlens`` (1-D int32 offsets 0 .. ``tokens``
    into the flattened batch). ``multiple``: the local token count is padded (one pad document at the end) to a
    multiple of it (and of 2 under cp > 1): sequence parallel's tp. ``length``: pad to exactly this many local tokens
    instead (a ValueError if they do not fit): equal shapes for every micro-batch of a pipeline. One host read.
    Under cp = 1 the documents stay whole (no pads but the final pad document)."""
    for name, val, lo in (("cp", cp, 1), ("multiple", multiple, 1), ("tokens", tokens, 0)):
        if isinstance(val, bool) or not isinstance(val, int) or val < lo:
            raise ValueError(f"cp_pack_layout: {name} must be an int >= {lo}, got {val!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < cp:
        raise ValueError(f"cp_pack_layout: rank must be an int in 0..{cp - 1}, got {rank!r}")
    lengths = document_lengths("cp_pack_layout", cu_seqlens, tokens)
    offsets = cu_seqlens.tolist()
    starts = torch.tensor([s for s, n in zip(offsets, lengths) if n], dtype=torch.int64)
    n = torch.tensor([n for n in lengths if n], dtype=torch.int64)
    if cp == 1:
        c, local = n, n
    else:
        c = (n + 2 * cp - 1) // (2 * cp)  # chunk size per document
        local = 2 * c
    doc = torch.repeat_interleave(torch.arange(local.numel()), local)  # the document of each local token
    begin = torch.cumsum(local, 0) - local
    u = torch.arange(int(local.sum())) - begin[doc]  # place in the local document
    if cp == 1:
        p = u
    else:
        cd = c[doc]
        first = u < cd
        p = torch.where(first, rank * cd + u, (2 * cp - 1 - rank) * cd + u - cd)  # position in the padded document
    real = p < n[doc]
    index = torch.where(real, starts[doc] + p, -1)
    position = torch.where(real, p, 0)
    have = u.numel()
    step = multiple if cp == 1 else math.lcm(2, multiple)
    if length is None:
        want = -(-have // step) * step
    else:
        if isinstance(length, bool) or not isinstance(length, int) or length % step or length < have:
            raise ValueError(f"cp_pack_layout: length {length!r} must be a multiple of {step} and at least the "
                             f"{have} local tokens of rank {rank} of cp={cp}")
        want = length
    docs = local.tolist()
    if want > have:  # one pad document
        docs.append(want - have)
        index = torch.cat([index, index.new_full((want - have,), -1)])
        position = torch.cat([position, position.new_zeros(want - have)])
    cu = torch.tensor([0] + docs, dtype=torch.int64).cumsum(0).to(torch.int32)
    return CPPackedLayout(tokens, cp, rank, cu.to(device), max(docs, default=0), position.to(device),
                          index.to(device))


def cp_shard_packed(x: torch.Tensor, cu_seqlens: torch.Tensor, cp: int, rank: int, *, fill=0, multiple: int = 1,
                    length: int | None = None) -> tuple[torch.Tensor, CPPackedLayout]:
    """(this rank's tokens of ``x`` (L, ...), the layout): ``x`` (B, T, ...) or (B * T, ...) with packed documents
    ``cu_seqlens``; pads get ``fill`` (``IGNORE_INDEX`` for targets). The layout carries the local cu_seqlens,
    max_seqlen, position ids and the index that unshards (``cp_unshard_packed``). See ``cp_pack_layout``."""
    tokens = x.shape[0] if x.dim() == 1 else x.shape[0] * x.shape[1]
    layout = cp_pack_layout(cu_seqlens, tokens, cp, rank, multiple=multiple, length=length, device=x.device)
    return layout.shard(x, fill), layout


def cp_unshard_packed(x: torch.Tensor, layout: CPPackedLayout, group) -> torch.Tensor:
    """The flattened batch (B * T, ...) from every cp rank's local tokens x (L, ...), pads dropped (all-gather, no
    autograd). ``layout``: this rank's; the ranks' local lengths must agree (the same ``multiple`` / ``length``)."""
    n = group_size(group)
    if x.shape[0] != layout.length:
        raise ValueError(f"cp_unshard_packed: x has {x.shape[0]} tokens, the layout {layout.length}")
    index = layout.index.to(x.device)
    if n > 1:
        x = all_gather(x.detach(), group, 0)
        index = all_gather(index, group, 0)
    keep = index >= 0
    out = x.new_zeros((layout.tokens, *x.shape[1:]))
    out[index[keep]] = x[keep]
    return out


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


def _half_major(cu_seqlens: torch.Tensor, total: int):
    """(perm, cu2) for a local packing of even documents: ``x[perm]`` puts every document's first half, then every
    document's second half (h = total / 2 tokens each); cu2 (2 ndocs + 1,) int32 are the offsets of those 2 ndocs
    halves. On the device, no host read."""
    h = total // 2
    cu = cu_seqlens.to(torch.int64)
    cu_half = cu // 2
    t = torch.arange(h, device=cu.device)
    doc = torch.searchsorted(cu_half[1:].contiguous(), t, right=True)
    c = cu_half[doc + 1] - cu_half[doc]
    first = cu[doc] + t - cu_half[doc]
    perm = torch.cat([first, first + c])
    cu2 = torch.cat([cu_half, cu_half[1:] + h]).to(torch.int32)
    return perm, cu2


def _twice(x: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return torch.cat([x, x], dim=dim)


class _PackedRingAttention(torch.autograd.Function):
    """Ring attention over packed documents in the THD layout (module docstring): q (total, nh, hs), k, v
    (total, nkv, hs), local cu_seqlens with even documents, identical on every rank."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, group, scale, backend, deterministic):
        n, i = group_size(group), group_rank(group)
        total = q.shape[0]
        h, half_max = total // 2, max_seqlen // 2
        perm, cu2 = _half_major(cu_seqlens, total)
        ring = _Ring(group)
        kv = torch.stack([k, v]).index_select(1, perm)  # half-major, as every rank holds and sends it
        qh = q.index_select(0, perm)
        q2 = _twice(qh[h:]) if i < n - 1 else None  # the second halves twice, for the ranks after this one
        out = lse = None
        for s in range(n):
            if s + 1 < n:
                nxt, reqs = ring.shift(kv)
            r = (i - s) % n
            if s == 0:  # causal on the local documents, in the model's order, then half-major
                o, l = attention_forward(q, k, v, causal=True, softmax_scale=scale, cu_seqlens=cu_seqlens,
                                         max_seqlen=max_seqlen, backend=backend)
                out = o.to(torch.promote_types(o.dtype, torch.float32)).index_select(0, perm)
                lse = l.index_select(-1, perm)
            elif r < i:  # every query half against r's first halves (twice)
                kf = _twice(kv[:, :h], 1)
                o, l = attention_forward(qh, kf[0], kf[1], causal=False, softmax_scale=scale, cu_seqlens=cu2,
                                         max_seqlen=half_max, backend=backend)
                out, lse = merge_attention(out, lse, o, l)
            else:  # the second query halves (twice) against r's two halves
                o, l = attention_forward(q2, kv[0], kv[1], causal=False, softmax_scale=scale, cu_seqlens=cu2,
                                         max_seqlen=half_max, backend=backend)
                o = o.to(out.dtype)
                o, l = merge_attention(o[:h], l[..., :h], o[h:], l[..., h:])
                out[h:], lse[..., h:] = merge_attention(out[h:], lse[..., h:], o, l)
            if s + 1 < n:
                ring.wait(reqs)
                kv = nxt
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(total, device=perm.device)
        out = out.index_select(0, inv).to(q.dtype)
        lse = lse.index_select(-1, inv)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, perm, inv, cu2)
        ctx.max_seqlen, ctx.group, ctx.scale, ctx.backend, ctx.deterministic = (max_seqlen, group, scale, backend,
                                                                                deterministic)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, perm, inv, cu2 = ctx.saved_tensors
        group, scale, backend, det, max_seqlen = ctx.group, ctx.scale, ctx.backend, ctx.deterministic, ctx.max_seqlen
        n, i = group_size(group), group_rank(group)
        total = q.shape[0]
        h, half_max = total // 2, max_seqlen // 2
        ring = _Ring(group)
        dout = dout.contiguous()
        acc = torch.promote_types(q.dtype, torch.float32)
        bwd = dict(softmax_scale=scale, deterministic=det, backend=backend, causal=False, cu_seqlens=cu2,
                   max_seqlen=half_max)
        qh, doh, outh = (t.index_select(0, perm) for t in (q, dout, out))
        lseh = lse.index_select(-1, perm)
        if i < n - 1:  # the second halves twice, for the ranks after this one
            q2, do2, out2, lse2 = _twice(qh[h:]), _twice(doh[h:]), _twice(outh[h:]), _twice(lseh[..., h:], -1)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # half-major
        kv = torch.stack([k, v]).index_select(1, perm)
        dkv = torch.zeros(kv.shape, dtype=acc, device=k.device)
        dkv_reqs = None
        for s in range(n):
            if s + 1 < n:
                nxt, kv_reqs = ring.shift(kv)
            r = (i - s) % n
            if s == 0:
                grads = attention_backward(dout, q, k, v, out, lse, causal=True, softmax_scale=scale,
                                           cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, deterministic=det,
                                           backend=backend)
                dq_, dk_, dv_ = (g.index_select(0, perm) for g in grads)
                dq += dq_
                dkv[0] += dk_
                dkv[1] += dv_
            else:
                if r < i:
                    kf = _twice(kv[:, :h], 1)
                    dq_, dk_, dv_ = attention_backward(doh, qh, kf[0], kf[1], outh, lseh, **bwd)
                    dq += dq_
                    dk_, dv_ = dk_[:h] + dk_[h:], dv_[:h] + dv_[h:]
                else:
                    dq_, dk_, dv_ = attention_backward(do2, q2, kv[0], kv[1], out2, lse2, **bwd)
                    dq[h:] += dq_[:h]
                    dq[h:] += dq_[h:]
                ring.wait(dkv_reqs)  # the accumulators of this kv block, from the previous rank
                dkv = dkv_recv
                part = slice(None, h) if r < i else slice(None)
                dkv[0][part] += dk_
                dkv[1][part] += dv_
            dkv_recv, dkv_reqs = ring.shift(dkv)  # on to the next rank; after n hops it is back with its owner
            if s + 1 < n:
                ring.wait(kv_reqs)
                kv = nxt
        ring.wait(dkv_reqs)
        dq = dq.index_select(0, inv).to(q.dtype)
        dk, dv = dkv_recv.index_select(1, inv)
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def ring_attention_packed(q, k, v, cu_seqlens, group, *, max_seqlen: int | None = None,
                          softmax_scale: float | None = None, backend=None, deterministic: bool = True):
    """Causal attention of this rank's packed queries over its documents' whole (context-parallel) length.

    q (total, nh, hs), k and v (total, nkv, hs): this rank's tokens in the THD layout (``cp_shard_packed``);
    ``cu_seqlens`` their local offsets (``CPPackedLayout.cu_seqlens``, equal on every rank, all even under cp > 1),
    ``max_seqlen`` the longest local document (None: read from cu_seqlens, one host read, which also checks the
    offsets). Returns out like q."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if group_size(group) == 1:
        return megakern.attention(q, k, v, causal=True, softmax_scale=scale, cu_seqlens=cu_seqlens,
                                  max_seqlen=max_seqlen, backend=backend, deterministic=deterministic)
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"ring_attention_packed: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want "
                         "packed (total, heads, head_dim) tokens shared by q, k and v")
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError("ring_attention_packed: cu_seqlens must be a 1-D torch.int32 tensor of local offsets")
    if cu_seqlens.device != q.device:
        raise ValueError(f"ring_attention_packed: cu_seqlens is on {cu_seqlens.device} but q is on {q.device}")
    if q.shape[0] % 2:
        raise ValueError(f"ring_attention_packed: {q.shape[0]} local tokens; the THD layout holds two equal chunks "
                         "of every document (cp_shard_packed)")
    if max_seqlen is None:
        lengths = document_lengths("ring_attention_packed", cu_seqlens, q.shape[0])
        if any(n % 2 for n in lengths):
            raise ValueError("ring_attention_packed: a local document has an odd length; the THD layout holds two "
                             "equal chunks of every document (cp_shard_packed)")
        max_seqlen = max(lengths)
    return _PackedRingAttention.apply(q, k, v, cu_seqlens, int(max_seqlen), group, scale, backend, deterministic)


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
                         "documents: ring_attention_packed)")
    if q.shape[1] % 2 or k.shape[1] != q.shape[1] or v.shape != k.shape:
        raise ValueError(f"ring_attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: want an even "
                         "local sequence (two chunks) shared by q, k and v")
    return _RingAttention.apply(q, k, v, group, scale, backend, deterministic)


class RingAttention(nn.Module):
    """``attn.core`` for context parallelism: ``forward(q, k, v, *, cu_seqlens=None, max_seqlen=None)``; packed
    documents (cu_seqlens: the local THD packing, ``CPPackedLayout.cu_seqlens``) run ``ring_attention_packed``."""

    def __init__(self, group, *, softmax_scale: float | None = None, backend=None, deterministic: bool = True):
        super().__init__()
        self.group, self.softmax_scale, self.backend, self.deterministic = group, softmax_scale, backend, deterministic

    def forward(self, q, k, v, *, cu_seqlens=None, max_seqlen=None):
        if cu_seqlens is not None:  # the local THD packing of cp_shard_packed
            return ring_attention_packed(q, k, v, cu_seqlens, self.group, max_seqlen=max_seqlen,
                                         softmax_scale=self.softmax_scale, backend=self.backend,
                                         deterministic=self.deterministic)
        return ring_attention(q, k, v, self.group, softmax_scale=self.softmax_scale, backend=self.backend,
                              deterministic=self.deterministic)

    def extra_repr(self) -> str:
        return f"cp={group_size(self.group)}, backend={self.backend}"
