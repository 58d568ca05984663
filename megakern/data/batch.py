"""A micro-batch on the device (Batch) from a sample of token rows: inputs and targets shifted by one, and for packed
documents the documents' offsets (cu_seqlens) found at each end-of-document token."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One micro-batch on the device: inputs and targets (B, T) int64; with packed documents cu_seqlens
    (ndocs + 1,) int32 over the B * T tokens (on the device, and ``host_cu_seqlens`` the same on the host) and its
    longest document."""

    inputs: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    host_cu_seqlens: torch.Tensor | None = None

    def model_kwargs(self) -> dict:
        return {} if self.cu_seqlens is None else {"cu_seqlens": self.cu_seqlens, "max_seqlen": self.max_seqlen}

    def parallel_kwargs(self) -> dict:
        """The packing as ParallelModel.forward_backward takes it: host-side offsets (it cuts them into micro-batches
        without reading device memory)."""
        if self.cu_seqlens is None:
            return {}
        return {"cu_seqlens": self.host_cu_seqlens if self.host_cu_seqlens is not None else self.cu_seqlens,
                "max_seqlen": self.max_seqlen}


def document_offsets(inputs: torch.Tensor, eod_id: int) -> tuple[torch.Tensor, int]:
    """cu_seqlens (int32) of the documents in (B, T) ``inputs`` flattened: a document ends after each eod token and
    at each row's end; and the longest document's length."""
    B, T = inputs.shape
    flat = inputs.reshape(-1)
    ends = torch.nonzero(flat == eod_id).flatten() + 1
    rows = torch.arange(1, B + 1, dtype=ends.dtype) * T
    bounds = torch.unique(torch.cat([torch.zeros(1, dtype=ends.dtype), ends, rows]))
    return bounds.to(torch.int32), int(torch.diff(bounds).max())


def to_batch(sample: dict, device: torch.device, eod_id: int | None) -> Batch:
    tokens = sample["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cu, longest = document_offsets(inputs, eod_id) if eod_id is not None else (None, None)
    non_blocking = device.type == "cuda"
    return Batch(inputs.to(device, non_blocking=non_blocking), targets.to(device, non_blocking=non_blocking),
                 None if cu is None else cu.to(device, non_blocking=non_blocking), longest, cu)


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, optimizer.
