"""GPT pretraining samples: fixed-length windows over a shuffled stream of documents (Megatron's GPTDataset).

The stream is the documents of an IndexedDataset concatenated epoch after epoch; epoch e visits every document
once, in the order of a permutation drawn from ``np.random.default_rng((seed, 0, e))``. With L = seq_length,
sample j is ``stream[j*L : j*L + L + 1]``: L + 1 tokens that run across document boundaries, the last one shared
with sample j + 1. Item i of the dataset is sample ``shuffle_idx[i]``, a permutation drawn from
``np.random.default_rng((seed, 1))``; ``dataset[i]`` is ``{'tokens': int64 tensor (L + 1,)}``, and the training
program takes inputs ``tokens[:-1]`` and labels ``tokens[1:]``.

Three index arrays (Megatron's layout) describe the samples, E epochs of D documents, N samples:
    doc_idx      (E*D,)     document ids in stream order
    sample_idx   (N + 1, 2) (position in doc_idx, offset in that document) of stream token j*L, j = 0 .. N
    shuffle_idx  (N,)       the sample served as item i
``build_indices`` makes them with numpy alone: a cumulative sum of the stream's document sizes and one
``searchsorted`` for all sample starts; the only Python loop is over epochs. E is the fewest epochs that hold
N*L + 1 tokens; more than ``max_epochs`` is an error that gives the count (no silent repetition, no endless loop).

Cache (``cache_dir``): the arrays go to ``<name>.<key>.{doc_idx,sample_idx,shuffle_idx}.npy`` next to a descriptor
``<name>.json`` that records what they were built from (the indexed dataset's fingerprint, its size, seq_length,
seed, num_samples, epochs, CACHE_FORMAT) and each array's CRC32; ``key`` is the start of the dataset's fingerprint.
Each file is written to a temporary name, synced and renamed, the descriptor last, so a crash leaves the previous
cache or the new one, never a mix. A descriptor that does not match the parameters, or arrays of the wrong shape
or checksum, are rebuilt with a warning, or refused with ``strict=True``; matching arrays are memory-mapped
read-only (the checksum reads them once, a fraction of a second per GB).

Modification (contracts 11 and 34, docs/contracts.md): ``fingerprint`` identifies content and parameters (record it
in checkpoints and compare it on resume); ``check_unmodified()`` is a cheap stat of the .bin/.idx (the training
program calls it after every step and before every checkpoint), and ``__getitem__`` calls it too whenever a sample
crosses an epoch boundary.
"""
from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
import tempfile
import warnings
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from megakern.data.indexed import DataError, IndexedDataset

CACHE_FORMAT = 1
_DOC_STREAM, _SHUFFLE_STREAM = 0, 1  # second word of the seed: document order vs sample order
_ARRAYS = ("doc_idx", "sample_idx", "shuffle_idx")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _int_arg(name: str, value, minimum: int) -> int:
    """``value`` as an int, or ValueError naming the argument when it is not an integer >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _index_dtype(largest: int) -> np.dtype:
    return np.dtype(np.int32 if largest <= np.iinfo(np.int32).max else np.int64)


def epochs_needed(num_tokens: int, seq_length: int, num_samples: int) -> int:
    """The fewest passes over ``num_tokens`` tokens that hold ``num_samples`` samples: N*L + 1 tokens."""
    return -(-(num_samples * seq_length + 1) // num_tokens)


class Indices(NamedTuple):
    """The three index arrays of a GPTDataset (layout in the module doc)."""

    doc_idx: np.ndarray
    sample_idx: np.ndarray
    shuffle_idx: np.ndarray


def build_indices(sizes: np.ndarray, seq_length: int, num_samples: int, seed: int) -> Indices:
    """The index arrays for ``num_samples`` samples over documents of ``sizes`` tokens (layout in the module doc).

    Uses as many epochs as ``epochs_needed`` says; the caller decides whether that many are acceptable.
    """
    sizes = np.asarray(sizes)
    if sizes.ndim != 1 or not np.issubdtype(sizes.dtype, np.integer):
        raise DataError(f"document sizes must be a 1-D integer array, got shape {sizes.shape} dtype {sizes.dtype}")
    if sizes.size and sizes.min() < 0:
        raise DataError(f"document {int(sizes.argmin())} has a negative size {int(sizes.min())}")
    num_tokens = int(sizes.sum())
    if num_tokens == 0:
        raise DataError(f"the dataset has no tokens ({len(sizes)} documents)")
    num_docs, epochs = len(sizes), epochs_needed(num_tokens, seq_length, num_samples)

    doc_idx = np.empty(epochs * num_docs, dtype=_index_dtype(num_docs - 1))
    for epoch in range(epochs):
        doc_idx[epoch * num_docs:(epoch + 1) * num_docs] = np.random.default_rng(
            (seed, _DOC_STREAM, epoch)).permutation(num_docs)

    sizes = sizes.astype(np.int64, copy=False)
    doc_ends = np.cumsum(sizes[doc_idx])  # stream position just past each document
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(doc_ends, starts, side="right")  # first document that ends after the token
    sample_idx = np.empty((num_samples + 1, 2), dtype=_index_dtype(max(len(doc_idx), int(sizes.max()))))
    sample_idx[:, 0] = position
    sample_idx[:, 1] = starts - doc_ends[position] + sizes[doc_idx[position]]

    shuffle_idx = np.random.default_rng((seed, _SHUFFLE_STREAM)).permutation(num_samples)
    return Indices(doc_idx, sample_idx, shuffle_idx.astype(_index_dtype(num_samples - 1)))


def _crc32(array: np.ndarray) -> int:
    """CRC32 of an array's bytes."""
    return zlib.crc32(memoryview(np.ascontiguousarray(array)).cast("B"))


def _write_atomic(path: Path, write) -> None:
    """write(file) into a temporary file next to ``path``, sync it, and rename it to ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class GPTDataset(torch.utils.data.Dataset):
    """``num_samples`` samples of ``seq_length + 1`` tokens from ``indexed`` (see the module doc).

    num_samples: None for one epoch's worth, (num_tokens - 1) // seq_length.
    seed: a non-negative int; equal arguments and data give identical indices on every machine.
    cache_dir: where the index arrays are kept between runs; None builds them in memory every time.
    max_epochs: how many passes over the data num_samples may take; more is a DataError giving the count.
    strict: refuse (DataError) a cache built for other parameters or data instead of rebuilding it.
    name: the cache's file name stem and the name in messages; defaults to the indexed dataset's file name.
    Must be unique among the datasets sharing a cache_dir.
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, num_samples: int | None, seed: int, *,
                 cache_dir=None, max_epochs: int = 1, strict: bool = False, name: str | None = None):
        self.indexed = indexed
        self.seq_length = _int_arg("seq_length", seq_length, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.max_epochs = _int_arg("max_epochs", max_epochs, 1)
        self.name = indexed.prefix.name if name is None else name
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"name must be letters, digits, '.', '_' or '-' (a file name stem), got {self.name!r}")
        tokens = indexed.num_tokens
        if tokens == 0:
            raise DataError(f"{self.name}: the dataset has no tokens ({len(indexed)} documents)")
        per_epoch = (tokens - 1) // self.seq_length
        if num_samples is None and per_epoch < 1:
            raise DataError(f"{self.name}: {tokens} tokens, too few for one sample of seq_length "
                            f"{self.seq_length} + 1 tokens")
        self.num_samples = _int_arg("num_samples", per_epoch if num_samples is None else num_samples, 1)
        self.epochs = epochs_needed(tokens, self.seq_length, self.num_samples)
        if self.epochs > self.max_epochs:
            raise DataError(
                f"{self.name}: {self.num_samples} samples of seq_length {self.seq_length} need "
                f"{self.num_samples * self.seq_length + 1} tokens, {self.epochs} epochs of this dataset's {tokens} "
                f"tokens, but max_epochs={self.max_epochs}; pass max_epochs={self.epochs} to repeat the data, or "
                f"ask for at most {self.max_epochs * per_epoch} samples")
        self.descriptor = {"format": CACHE_FORMAT, "dataset": indexed.fingerprint, "documents": len(indexed),
                           "tokens": tokens, "seq_length": self.seq_length, "seed": self.seed,
                           "num_samples": self.num_samples, "epochs": self.epochs}
        self.fingerprint = hashlib.sha256(json.dumps(self.descriptor, sort_keys=True).encode()).hexdigest()[:32]
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        arrays = self._load_or_build_cache(strict) if self.cache_dir else build_indices(
            indexed.sizes, self.seq_length, self.num_samples, self.seed)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {"doc_idx": (self.epochs * len(self.indexed),), "sample_idx": (self.num_samples + 1, 2),
                "shuffle_idx": (self.num_samples,)}

    def _load_or_build_cache(self, strict: bool) -> Indices:
        path = self.cache_dir / f"{self.name}.json"
        if path.exists():
            arrays, problem = self._load_cache(path)
            if arrays is not None:
                return arrays
            if strict:
                raise DataError(f"{path}: {problem}; refusing to rebuild it (strict=True): remove it or use the "
                                f"parameters it was built for")
            warnings.warn(f"{path}: {problem}; rebuilding the index", stacklevel=3)
        return self._write_cache(path)

    def _load_cache(self, path: Path) -> tuple[Indices | None, str]:
        """(arrays, '') when the cache at ``path`` matches this dataset, else (None, what is wrong)."""
        try:
            cached = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            return None, f"unreadable descriptor ({exc})"
        if not isinstance(cached, dict):
            return None, "unreadable descriptor (not a JSON object)"
        differ = [f"{k}={cached.get(k)!r} (now {v!r})" for k, v in self.descriptor.items() if cached.get(k) != v]
        if differ:
            return None, "built for " + ", ".join(differ)
        arrays, crcs = [], cached.get("crc32") if isinstance(cached.get("crc32"), dict) else {}
        for field, shape in self._shapes().items():
            file = self.cache_dir / f"{self.name}.{self.fingerprint[:16]}.{field}.npy"
            try:
                array = np.load(file, mmap_mode="r")
            except (OSError, ValueError) as exc:
                return None, f"{file.name} unreadable ({exc})"
            if array.shape != shape or not np.issubdtype(array.dtype, np.integer):
                return None, f"{file.name} holds {array.dtype} {array.shape}, expected integers of shape {shape}"
            if _crc32(array) != crcs.get(field):
                return None, f"{file.name} does not match its checksum (corrupt)"
            arrays.append(array)
        return Indices(*arrays), ""

    def _write_cache(self, path: Path) -> Indices:
        """Build the arrays, write them and then the descriptor atomically, drop older arrays, map the new ones."""
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        arrays = build_indices(self.indexed.sizes, self.seq_length, self.num_samples, self.seed)
        stem = f"{self.name}.{self.fingerprint[:16]}"
        for field, array in zip(_ARRAYS, arrays):
            _write_atomic(self.cache_dir / f"{stem}.{field}.npy", lambda f, a=array: np.save(f, a))
        descriptor = self.descriptor | {"crc32": {field: _crc32(a) for field, a in zip(_ARRAYS, arrays)}}
        _write_atomic(path, lambda f: f.write(json.dumps(descriptor, indent=1).encode()))
        ours = re.compile(re.escape(self.name) + r"\.[0-9a-f]{16}\.(" + "|".join(_ARRAYS) + r")\.npy")
        for old in self.cache_dir.iterdir():
            if ours.fullmatch(old.name) and not old.name.startswith(stem + "."):
                old.unlink(missing_ok=True)
        return Indices(*(np.load(self.cache_dir / f"{stem}.{field}.npy", mmap_mode="r") for field in _ARRAYS))

    def check_unmodified(self) -> None:
        """DataError if the .bin/.idx changed on disk since they were opened."""
        self.indexed.check_unmodified()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sample {i} out of range [0, {self.num_samples})")
        j = int(self.shuffle_idx[i])
        (first, offset), (last, end) = self.sample_idx[j].tolist(), self.sample_idx[j + 1].tolist()
        if first // len(self.indexed) != last // len(self.indexed):
            self.check_unmodified()
        docs = self.doc_idx[first:last + 1].tolist()
        if first == last:
            parts = [self.indexed.get(docs[0], offset, end - offset + 1)]
        else:
            parts = ([self.indexed.get(docs[0], offset)] + [self.indexed.get(d) for d in docs[1:-1]]
                     + [self.indexed.get(docs[-1], 0, end + 1)])
        return {"tokens": torch.from_numpy(np.concatenate(parts).astype(np.int64))}

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, samples={self.num_samples}, seq_length={self.seq_length}, "
                f"seed={self.seed}, epochs={self.epochs})")
