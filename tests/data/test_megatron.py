"""megakern.data.megatron: Megatron-LM's MMIDIDX .bin/.idx read as Megatron-LM's indexed_dataset.py writes them (the
writer below follows its layout byte for byte): documents, dtypes, and a training run on such a corpus; corrupt,
truncated and mismatched files, ids outside the tokenizer's vocabulary and a corpus changed since its first read
are named."""
import struct

import numpy as np
import pytest

from megakern.data import DataError
from megakern.data.megatron import CHECK_SUFFIX, MegatronIndexedDataset, is_megatron

CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron(prefix, documents, dtype=np.uint16):
    """Megatron-LM's MMapIndexedDataset layout: one sequence per document."""
    lengths = np.array([len(d) for d in documents], dtype=np.int32)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) * itemsize
    doc_idx = np.arange(len(documents) + 1, dtype=np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for d in documents:
            f.write(np.asarray(d, dtype=dtype).tobytes(order="C"))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(doc_idx.tobytes(order="C"))


def _docs(n=7, vocab=250, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, rng.integers(1, 40)).tolist() for _ in range(n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.uint8, np.int64])
def test_reads_what_megatron_writes(tmp_path, dtype):
    docs = _docs()
    write_megatron(tmp_path / "corpus", docs, dtype)
    assert is_megatron(tmp_path / "corpus")
    ds = MegatronIndexedDataset(tmp_path / "corpus", vocab_size=257)
    assert len(ds) == len(docs) and ds.num_tokens == sum(map(len, docs))
    for i, d in enumerate(docs):
        assert ds.get(i).tolist() == d
    assert ds.get(2, 1, 2).tolist() == docs[2][1:3]
    assert (tmp_path / f"corpus.idx{CHECK_SUFFIX}").is_file()  # recorded on the first open
    MegatronIndexedDataset(tmp_path / "corpus", vocab_size=257)  # and matched on the next


def test_bad_files_are_named(tmp_path):
    docs = _docs()
    write_megatron(tmp_path / "c", docs)
    with pytest.raises(DataError, match=r"outside the tokenizer's vocabulary \[0, 100\)"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=100)
    raw = (tmp_path / "c.idx").read_bytes()
    (tmp_path / "c.idx").write_bytes(raw[:-8])
    with pytest.raises(DataError, match="expected .* document indices \\(truncated or corrupt\\)"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=257)
    (tmp_path / "c.idx").write_bytes(raw[:9] + struct.pack("<Q", 2) + raw[17:])
    with pytest.raises(DataError, match="index version 2"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=257)
    (tmp_path / "c.idx").write_bytes(raw[:17] + struct.pack("<B", 6) + raw[18:])
    with pytest.raises(DataError, match="dtype code 6 is not a token dtype"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=257)
    (tmp_path / "c.idx").write_bytes(raw)
    b = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(b[:-2])
    with pytest.raises(DataError, match="c.bin: .* bytes, expected"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=257)


def test_a_corpus_changed_since_its_first_read_is_named(tmp_path):
    write_megatron(tmp_path / "c", _docs())
    MegatronIndexedDataset(tmp_path / "c", vocab_size=257)
    write_megatron(tmp_path / "c", [d[::-1] for d in _docs()])  # the same sizes, other tokens
    with pytest.raises(DataError, match="differs from when megakern first read it"):
        MegatronIndexedDataset(tmp_path / "c", vocab_size=257)
    (tmp_path / f"c.idx{CHECK_SUFFIX}").unlink()  # accepted as it is now
    MegatronIndexedDataset(tmp_path / "c", vocab_size=257)


def test_training_on_a_megatron_corpus(tmp_path):
    """megakern-train with data.paths a Megatron-LM prefix and data.tokenizer naming its tokenizer."""
    from megakern.config import load_config
    from megakern.train import Trainer

    docs = _docs(n=120, vocab=256, seed=3)
    docs = [d + [256] for d in docs]  # the byte tokenizer's end of document
    write_megatron(tmp_path / "corpus", docs)
    config = load_config(None, ["train.device=cpu", "train.steps=2", "train.micro_batch_size=2",
                                "model.max_seqlen=32", "train.seq_length=16", "log.progress=false",
                                "log.tensorboard=false", "train.sample_tokens=0", "data.num_workers=0",
                                "eval.every=0", "eval.batches=1", "checkpoint.final=false",
                                f"data.paths=[{tmp_path / 'corpus'}]",
                                "data.tokenizer=byte", f"log.run_dir={tmp_path / 'run'}",
                                f"data.index_cache_dir={tmp_path / 'cache'}"])
    console = tmp_path / "console.txt"
    result = Trainer(config, stream=open(console, "a")).run()
    assert sorted(result.losses) == [1, 2]
    assert "is a Megatron-LM dataset" in console.read_text()
