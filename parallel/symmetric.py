"""Symmetric memory of a tensor-parallel group: buffers that every rank of the group maps and writes peer to peer
(NVLink), for the fused GEMM + collective ops of ``overlap.py``.

``SymmetricWorkspace(group, device)`` holds, per named role, two symmetric allocations used in turn (``buffer(role,
nbytes)`` returns the next one's handle), every rank's buffer address on the device (``addresses``, for kernels that
store into a peer's buffer), one stream per peer and role for the copy-engine transfers (``pull`` out of a peer's
buffer, ``push`` into it), and the signals that order them (a rank tells a peer that data is in place; the peer
waits for it on its stream). An op of a role signals every peer and waits for every peer's signal; a rank writes a
buffer (its own, or a peer's) of the turn used two ops ago only after the op in between, whose signals every peer
sent after finishing the op before it: so no rank overwrites data a peer still reads, without a barrier.
``end_step()`` keeps the turns alternating across the replays of a captured step, and joins the transfer streams
whose joins an op deferred (``defer_joins``: ``join_later``, ``flush``). Buffers grow, collectively, when an
op needs more bytes than they hold; every rank of the group calls the ops in the same order with the same shapes
(sequence parallel requires it), so every rank grows at the same call. Growing needs the host (a rendezvous over the
group's store): it is refused with a clear error inside a CUDA-graph capture (run one eager step first, as the trainer's
warm-up steps do). ``rs_pieces`` cuts each block of a GEMM + reduce-scatter into that many runs of rows, each
signalled and pulled on its own, and ``rs_route`` picks what such an op moves, the partial sums or the inputs
(overlap.py).

``signals`` says how a rank signals a peer (SIGNALS): by default a stream memory operation sets the peer's flag
(stream_memops.py: the driver's cuStreamWriteValue32 after a fence over the stream's earlier work), in the stream's
front end: a signal kernel queued behind a GEMM that fills every SM starts only at the GEMM's tail,
and the transfer it gates with it. (The driver's matching wait is not used: on an H200 it ended 15-30 microseconds
after the flag was set, where torch's waiting kernel sees it at once.) Such a write does not wait for the flag to
be clear, as torch's signal kernel does: each turn of a role has its own channels, and a rank signals on a turn's
channel again only two ops later, after the peer's signal of the op in between, which the peer sent after clearing
the flag.

Peer-to-peer only: NVLink multicast (NVLS) stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set here unless the
environment says otherwise, before the first allocation), and the CUDA backend of torch's symmetric memory is
selected (not NVSHMEM). Nothing here holds module-level state: a ParallelModel owns its workspace.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megakern.parallel import stream_memops
from megakern.parallel.mappings import group_rank, group_size

# signal-pad channels: each role on its own, a role's op signalling up to PIECES pieces of its data, piece j of an op
# on a buffer of turn t on channel CHANNELS[role] + t * PIECES + j (a signal is a flag a peer's wait clears: one
# channel per piece lets a rank signal every piece without waiting for the peer to take the one before, and one set
# per turn lets a stream signal set its flag without checking that it is clear: see the module doc; torch's pad holds
# 32 channels at any group size).
# Roles: "rs" a GEMM + reduce-scatter's partial sums, "ag" an all-gather's shards, "rs_in" the inputs and weights of
# a GEMM + reduce-scatter computed by the owner of each block (overlap.py, the "inputs" route)
PIECES = 4
CHANNELS = {"rs": 0, "ag": 2 * PIECES, "rs_in": 4 * PIECES}
ROUTES = ("auto", "partials", "inputs")
# how a GEMM + reduce-scatter computes and moves the partial sums: "copy" (cuBLAS GEMMs into the own buffer, the
# owners pull them by copy engine), "kernel" (a Triton GEMM storing its tiles into the owners' buffers); overlap.py
RS_IMPLS = ("copy", "kernel")
# how an all-gather whose shards outlive the op (a column layer's input, kept for dW) moves them: "pull" (each rank
# copies its shard into its own buffer and signals; each peer pulls it by copy engine once signalled) or "push" (each
# rank pushes its shard straight from where it is into every peer's buffer by copy engine and signals it there; the
# peer waits for it right before the GEMM that reads it and copies it out to keep it)
GATHERS = ("pull", "push")
# how a rank signals a peer: "stream" (a stream memory operation sets the peer's flag: no SM taken, so the signal
# goes out while a GEMM fills every SM) or "kernel" (torch's put_signal kernel, which starts only once an SM is
# free). Waits are torch's wait_signal kernels either way (a stream's wait on memory ends tens of microseconds after
# the flag is set; a waiting kernel sees it at once).
SIGNALS = ("stream", "kernel")


def symmetric_memory_usable(group, device: torch.device) -> str:
    """'' when the fused ops can run on ``group`` (NCCL ranks of one host, CUDA devices, torch with symmetric
    memory); else why not, in a sentence. Collective over ``group`` once it reaches the host check (every rank of the
    group calls it at the same point)."""
    if device.type != "cuda":
        return f"the device is {device.type}, not cuda"
    if group is None or group_size(group) < 2:
        return "the group has one rank"
    backend = dist.get_backend(group)
    if "nccl" not in str(backend).lower():
        return f"the group's backend is {backend}, not nccl"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:
        return f"torch {torch.__version__} has no symmetric memory ({exc})"
    hosts = [None] * group_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        return (f"the group spans hosts {sorted(set(hosts))}; symmetric memory maps peers of one host (NVLink), so "
                "the tensor-parallel group must be on one host")
    return ""


def _check_pieces(pieces: int) -> None:
    if not 1 <= pieces <= PIECES:
        raise ValueError(f"SymmetricWorkspace: {pieces} pieces of an op's data; 1 to {PIECES} have signal channels")


class SymmetricWorkspace:
    """Double-buffered symmetric allocations of one process group (see the module doc)."""

    def __init__(self, group, device: torch.device):
        why = symmetric_memory_usable(group, device)
        if why:
            raise ValueError(f"SymmetricWorkspace: symmetric memory cannot be used: {why}")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        try:
            symm_mem.set_backend("CUDA")
        except Exception:  # an older torch without backends, or a backend chosen already by the application
            pass
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.group, self.device = group, device
        self.size, self.rank = group_size(group), group_rank(group)
        self._buffers: dict[str, list] = {}  # role -> [[tensor, handle], [tensor, handle]]
        self._turn: dict[str, int] = {}
        self._uses: dict[str, int] = {}  # ops of each role since end_step
        self._streams: dict = {}
        self._addresses: dict[int, torch.Tensor] = {}  # id(handle) -> every rank's buffer address, on the device
        self.grown = 0  # allocations made (tests, logs)
        # GEMM + reduce-scatter: "copy" (cuBLAS GEMMs, copy-engine pulls added by the own block's GEMMs) or "kernel"
        # (a Triton GEMM storing its tiles into the owners' buffers); docs/parallelism.md compares them
        self.rs_impl = "copy"
        # how an all-gather whose shards outlive the op moves them (GATHERS): pushed (no staging copy, no signal
        # before the transfer; docs/results.md)
        self.gather = "push"
        # the transfer and signal streams of an op whose sources outlive it joined into the current stream at the
        # next ``flush()`` (``end_step`` calls it) instead of at the op's end: a join that waits costs the compute
        # stream some 10 us in a CUDA graph's replay, even when the work joined is done (the consumers wait for the
        # data by signals, not by the joins); for callers that flush before a capture ends
        self.defer_joins = False
        self._deferred: list = []  # streams to join at the next flush
        # runs of rows a GEMM + reduce-scatter block is computed, signalled and pulled in (1 to PIECES): a peer starts
        # pulling after the first run's GEMM, not the whole block's, and the own block adds each pulled run as it lands
        self.rs_pieces = 2
        # how a GEMM + reduce-scatter ("copy") moves its data: "partials" (each rank computes every block's partial sum,
        # the owner pulls them), "inputs" (each peer pushes its input rows of the owner's block and its weight, and the
        # owner computes the block alone), "auto" (whichever moves fewer bytes at the op's shape: overlap.py)
        self.rs_route = "auto"
        # how a rank signals a peer (SIGNALS; the module doc): a stream memory operation where the driver has it
        self.signals = "stream" if not stream_memops.unavailable() else "kernel"
        self._handle_turn: dict[int, int] = {}  # id(handle) -> the turn of the role's buffers it is
        self._pads: dict[tuple[int, int], int] = {}  # (id(handle), rank) -> where that rank's signal pad is mapped

    def _channel(self, handle, role: str, piece: int) -> int:
        """The signal-pad channel of ``piece`` of ``role``'s op on ``handle`` (CHANNELS)."""
        return CHANNELS[role] + self._handle_turn[id(handle)] * PIECES + piece

    def signal(self, handle, role: str, peer: int, piece: int = 0) -> None:
        """On the current stream, after its earlier work: tell ``peer`` that piece ``piece`` of this rank's data for
        the op on ``handle`` is in place."""
        channel = self._channel(handle, role, piece)
        if self._signals() == "stream":  # torch's pad layout: pads[peer][size * channel + sender], uint32
            key = (id(handle), peer)
            if key not in self._pads:
                words = self.size * (max(CHANNELS.values()) + 2 * PIECES)  # the highest word any signal sets, + 1
                if 4 * words > handle.signal_pad_size:  # torch's kernels check their channel; a stream write cannot
                    raise RuntimeError(f"SymmetricWorkspace: torch's signal pad holds {handle.signal_pad_size} bytes, "
                                       f"the signals of {self.size} ranks need {4 * words}; use signals 'kernel'")
                self._pads[key] = handle.signal_pad_ptrs[peer]
            stream_memops.write_value32(torch.cuda.current_stream(),
                                        self._pads[key] + 4 * (self.size * channel + self.rank), 1)
        else:
            handle.put_signal(peer, channel=channel)

    def wait(self, handle, role: str, peer: int, piece: int = 0) -> None:
        """The current stream's later work waits for ``peer``'s signal of piece ``piece`` (and clears it): that the
        peer's data for the op on ``handle`` is in place (in its buffer, or pushed into this rank's). Every rank
        waits, once, for every piece a peer signals it."""
        handle.wait_signal(peer, channel=self._channel(handle, role, piece))

    def _signals(self) -> str:
        if self.signals not in SIGNALS:
            raise ValueError(f"SymmetricWorkspace: unknown signals {self.signals!r} (known: {', '.join(SIGNALS)})")
        if self.signals == "stream" and (why := stream_memops.unavailable()):
            raise RuntimeError(f"SymmetricWorkspace: signals 'stream' cannot be used ({why}); use signals 'kernel'")
        return self.signals

    def _stream(self, key):
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=self.device)
        return self._streams[key]

    def peer_stream(self, peer: int, role: str):
        """The stream that moves ``role``'s data from ``peer`` while the current stream computes (one per peer and
        role: a column layer's backward gathers its input while its reduce-scatter's pulls are in flight)."""
        return self._stream((peer, role))

    def pull(self, handle, role: str, peers: list[int], copy, signal_first: bool, after, pieces: int = 1) -> dict:
        """For each of ``peers``, on its own stream forked from the current one at event ``after``: for each piece j <
        ``pieces``, wait for the peer's signal of piece j and ``copy(peer, j)`` (copy-engine transfers out of the peer's
        buffer). With ``signal_first``, the rank first tells the peer that all of its own data is in place, and the
        peer's one signal (piece 0's) says the same of all the peer's pieces. {peer: [event after the copy of piece j,
        for each j]}; ``join`` them into the current stream."""
        _check_pieces(pieces)

        def piece(peer, j):
            if signal_first and j == 0:
                self.signal(handle, role, peer)
            if j == 0 or not signal_first:
                self.wait(handle, role, peer, j)
            copy(peer, j)

        return self._per_peer(role, peers, after, pieces, piece)

    def push(self, handle, role: str, peers: list[int], put, after, pieces: int = 1) -> dict:
        """For each of ``peers``, on its own stream forked from the current one at event ``after``: for each piece j <
        ``pieces``, ``put(peer, j)`` (copy-engine transfers into the peer's buffer) and tell the peer that piece j is
        in place. {peer: [event after the signal of piece j, for each j]}: ``join`` them into the current stream
        before the op returns. The peers' pieces in this rank's buffer are waited for where they are used, on the
        current stream (``wait``): the waiting kernel follows the GEMM before it on its stream at once, where a
        wait queued on the transfer stream after its copy started only after the copy engine's handover (some 14 us
        in a CUDA graph). A rank puts into a peer's buffer only what the peer's op of two turns ago no longer reads
        (see the module doc: the same rule as the pulls')."""
        _check_pieces(pieces)

        def piece(peer, j):
            put(peer, j)
            self.signal(handle, role, peer, j)

        return self._per_peer(role, peers, after, pieces, piece)

    def _per_peer(self, role: str, peers: list[int], after, pieces: int, piece) -> dict:
        """For each of ``peers``, on its own stream (``peer_stream``) forked from the current one at event ``after``:
        ``piece(peer, j)`` for each j < ``pieces``, an event recorded after each. {peer: [those events]}."""
        events = {}
        for peer in peers:
            stream = self.peer_stream(peer, role)
            stream.wait_event(after)
            events[peer] = []
            with torch.cuda.stream(stream):
                for j in range(pieces):
                    piece(peer, j)
                    event = torch.cuda.Event()
                    event.record(stream)
                    events[peer].append(event)
        return events

    def signal_aside(self, handle, role: str, peer: int, piece: int = 0) -> None:
        """``signal``, sent from the role's signal stream once the work queued so far on the current stream is done:
        the current stream goes on at once (a signal kernel takes a round trip over NVLink, and a stream signal's
        fence held the next GEMM on the stream back by some 8 microseconds). ``settle(role)`` joins the signal stream
        back before the op returns."""
        _check_pieces(piece + 1)
        stream = self._stream(("signals", role))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.signal(handle, role, peer, piece)

    def settle(self, role: str) -> None:
        """The current stream waits for every signal ``signal_aside`` sent for ``role`` (for graph capture: every
        stream forked from the captured one joins it again); with ``defer_joins``, at the next ``flush``."""
        stream = self._stream(("signals", role))
        if self.defer_joins:
            self._defer(stream)
        else:
            torch.cuda.current_stream().wait_stream(stream)

    def _defer(self, stream) -> None:
        if all(stream is not s for s in self._deferred):
            self._deferred.append(stream)

    def join_later(self, events: dict, role: str) -> None:
        """``join(events)`` of ``role``'s transfers, at the next ``flush`` with ``defer_joins`` (for transfers whose
        sources outlive the op, and whose consumers wait for them by signals)."""
        if not self.defer_joins:
            self.join(events)
            return
        for peer in events:
            self._defer(self.peer_stream(peer, role))

    def flush(self) -> None:
        """The current stream joins every stream whose join was deferred (``defer_joins``) since the last flush: call
        it before a CUDA-graph capture ends (``end_step`` does)."""
        current = torch.cuda.current_stream()
        for stream in self._deferred:
            current.wait_stream(stream)
        self._deferred.clear()

    @staticmethod
    def join(events: dict) -> None:
        """The current stream waits for every pull of ``events`` (and so joins their streams, for graph capture)."""
        current = torch.cuda.current_stream()
        for per_peer in events.values():
            for event in per_peer:
                current.wait_event(event)

    def buffer(self, role: str, nbytes: int):
        """The handle of ``role``'s next buffer (alternating between two), at least ``nbytes`` long."""
        if role not in CHANNELS:
            raise ValueError(f"SymmetricWorkspace: unknown role {role!r} (known: {sorted(CHANNELS)})")
        pair = self._buffers.setdefault(role, [[None, None], [None, None]])
        turn = self._turn.get(role, 0)
        self._turn[role] = 1 - turn
        self._uses[role] = self._uses.get(role, 0) + 1
        slot = pair[turn]
        if slot[0] is None or slot[0].numel() < nbytes:
            if torch.cuda.is_current_stream_capturing():
                have = 0 if slot[0] is None else slot[0].numel()
                raise RuntimeError(f"SymmetricWorkspace: the {role!r} buffer must grow from {have} to {nbytes} bytes "
                                   "inside a CUDA-graph capture, which cannot rendezvous; run the step once eagerly "
                                   "before capturing it")
            size = max(nbytes, 2 * (0 if slot[0] is None else slot[0].numel()))
            if slot[0] is not None:  # work queued on this device may still read the old buffer
                torch.cuda.synchronize(self.device)
            if slot[1] is not None:
                self._addresses.pop(id(slot[1]), None)
                self._handle_turn.pop(id(slot[1]), None)
                self._pads = {k: v for k, v in self._pads.items() if k[0] != id(slot[1])}
            slot[1] = None
            slot[0] = self._symm.empty(size, dtype=torch.uint8, device=self.device)
            slot[1] = self._symm.rendezvous(slot[0], self.group)
            # made here, outside any capture: a host-to-device copy cannot be captured
            addresses = [slot[1].get_buffer(peer, [1], torch.uint8, 0).data_ptr() for peer in range(self.size)]
            if any(a % 16 for a in addresses):  # the kernels store into them in 16-byte vectors
                raise RuntimeError(f"SymmetricWorkspace: the {role!r} buffer is mapped at "
                                   f"{[hex(a) for a in addresses]}, not all 16-byte aligned")
            self._addresses[id(slot[1])] = torch.tensor(addresses, dtype=torch.int64, device=self.device)
            self._handle_turn[id(slot[1])] = turn  # a slot's turn is its place in the pair, fixed
            self.grown += 1
        return slot[1]

    def addresses(self, handle) -> torch.Tensor:
        """(group size,) int64 on the device: where each rank's buffer of ``handle`` is mapped in this process (for
        kernels that store into peers' buffers)."""
        return self._addresses[id(handle)]

    def barrier(self, handle, role: str) -> None:
        """Every rank of the group reaches this point of its current stream (the role's channel)."""
        handle.barrier(channel=CHANNELS[role])

    def end_step(self) -> None:
        """Ends a training (or evaluation) step: a role used an odd number of times since the last call takes one more
        turn, a barrier alone. A step captured in a CUDA graph and replayed then still alternates the two buffers
        across replays (its last op and the next replay's first never share one). Joins the deferred streams first
        (``flush``)."""
        self.flush()
        for role, uses in sorted(self._uses.items()):
            if uses % 2:
                self.barrier(self.buffer(role, 1), role)
        self._uses.clear()

    def close(self) -> None:
        """Drops the buffers (collective in effect: every rank should close together)."""
        self._buffers.clear()
        self._addresses.clear()
        self._handle_turn.clear()
        self._pads.clear()
        self._deferred.clear()
