"""megakern/data/blended.py: exact counts, proportions along the stream, weight checks (contract 25,
docs/contracts.md), and components that cannot supply their share."""
from functools import partial

import numpy as np
import pytest

from megakern.data.blended import BlendedDataset, blend_counts, blend_order
from megakern.data.gpt_dataset import GPTDataset
from megakern.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter


class Numbered:
    """A component whose sample k is (name, k, seed)."""

    def __init__(self, name, count, seed):
        self.name, self.count, self.seed = name, count, seed
        self.fingerprint = f"{name}-fp"

    def check_unmodified(self):
        pass

    def __len__(self):
        return self.count

    def __getitem__(self, k):
        assert 0 <= k < self.count
        return self.name, k, self.seed


def numbered(*names):
    return [partial(Numbered, name) for name in names]


def write_dataset(prefix, n_docs, seed):
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, 500) as w:
        for k in rng.integers(1, 30, n_docs):
            w.add_document(rng.integers(0, 500, k))
    return IndexedDataset(prefix)


@pytest.mark.parametrize("weights, n, counts", [([0.5, 0.3, 0.2], 1000, [500, 300, 200]),
                                                ([5, 3, 2], 7, [4, 2, 1]),
                                                ([1, 1, 1], 10, [4, 3, 3]),
                                                ([1, 2, 1], 2, [1, 1, 0]),
                                                ([1 / 3, 1 / 3, 1 / 3], 1, [1, 0, 0])])
def test_exact_counts(weights, n, counts):
    w = np.asarray(weights, float)
    assert blend_counts(w / w.sum(), n).tolist() == counts


def test_counts_sum_and_stream_proportions():
    rng = np.random.default_rng(0)
    for _ in range(50):
        d = int(rng.integers(1, 8))
        w = rng.random(d) + 1e-3
        w /= w.sum()
        n = int(rng.integers(d, 20_000))
        counts = blend_counts(w, n)
        assert counts.sum() == n and np.abs(counts - w * n).max() < 1
        dataset, sample = blend_order(counts)
        for i in range(d):  # each dataset's samples 0 .. count - 1, in order
            assert np.array_equal(sample[dataset == i], np.arange(counts[i]))
        seen = np.cumsum(np.eye(d, dtype=np.int64)[dataset], axis=0)  # per prefix, samples of each dataset
        target = np.arange(1, n + 1)[:, None] * (counts / n)
        assert np.abs(seen - target).max() <= (d + 1) / 2, "a dataset fell behind its share somewhere in the stream"


def test_items_come_from_the_components():
    blend = BlendedDataset(numbered("a", "b", "c"), [2, 1, 1], 400, seed=7)
    assert blend.counts.tolist() == [200, 100, 100] and len(blend) == 400
    items = [blend[i] for i in range(len(blend))]
    for name, count in zip("abc", blend.counts.tolist()):
        assert sorted(k for n, k, _ in items if n == name) == list(range(count))
    assert {seed for _, _, seed in items} == {7}
    with pytest.raises(IndexError, match="blend sample 400 out of range"):
        blend[400]
    again = BlendedDataset(numbered("a", "b", "c"), [4, 2, 2], 400, seed=7)
    assert np.array_equal(again.dataset_index, blend.dataset_index) and again.fingerprint == blend.fingerprint
    assert BlendedDataset(numbered("a", "b", "c"), [2, 1, 1], 400, seed=8).fingerprint != blend.fingerprint


def test_describe_prints_the_mix():
    table = BlendedDataset(numbered("web", "code"), [3, 1], 1000, seed=0).describe()
    lines = table.splitlines()
    assert lines[0].split() == ["dataset", "weight", "samples", "share"]
    assert lines[1].split() == ["web", "0.7500", "750", "0.7500"]
    assert lines[2].split() == ["code", "0.2500", "250", "0.2500"]
    assert lines[3].split() == ["total", "1.0000", "1000", "1.0000"]


@pytest.mark.parametrize("weights, match", [([1, 0], "weight 1 is 0; every weight must be a finite number > 0"),
                                            ([1, -2], "weight 1 is -2"),
                                            ([float("nan"), 1], "weight 0 is nan"),
                                            ([1, float("inf")], "weight 1 is inf"),
                                            ([1, "2"], "weight 1 is '2'"),
                                            ([1e6, 1], r"differ by 1e\+06x, beyond max_weight_ratio=10000"),
                                            ([1, 2, 3], "3 weights for 2 datasets")])
def test_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        BlendedDataset(numbered("a", "b"), weights, 100, seed=0)


def test_extreme_ratio_only_when_allowed():
    blend = BlendedDataset(numbered("a", "b"), [1e6, 1], 2_000_000, seed=0, allow_extreme=True)
    assert blend.counts.tolist() == [1_999_998, 2]
    BlendedDataset(numbered("a", "b"), [1e6, 1], 2_000_000, seed=0, max_weight_ratio=1e7)
    with pytest.raises(ValueError, match="max_weight_ratio must be a number >= 1"):
        BlendedDataset(numbered("a", "b"), [1, 1], 10, seed=0, max_weight_ratio=0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one dataset"):
        BlendedDataset([], [], 10, seed=0)
    with pytest.raises(ValueError, match="num_samples must be an integer >= 1"):
        BlendedDataset(numbered("a"), [1], 0, seed=0)
    with pytest.raises(ValueError, match=r"dataset 1 \(weight 0.001\) would get 0 of 100 samples"):
        BlendedDataset(numbered("a", "b"), [999, 1], 100, seed=0)
    with pytest.raises(DataError, match="blend dataset 0 was asked for 10 samples and has 11"):
        BlendedDataset([lambda count, seed: Numbered("a", count + 1, seed)], [1], 10, seed=0)
    with pytest.raises(ValueError, match="blend dataset 0 \\(list\\) lacks name, fingerprint, check_unmodified"):
        BlendedDataset([lambda count, seed: [0] * count], [1], 10, seed=0)


def test_gpt_components_and_their_epochs(tmp_path):
    small, large = write_dataset(tmp_path / "small", 20, 0), write_dataset(tmp_path / "large", 400, 1)
    per_epoch_small = (small.num_tokens - 1) // 8
    factories = [partial(GPTDataset, small, 8, cache_dir=tmp_path / "cache"),
                 partial(GPTDataset, large, 8, cache_dir=tmp_path / "cache")]
    n = 4 * per_epoch_small  # the small dataset's half needs two epochs
    with pytest.raises(DataError, match=r"blend dataset 0 \(weight 0.5\) cannot supply its \d+ of \d+ samples: "
                                        r"small: .* 2 epochs .* max_epochs=1"):
        BlendedDataset(factories, [1, 1], n, seed=3)
    factories[0] = partial(GPTDataset, small, 8, cache_dir=tmp_path / "cache", max_epochs=2)
    blend = BlendedDataset(factories, [1, 1], n, seed=3)
    assert [d.name for d in blend.datasets] == ["small", "large"] and [d.seed for d in blend.datasets] == [3, 3]
    assert [len(d) for d in blend.datasets] == blend.counts.tolist() == [n // 2, n // 2]
    assert blend.datasets[0].epochs == 2
    for i in range(0, n, 7):
        d, k = int(blend.dataset_index[i]), int(blend.sample_index[i])
        assert blend[i]["tokens"].tolist() == blend.datasets[d][k]["tokens"].tolist()
    blend.check_unmodified()
    assert "small" in blend.describe() and "large" in blend.describe()
