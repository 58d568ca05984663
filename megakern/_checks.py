"""Input checks shared by the ops, and by models/ and parallel/ (``document_lengths``: packed documents'
cu_seqlens): a documented shared helper, the one private module those may import (tests/test_layout.py)."""
from __future__ import annotations

import torch


def document_lengths(op: str, cu_seqlens: torch.Tensor, tokens: int) -> list[int]:
    """Lengths of the packed documents that ``cu_seqlens`` (1-D int32 offsets 0, len0, len0 + len1, ..., tokens)
    describes; TypeError / ValueError naming ``op`` and the problem otherwise. One host sync."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1:
        raise TypeError(f"{op}: cu_seqlens must be a 1-D torch.int32 tensor of document offsets")
    offsets = cu_seqlens.tolist()
    if len(offsets) < 2 or offsets[0] != 0:
        raise ValueError(f"{op}: cu_seqlens must start at 0 and hold at least 2 offsets, got {offsets[:8]}")
    lengths = [e - s for s, e in zip(offsets[:-1], offsets[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing, got {offsets[:16]}")
    if offsets[-1] != tokens:
        raise ValueError(f"{op}: cu_seqlens ends at {offsets[-1]} but q holds {tokens} tokens")
    return lengths
