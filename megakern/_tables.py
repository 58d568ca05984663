"""Device tables of tensor addresses for multi-tensor kernels (megakern.optim's AdamW and sum of squares).

A multi-tensor kernel finds its tensors through an int64 table, a row of ``row`` entries per tensor (numel first,
then addresses), and a work list of (row, first element) pairs, one per block of ``block`` elements, which depends
on the sizes only. ``AddressTables.get(key, rows, device)`` returns (work list, table, programs) for one launch:

- eager calls share one table per key, rewritten (through a pinned staging buffer, asynchronously) when an address
  changes: autograd may put the gradients elsewhere from one step to the next;
- a CUDA-graph capture takes the key's eager table over (the graph owns it from then on, never rewritten; later
  eager calls build their own), its new addresses written by ``flush()`` after the capture, before the first
  replay. Nothing is allocated during a capture: memory taken from the graph's pool there may hold other tensors
  earlier in the graph, which every replay would write over the table. So a capture needs an eager call with the
  same sizes first.
"""
from __future__ import annotations

import torch


class AddressTables:
    """Work lists and address tables of multi-tensor launches, cached per launch key (see the module docstring)."""

    def __init__(self, row: int, block: int, name: str = "AddressTables"):
        if row < 1:
            raise ValueError(f"AddressTables: row must be >= 1 entries, got {row}")
        if block < 1:
            raise ValueError(f"AddressTables: block must be >= 1 elements, got {block}")
        self.row, self.block, self.name = row, block, name  # name: the caller, in error messages
        # (key, sizes) -> (work list, programs); key -> (rows, its table) for eager calls; (key, rows) -> a captured
        # graph's table
        self._works: dict[tuple, tuple[torch.Tensor, int]] = {}
        self._eager: dict = {}
        self._graph: dict[tuple, torch.Tensor] = {}
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._staging: list[list] = []  # [pinned buffer, event of its last copy]

    def ready(self, key, rows: tuple[tuple[int, ...], ...], device: torch.device) -> bool:
        """Whether ``get`` can serve these rows now: always outside a CUDA-graph capture; inside one, only where a
        graph already owns their table or an eager call with the same sizes came first."""
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return True
        if (key, rows) in self._graph:
            return True
        cached = self._eager.get(key)
        return cached is not None and tuple(r[0] for r in cached[0]) == tuple(r[0] for r in rows)

    @torch.no_grad()
    def get(self, key, rows: tuple[tuple[int, ...], ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          int]:
        """(work list, table, programs) of one launch over ``rows``: a tuple per tensor of ``row`` ints, its numel
        first. ``key`` names the launch (what else in the call's arguments tells launches apart)."""
        if not rows or any(len(r) != self.row for r in rows):
            raise ValueError(f"AddressTables.get: every row must hold {self.row} entries, got "
                             f"{sorted({len(r) for r in rows})}")
        if not self.ready(key, rows, device):
            raise RuntimeError(f"{self.name}: captured in a CUDA graph before an eager call with the same tensors; "
                               "run one step eagerly first (its tables must live outside the graph's memory pool)")
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        sizes = tuple(r[0] for r in rows)
        owned = self._graph.get((key, rows))  # a graph's table (never rewritten) serves every call alike
        cached = self._eager.get(key)
        if (key, sizes) not in self._works:
            work = [(i, start) for i, n in enumerate(sizes) for start in range(0, n, self.block)]
            self._works[(key, sizes)] = (self._device(torch.tensor(work, dtype=torch.int64).reshape(-1), device),
                                         len(work))
        work, programs = self._works[(key, sizes)]
        if owned is not None:
            return work, owned, programs
        if capturing:  # the graph takes the eager table over: the new addresses, if any, are written by flush()
            table = self._eager.pop(key)[1]
            if cached[0] != rows:
                self._pending.append((table, torch.tensor(rows, dtype=torch.int64).reshape(-1)))
            self._graph[(key, rows)] = table
            return work, table, programs
        if cached is not None and cached[0] == rows:
            return work, cached[1], programs
        host = torch.tensor(rows, dtype=torch.int64).reshape(-1)
        if cached is not None and cached[1].shape == host.shape:
            table = cached[1]
            self._write(table, host)
        else:
            table = self._device(host, device)
        self._eager[key] = (rows, table)
        return work, table, programs

    def flush(self) -> None:
        """Writes the tables built during a CUDA-graph capture; call it after the capture, before the replay."""
        for device_tensor, host in self._pending:
            device_tensor.copy_(host)
        self._pending.clear()

    def _device(self, host: torch.Tensor, device) -> torch.Tensor:
        out = torch.empty(host.shape, dtype=host.dtype, device=device)
        self._write(out, host)
        return out

    def _write(self, device_tensor: torch.Tensor, host: torch.Tensor) -> None:
        if device_tensor.is_cuda:
            self._upload(device_tensor, host)
        else:
            device_tensor.copy_(host)

    def _upload(self, device_tensor: torch.Tensor, host: torch.Tensor) -> None:
        """An asynchronous copy through a pinned staging buffer of this object's, reused once its last copy has
        finished (an event query, no wait). A pageable copy may wait for the stream: an unseen sync every step the
        gradients move. The buffers live as long as the object: a pinned block freed during a later CUDA-graph
        capture would record an event on the capturing thread's streams and break the capture."""
        for entry in self._staging:
            buf, done = entry
            if buf.numel() == host.numel() and (done is None or done.query()):
                break
        else:
            entry = [torch.empty(host.shape, dtype=host.dtype, pin_memory=True), None]
            self._staging.append(entry)
        entry[0].copy_(host)
        device_tensor.copy_(entry[0], non_blocking=True)
        entry[1] = torch.cuda.Event()
        entry[1].record()
