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

Loss masks (SFT data, ``megakern.data.sft``): where the indexed dataset has one (PREFIX.mask.bin), each item also
holds ``'loss_mask'``, a bool tensor (L + 1,) aligned with the tokens, True where the token is trained as a target;
``to_batch`` turns the targets of the others into the ignore index. ``loss_mask=False`` ignores the dataset's mask
(every token trains). A dataset without one serves ``{'tokens'}`` alone, exactly as before.

Whole documents (``whole_documents=True``): instead of windows of the stream, each sample holds whole documents,
packed in the epoch's document order (the permutation above) into samples of L + 1 tokens: a document goes into the
first of the last OPEN_BINS samples still open that has room for it, else opens a new one (closing the fullest when
OPEN_BINS are open); samples never span epochs. The rest of a sample is PAD_ID tokens whose loss mask is False, so
every item has a ``'loss_mask'``; a document longer than L + 1 tokens is an error. No example of SFT data is then
cut from its prompt or split over two samples. ``doc_idx`` holds the documents in packed order, sample j being
``doc_idx[sample_idx[j, 0]:sample_idx[j + 1, 0]]`` (offsets 0); the epochs are as many as the samples need, found by
packing (``min_samples``: the fewest whole epochs holding at least that many samples).
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
OPEN_BINS = 16  # samples open to more documents at once when packing whole documents
PAD_ID = 0  # the token that fills the rest of a sample of whole documents (never trained)
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


def pack_documents(sizes: np.ndarray, order: np.ndarray, capacity: int,
                   open_bins: int = OPEN_BINS) -> tuple[np.ndarray, np.ndarray]:
    """(the documents of ``order`` regrouped by sample, each sample's document count): documents of ``sizes`` tokens
    (none over ``capacity``) packed in the given order into samples of ``capacity`` tokens, each into the first open
    sample with room for it (see the module doc)."""
    closed: list[list[int]] = []
    docs: list[list[int]] = []
    room: list[int] = []
    for d, size in zip(order.tolist(), sizes[order].tolist()):
        for k, free in enumerate(room):
            if size <= free:
                docs[k].append(d)
                room[k] = free - size
                if not room[k]:
                    closed.append(docs.pop(k))
                    room.pop(k)
                break
        else:
            if size == capacity:  # a sample of its own, full at once
                closed.append([d])
                continue
            if len(room) == open_bins:
                k = room.index(min(room))
                closed.append(docs.pop(k))
                room.pop(k)
            docs.append([d])
            room.append(capacity - size)
    closed += docs
    counts = np.fromiter((len(b) for b in closed), dtype=np.int64, count=len(closed))
    return np.fromiter((d for b in closed for d in b), dtype=np.int64, count=len(order)), counts


def build_packed_indices(sizes: np.ndarray, seq_length: int, seed: int, *, num_samples: int | None = None,
                         min_samples: int | None = None, max_epochs: int = 1,
                         name: str = "dataset") -> tuple[Indices, int]:
    """(the index arrays, epochs) of samples of whole documents (see the module doc): ``num_samples`` of them, or
    with ``min_samples`` all those of the fewest epochs holding that many, else one epoch's. DataError when more than
    ``max_epochs`` epochs would be needed, or a document does not fit a sample."""
    sizes = np.asarray(sizes, dtype=np.int64)
    capacity, num_docs = seq_length + 1, len(sizes)
    if num_docs and int(sizes.max()) > capacity:
        over = int((sizes > capacity).sum())
        raise DataError(f"{name}: {over} of {num_docs} documents are longer than a sample of whole documents "
                        f"(seq_length {seq_length} + 1 = {capacity} tokens; the longest has {int(sizes.max())}): "
                        f"shorten them (megakern.data.preprocess --format sft --max-length {capacity}) or use a longer "
                        "sequence")
    wanted = num_samples if num_samples is not None else min_samples
    orders, ends, total = [], [], 0
    for epoch in range(max_epochs):
        perm = np.random.default_rng((seed, _DOC_STREAM, epoch)).permutation(num_docs)
        order, counts = pack_documents(sizes, perm, capacity)
        orders.append(order)
        ends.append(epoch * num_docs + np.cumsum(counts))
        total += len(counts)
        if wanted is None or total >= wanted:
            break
    if wanted is not None and total < wanted:
        per = total / max_epochs
        raise DataError(f"{name}: {wanted} samples of whole documents (seq_length {seq_length}) need about "
                        f"{-(-wanted // max(int(per), 1))} epochs of this dataset (one packs into {per:.0f} samples), "
                        f"but max_epochs={max_epochs}; pass max_epochs to repeat the data, or ask for at most "
                        f"{total} samples")
    epochs, count = len(orders), wanted if num_samples is not None else total
    starts = np.concatenate([[0], *ends])[:count + 1]
    doc_idx = np.concatenate(orders).astype(_index_dtype(max(num_docs - 1, 0)))
    sample_idx = np.zeros((count + 1, 2), dtype=_index_dtype(len(doc_idx)))
    sample_idx[:, 0] = starts
    shuffle_idx = np.random.default_rng((seed, _SHUFFLE_STREAM)).permutation(count)
    return Indices(doc_idx, sample_idx, shuffle_idx.astype(_index_dtype(count - 1))), epochs


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
    min_samples: with num_samples None, the samples of the fewest whole epochs that hold at least this many.
    whole_documents: samples of whole documents, packed and padded (see the module doc).
    loss_mask: serve the indexed dataset's loss mask where it has one (False: every token trains).
    """

    def __init__(self, indexed: IndexedDataset, seq_length: int, num_samples: int | None, seed: int, *,
                 cache_dir=None, max_epochs: int = 1, strict: bool = False, name: str | None = None,
                 min_samples: int | None = None, whole_documents: bool = False, loss_mask: bool = True):
        self.indexed = indexed
        self.seq_length = _int_arg("seq_length", seq_length, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.max_epochs = _int_arg("max_epochs", max_epochs, 1)
        self.name = indexed.prefix.name if name is None else name
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(f"name must be letters, digits, '.', '_' or '-' (a file name stem), got {self.name!r}")
        if min_samples is not None:
            min_samples = _int_arg("min_samples", min_samples, 1)
            if num_samples is not None:
                raise ValueError("num_samples and min_samples are alternatives: give one")
        self.whole_documents = bool(whole_documents)
        self.reads_mask = bool(loss_mask) and bool(getattr(indexed, "has_loss_mask", False))
        self.has_loss_mask = self.reads_mask or self.whole_documents  # items carry 'loss_mask'
        tokens = indexed.num_tokens
        if tokens == 0:
            raise DataError(f"{self.name}: the dataset has no tokens ({len(indexed)} documents)")
        built = None
        if self.whole_documents:
            if num_samples is not None:
                num_samples = _int_arg("num_samples", num_samples, 1)
            built, self.epochs = build_packed_indices(indexed.sizes, self.seq_length, self.seed,
                                                      num_samples=num_samples, min_samples=min_samples,
                                                      max_epochs=self.max_epochs, name=self.name)
            self.num_samples = len(built.shuffle_idx)
        else:
            per_epoch = (tokens - 1) // self.seq_length
            if (num_samples is None or min_samples is not None) and per_epoch < 1:
                raise DataError(f"{self.name}: {tokens} tokens, too few for one sample of seq_length "
                                f"{self.seq_length} + 1 tokens")
            if min_samples is not None:
                num_samples = -(-min_samples // per_epoch) * per_epoch
            self.num_samples = _int_arg("num_samples", per_epoch if num_samples is None else num_samples, 1)
            self.epochs = epochs_needed(tokens, self.seq_length, self.num_samples)
            if self.epochs > self.max_epochs:
                raise DataError(
                    f"{self.name}: {self.num_samples} samples of seq_length {self.seq_length} need "
                    f"{self.num_samples * self.seq_length + 1} tokens, {self.epochs} epochs of this dataset's "
                    f"{tokens} tokens, but max_epochs={self.max_epochs}; pass max_epochs={self.epochs} to repeat the "
                    f"data, or ask for at most {self.max_epochs * per_epoch} samples")
        self.descriptor = {"format": CACHE_FORMAT, "dataset": indexed.fingerprint, "documents": len(indexed),
                           "tokens": tokens, "seq_length": self.seq_length, "seed": self.seed,
                           "num_samples": self.num_samples, "epochs": self.epochs}
        if self.whole_documents:  # (absent otherwise: the windows' caches and fingerprints stay as they were)
            self.descriptor.update(whole_documents=True, open_bins=OPEN_BINS)
        self.fingerprint = hashlib.sha256(json.dumps(self.descriptor, sort_keys=True).encode()).hexdigest()[:32]
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self._built = built
        arrays = self._load_or_build_cache(strict) if self.cache_dir else self._build()
        self._built = None
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays
        self.fill = None  # whole documents: the share of the samples' tokens that are documents' (not padding)
        if self.whole_documents:
            used = np.asarray(indexed.sizes, dtype=np.int64)[self.doc_idx[:int(self.sample_idx[-1, 0])]].sum()
            self.fill = float(used) / (self.num_samples * (self.seq_length + 1))

    def _build(self) -> Indices:
        if self._built is not None:
            return self._built
        return build_indices(self.indexed.sizes, self.seq_length, self.num_samples, self.seed)

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
        arrays = self._build()
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
        if self.whole_documents:
            return self._whole(j)
        (first, offset), (last, end) = self.sample_idx[j].tolist(), self.sample_idx[j + 1].tolist()
        if first // len(self.indexed) != last // len(self.indexed):
            self.check_unmodified()
        docs = self.doc_idx[first:last + 1].tolist()

        def window(get) -> np.ndarray:
            if first == last:
                return get(docs[0], offset, end - offset + 1)
            return np.concatenate([get(docs[0], offset)] + [get(d) for d in docs[1:-1]] + [get(docs[-1], 0, end + 1)])

        sample = {"tokens": torch.from_numpy(window(self.indexed.get).astype(np.int64))}
        if self.reads_mask:
            sample["loss_mask"] = torch.from_numpy(window(self.indexed.get_mask).astype(bool))
        return sample

    def _whole(self, j: int) -> dict[str, torch.Tensor]:
        """Sample ``j`` of whole documents: their tokens, then PAD_ID up to seq_length + 1, with the loss mask."""
        docs = self.doc_idx[int(self.sample_idx[j, 0]):int(self.sample_idx[j + 1, 0])].tolist()
        tokens = np.full(self.seq_length + 1, PAD_ID, dtype=np.int64)
        mask = np.zeros(self.seq_length + 1, dtype=bool)
        at = 0
        for d in docs:
            ids = self.indexed.get(d)
            tokens[at:at + len(ids)] = ids
            mask[at:at + len(ids)] = self.indexed.get_mask(d) if self.reads_mask else True
            at += len(ids)
        return {"tokens": torch.from_numpy(tokens), "loss_mask": torch.from_numpy(mask)}

    def __repr__(self) -> str:
        return (f"GPTDataset({self.name!r}, samples={self.num_samples}, seq_length={self.seq_length}, "
                f"seed={self.seed}, epochs={self.epochs}{', whole documents' if self.whole_documents else ''}"
                f"{', loss mask' if self.reads_mask else ''})")
