"""megakern/data/gpt_dataset.py: samples against a pure-Python reference, determinism, epochs (contract 26), the
index cache and its descriptor (contract 14), modification checks (contract 34): contracts of docs/contracts.md."""
import json
import os
import re
import warnings

import numpy as np
import pytest
import torch

from megakern.data import gpt_dataset
from megakern.data.gpt_dataset import GPTDataset, build_indices
from megakern.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter


def make_dataset(prefix, seed=0, n=60, max_len=40, vocab=1000, overwrite=False):
    """n documents of random lengths 0 .. max_len - 1, with some of length 1 and 0 among them."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, max_len, n)
    lengths[::7], lengths[3::11] = 1, 0
    docs = [rng.integers(0, vocab, k) for k in lengths]
    with IndexedDatasetWriter(prefix, vocab, overwrite=overwrite) as w:
        for d in docs:
            w.add_document(d)
    return IndexedDataset(prefix), docs


def reference_sample_idx(sizes, doc_idx, seq_length, num_samples):
    """(position in doc_idx, offset) of stream token j * seq_length, walking the stream token by token."""
    starts, token = [], 0
    for position, doc in enumerate(doc_idx):
        for offset in range(sizes[doc]):
            if token % seq_length == 0 and len(starts) <= num_samples:
                starts.append((position, offset))
            token += 1
    return starts[:num_samples + 1]


@pytest.mark.parametrize("seq_length, num_samples", [(1, None), (5, None), (64, None), (7, 300), (64, 100)])
def test_samples_are_windows_of_the_shuffled_stream(tmp_path, seq_length, num_samples):
    ds, docs = make_dataset(tmp_path / "d")
    g = GPTDataset(ds, seq_length, num_samples, seed=5, max_epochs=100)
    tokens = sum(len(d) for d in docs)
    n = (tokens - 1) // seq_length if num_samples is None else num_samples
    assert len(g) == n and g.epochs == -(-(n * seq_length + 1) // tokens)
    assert len(g.doc_idx) == g.epochs * len(docs)
    for epoch in np.split(np.asarray(g.doc_idx), g.epochs):
        assert sorted(epoch.tolist()) == list(range(len(docs)))
    assert np.array_equal(np.sort(g.shuffle_idx), np.arange(n))
    assert [tuple(r) for r in g.sample_idx.tolist()] == reference_sample_idx(
        [len(d) for d in docs], g.doc_idx.tolist(), seq_length, n)
    stream = [int(t) for doc in g.doc_idx.tolist() for t in docs[doc]]
    for i in range(n):
        j = int(g.shuffle_idx[i])
        sample = g[i]["tokens"]
        assert sample.dtype == torch.int64 and sample.shape == (seq_length + 1,)
        assert sample.tolist() == stream[j * seq_length:j * seq_length + seq_length + 1], f"item {i} (sample {j})"
    with pytest.raises(IndexError, match=f"sample {n} out of range"):
        g[n]


def test_deterministic_and_seeded(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    a, b = (GPTDataset(ds, 8, 400, seed=1, max_epochs=10) for _ in range(2))
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.fingerprint == b.fingerprint
    c = GPTDataset(ds, 8, 400, seed=2, max_epochs=10)
    assert not np.array_equal(a.doc_idx, c.doc_idx) and not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert c.fingerprint != a.fingerprint != GPTDataset(ds, 9, 400, seed=1, max_epochs=10).fingerprint
    epochs = np.split(np.asarray(a.doc_idx), a.epochs)
    assert a.epochs > 1 and not np.array_equal(epochs[0], epochs[1])  # every epoch has its own order


def test_epochs_are_explicit(tmp_path):
    ds, docs = make_dataset(tmp_path / "d")
    tokens = sum(len(d) for d in docs)
    per_epoch = (tokens - 1) // 10
    need = 3 * per_epoch
    epochs = -(-(need * 10 + 1) // tokens)
    with pytest.raises(DataError, match=f"need {need * 10 + 1} tokens, {epochs} epochs .* max_epochs=1; pass "
                                        f"max_epochs={epochs} .* at most {per_epoch} samples"):
        GPTDataset(ds, 10, need, seed=0)
    assert GPTDataset(ds, 10, need, seed=0, max_epochs=epochs).epochs == epochs
    assert GPTDataset(ds, 10, per_epoch, seed=0).epochs == 1


def test_bad_arguments(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    for kwargs, match in [(dict(seq_length=0), "seq_length must be an integer >= 1, got 0"),
                          (dict(seq_length=2.0), "seq_length must be an integer"),
                          (dict(num_samples=0), "num_samples must be an integer >= 1"),
                          (dict(seed=-1), "seed must be an integer >= 0"),
                          (dict(max_epochs=0), "max_epochs must be an integer >= 1"),
                          (dict(name="../up"), "name must be letters")]:
        args = dict(seq_length=4, num_samples=10, seed=0) | kwargs
        with pytest.raises(ValueError, match=match):
            GPTDataset(ds, args.pop("seq_length"), args.pop("num_samples"), args.pop("seed"), **args)
    tiny, _ = make_dataset(tmp_path / "tiny", n=1, max_len=2)  # one document of length 1
    with pytest.raises(DataError, match="tiny: 1 tokens, too few for one sample of seq_length 4"):
        GPTDataset(tiny, 4, None, seed=0)
    with pytest.raises(DataError, match="document 1 has a negative size"):
        build_indices(np.array([3, -1]), 2, 1, 0)


def cache_files(cache):
    return sorted(p.name for p in cache.iterdir())


def test_cache_reused_and_mapped(tmp_path, monkeypatch):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    built = GPTDataset(ds, 8, 300, seed=3, cache_dir=cache, max_epochs=10)
    descriptor = json.loads((cache / "d.json").read_text())
    assert {"dataset": ds.fingerprint, "seq_length": 8, "seed": 3, "num_samples": 300,
            "epochs": built.epochs}.items() <= descriptor.items()
    assert len(cache_files(cache)) == 4 and not any(".tmp-" in f for f in cache_files(cache))

    def no_build(*args):
        raise AssertionError("rebuilt although the cache matches")

    monkeypatch.setattr(gpt_dataset, "build_indices", no_build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = GPTDataset(ds, 8, 300, seed=3, cache_dir=cache, max_epochs=10)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        array = getattr(loaded, name)
        assert isinstance(array, np.memmap) and not array.flags.writeable, name
        assert np.array_equal(array, getattr(built, name)), name
    assert [loaded[i]["tokens"].tolist() for i in range(300)] == [built[i]["tokens"].tolist() for i in range(300)]


@pytest.mark.parametrize("change, field", [(dict(seq_length=9), "seq_length=8 (now 9)"),
                                           (dict(seed=4), "seed=3 (now 4)"),
                                           (dict(num_samples=200), "num_samples=300 (now 200)")])
def test_cache_mismatch_rebuilt_or_refused(tmp_path, change, field):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    args = dict(seq_length=8, num_samples=300, seed=3)
    GPTDataset(ds, *args.values(), cache_dir=cache, max_epochs=10)
    new, field = args | change, re.escape(field)
    with pytest.raises(DataError, match=rf"d.json: built for .*{field}.*refusing to rebuild it \(strict=True\)"):
        GPTDataset(ds, *new.values(), cache_dir=cache, max_epochs=10, strict=True)
    with pytest.warns(UserWarning, match=rf"built for .*{field}.*rebuilding"):
        rebuilt = GPTDataset(ds, *new.values(), cache_dir=cache, max_epochs=10)
    fresh = GPTDataset(ds, *new.values(), max_epochs=10)
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(rebuilt, name), getattr(fresh, name)), name
    assert len(cache_files(cache)) == 4  # the old arrays are gone
    GPTDataset(ds, *new.values(), cache_dir=cache, max_epochs=10, strict=True)  # now it matches


def test_cache_of_other_data_rebuilt(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    GPTDataset(ds, 8, 100, seed=0, cache_dir=cache, max_epochs=10)
    other, _ = make_dataset(tmp_path / "d", seed=1, overwrite=True)
    with pytest.warns(UserWarning, match=f"built for dataset='{ds.fingerprint}' \\(now '{other.fingerprint}'\\)"):
        g = GPTDataset(other, 8, 100, seed=0, cache_dir=cache, max_epochs=10)
    assert json.loads((cache / "d.json").read_text())["dataset"] == other.fingerprint
    assert g.fingerprint == GPTDataset(other, 8, 100, seed=0).fingerprint


def test_damaged_cache_rebuilt_or_refused(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    GPTDataset(ds, 8, 100, seed=0, cache_dir=cache)
    array_file = next(cache.glob("d.*.sample_idx.npy"))
    array_file.write_bytes(array_file.read_bytes()[:-40])
    with pytest.raises(DataError, match="sample_idx.npy unreadable.*strict=True"):
        GPTDataset(ds, 8, 100, seed=0, cache_dir=cache, strict=True)
    with pytest.warns(UserWarning, match="sample_idx.npy unreadable"):
        rebuilt = GPTDataset(ds, 8, 100, seed=0, cache_dir=cache)
    assert np.array_equal(rebuilt.sample_idx, GPTDataset(ds, 8, 100, seed=0).sample_idx)
    data = bytearray(array_file.read_bytes())
    data[-1] ^= 1  # one bit of the last sample start: same size, wrong content
    array_file.write_bytes(bytes(data))
    with pytest.raises(DataError, match="sample_idx.npy does not match its checksum.*strict=True"):
        GPTDataset(ds, 8, 100, seed=0, cache_dir=cache, strict=True)
    with pytest.warns(UserWarning, match="sample_idx.npy does not match its checksum"):
        GPTDataset(ds, 8, 100, seed=0, cache_dir=cache)
    (cache / "d.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable descriptor"):
        GPTDataset(ds, 8, 100, seed=0, cache_dir=cache)


def test_crash_while_writing_keeps_the_old_cache(tmp_path, monkeypatch):
    ds, _ = make_dataset(tmp_path / "d")
    cache = tmp_path / "cache"
    GPTDataset(ds, 8, 50, seed=0, cache_dir=cache)
    before = {name: (cache / name).read_bytes() for name in cache_files(cache)}
    calls = []

    def crashing_save(f, array):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        np.lib.format.write_array(f, array)

    monkeypatch.setattr(np, "save", crashing_save)
    with pytest.raises(OSError, match="disk full"), pytest.warns(UserWarning, match="seq_length=8 \\(now 9\\)"):
        GPTDataset(ds, 9, 50, seed=0, cache_dir=cache)
    monkeypatch.undo()
    assert json.loads((cache / "d.json").read_text())["seq_length"] == 8  # descriptor untouched
    assert not any(".tmp-" in f for f in cache_files(cache))
    assert all((cache / name).read_bytes() == data for name, data in before.items())
    GPTDataset(ds, 8, 50, seed=0, cache_dir=cache, strict=True)  # the old cache still loads


def test_modification_detected_at_epoch_boundaries(tmp_path):
    ds, _ = make_dataset(tmp_path / "d")
    g = GPTDataset(ds, 8, 300, seed=0, max_epochs=10)
    first, last = g.sample_idx[:-1, 0] // len(ds), g.sample_idx[1:, 0] // len(ds)
    crossing = np.flatnonzero(first != last)
    assert len(crossing) == g.epochs - 1
    item = {int(j): i for i, j in enumerate(g.shuffle_idx)}
    inside = next(j for j in range(g.num_samples) if j not in set(crossing.tolist()))
    g.check_unmodified()
    bin_path = tmp_path / "d.bin"
    stat = bin_path.stat()
    os.utime(bin_path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    with pytest.raises(DataError, match="changed on disk since it was opened"):
        g.check_unmodified()
    g[item[inside]]  # within an epoch: no stat per sample
    with pytest.raises(DataError, match="changed on disk since it was opened"):
        g[item[int(crossing[0])]]


def test_index_benchmark_runs(capsys):
    from benchmarks import bench_data_index

    sizes = bench_data_index.document_sizes(100_000, 100.0, seed=0)
    assert sizes.sum() == 100_000 and sizes.min() >= 1 and 500 < len(sizes) < 2000
    (row,) = bench_data_index.main(["--tokens", "1e5", "--seq-length", "64", "--repeats", "1"])
    assert row["tokens"] == 100_000 and row["samples"] == (100_000 - 1) // 64 and row["epochs"] == 1
    assert row["seconds"] > 0 and row["peak MiB"] > 0
    assert "| tokens | documents | samples |" in capsys.readouterr().out
