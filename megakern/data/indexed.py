"""Indexed token datasets: PREFIX.bin (token ids) + PREFIX.idx (document sizes, checksums), memory-mapped, and for
supervised fine-tuning data a loss mask beside them, PREFIX.mask.bin (which tokens are trained as targets).

Megatron's .bin/.idx, with the checks it lacks: a magic and a format version in both files; an id written into both
that ties the .idx to its .bin; the exact payload size; a CRC32 per chunk of tokens, verified on open; the dtype
chosen from the vocabulary (uint16 only when every id fits) and every id checked against the vocabulary when written
and when verified; files written to temporary names, synced and renamed (the .idx last), so a crash never leaves a
half-written pair and existing files are never overwritten unless asked; modification after opening detected.

Layout (little-endian):
    .bin  MAGIC_BIN(8) version u32, flags u32, pair id (16)  | tokens (dtype) ...
    .idx  MAGIC_IDX(8) version u32, dtype code u32, vocab_size u64, documents u64, tokens u64, chunk tokens u64,
          chunks u64, pair id (16)  | sizes int64[documents] | chunk CRC32 uint32[chunks] | CRC32 of all before u32
    .mask.bin  MAGIC_MASK(8) version u32, reserved u32, pair id (16), tokens u64, chunk tokens u64, chunks u64
          | mask uint8[tokens] | chunk CRC32 uint32[chunks] | CRC32 of the header and the chunk CRCs u32

The loss mask (``loss_mask=True`` to the writer; ``megakern.data.sft`` writes it) holds one byte per token: 1 where
the token is trained as a target (predicted from the tokens before it), 0 where it is not. The .bin's flags say
whether the pair has one (FLAG_LOSS_MASK), so a mask that goes missing is an error, never silently "train every
token"; the mask carries the pair id too, and the same checks as the tokens: its exact size, a CRC32 per chunk
verified on open, values 0 or 1, and modification after opening detected. A document's first token is never trained
(it would be predicted from the previous document's end): the writer refuses such a mask and the reader too.
"""
from __future__ import annotations

import hashlib
import os
import struct
import uuid
import zlib
from pathlib import Path

import numpy as np

MAGIC_BIN = b"MKTOKBIN"
MAGIC_IDX = b"MKTOKIDX"
VERSION = 1
BIN_HEADER = struct.Struct("<8sII16s")
IDX_HEADER = struct.Struct("<8sIIQQQQQ16s")
MASK_HEADER = struct.Struct("<8sII16sQQQ")
MAGIC_MASK = b"MKLOSSMK"
MASK_VERSION = 1
FLAG_LOSS_MASK = 1  # .bin flags: the pair has a PREFIX.mask.bin
CHUNK_TOKENS = 1 << 20
DTYPES = {0: np.dtype(np.uint16), 1: np.dtype(np.int32)}


class DataError(ValueError):
    """A dataset file is missing, corrupt, mismatched, modified, or inconsistent with its parameters."""


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id < vocab_size fits (vocab_size <= 65536), else int32."""
    if not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > np.iinfo(np.int32).max:
        raise ValueError(f"vocab_size {vocab_size} does not fit int32 token ids")
    return DTYPES[0] if vocab_size <= 65536 else DTYPES[1]


def paths(prefix) -> tuple[Path, Path]:
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".bin"), prefix.with_name(prefix.name + ".idx")


def mask_path(prefix) -> Path:
    """PREFIX.mask.bin, the loss mask of a dataset that has one."""
    prefix = Path(prefix)
    return prefix.with_name(prefix.name + ".mask.bin")


class _ChunkCRCs:
    """CRC32 per ``chunk_bytes`` of a stream written piece by piece, across the pieces' boundaries."""

    def __init__(self, chunk_bytes: int):
        self.chunk_bytes, self.crcs, self._crc, self._in_chunk = chunk_bytes, [], 0, 0

    def update(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            take = min(len(view), self.chunk_bytes - self._in_chunk)
            self._crc = zlib.crc32(view[:take], self._crc)
            self._in_chunk += take
            view = view[take:]
            if self._in_chunk == self.chunk_bytes:
                self.crcs.append(self._crc)
                self._crc, self._in_chunk = 0, 0

    def finish(self) -> list[int]:
        if self._in_chunk:
            self.crcs.append(self._crc)
            self._crc, self._in_chunk = 0, 0
        return self.crcs


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


class IndexedDatasetWriter:
    """Streams documents into PREFIX.bin / PREFIX.idx (and with ``loss_mask`` PREFIX.mask.bin); ``finalize`` (or
    leaving the ``with`` block) commits them."""

    def __init__(self, prefix, vocab_size: int, *, overwrite: bool = False, loss_mask: bool = False):
        self.bin_path, self.idx_path = paths(prefix)
        self.mask_path = mask_path(prefix)
        self.overwrite, self.loss_mask = overwrite, bool(loss_mask)
        self._refuse_existing()
        self.vocab_size, self.dtype = vocab_size, dtype_for_vocab(vocab_size)
        self.pair_id = uuid.uuid4().bytes
        suffix = f".tmp-{os.getpid()}-{self.pair_id.hex()[:8]}"
        self._bin_tmp = self.bin_path.with_name(self.bin_path.name + suffix)
        self._idx_tmp = self.idx_path.with_name(self.idx_path.name + suffix)
        self._mask_tmp = self.mask_path.with_name(self.mask_path.name + suffix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self._bin_tmp, "wb")
        self._bin.write(BIN_HEADER.pack(MAGIC_BIN, VERSION, FLAG_LOSS_MASK if self.loss_mask else 0, self.pair_id))
        self._mask = None
        if self.loss_mask:
            self._mask = open(self._mask_tmp, "wb")
            self._mask.write(bytes(MASK_HEADER.size))  # filled in by finalize
        self._sizes: list[int] = []
        self._crcs = _ChunkCRCs(CHUNK_TOKENS * self.dtype.itemsize)
        self._mask_crcs = _ChunkCRCs(CHUNK_TOKENS)
        self._tokens = 0
        self.trained_tokens = 0
        self._done = False

    def _refuse_existing(self) -> None:
        if not self.overwrite:
            for path in (self.bin_path, self.idx_path, self.mask_path):
                if path.exists():
                    raise FileExistsError(f"{path} exists; refusing to overwrite it (pass overwrite=True)")

    def add_document(self, ids, loss_mask=None) -> None:
        """Appends a document; ``loss_mask`` (with ``loss_mask=True`` to the writer, else None): one 0 or 1 per token,
        1 where the token is trained as a target, 0 for the first token."""
        doc = len(self._sizes)
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
            raise ValueError(f"document {doc}: token ids must be a 1-D sequence of ints, got "
                             f"shape {arr.shape} dtype {arr.dtype}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr.min()) if arr.min() < 0 else int(arr.max())
            raise ValueError(f"document {doc}: token id {bad} outside the vocabulary "
                             f"[0, {self.vocab_size})")
        mask = self._check_mask(doc, arr.size, loss_mask)
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._checksum(data)
        if mask is not None:
            self._mask.write(mask)
            self._mask_crcs.update(mask)
            self.trained_tokens += int(np.count_nonzero(np.frombuffer(mask, np.uint8)))
        self._sizes.append(int(arr.size))
        self._tokens += int(arr.size)

    def _checksum(self, data: bytes) -> None:
        """CRC32 per CHUNK_TOKENS tokens of payload, across document boundaries."""
        self._crcs.update(data)

    def _check_mask(self, doc: int, size: int, loss_mask) -> bytes | None:
        """The mask's bytes, or ValueError saying what is wrong with it."""
        if not self.loss_mask:
            if loss_mask is not None:
                raise ValueError(f"document {doc}: a loss mask given to a writer without one (pass loss_mask=True)")
            return None
        if loss_mask is None:
            raise ValueError(f"document {doc}: no loss mask (this writer writes one for every document)")
        mask = np.asarray(loss_mask)
        if mask.shape != (size,):
            raise ValueError(f"document {doc}: loss mask of shape {mask.shape} for {size} tokens")
        if size and (mask.dtype.kind not in "biu" or mask.min() < 0 or mask.max() > 1):
            raise ValueError(f"document {doc}: loss mask values must be 0 or 1 (or bools), got {mask.dtype} "
                             f"{mask.min()}..{mask.max()}")
        if size and mask[0]:
            raise ValueError(f"document {doc}: its first token is marked trained; a document's first token is never "
                             "a target (it would be predicted from the previous document's end)")
        return mask.astype(np.uint8, copy=False).tobytes()

    def finalize(self) -> None:
        if self._done:
            return
        self._refuse_existing()
        crcs = self._crcs.finish()
        self._bin.close()
        code = next(c for c, d in DTYPES.items() if d == self.dtype)
        header = IDX_HEADER.pack(MAGIC_IDX, VERSION, code, self.vocab_size, len(self._sizes), self._tokens,
                                 CHUNK_TOKENS, len(crcs), self.pair_id)
        body = header + np.asarray(self._sizes, dtype=np.int64).tobytes() + np.asarray(crcs, np.uint32).tobytes()
        with open(self._idx_tmp, "wb") as f:
            f.write(body + struct.pack("<I", zlib.crc32(body)))
        if self._mask is not None:
            mask_crcs = self._mask_crcs.finish()
            head = MASK_HEADER.pack(MAGIC_MASK, MASK_VERSION, 0, self.pair_id, self._tokens, CHUNK_TOKENS,
                                    len(mask_crcs))
            tail = np.asarray(mask_crcs, np.uint32).tobytes()
            self._mask.write(tail + struct.pack("<I", zlib.crc32(head + tail)))
            self._mask.seek(0)
            self._mask.write(head)
            self._mask.close()
            _fsync(self._mask_tmp)
        _fsync(self._bin_tmp)
        _fsync(self._idx_tmp)
        os.replace(self._bin_tmp, self.bin_path)
        if self._mask is not None:
            os.replace(self._mask_tmp, self.mask_path)
        else:
            self.mask_path.unlink(missing_ok=True)  # an overwritten dataset's mask (it no longer fits)
        os.replace(self._idx_tmp, self.idx_path)  # the .idx last: it commits the files
        self._done = True

    def abort(self) -> None:
        """Drop the temporary files; nothing existing is touched."""
        self._bin.close()
        if self._mask is not None:
            self._mask.close()
        for path in (self._bin_tmp, self._idx_tmp, self._mask_tmp):
            path.unlink(missing_ok=True)
        self._done = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False


class MappedTokens:
    """What a memory-mapped token file pair gives a dataset: documents by ``get`` (views of the mapping), their
    count, their loss mask where they have one (``get_mask``), and the check that no file changed since it was
    opened. A subclass sets bin_path, idx_path, sizes, offsets (the documents' first token, and the total last),
    tokens, and ``_stat = self._stats()`` when it opens; with a loss mask also loss_mask and mask_file (before
    ``_stats``)."""

    loss_mask: np.ndarray | None = None  # uint8 per token, 1 where it is trained as a target
    mask_file: Path | None = None

    @property
    def has_loss_mask(self) -> bool:
        return self.mask_file is not None

    def _watched(self) -> tuple[Path, ...]:
        return (self.bin_path, self.idx_path) + ((self.mask_file,) if self.mask_file is not None else ())

    def _stats(self) -> tuple:
        """(size, mtime, ctime, inode, device) of the .bin, of the .idx (and of the loss mask): any write,
        truncation, replacement (a new inode) or restored mtime (ctime still moves) changes it."""
        return tuple((s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev)
                     for s in (path.stat() for path in self._watched()))

    def check_unmodified(self) -> None:
        """DataError naming the file if the .bin, the .idx or the loss mask changed on disk since it was opened:
        written to (size, modification or change time), replaced (another inode) or removed. A stat of each file: a
        few microseconds."""
        try:
            now = self._stats()
        except FileNotFoundError as exc:
            raise DataError(f"{exc.filename}: removed while in use") from None
        for path, before, after in zip(self._watched(), self._stat, now):
            if before != after:
                what = [name for name, b, a in zip(("size", "modification time", "change time", "inode", "device"),
                                                   before, after) if b != a]
                raise DataError(f"{path}: changed on disk since it was opened ({', '.join(what)} differ"
                                f"{f': {before[0]} -> {after[0]} bytes' if before[0] != after[0] else ''}); the "
                                "samples read since then may hold other tokens. Restore the file, or start a new "
                                "run on the new data")

    def __len__(self) -> int:
        return len(self.sizes)

    def _span(self, doc: int, offset: int, length: int | None) -> slice:
        if not 0 <= doc < len(self.sizes):
            raise IndexError(f"document {doc} out of range [0, {len(self.sizes)})")
        size = int(self.sizes[doc])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens {offset}..{offset + length} outside document {doc} of {size} tokens")
        start = int(self.offsets[doc]) + offset
        return slice(start, start + length)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens offset .. offset + length of document ``doc`` (a view of the mapping)."""
        return self.tokens[self._span(doc, offset, length)]

    def get_mask(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """The loss mask (uint8, 1: trained) of the tokens ``get`` returns; ValueError without one."""
        if self.loss_mask is None:
            raise ValueError(f"{self.bin_path}: the dataset has no loss mask")
        return self.loss_mask[self._span(doc, offset, length)]


class IndexedDataset(MappedTokens):
    """A memory-mapped PREFIX.bin / PREFIX.idx pair (and its PREFIX.mask.bin where it has a loss mask), checked on
    open (``verify``: every chunk's CRC, the ids, and the mask's values)."""

    def __init__(self, prefix, *, vocab_size: int | None = None, verify: bool = True):
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"{path}: missing (expected the pair {self.bin_path.name} + {self.idx_path.name})")
        mask = mask_path(prefix)
        self.mask_file = mask if mask.exists() else None
        self._stat = self._stats()
        self._read_index()
        self._open_bin()
        self._open_mask(mask)
        if vocab_size is not None and vocab_size < self.vocab_size:
            raise DataError(f"{self.idx_path}: built for a vocabulary of {self.vocab_size} ids, larger than the "
                            f"tokenizer's {vocab_size}")
        self.checked_vocab = vocab_size or self.vocab_size
        if verify:
            self.verify()

    def _read_index(self) -> None:
        raw = self.idx_path.read_bytes()
        if len(raw) < IDX_HEADER.size + 4 or raw[:8] != MAGIC_IDX:
            raise DataError(f"{self.idx_path}: not a megakern index (bad magic or truncated header)")
        magic, version, code, vocab, docs, tokens, chunk, chunks, pair = IDX_HEADER.unpack_from(raw)
        if version != VERSION:
            raise DataError(f"{self.idx_path}: format version {version}; this megakern reads version {VERSION}")
        if code not in DTYPES:
            raise DataError(f"{self.idx_path}: unknown dtype code {code}")
        expected = IDX_HEADER.size + 8 * docs + 4 * chunks + 4
        if len(raw) != expected:
            raise DataError(f"{self.idx_path}: {len(raw)} bytes, expected {expected} (truncated or corrupt)")
        if zlib.crc32(raw[:-4]) != struct.unpack("<I", raw[-4:])[0]:
            raise DataError(f"{self.idx_path}: checksum mismatch (the index is corrupt)")
        self.dtype, self.vocab_size, self.pair_id, self.chunk_tokens = DTYPES[code], vocab, pair, chunk
        self.sizes = np.frombuffer(raw, np.int64, docs, IDX_HEADER.size)
        self.chunk_crcs = np.frombuffer(raw, np.uint32, chunks, IDX_HEADER.size + 8 * docs)
        if self.sizes.sum() != tokens or (docs and self.sizes.min() < 0):
            raise DataError(f"{self.idx_path}: document sizes do not add up to {tokens} tokens")
        self.num_tokens = int(tokens)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.fingerprint = hashlib.sha256(raw[:IDX_HEADER.size - 16] + raw[IDX_HEADER.size:-4]).hexdigest()[:16]

    def _open_bin(self) -> None:
        size = self.bin_path.stat().st_size
        expected = BIN_HEADER.size + self.num_tokens * self.dtype.itemsize
        with open(self.bin_path, "rb") as f:
            head = f.read(BIN_HEADER.size)
        if len(head) < BIN_HEADER.size or head[:8] != MAGIC_BIN:
            raise DataError(f"{self.bin_path}: not a megakern token file (bad magic)")
        _, version, self.flags, pair = BIN_HEADER.unpack(head)
        if version != VERSION:
            raise DataError(f"{self.bin_path}: format version {version}; this megakern reads version {VERSION}")
        if self.flags & ~FLAG_LOSS_MASK:
            raise DataError(f"{self.bin_path}: unknown flags {self.flags:#x} (written by a newer megakern?)")
        if pair != self.pair_id:
            raise DataError(f"{self.bin_path} and {self.idx_path} are not a pair (written separately): "
                            f"ids {pair.hex()[:8]} vs {self.pair_id.hex()[:8]}")
        if size != expected:
            raise DataError(f"{self.bin_path}: {size} bytes, expected {expected} for {self.num_tokens} tokens "
                            f"(truncated or appended to)")
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", offset=BIN_HEADER.size,
                                 shape=(self.num_tokens,)) if self.num_tokens else np.zeros(0, self.dtype))

    def _open_mask(self, path: Path) -> None:
        """The loss mask, when the .bin's flags say the dataset has one: its header checked against the pair, its
        exact size and its chunk CRCs' own checksum; mapped read-only."""
        if not self.flags & FLAG_LOSS_MASK:
            if self.mask_file is not None:
                raise DataError(f"{path}: a loss mask beside {self.bin_path.name}, which was written without one (a "
                                "leftover of an earlier dataset of this prefix?); remove it")
            return
        if self.mask_file is None:
            raise DataError(f"{path}: missing; {self.bin_path.name} was written with a loss mask (SFT data), and "
                            "training it without one would train the prompts too")
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(MASK_HEADER.size)
            if len(head) < MASK_HEADER.size or head[:8] != MAGIC_MASK:
                raise DataError(f"{path}: not a megakern loss mask (bad magic or truncated header)")
            _, version, _, pair, tokens, chunk, chunks = MASK_HEADER.unpack(head)
            if version != MASK_VERSION:
                raise DataError(f"{path}: format version {version}; this megakern reads version {MASK_VERSION}")
            if pair != self.pair_id:
                raise DataError(f"{path} does not belong to {self.idx_path} (written separately): ids "
                                f"{pair.hex()[:8]} vs {self.pair_id.hex()[:8]}")
            if tokens != self.num_tokens:
                raise DataError(f"{path}: a mask of {tokens} tokens for the {self.num_tokens} of {self.idx_path.name}")
            if chunk < 1 or chunks != -(-tokens // chunk):
                raise DataError(f"{path}: {chunks} checksum chunks of {chunk} tokens for {tokens} tokens (corrupt)")
            expected = MASK_HEADER.size + tokens + 4 * chunks + 4
            if size != expected:
                raise DataError(f"{path}: {size} bytes, expected {expected} for {tokens} tokens (truncated or "
                                "appended to)")
            f.seek(MASK_HEADER.size + tokens)
            tail = f.read(4 * chunks + 4)
        if zlib.crc32(head + tail[:-4]) != struct.unpack("<I", tail[-4:])[0]:
            raise DataError(f"{path}: checksum mismatch in its header or chunk checksums (corrupt)")
        self.mask_chunk_tokens = chunk
        self.mask_crcs = np.frombuffer(tail, np.uint32, chunks)
        self.loss_mask = (np.memmap(path, dtype=np.uint8, mode="r", offset=MASK_HEADER.size, shape=(tokens,))
                          if tokens else np.zeros(0, np.uint8))
        # the mask is part of what trains: datasets with other masks have other fingerprints
        mask_id = head[:16] + head[32:] + tail[:-4]  # all but the pair id (as the .idx's fingerprint)
        self.fingerprint = hashlib.sha256(self.fingerprint.encode() + mask_id).hexdigest()[:16]

    def verify(self) -> None:
        """Check every chunk's CRC32 and that every id is in [0, vocabulary); with a loss mask its chunks' CRC32s,
        values 0 or 1, and no document's first token trained. DataError naming the chunk."""
        for i, crc in enumerate(self.chunk_crcs):
            chunk = self.tokens[i * self.chunk_tokens:(i + 1) * self.chunk_tokens]
            if zlib.crc32(chunk.tobytes()) != int(crc):
                first = i * self.chunk_tokens
                raise DataError(f"{self.bin_path}: checksum mismatch in tokens {first}..{first + len(chunk) - 1} "
                                f"(chunk {i}): the file is corrupt")
            if chunk.size and int(chunk.max()) >= self.checked_vocab:
                raise DataError(f"{self.bin_path}: token id {int(chunk.max())} in chunk {i} is outside the "
                                f"vocabulary of {self.checked_vocab}")
            if chunk.size and self.dtype.kind == "i" and int(chunk.min()) < 0:  # signed files (int32)
                raise DataError(f"{self.bin_path}: token id {int(chunk.min())} in chunk {i} is negative")
        if self.loss_mask is None:
            return
        for i, crc in enumerate(self.mask_crcs):
            first = i * self.mask_chunk_tokens
            chunk = self.loss_mask[first:first + self.mask_chunk_tokens]
            if zlib.crc32(chunk.tobytes()) != int(crc):
                raise DataError(f"{self.mask_file}: checksum mismatch in the mask of tokens {first}.."
                                f"{first + len(chunk) - 1} (chunk {i}): the file is corrupt")
            if chunk.size and int(chunk.max()) > 1:
                raise DataError(f"{self.mask_file}: value {int(chunk.max())} in chunk {i}; a loss mask holds 0 or 1")
        starts = self.offsets[:-1][self.sizes > 0]
        trained = np.flatnonzero(self.loss_mask[starts]) if starts.size else starts
        if trained.size:
            doc = int(np.flatnonzero(self.sizes > 0)[trained[0]])
            raise DataError(f"{self.mask_file}: the first token of document {doc} is marked trained; a document's "
                            "first token is never a target (it would be predicted from the previous document's end)")

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.prefix)!r}, documents={len(self)}, tokens={self.num_tokens}, "
                f"dtype={self.dtype}, vocab_size={self.vocab_size}{', loss mask' if self.has_loss_mask else ''})")
