"""Weighted mixes of datasets (Megatron's BlendedDataset), with the weights checked (contract 25, docs/contracts.md).

Weights must be finite and > 0, with max/min at most ``max_weight_ratio`` unless ``allow_extreme``; they are
normalized to w_i (sum 1). Dataset i gets exactly c_i of the N samples: floor(w_i*N), plus one for the
N - sum(floor) datasets with the largest remainders (ties to the lower index). The c_i samples of dataset i take
the stream positions of the ideal times (k + 1/2) / c_i, k = 0 .. c_i - 1, all datasets merged in order of time
(a stable sort, ties to the lower index): every prefix of the stream holds each of the D datasets within
(D + 1) / 2 samples of its share, the order is a pure function of the counts, and numpy builds it with one
sort. Item i of the blend is sample ``sample_index[i]`` of dataset ``dataset_index[i]``.

Each component is given as a factory, called as ``factory(count, seed)`` with exactly its count and the blend's
seed, e.g. ``functools.partial(GPTDataset, indexed, seq_length, cache_dir=cache)``; it must return a dataset of
exactly ``count`` samples with ``name``, ``fingerprint`` and ``check_unmodified()`` (as GPTDataset has). A
component that cannot supply its count raises (GPTDataset's DataError gives the epochs it would need; pass it
``max_epochs`` to allow repeating the data), and the blend adds which component it was.

Loss masks: when any component's items carry a ``'loss_mask'`` (SFT data: its ``has_loss_mask``), the blend's all
do, all True for the components without one (every token trains), so that the items of a batch stack alike.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megakern.data.gpt_dataset import _index_dtype, _int_arg
from megakern.data.indexed import DataError


def _check_weights(weights, count: int, max_weight_ratio: float, allow_extreme: bool) -> np.ndarray:
    """The weights normalized to sum 1, or ValueError naming the bad weight."""
    if len(weights) != count:
        raise ValueError(f"{len(weights)} weights for {count} datasets")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w <= 0:
            raise ValueError(f"weight {i} is {w!r}; every weight must be a finite number > 0")
    weights = np.asarray(weights, dtype=np.float64)
    ratio = weights.max() / weights.min()
    if ratio > max_weight_ratio and not allow_extreme:
        raise ValueError(f"weights {weights.argmax()} and {weights.argmin()} ({weights.max():g} : {weights.min():g}) "
                         f"differ by {ratio:.3g}x, beyond max_weight_ratio={max_weight_ratio:g}; fix the weights or "
                         f"pass allow_extreme=True")
    return weights / weights.sum()


def blend_counts(weights: np.ndarray, num_samples: int) -> np.ndarray:
    """Exact per-dataset sample counts for normalized ``weights``: largest remainders, ties to the lower index."""
    exact = weights * num_samples
    counts = np.floor(exact).astype(np.int64)
    behind = np.argsort(-(exact - counts), kind="stable")[:num_samples - int(counts.sum())]
    counts[behind] += 1
    return counts


def blend_order(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, sample_index) of every stream position for per-dataset ``counts`` (see the module doc)."""
    dataset = np.repeat(np.arange(len(counts)), counts)
    sample = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    order = np.argsort((2 * sample + 1) / (2 * counts[dataset]), kind="stable")
    return (dataset[order].astype(_index_dtype(len(counts) - 1)),
            sample[order].astype(_index_dtype(int(counts.max()) - 1)))


class BlendedDataset(torch.utils.data.Dataset):
    """``num_samples`` samples drawn from component datasets in proportion to ``weights`` (see the module doc).

    datasets: factories, ``factory(count, seed) -> dataset`` of exactly ``count`` samples.
    weights: one per dataset, finite and > 0, any scale (normalized here).
    max_weight_ratio: largest max/min weight accepted without ``allow_extreme=True``.
    """

    def __init__(self, datasets: Sequence[Callable], weights: Sequence[float], num_samples: int, *, seed: int,
                 max_weight_ratio: float = 1e4, allow_extreme: bool = False):
        if not datasets:
            raise ValueError("a blend needs at least one dataset")
        if not (isinstance(max_weight_ratio, numbers.Real) and max_weight_ratio >= 1):
            raise ValueError(f"max_weight_ratio must be a number >= 1, got {max_weight_ratio!r}")
        self.num_samples = _int_arg("num_samples", num_samples, 1)
        self.seed = _int_arg("seed", seed, 0)
        self.weights = _check_weights(weights, len(datasets), max_weight_ratio, allow_extreme)
        self.counts = blend_counts(self.weights, self.num_samples)
        if (empty := np.flatnonzero(self.counts == 0)).size:
            i = int(empty[0])
            raise ValueError(f"dataset {i} (weight {self.weights[i]:.3g}) would get 0 of {self.num_samples} "
                             f"samples; raise num_samples or drop it from the blend")
        self.datasets = [self._build(i, factory) for i, factory in enumerate(datasets)]
        self.dataset_index, self.sample_index = blend_order(self.counts)
        self.has_loss_mask = any(getattr(d, "has_loss_mask", False) for d in self.datasets)
        parts = [f"{self.seed}"] + [f"{d.fingerprint}:{c}" for d, c in zip(self.datasets, self.counts.tolist())]
        self.fingerprint = hashlib.sha256(";".join(parts).encode()).hexdigest()[:32]

    def _build(self, i: int, factory: Callable):
        count = int(self.counts[i])
        try:
            dataset = factory(count, self.seed)
        except DataError as exc:
            raise DataError(f"blend dataset {i} (weight {self.weights[i]:.3g}) cannot supply its {count} of "
                            f"{self.num_samples} samples: {exc}") from exc
        if len(dataset) != count:
            raise DataError(f"blend dataset {i} was asked for {count} samples and has {len(dataset)}")
        missing = [a for a in ("name", "fingerprint", "check_unmodified") if not hasattr(dataset, a)]
        if missing:
            raise ValueError(f"blend dataset {i} ({type(dataset).__name__}) lacks {', '.join(missing)}")
        return dataset

    def describe(self) -> str:
        """The effective mix as a table: name, requested weight (normalized), samples, share of the blend."""
        rows = [f"{'dataset':<24} {'weight':>8} {'samples':>12} {'share':>8}"]
        rows += [f"{d.name:<24} {w:8.4f} {c:12d} {c / self.num_samples:8.4f}"
                 for d, w, c in zip(self.datasets, self.weights.tolist(), self.counts.tolist())]
        return "\n".join(rows + [f"{'total':<24} {1:8.4f} {self.num_samples:12d} {1:8.4f}"])

    def check_unmodified(self) -> None:
        """DataError if any component's files changed on disk since they were opened."""
        for dataset in self.datasets:
            dataset.check_unmodified()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int):
        if not 0 <= i < self.num_samples:
            raise IndexError(f"blend sample {i} out of range [0, {self.num_samples})")
        sample = self.datasets[int(self.dataset_index[i])][int(self.sample_index[i])]
        if self.has_loss_mask and "loss_mask" not in sample:
            sample = {**sample, "loss_mask": torch.ones(sample["tokens"].shape, dtype=torch.bool)}
        return sample
