"""Megatron-LM's indexed datasets (the MMIDIDX PREFIX.bin / PREFIX.idx pair that Megatron-LM's
tools/preprocess_data.py writes), read with megakern's checks, so corpora prepared for Megatron-LM train here
unchanged.

Layout (little-endian), as Megatron-LM's indexed_dataset.py writes it:
    .idx  b"MMIDIDX\\x00\\x00" | version u64 (1) | dtype code u8 | sequences u64 | documents u64
          | sequence lengths int32[sequences] | sequence pointers int64[sequences] (byte offsets into .bin)
          | document indices int64[documents] (sequence boundaries: 0 .. sequences)
    .bin  the tokens, back to back, no header
dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16 (6 and 7, floats, are refused).

Each sequence is a document here, as in Megatron-LM's GPT datasets. Checked on open: the magic, the version, the dtype,
that the .idx holds exactly its arrays, that the pointers lay the sequences back to back from 0, that the document
indices rise from 0 to the sequence count, and that the .bin holds exactly the tokens the lengths add up to. With
``verify`` every token is checked against the vocabulary (non-negative, below it) and CRC32s of chunks of tokens are
computed; the first open records them in PREFIX.idx.megakern-check (with the files' sizes and the dtype), and later
opens compare against that record, so a corpus that changed since a run first read it is named, not read.
``IndexedDataset``'s interface: sizes, offsets, tokens, get, verify, check_unmodified, fingerprint, num_tokens.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from megakern.data.indexed import DataError, MappedTokens, paths

MAGIC = b"MMIDIDX\x00\x00"
HEADER = struct.Struct("<9sQBQQ")
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
CHUNK_TOKENS = 1 << 20
CHECK_SUFFIX = ".megakern-check"


def is_megatron(prefix) -> bool:
    """PREFIX.idx starts with Megatron-LM's magic."""
    try:
        with open(paths(prefix)[1], "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


class MegatronIndexedDataset(MappedTokens):
    """A memory-mapped Megatron-LM PREFIX.bin / PREFIX.idx pair (see the module doc)."""

    def __init__(self, prefix, *, vocab_size: int, verify: bool = True):
        self.prefix = Path(prefix)
        self.bin_path, self.idx_path = paths(prefix)
        for path in (self.idx_path, self.bin_path):
            if not path.is_file():
                raise DataError(f"{path}: missing (expected the pair {self.bin_path.name} + {self.idx_path.name})")
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        self.vocab_size = self.checked_vocab = vocab_size
        self._stat = self._stats()
        self._read_index()
        self._open_bin()
        if verify:
            self.verify()

    def _read_index(self) -> None:
        raw = self.idx_path.read_bytes()
        if len(raw) < HEADER.size or raw[:len(MAGIC)] != MAGIC:
            raise DataError(f"{self.idx_path}: not a Megatron-LM index (bad magic or truncated header)")
        _, version, code, seqs, docs = HEADER.unpack_from(raw)
        if version != 1:
            raise DataError(f"{self.idx_path}: Megatron-LM index version {version}; megakern reads version 1")
        if code not in DTYPES:
            raise DataError(f"{self.idx_path}: dtype code {code} is not a token dtype (known: {sorted(DTYPES)})")
        expected = HEADER.size + 4 * seqs + 8 * seqs + 8 * docs
        if len(raw) != expected:
            raise DataError(f"{self.idx_path}: {len(raw)} bytes, expected {expected} for {seqs} sequences and {docs} "
                            "document indices (truncated or corrupt)")
        self.dtype = np.dtype(DTYPES[code])
        lengths = np.frombuffer(raw, np.int32, seqs, HEADER.size)
        pointers = np.frombuffer(raw, np.int64, seqs, HEADER.size + 4 * seqs)
        doc_idx = np.frombuffer(raw, np.int64, docs, HEADER.size + 12 * seqs)
        if seqs and lengths.min() < 0:
            raise DataError(f"{self.idx_path}: a negative sequence length")
        self.sizes = lengths.astype(np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        if not np.array_equal(pointers, self.offsets[:-1] * self.dtype.itemsize):
            bad = int(np.flatnonzero(pointers != self.offsets[:-1] * self.dtype.itemsize)[0])
            raise DataError(f"{self.idx_path}: sequence {bad} starts at byte {int(pointers[bad])}, not right after "
                            f"the one before ({int(self.offsets[bad]) * self.dtype.itemsize}): corrupt index")
        if docs and (doc_idx[0] != 0 or doc_idx[-1] != seqs or np.any(np.diff(doc_idx) < 0)):
            raise DataError(f"{self.idx_path}: document indices do not rise from 0 to the {seqs} sequences")
        self.num_tokens = int(self.offsets[-1])
        self.fingerprint = hashlib.sha256(raw).hexdigest()[:16]

    def _open_bin(self) -> None:
        size = self.bin_path.stat().st_size
        expected = self.num_tokens * self.dtype.itemsize
        if size != expected:
            raise DataError(f"{self.bin_path}: {size} bytes, expected {expected} for the {self.num_tokens} tokens "
                            f"of {self.idx_path.name} (truncated, appended to, or another index's)")
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
                       if self.num_tokens else np.zeros(0, self.dtype))

    def _record_path(self) -> Path:
        return self.idx_path.with_name(self.idx_path.name + CHECK_SUFFIX)

    def verify(self) -> None:
        """Every id in [0, vocabulary), and the chunks' CRC32s against the record of the first open (written then);
        DataError naming the file and the chunk."""
        crcs = []
        for i in range(0, max(self.num_tokens, 1), CHUNK_TOKENS):
            chunk = self.tokens[i:i + CHUNK_TOKENS]
            if not chunk.size:
                break
            lo, hi = int(chunk.min()), int(chunk.max())
            if lo < 0 or hi >= self.checked_vocab:
                raise DataError(f"{self.bin_path}: token id {hi if hi >= self.checked_vocab else lo} in tokens "
                                f"{i}..{i + chunk.size - 1} is outside the tokenizer's vocabulary [0, "
                                f"{self.checked_vocab}) (another tokenizer's corpus? name it with data.tokenizer)")
            crcs.append(zlib.crc32(chunk.tobytes()))
        record = {"format": 1, "bin_bytes": self.bin_path.stat().st_size, "index": self.fingerprint,
                  "dtype": self.dtype.name, "chunk_tokens": CHUNK_TOKENS, "crc32": crcs}
        path = self._record_path()
        if path.is_file():
            try:
                saved = json.loads(path.read_text())
            except ValueError:
                saved = None
            if saved != record:
                first = next((j for j, (a, b) in enumerate(zip((saved or {}).get("crc32", []), crcs)) if a != b), None)
                where = f" (tokens from {first * CHUNK_TOKENS} on)" if first is not None else ""
                raise DataError(f"{self.bin_path}: differs from when megakern first read it{where}, as recorded in "
                                f"{path}; restore the corpus, or delete the record to accept it as it is now")
        else:
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            try:
                tmp.write_text(json.dumps(record))
                os.replace(tmp, path)
            except OSError:  # a read-only corpus: checked, not recorded
                tmp.unlink(missing_ok=True)

    def __repr__(self) -> str:
        return (f"MegatronIndexedDataset({self.prefix}, {len(self)} documents, {self.num_tokens} tokens, "
                f"{self.dtype.name})")
