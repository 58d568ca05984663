"""GEMM overlapped with the sequence-parallel collectives: GEMM + reduce-scatter (the row-parallel layer's output)
and all-gather + GEMM (the column-parallel layer's input), forward and backward.

Two implementations behind one signature each:

**Symmetric memory (CUDA, NCCL groups of one host; ``workspace`` given).** Every rank maps its peers' buffers of a
``symmetric.SymmetricWorkspace``; data moves peer to peer over NVLink while the GEMMs run, and ranks tell each other
that data is in place by signals (no barrier per op):

- GEMM + reduce-scatter, y = x W^T summed over the ranks, rank r keeping token shard r. By default (the workspace's
  ``rs_impl="copy"``) cuBLAS GEMMs compute the chunks in the order r+1, ..., r into the rank's own buffer, in runs of
  rows (``rs_pieces``), signalling each run to its chunk's owner, which pulls it by copy engine while the next runs'
  GEMMs go on; the own chunk's GEMMs, run by run, add the pulled partial sums (beta 1) as they land (what stays
  exposed: the pulls of the last runs beyond the own chunk's GEMMs). With ``rs_impl="kernel"`` a Triton GEMM
  (megakern.gemm_scatter) computes chunks r+1, r+2, ... and stores each output tile into slot r of its owner's buffer
  over NVLink as soon as the tile is done, so the transfer runs inside the GEMM; the rank signals every peer and waits
  for every peer's signal; a second launch computes chunk r and adds the n - 1 partial sums found in its slots in the
  epilogue (fp32, one rounding): nothing is copied after the GEMMs and no summing pass rereads the partial sums, but
  the Triton GEMM trails cuBLAS at these shapes (docs/parallelism.md has the figures).
- GEMM + reduce-scatter by the inputs (the copy implementation's other route, taken by ``rs_route`` where it moves
  fewer bytes: a layer whose input is much narrower than its output, as attention's output projection is): each
  peer pushes its input rows of block r and its weight into rank r's buffer, k (rows + n) elements instead of its
  rows x n partial sum, and rank r computes block r alone: its own part first, while the transfers are in flight,
  then each peer's part (beta 1) as it lands.
- all-gather + GEMM, y = gather(x) W^T: each rank pushes its shard, straight from where it is, into every peer's
  buffer by copy engine and signals it there, all peers at once, while the GEMM of the shard at hand runs: the own
  shard first, each next one as soon as its signal has come (waited for on the current stream right before its
  GEMM); a shard kept for dW is copied out of the buffer after its wait. (With the workspace's ``gather="pull"``
  each rank stages its shard in its own buffer and signals, and its peers pull it into ordinary memory instead: a
  staging copy and a signal before each transfer.)
- The backwards are the same two ops transposed: the row layer's dX is all-gather(dY) + GEMM, its dW by shards over
  the gathered dY; the column layer's dX is GEMM + reduce-scatter, its dW by shards over the input's shards gathered
  in the forward and kept (the unfused layer under sequence parallelism gathers its input again instead: a fifth of
  a layer's transfers, for (n - 1) / n of the gathered input in memory), computed while dX's pulls are in flight.
Buffers alternate between two per role, and a rank starts an op only after every peer's signal of the op before it:
so no rank writes a buffer a peer still reads (symmetric.py). The peers' streams fork from and join the current
stream, so the ops can be captured in CUDA graphs: at the op's end, or, for transfers whose sources outlive the op
(the forward's: the input and the weight are kept for the backward) with the workspace's ``defer_joins``, at its next
``flush`` (a ParallelModel's ``end_step``): consumers wait for data by signals, so those joins only close the graph,
and a join on the compute stream costs some 10 us in a replay even when the work joined is done.

**Everywhere else (gloo ranks on CPU, or no workspace).** GEMM + reduce-scatter is a ring of ``batch_isend_irecv``
transfers around chunked matmuls (Megatron-LM's ring exchange); all-gather + GEMM is the unfused
``gather_from_sp`` + matmul. Both are tested against the unfused layers on gloo ranks.

Ring details: the tokens are cut into one chunk per rank and the chunks' partial sums travel around the ring:

    step s = 0 .. n-1 on rank r: chunk c = (r - 1 - s) mod n
        acc = x_c W^T  (+ the accumulator received from rank r-1 for chunk c, when s > 0)
        send acc to rank r+1 (when s < n-1), and meanwhile compute step s+1's matmul
    after the last step acc is chunk r of the sum: this rank's output.

Its backward is the dual ring (the output gradient's chunks all-gathered around the ring, each chunk's input-gradient
rows computed while the next chunk travels; the weight gradient one matmul over the gathered gradient).

Both implementations work on row matrices: the token shards of mappings (a contiguous run of the tensor's tokens
per rank) make every chunk a block of rows, read and written in place by plain GEMMs (a chunk of the sequence dim
of a (B, T, C) tensor would be a strided view, copied or batched).

Sums follow their own order (the slots' order, the ring's) instead of NCCL's: equal within rounding to the unfused
``layers.linear_reduce``. The sequence dim must be divisible by the group size (checked, the numbers in the error).

``gemm_reduce_scatter(x, weight, group, sequence_parallel, seq_dim, workspace=None)`` has the signature of
``layers.linear_reduce`` (RowParallelLinear's ``gemm_reduce``); ``all_gather_gemm(x, weight, group, seq_dim,
workspace=None)`` is ColumnParallelLinear's ``gather_gemm``. ``parallel.tp_comm_overlap=true`` puts the first in the
GPT's row layers (the ring); with ``parallel.tp_overlap_impl=symmetric`` both, through the ParallelModel's workspace
(bound with functools.partial).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megakern.gemm_scatter import reduce_own, scatter_partials
from megakern.linear import bias_grad
from megakern.parallel.mappings import (gather_from_sp, group_rank, group_size, token_rows, token_shard_shape,
                                        token_whole_shape)
from megakern.parallel.symmetric import GATHERS, ROUTES, RS_IMPLS


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


def _mm_into(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out = a @ w^T (+ bias, in the GEMM's epilogue) in place: a (M, K), w (N, K) (any strides), out (M, N) with
    unit column stride (a row block of a contiguous matrix)."""
    if bias is None:
        torch.mm(a, w.t(), out=out)
    else:
        torch.addmm(bias, a, w.t(), out=out)


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype | None, needed: bool) -> torch.Tensor | None:
    """The column sums of ``grad`` (rows, N) in the bias's ``dtype`` (None: no bias), 16-bit grads summed in fp32."""
    if dtype is None or not needed:
        return None
    return bias_grad(grad, dtype)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


# ---- symmetric memory ------------------------------------------------------------------------------------------
# The ops below take row matrices: a token shard's rows (S, K), or the whole sequence's (n * S, K) with rank c's
# shard in rows [c * S, (c + 1) * S) (mappings' token shards of a contiguous tensor, flattened).
def _rs_symm(x: torch.Tensor, w: torch.Tensor, ws, under=None, bias=None, sources_kept: bool = False) -> torch.Tensor:
    """This rank's row block of sum over ranks (x @ w^T), by the workspace's ``rs_impl``: "kernel" (the GEMM
    stores the peers' blocks straight into their buffers, then the own block's GEMM adds what the peers left here)
    or "copy" (cuBLAS GEMMs, copy-engine pulls, the own block's GEMMs adding what was pulled). ``under()``: more
    work for the current stream, queued while the peers' blocks are in flight (after the peers' blocks' GEMMs,
    before waiting for the pulls). ``bias`` (N,): added once, to this rank's block. ``sources_kept``: ``x`` and ``w``
    outlive the op (saved for the backward), so transfers reading them may be joined later (``ws.join_later``)."""
    if ws.rs_impl not in RS_IMPLS:
        raise ValueError(f"gemm_reduce_scatter: unknown rs_impl {ws.rs_impl!r} (known: {', '.join(RS_IMPLS)})")
    if ws.rs_impl == "kernel":
        out = _rs_kernel(x, w, ws)
        if under is not None:
            under()
        return out if bias is None else out.add_(bias)
    if rs_route(x.shape[0] // ws.size, x.shape[1], w.shape[0], ws.rs_route) == "inputs":
        return _rs_inputs(x, w, ws, under, bias, sources_kept)
    return _rs_copy(x, w, ws, under, bias)


def rs_route(rows: int, k: int, n: int, route: str = "auto") -> str:
    """What a GEMM + reduce-scatter of blocks of ``rows`` rows, (rows, k) @ (k, n) a block and rank, moves from each
    peer: "partials" (the peer's partial sum of this rank's block, rows x n elements) or "inputs" (the peer's input
    rows of the block and its weight, k x (rows + n)). "auto": the one moving fewer elements (the inputs where the
    layer's input is much narrower than its output, as attention's output projection is at tp >= 2); a named route
    is taken as it is."""
    if route not in ROUTES:
        raise ValueError(f"rs_route: unknown route {route!r} (known: {', '.join(ROUTES)})")
    if route != "auto":
        return route
    return "inputs" if k * (rows + n) < rows * n else "partials"


def _rs_inputs(x: torch.Tensor, w: torch.Tensor, ws, under=None, bias=None, sources_kept: bool = False) -> torch.Tensor:
    """This rank's row block of sum over ranks (x @ w^T), computed here from the peers' inputs: every rank pushes its
    input rows of each other rank's block, and its weight, straight into that rank's buffer (copy engine, one
    stream a peer, all at once; slot r of the rows and of the weights), signalling each run of rows
    (``ws.rs_pieces``); meanwhile this rank's own part of its block, x_r[block r] w_r^T (+ bias), runs; each peer's
    part, x_p[block r] w_p^T, is added (beta 1) run by run as soon as the peer's run has landed. Each peer sends k
    (rows + n) elements instead of its rows x n partial sum, nothing is copied before the transfers start, and the own
    GEMM waits for nothing. The backward is the partials route's (the op's inputs and weight are the same)."""
    n, r = ws.size, ws.rank
    xs = x.chunk(n)
    rows, k = xs[0].shape
    shape_w = list(w.shape)
    x_numel, w_numel = rows * k, math.prod(shape_w)
    handle = ws.buffer("rs_in", n * (x_numel + w_numel) * x.element_size())
    runs = _row_runs(rows, ws.rs_pieces)
    peers = [(r - step) % n for step in range(1, n)]

    def rows_from(owner: int, c: int) -> torch.Tensor:  # rank c's input rows of ``owner``'s block, in its buffer
        return handle.get_buffer(owner, [rows, k], x.dtype, c * x_numel)

    def weight_from(owner: int, c: int) -> torch.Tensor:  # rank c's weight, in ``owner``'s buffer
        return handle.get_buffer(owner, shape_w, x.dtype, n * x_numel + c * w_numel)

    def put(q, j):  # into q's buffer: this rank's weight with the first run, then run j of its rows of q's block
        lo, m = runs[j]
        if j == 0:
            weight_from(q, r).copy_(w)
        rows_from(q, r).narrow(0, lo, m).copy_(xs[q].narrow(0, lo, m))

    start = torch.cuda.Event()
    start.record()
    out = torch.empty(rows, shape_w[0], dtype=x.dtype, device=x.device)
    _mm_into(xs[r], w, out, bias)  # launched before the transfers' waiting kernels (see _rs_copy)
    if under is not None:
        under()
    events = ws.push(handle, "rs_in", peers, put, after=start, pieces=len(runs))
    for j, (lo, m) in enumerate(runs):  # each run of rows as soon as every peer's has landed
        for p in peers:
            ws.wait(handle, "rs_in", p, j)
            out.narrow(0, lo, m).addmm_(rows_from(r, p).narrow(0, lo, m), weight_from(r, p).t())
    if sources_kept:  # the push streams joined (graph capture), now or at the workspace's next flush
        ws.join_later(events, "rs_in")
    else:  # x or w may be freed once the op returns: the pushes reading them joined now
        ws.join(events)
    return out


def _rs_kernel(x: torch.Tensor, w: torch.Tensor, ws) -> torch.Tensor:
    """GEMM + reduce-scatter by megakern.gemm_scatter: launch 1 computes blocks r+1, r+2, ... and stores each
    output tile into slot r of its owner's buffer as it is done (the transfer runs inside the GEMM); this rank then
    signals every peer and waits for every peer's signal; launch 2 computes block r and adds the peers' n - 1 partial
    sums in its epilogue (fp32, one rounding). All on the current stream."""
    n, r = ws.size, ws.rank
    m = x.shape[0] // n
    x4 = x.contiguous().view(1, n, m, x.shape[-1])
    handle = ws.buffer("rs", n * m * w.shape[0] * x.element_size())
    addresses = ws.addresses(handle)
    scatter_partials(x4, w, addresses, r)
    for step in range(1, n):
        ws.signal(handle, "rs", (r + step) % n)
    for step in range(1, n):
        ws.wait(handle, "rs", (r - step) % n)
    out = torch.empty(m, w.shape[0], dtype=x.dtype, device=x.device)
    reduce_own(x4, w, addresses, r, out)
    return out


def _row_runs(rows: int, pieces: int) -> list[tuple[int, int]]:
    """(start, length) of ``pieces`` runs of ``rows`` rows, as equal as they come (fewer when rows are fewer)."""
    pieces = max(1, min(pieces, rows))
    bounds = [rows * j // pieces for j in range(pieces + 1)]
    return [(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:])]


def _rs_copy(x: torch.Tensor, w: torch.Tensor, ws, under=None, bias=None) -> torch.Tensor:
    """This rank's row block of sum over ranks (x @ w^T). Each peer's block is computed into this rank's buffer in
    ``ws.rs_pieces`` runs of rows, each run signalled to the block's owner as soon as its GEMM is done; the owner
    pulls it by copy engine while the next runs' GEMMs go on (the signals go out from a side stream: a signal kernel
    between two GEMMs on this stream would hold the second back). The own block comes last, run by run: each run's
    GEMM adds (beta 1, in its fp32 accumulator) the peers' partial sums of that run, as soon as they have landed; so
    no summing pass rereads the block, and the pulls have every GEMM of the op but the own block's last runs to hide
    under. ``bias`` is added once: rank r puts it into block r + 1, its first GEMM.

    Every GEMM but the own block's is launched before the pulls' waiting kernels are: a kernel launched for the
    first time may have to wait for the device's running kernels (lazy module loading), and a kernel that waits for a
    peer must not be among them while the peer waits for this rank's GEMMs. The own block's GEMMs come after them,
    but by then every signal of the op is queued: the waits they follow need nothing more of this rank."""
    n, r = ws.size, ws.rank
    xs = x.chunk(n)
    shape = [xs[0].shape[0], w.shape[0]]
    numel = math.prod(shape)
    runs = _row_runs(shape[0], ws.rs_pieces)
    handle = ws.buffer("rs", n * numel * x.element_size())
    peers = [(r - step) % n for step in range(1, n)]  # peer r - s computes block r at its step s: pulled in that order
    parts = torch.empty([n - 1, *shape], dtype=x.dtype, device=x.device)  # parts[i]: peers[i]'s partial sum
    start = torch.cuda.Event()
    start.record()
    for step in range(1, n):
        c = (r + step) % n
        block = handle.get_buffer(r, shape, x.dtype, c * numel)
        for j, (lo, m) in enumerate(runs):
            _mm_into(xs[c].narrow(0, lo, m), w, block.narrow(0, lo, m), bias if step == 1 else None)
            ws.signal_aside(handle, "rs", c, piece=j)
    if under is not None:
        under()

    def copy(p, j):
        lo, m = runs[j]
        parts[peers.index(p)].narrow(0, lo, m).copy_(handle.get_buffer(p, shape, x.dtype, r * numel).narrow(0, lo, m))

    # on streams forked at the op's start: the pulls run beside the GEMMs above
    events = ws.pull(handle, "rs", peers, copy, signal_first=False, after=start, pieces=len(runs))
    out = parts[0] if n == 2 else torch.empty(shape, dtype=x.dtype, device=x.device)
    current = torch.cuda.current_stream()
    for j, (lo, m) in enumerate(runs):
        for p in peers:
            current.wait_event(events[p][j])
        acc = out.narrow(0, lo, m)
        if n > 2:
            torch.sum(parts.narrow(1, lo, m), 0, out=acc)
        acc.addmm_(xs[r].narrow(0, lo, m), w.t())
    ws.join(events)  # (every pull has been waited for; for graph capture's stream joins)
    ws.settle("rs")
    return out


class _Gather:
    """All-gather of the row matrix ``shard`` (S, C) over the workspace's group, in one of two ways:

    - pushed (by default): each rank pushes its shard, straight from where it is, into slot r of every peer's buffer
      (copy engine, one stream a peer) and signals it there; a peer's shard is read in this rank's own buffer, slot
      p, as soon as the peer's signal has come, waited for on the current stream right before the GEMM that reads it
      (no copy into the symmetric buffer first: the transfers start at once). With ``keep`` (the shards outlive the
      op, as a column layer keeps its input for dW) each peer's shard is copied out of the buffer, which a later op
      reuses, into ``peer_rows`` (ordinary memory, (n - 1, S, C), the peers in ``peers`` order: r-1, r-2, ...) once
      it has come, and read there;
    - pulled (``keep`` with the workspace's ``gather="pull"``): the own shard is copied into slot r of this rank's
      symmetric buffer (where the peers pull it from), then each peer's shard pulled into ``peer_rows`` on that
      peer's stream once the peer signals it in place (one contiguous copy-engine transfer a peer, all at once).
    A rank writes a peer's buffer only after the signal of the op in between, which the peer sent once it was done
    with the op before (symmetric.py), the same rule as the pulls'. Every rank gathers the same way (``keep`` the
    same on every rank: the weight needs a gradient on all of them or on none).

    ``chunk(c)`` makes the current stream wait for shard c and returns it; ``join()`` waits for every transfer. The
    pulls are queued at the first ``chunk`` of a peer's shard or ``join()``, after the GEMMs launched before (see
    _rs_copy on launch order); the pushes at once (their waits need nothing but the peers' pushes)."""

    def __init__(self, shard: torch.Tensor, ws, keep: bool = True):
        n, r = ws.size, ws.rank
        self.n, self.r, self.shard, self.len, self.ws, self.keep = n, r, shard, shard.shape[0], ws, keep
        if ws.gather not in GATHERS:
            raise ValueError(f"all_gather_gemm: unknown gather {ws.gather!r} (known: {', '.join(GATHERS)})")
        self.pushed = not keep or ws.gather == "push"  # else pulled
        self.slot_shape = list(shard.shape)
        self.handle = ws.buffer("ag", n * shard.numel() * shard.element_size())
        self.peers = [(r - step) % n for step in range(1, n)]
        self.events = None
        self.arrived: set[int] = set()  # the peers whose pushed shards the current stream has waited for
        if keep:
            if not self.pushed:
                self.handle.get_buffer(r, self.slot_shape, shard.dtype, r * shard.numel()).copy_(shard)
                # (a copy beside the own shard's GEMM, off this stream, takes SMs from it: slower where measured)
            self.peer_rows = torch.empty([n - 1, *self.slot_shape], dtype=shard.dtype, device=shard.device)
        self.start = torch.cuda.Event()
        self.start.record()
        if self.pushed:
            self.events = self._pushes()

    def _slot(self, owner: int, c: int) -> torch.Tensor:
        """Slot c (shard c's place) of ``owner``'s buffer."""
        return self.handle.get_buffer(owner, self.slot_shape, self.shard.dtype, c * self.shard.numel())

    def _pushes(self) -> dict:
        def put(p, _piece):
            self._slot(p, self.r).copy_(self.shard)

        return self.ws.push(self.handle, "ag", self.peers, put, after=self.start)

    def _pulls(self) -> dict:
        if self.events is None:
            def copy(p, _piece):
                self.peer_rows[self.peers.index(p)].copy_(self._slot(p, p))

            self.events = self.ws.pull(self.handle, "ag", self.peers, copy, signal_first=True, after=self.start)
        return self.events

    def order(self) -> list[int]:
        """The shards in the order they are used: this rank's, then r-1, r-2, ..."""
        return [self.r, *self.peers]

    def chunk(self, c: int) -> torch.Tensor:
        if c == self.r:
            return self.shard
        if not self.pushed:
            torch.cuda.current_stream().wait_event(self._pulls()[c][0])
            return self.peer_rows[self.peers.index(c)]
        if c not in self.arrived:  # the peer's push, waited for here (symmetric.push)
            self.ws.wait(self.handle, "ag", c)
            self.arrived.add(c)
            if self.keep:  # out of the buffer, which a later op reuses, into the rows kept for the backward
                self.peer_rows[self.peers.index(c)].copy_(self._slot(self.r, c))
        return self.peer_rows[self.peers.index(c)] if self.keep else self._slot(self.r, c)

    def join(self) -> None:
        if not self.pushed:
            self.ws.join(self._pulls())  # every transfer done (and their streams joined, for graph capture)
            return
        for c in self.peers:  # every pushed shard waited for once, as the peers' signals each expect
            self.chunk(c)
        if self.keep:  # the shard pushed is kept for the backward: its pushes may be joined later
            self.ws.join_later(self.events, "ag")
        else:
            self.ws.join(self.events)


def _gathered_gemm(gather: _Gather, w: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    """out (the whole sequence's rows) = gather(x) @ w^T (+ bias), each shard's rows as soon as the shard is here."""
    for c in gather.order():
        _mm_into(gather.chunk(c), w, out.narrow(0, c * gather.len, gather.len), bias)


class _WeightGrad:
    """dW = sum over the shards c of a_c^T b_c, a shard's product as soon as its operands are here (the own shard's
    while the peers' are in flight), summed in fp32 for 16-bit operands (one rounding at the end, as one GEMM over
    the gathered rows would)."""

    def __init__(self):
        self.acc = None

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        wide = {"out_dtype": torch.float32} if a.dtype in (torch.float16, torch.bfloat16) else {}
        a = a.t()
        if self.acc is None:
            self.acc = torch.mm(a, b, **wide)
        else:  # in place (out= the accumulator): a new output would first get a copy of it
            torch.addmm(self.acc, a, b, **wide, out=self.acc)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.acc.to(dtype)


def _save(ctx, x, weight, bias, ws) -> tuple[torch.dtype, torch.Tensor]:
    """Keeps what a symmetric GEMM + reduce-scatter's backward needs; returns the dtype its GEMMs run in (autocast's,
    or x's) and the weight cast to it once, kept for the backward as autocast keeps F.linear's (casting it again
    there took a pass over every weight a step)."""
    dtype = _compute_dtype(x)
    w = weight.to(dtype)
    ctx.save_for_backward(x, w)
    ctx.ws, ctx.dtype, ctx.w_dtype, ctx.bias_dtype = ws, dtype, weight.dtype, None if bias is None else bias.dtype
    return dtype, w


class _SymmGemmReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, ws):
        dtype, w = _save(ctx, x, weight, bias, ws)
        with torch.autocast(x.device.type, enabled=False):  # x and w saved: transfers reading them joined later
            return _rs_symm(x.to(dtype), w, ws, bias=None if bias is None else bias.to(dtype),
                            sources_kept=x.dtype == dtype)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        ws, dtype = ctx.ws, ctx.dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = grad.to(dtype).contiguous()
        db = _bias_grad(grad, ctx.bias_dtype, ctx.needs_input_grad[2])  # this rank's rows: a partial sum over tp
        gather = _Gather(grad, ws, keep=False)
        # per shard, as soon as it arrives: its rows of dX = gather(dY) @ W and its part of dW = gather(dY)^T X
        # (the own shard's two GEMMs run while the peers' shards are in flight)
        dx = torch.empty(ws.size * grad.shape[0], w.shape[1], dtype=dtype, device=grad.device) if need_x else None
        dw = _WeightGrad() if need_w else None
        xc = x.to(dtype) if need_w else None
        rows = gather.len
        for c in gather.order():
            dy_c = gather.chunk(c)
            if need_x:
                _mm_into(dy_c, w.t(), dx.narrow(0, c * rows, rows))
            if need_w:
                dw.add(dy_c, xc.narrow(0, c * rows, rows))
        gather.join()  # every pull joined into this stream (for graph capture)
        return (dx.to(x.dtype) if need_x else None), (dw.result(ctx.w_dtype) if need_w else None), db, None


class _SymmAllGatherGemm(torch.autograd.Function):
    """The peers' shards pulled in the forward are kept for the weight gradient (when the weight needs one): the
    backward moves no input again, and its dW GEMMs all run while dX's reduce-scatter is in flight. The cost:
    (n - 1) / n of the gathered input in memory from the forward to the backward, as the unfused layer without
    sequence parallelism keeps it whole."""

    @staticmethod
    def forward(ctx, x, weight, bias, ws):
        dtype = _compute_dtype(x)
        ctx.ws, ctx.dtype, ctx.w_dtype, ctx.bias_dtype = ws, dtype, weight.dtype, None if bias is None else bias.dtype
        with torch.autocast(x.device.type, enabled=False):
            xc, w = x.to(dtype).contiguous(), weight.to(dtype)  # w kept for the backward (see _save)
            keep = ctx.needs_input_grad[1]
            gather = _Gather(xc, ws, keep=keep)
            out = torch.empty(ws.size * xc.shape[0], w.shape[0], dtype=dtype, device=xc.device)
            _gathered_gemm(gather, w, out, None if bias is None else bias.to(dtype))
            gather.join()
        ctx.save_for_backward(xc if keep else None, w, gather.peer_rows if keep else None)
        ctx.peers, ctx.x_dtype = gather.peers, x.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        xc, w, peer_rows = ctx.saved_tensors
        ws, dtype = ctx.ws, ctx.dtype
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad = grad.to(dtype).contiguous()
        db = _bias_grad(grad, ctx.bias_dtype, ctx.needs_input_grad[2])
        dw = _WeightGrad() if need_w else None

        def weight_grad():  # dW = dY^T gather(X), by shards, the inputs all here since the forward
            rows = xc.shape[0]
            for c, x_c in [(ws.rank, xc), *zip(ctx.peers, peer_rows)]:
                dw.add(grad.narrow(0, c * rows, rows), x_c)

        if need_x:
            dx = _rs_symm(grad, w.t(), ws, under=weight_grad if need_w else None).to(ctx.x_dtype)
        else:
            dx = None
            weight_grad()
        return dx, (dw.result(ctx.w_dtype) if need_w else None), db, None


# ---- the ring (any backend) ------------------------------------------------------------------------------------
class _RingGemmReduceScatter(torch.autograd.Function):
    """On row matrices, as the symmetric ops: x (n * S, K) -> this rank's row block (S, N) of the sum."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        n, r, nxt, prev = _peers(group)
        xs = x.chunk(n)
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.bias_dtype = group, None if bias is None else bias.dtype
        kind = x.device.type
        if torch.is_autocast_enabled(kind):  # cast once here, not per chunk
            weight = weight.to(torch.get_autocast_dtype(kind))
        acc = F.linear(xs[(r - 1) % n], weight)
        for s in range(1, n):
            incoming = torch.empty_like(acc)
            requests = _exchange(acc, incoming, nxt, prev, group)
            part = F.linear(xs[(r - 1 - s) % n], weight)  # overlaps the transfer
            for req in requests:
                req.wait()
            acc = incoming.add_(part)
        return acc if bias is None else acc.add_(bias.to(acc.dtype))

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        group = ctx.group
        n, r, nxt, prev = _peers(group)
        # under autocast the forward's matmuls ran in the autocast dtype, which is the gradient's: the backward's
        # run in it too (autograd runs this outside autocast)
        w = weight.to(grad.dtype)
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        db = _bias_grad(grad, ctx.bias_dtype, ctx.needs_input_grad[2])
        chunks, dxs = [None] * n, [None] * n
        current = grad.contiguous()
        # step s holds block (r - s) mod n of the output gradient: rank r starts with its own, then passes on what
        # it holds while computing that block's rows of the input gradient
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
        dx = torch.cat(dxs) if need_x else None
        dw = None
        if need_w:  # one matmul over the gathered gradient: summed in the GEMM's own fp32 accumulator, as unfused
            dw = (torch.cat(chunks).t() @ x.to(grad.dtype)).to(weight.dtype)
        return dx, dw, db, None


def _check_operands(what: str, x: torch.Tensor, weight: torch.Tensor, seq_dim: int) -> int:
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"{what}: x of shape {tuple(x.shape)} does not fit weight of shape {tuple(weight.shape)} "
                         "(last dims differ)")
    if x.dim() < 2 or (seq_dim % x.dim()) == x.dim() - 1:
        raise ValueError(f"{what}: seq_dim {seq_dim} must name a dimension of x {tuple(x.shape)} other than the "
                         "features (last)")
    return seq_dim % x.dim()


def _check_workspace(what: str, ws, group, x: torch.Tensor) -> None:
    if ws.group is not group:
        raise ValueError(f"{what}: the workspace belongs to another process group")
    if x.device != ws.device:
        raise ValueError(f"{what}: x is on {x.device}, the workspace on {ws.device}")


def gemm_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, group, sequence_parallel: bool,
                        seq_dim: int, workspace=None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T reduce-scattered to this rank's token shard (mappings.reduce_scatter_to_sp along ``seq_dim``)
    over ``group``, + ``bias`` (whole on every rank; added once, in the product's dtype), the transfers overlapped
    with the matmuls (see the module doc): through ``workspace`` (a symmetric.SymmetricWorkspace of ``group``) on
    CUDA, else the ring; ``layers.linear_reduce`` where there is no reduce-scatter to hide."""
    from megakern.parallel.layers import linear_reduce

    if not sequence_parallel or group_size(group) == 1:
        return linear_reduce(x, weight, group, sequence_parallel, seq_dim, bias=bias)
    seq_dim = _check_operands("gemm_reduce_scatter", x, weight, seq_dim)
    n = group_size(group)
    rows = token_rows(x, n, seq_dim, "gemm_reduce_scatter").reshape(-1, x.shape[-1])
    shape = token_shard_shape((*x.shape[:-1], weight.shape[0]), n, seq_dim)
    if workspace is not None and x.is_cuda:
        _check_workspace("gemm_reduce_scatter", workspace, group, x)
        return _SymmGemmReduceScatter.apply(rows, weight, bias, workspace).view(shape)
    return _RingGemmReduceScatter.apply(rows, weight, bias, group).view(shape)


def all_gather_gemm(x: torch.Tensor, weight: torch.Tensor, group, seq_dim: int, workspace=None,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """gather(x) @ weight^T (+ ``bias``, in the GEMMs' epilogue, in the product's dtype as F.linear adds it): x is
    this rank's token shard (mappings.gather_from_sp along ``seq_dim``), the result
    covers the whole sequence (this rank's columns of a column-parallel layer); the gradient of x is
    reduce-scattered back. Through ``workspace`` on CUDA the shards travel under the GEMMs (see the module doc);
    else gather_from_sp, then the matmul."""
    if group_size(group) == 1:
        return F.linear(x, weight, bias)
    seq_dim = _check_operands("all_gather_gemm", x, weight, seq_dim)
    if workspace is not None and x.is_cuda:
        _check_workspace("all_gather_gemm", workspace, group, x)
        shape = token_whole_shape((*x.shape[:-1], weight.shape[0]), group_size(group), seq_dim)
        return _SymmAllGatherGemm.apply(x.reshape(-1, x.shape[-1]), weight, bias, workspace).view(shape)
    return F.linear(gather_from_sp(x, group, seq_dim), weight, bias)
