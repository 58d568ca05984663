"""NVTX ranges around megakern ops, for Nsight timelines.

Uses the ``nvtx`` package (a no-op unless a profiler is attached); without it, or while torch.compile is
tracing (where a foreign context manager would break the graph), ranges are skipped.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import nvtx as _nvtx
except ImportError:  # optional: ranges are a profiling aid only
    _nvtx = None

DOMAIN = "megakern"


def annotate(name: str):
    """A context manager marking ``name`` in the ``megakern`` NVTX domain."""
    if _nvtx is None or torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return _nvtx.annotate(name, domain=DOMAIN)
