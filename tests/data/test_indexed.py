"""megakern/data/indexed.py: round trips, dtype from the vocabulary, and every corruption detected with an error
naming the file (contracts 11, 17, 20, 23 of docs/contracts.md); nothing existing is overwritten."""
import os
import time

import numpy as np
import pytest

from megakern.data.indexed import CHUNK_TOKENS, DataError, IndexedDataset, IndexedDatasetWriter, dtype_for_vocab


def write(prefix, docs, vocab=1000, **kw):
    with IndexedDatasetWriter(prefix, vocab, **kw) as w:
        for d in docs:
            w.add_document(d)
    return prefix


def random_docs(rng, n=50, vocab=1000, max_len=300):
    return [rng.integers(0, vocab, rng.integers(0, max_len)) for _ in range(n)]


def test_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    docs = random_docs(rng) + [np.array([7])]
    ds = IndexedDataset(write(tmp_path / "d", docs))
    assert len(ds) == len(docs) and ds.num_tokens == sum(len(d) for d in docs)
    assert ds.dtype == np.uint16 and ds.vocab_size == 1000
    for i, d in enumerate(docs):
        assert np.array_equal(ds.get(i), d)
    assert np.array_equal(ds.get(3, 2, 5), docs[3][2:7])
    with pytest.raises(IndexError):
        ds.get(len(docs))
    with pytest.raises(IndexError):
        ds.get(0, 0, len(docs[0]) + 1)
    assert IndexedDataset(write(tmp_path / "e", docs)).fingerprint == ds.fingerprint  # same content, same print


def test_dtype_from_vocabulary(tmp_path):
    assert dtype_for_vocab(65536) == np.uint16 and dtype_for_vocab(65537) == np.int32
    big = [np.array([0, 65535, 65536, 100_000])]
    ds = IndexedDataset(write(tmp_path / "big", big, vocab=100_001))
    assert ds.dtype == np.int32 and np.array_equal(ds.get(0), big[0])
    with pytest.raises(ValueError, match="document 1: token id 1000 outside the vocabulary"):
        write(tmp_path / "bad", [np.array([1]), np.array([1000])])
    with pytest.raises(ValueError, match="token id -1"):
        write(tmp_path / "neg", [np.array([-1])])
    assert not list(tmp_path.glob("bad*")) and not list(tmp_path.glob("neg*"))  # no temp files left behind
    with pytest.raises(DataError, match="vocabulary of 1000 ids, larger than the tokenizer's 500"):
        IndexedDataset(write(tmp_path / "v", [np.array([1])]), vocab_size=500)


def test_never_overwrites(tmp_path):
    prefix = write(tmp_path / "d", [np.array([1, 2])])
    before = (tmp_path / "d.bin").read_bytes()
    with pytest.raises(FileExistsError, match="refusing to overwrite"):
        IndexedDatasetWriter(prefix, 1000)
    assert (tmp_path / "d.bin").read_bytes() == before
    write(prefix, [np.array([3])], overwrite=True)
    assert np.array_equal(IndexedDataset(prefix).get(0), [3])


@pytest.mark.parametrize("damage", ["missing-bin", "missing-idx", "truncated-bin", "appended-bin", "flipped-token",
                                    "flipped-idx", "bad-magic", "bad-version", "swapped-pair"])
def test_corruption_detected(tmp_path, damage):
    rng = np.random.default_rng(1)
    docs = [rng.integers(0, 1000, CHUNK_TOKENS // 2) for _ in range(3)]  # two checksum chunks
    prefix = write(tmp_path / "d", docs)
    bin_path, idx_path = tmp_path / "d.bin", tmp_path / "d.idx"
    if damage == "missing-bin":
        bin_path.unlink()
        match = "d.bin: missing"
    elif damage == "missing-idx":
        idx_path.unlink()
        match = "d.idx: missing"
    elif damage == "truncated-bin":
        os.truncate(bin_path, bin_path.stat().st_size - 2)
        match = "d.bin: .* bytes, expected"
    elif damage == "appended-bin":
        with open(bin_path, "ab") as f:
            f.write(b"\0\0")
        match = "truncated or appended"
    elif damage == "flipped-token":
        raw = bytearray(bin_path.read_bytes())
        raw[-10] ^= 0x01  # a token in the last chunk
        bin_path.write_bytes(bytes(raw))
        match = "d.bin: checksum mismatch in tokens .* \\(chunk 1\\)"
    elif damage == "flipped-idx":
        raw = bytearray(idx_path.read_bytes())
        raw[100] ^= 0x01
        idx_path.write_bytes(bytes(raw))
        match = "d.idx: checksum mismatch"
    elif damage == "bad-magic":
        raw = bytearray(bin_path.read_bytes())
        raw[0:8] = b"MMIDIDX\0"
        bin_path.write_bytes(bytes(raw))
        match = "d.bin: not a megakern token file"
    elif damage == "bad-version":
        raw = bytearray(idx_path.read_bytes())
        raw[8] = 9
        idx_path.write_bytes(bytes(raw))
        match = "d.idx: format version 9"
    else:  # an .idx from another write with the same shape
        write(tmp_path / "other", docs)
        os.replace(tmp_path / "other.idx", idx_path)
        match = "are not a pair"
    with pytest.raises(DataError, match=match):
        IndexedDataset(prefix)


@pytest.mark.parametrize("how", ["mtime", "in-place, mtime restored", "replaced", "truncated", "idx removed"])
def test_modification_after_open_detected(tmp_path, how):
    """Every way a file can change under an open dataset is caught by the stat check, naming the file."""
    prefix = write(tmp_path / "d", [np.array([1, 2, 3]), np.array([4, 5])])
    ds = IndexedDataset(prefix)
    ds.check_unmodified()
    bin_path = tmp_path / "d.bin"
    st = bin_path.stat()
    if how == "mtime":
        os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        match = r"d\.bin: changed on disk since it was opened \(modification time"
    elif how == "in-place, mtime restored":  # same size, same mtime: only the change time tells
        time.sleep(0.01)
        with open(bin_path, "r+b") as f:
            f.seek(-2, os.SEEK_END)
            f.write(np.array([5], dtype=ds.dtype).tobytes())
        os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
        match = r"d\.bin: changed on disk since it was opened \(change time"
    elif how == "replaced":  # a rewrite through a temporary file and a rename: another inode
        write(tmp_path / "other", [np.array([1, 2, 3]), np.array([4, 5])])
        os.replace(tmp_path / "other.bin", bin_path)
        match = r"d\.bin: changed on disk .*inode"
    elif how == "truncated":
        os.truncate(bin_path, st.st_size - 2)
        match = r"d\.bin: changed on disk .*size.*: \d+ -> \d+ bytes"
    else:
        (tmp_path / "d.idx").unlink()
        match = "d.idx: removed while in use"
    with pytest.raises(DataError, match=match):
        ds.check_unmodified()


def test_failed_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(tmp_path / "d", 1000) as w:
            w.add_document([1, 2])
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(write(tmp_path / "d", []))
    assert len(ds) == 0 and ds.num_tokens == 0


def test_verify_refuses_negative_ids_in_a_hand_made_file(tmp_path):
    """A file written by other tools (int32, right checksums) with a negative id: opening it names the id."""
    prefix = tmp_path / "neg"
    with IndexedDatasetWriter(prefix, 70_000) as w:  # int32 tokens
        w.add_document([5, 69_999, 7])
        data = np.array([3, -2, 4], dtype=w.dtype).tobytes()  # what add_document refuses, written around it
        w._bin.write(data)
        w._checksum(data)
        w._sizes.append(3)
        w._tokens += 3
    with pytest.raises(DataError, match="token id -2 in chunk 0 is negative"):
        IndexedDataset(prefix, vocab_size=70_000).verify()
