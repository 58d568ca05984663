"""A micro-batch on the device (Batch) from a sample of token rows: inputs and targets shifted by one, targets the
loss mask leaves out set to the ignore index, and for packed documents the documents' offsets (cu_seqlens) found at
each end-of-document token."""
from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # targets not trained: the model's loss ignores them (megakern.models.gpt.IGNORE_INDEX)


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


def targets_of(sample: dict) -> torch.Tensor:
    """The targets of a sample's (B, T + 1) ``tokens``: ``tokens[:, 1:]``, and where the sample has a ``loss_mask``
    (B, T + 1) aligned with the tokens, IGNORE_INDEX at each target whose token the mask leaves out (the mask of a
    target is that of the token predicted, not of the input it is predicted from)."""
    targets = sample["tokens"][:, 1:]
    mask = sample.get("loss_mask")
    if mask is None:
        return targets
    if mask.shape != sample["tokens"].shape:
        raise ValueError(f"a loss_mask of shape {tuple(mask.shape)} for tokens of shape "
                         f"{tuple(sample['tokens'].shape)}")
    return targets.masked_fill(~mask[:, 1:].bool(), IGNORE_INDEX)


def to_batch(sample: dict, device: torch.device, eod_id: int | None) -> Batch:
    """The Batch of a sample of (B, T + 1) ``tokens`` (and its ``loss_mask``: ``targets_of``); with ``eod_id`` (packed
    documents) the documents' offsets."""
    tokens = sample["tokens"]
    inputs, targets = tokens[:, :-1], targets_of(sample)
    cu, longest = document_offsets(inputs, eod_id) if eod_id is not None else (None, None)
    non_blocking = device.type == "cuda"
    return Batch(inputs.to(device, non_blocking=non_blocking), targets.to(device, non_blocking=non_blocking),
                 None if cu is None else cu.to(device, non_blocking=non_blocking), longest, cu)


# ---------------------------------------------------------------------------------------------------------------
# Devices, precision, optimizer.
