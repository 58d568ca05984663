"""The run's datasets (``build_data``): each file's documents split into train and held-out (DocumentSubset, a seeded
split), a GPTDataset per split or a BlendedDataset over several files, with errors that name the config keys to
change, and the fingerprint that fixes the training samples' order (recorded in checkpoints, compared across ranks
and on resume). Datasets with a loss mask (SFT data) serve it unless data.loss_mask=false; data.whole_documents packs
whole documents into samples."""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megakern.config import ConfigError, TrainConfig
from megakern.data.blended import BlendedDataset
from megakern.data.corpus import ensure_default_dataset
from megakern.data.gpt_dataset import GPTDataset
from megakern.data.indexed import DataError, IndexedDataset
from megakern.data.megatron import MegatronIndexedDataset, is_megatron
from megakern.data.tokenizers import load_tokenizer


class DocumentSubset:
    """Some documents of an IndexedDataset, seen as a dataset of its own (what GPTDataset reads: sizes, get,
    num_tokens, fingerprint, prefix, check_unmodified, and has_loss_mask, get_mask)."""

    def __init__(self, indexed: IndexedDataset, docs: np.ndarray, split: str):
        self.indexed, self.docs, self.split = indexed, np.asarray(docs, dtype=np.int64), split
        self.has_loss_mask = bool(getattr(indexed, "has_loss_mask", False))
        self.sizes = indexed.sizes[self.docs]
        self.num_tokens = int(self.sizes.sum())
        self.prefix = indexed.prefix.with_name(f"{indexed.prefix.name}-{split}")
        digest = hashlib.sha256(indexed.fingerprint.encode() + self.docs.tobytes()).hexdigest()
        self.fingerprint = digest[:16]

    def __len__(self) -> int:
        return len(self.docs)

    def get(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.indexed.get(int(self.docs[doc]), offset, length)

    def get_mask(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        return self.indexed.get_mask(int(self.docs[doc]), offset, length)

    def check_unmodified(self) -> None:
        self.indexed.check_unmodified()


def open_indexed(prefix, vocab_size: int):
    """The dataset at ``prefix``: megakern's own format, or Megatron-LM's (megatron.py), checked against the
    vocabulary."""
    if is_megatron(prefix):
        return MegatronIndexedDataset(prefix, vocab_size=vocab_size)
    return IndexedDataset(prefix, vocab_size=vocab_size)


def split_documents(indexed: IndexedDataset, valid_fraction: float, seed: int) -> tuple[DocumentSubset, ...]:
    """(train, valid): a seeded permutation of the documents, the first round(valid_fraction * D) (at least one)
    held out; each part keeps the documents' original order."""
    n = len(indexed)
    if n < 2:
        raise DataError(f"{indexed.prefix}: {n} document(s); holding out data.valid_fraction needs at least 2")
    perm = np.random.default_rng((seed, 2)).permutation(n)
    n_valid = min(max(1, round(valid_fraction * n)), n - 1)
    return (DocumentSubset(indexed, np.sort(perm[n_valid:]), "train"),
            DocumentSubset(indexed, np.sort(perm[:n_valid]), "valid"))


@dataclass
class Data:
    """What the run reads: datasets, tokenizer and the fingerprint recorded in checkpoints."""

    train: torch.utils.data.Dataset
    valid: torch.utils.data.Dataset
    tokenizer: object
    fingerprint: str
    description: str


def _dataset_prefixes(config: TrainConfig, log) -> tuple[list[Path], object]:
    """The dataset prefixes and their common tokenizer."""
    d = config.data
    if not d.paths:
        tokenizer = load_tokenizer(d.tokenizer)
        prefix = ensure_default_dataset(d.cache_dir, tokenizer)
        log(f"data: the default corpus, {tokenizer.name} tokens, at {prefix}")
        return [prefix], tokenizer
    return _prefixes_and_tokenizer([Path(p) for p in d.paths], d, log)


def _prefixes_and_tokenizer(prefixes: list[Path], d, log) -> tuple[list[Path], object]:
    """``prefixes`` and their common tokenizer (recorded beside them, or data.tokenizer for Megatron-LM's)."""
    tokenizer = None
    for prefix in prefixes:
        spec = prefix.with_name(prefix.name + ".tokenizer.json")
        if is_megatron(prefix) and not spec.exists():  # Megatron-LM's corpora do not record their tokenizer
            this = load_tokenizer(d.tokenizer)
            log(f"data: {prefix} is a Megatron-LM dataset; its ids are read as {this.name}'s (data.tokenizer)")
        else:
            try:
                this = load_tokenizer(json.loads(spec.read_text()))
            except FileNotFoundError:
                raise DataError(f"{spec}: missing; datasets from megakern.data.preprocess carry their tokenizer "
                                "there") from None
        if tokenizer is not None and this.name != tokenizer.name:
            raise DataError(f"{prefix} was tokenized by {this.name}, {prefixes[0]} by {tokenizer.name}; a run "
                            "needs one tokenizer")
        tokenizer = this
    return prefixes, tokenizer


def build_data(config: TrainConfig, *, seq_length: int, eval_seq_length: int, train_samples: int,
               eval_samples: int, log=print) -> Data:
    """Train and held-out datasets for the run (checks in the module doc); DataError or ConfigError naming keys."""
    d, seed = config.data, config.train.seed
    prefixes, tokenizer = _dataset_prefixes(config, log)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise ConfigError(f"model.vocab_size {config.model.vocab_size} is smaller than the tokenizer's "
                          f"{tokenizer.vocab_size} ids ({tokenizer.name}); set model.vocab_size={tokenizer.vocab_size}")
    if d.valid_paths:  # separate validation data: every training document trains
        valid_prefixes, valid_tokenizer = _prefixes_and_tokenizer([Path(p) for p in d.valid_paths], d, log)
        if valid_tokenizer.name != tokenizer.name:
            raise DataError(f"data.valid_paths were tokenized by {valid_tokenizer.name}, data.paths by "
                            f"{tokenizer.name}; a run needs one tokenizer")
        held = [_whole(open_indexed(p, tokenizer.vocab_size), "valid") for p in valid_prefixes]
        splits = [(_whole(open_indexed(p, tokenizer.vocab_size), "train"), None) for p in prefixes]
    else:
        held = None
        splits = [split_documents(open_indexed(p, tokenizer.vocab_size), d.valid_fraction, d.split_seed)
                  for p in prefixes]
    cache = d.index_cache_dir
    kinds = {"whole_documents": d.whole_documents, "loss_mask": d.loss_mask}  # how every GPTDataset reads its data

    if len(prefixes) == 1:
        train_docs, valid_docs = splits[0]
        if d.whole_documents:
            try:  # whole epochs, so that the sample order (and the fingerprint) does not depend on train.steps
                train = GPTDataset(train_docs, seq_length, None, seed, cache_dir=cache, max_epochs=d.max_epochs,
                                   name=train_docs.prefix.name, min_samples=train_samples, **kinds)
            except DataError as exc:
                raise DataError(f"data.whole_documents: the run needs {train_samples} samples (train.steps x global "
                                f"batch): {str(exc).replace('pass max_epochs', 'set data.max_epochs')}") from None
            epochs, filled = train.epochs, f", whole documents filling {train.fill:.1%} of them"
        else:
            per_epoch = (train_docs.num_tokens - 1) // seq_length
            if per_epoch < 1:
                raise DataError(f"{prefixes[0]}: {train_docs.num_tokens} training tokens, fewer than one sample of "
                                f"{seq_length} + 1")
            epochs = -(-train_samples // per_epoch)
            if epochs > d.max_epochs:  # contract 26 (docs/contracts.md): say so now, not after an endless pass
                global_batch = max(train_samples // max(config.train.steps, 1), 1)
                fits = d.max_epochs * per_epoch // global_batch
                fix = (f"lower train.steps to {fits}" if fits >= 1 else
                       f"the data holds fewer samples than one step's global batch of {global_batch}: lower "
                       "train.global_batch_size or train.seq_length, or add data")
                raise DataError(
                    f"the run needs {train_samples} samples (train.steps x global batch) of {seq_length} tokens; the "
                    f"training split holds {per_epoch} per epoch ({train_docs.num_tokens} tokens), so {epochs} "
                    f"epochs, but data.max_epochs={d.max_epochs}: set data.max_epochs={epochs} to repeat the data, "
                    f"or {fix}")
            # whole epochs, so that the sample order (and the fingerprint) does not depend on train.steps
            train = GPTDataset(train_docs, seq_length, epochs * per_epoch, seed, cache_dir=cache, max_epochs=epochs,
                               name=train_docs.prefix.name, **kinds)
            filled = ""
        if held is None:
            with _held_out(config, eval_samples, eval_seq_length):
                valid = GPTDataset(valid_docs, eval_seq_length, eval_samples, seed, cache_dir=cache,
                                   name=valid_docs.prefix.name + f"-{eval_seq_length}", **kinds)
        description = (f"{train_docs.prefix.name}: {len(train_docs)} documents, {train_docs.num_tokens:,} "
                       f"tokens ({len(valid_docs) if held is None else 0} documents held out), {len(train)} samples "
                       f"of {seq_length} ({epochs} epoch{'s' * (epochs > 1)}){filled}")
    else:
        weights = d.weights or [1.0] * len(prefixes)

        def factories(part: int, length: int, max_epochs: int, suffix: str):
            return [functools.partial(_component, s[part], length, cache, max_epochs, s[part].prefix.name + suffix,
                                      **kinds) for s in splits]

        try:
            train = BlendedDataset(factories(0, seq_length, d.max_epochs, ""), weights, train_samples, seed=seed,
                                   allow_extreme=d.allow_extreme_weights)
            if held is None:
                with _held_out(config, eval_samples, eval_seq_length):
                    valid = BlendedDataset(factories(1, eval_seq_length, 1, f"-{eval_seq_length}"), weights,
                                           eval_samples, seed=seed, allow_extreme=d.allow_extreme_weights)
        except ValueError as exc:
            if isinstance(exc, DataError):
                raise
            message = (f"data.weights {weights}: {exc}".replace("pass allow_extreme=True",
                                                                 "set data.allow_extreme_weights=true")
                       .replace("raise num_samples", "raise train.steps or train.global_batch_size"))
            raise ConfigError(message) from None
        description = "blend:\n" + train.describe()
    if held is not None:
        valid = _separate_valid(config, held, cache, eval_samples, eval_seq_length, seed, kinds)
        description += f"; eval on data.valid_paths ({sum(len(h) for h in held)} documents)"
    masked = [s[0].prefix.name for s in splits if s[0].has_loss_mask]
    if masked:
        description += (f"; loss masks of {', '.join(masked)} (PREFIX.mask.bin) " +
                        ("applied" if d.loss_mask else "ignored: data.loss_mask=false trains every token"))
    # what fixes the training samples' order (the held-out set depends on eval sizes, not recorded)
    fingerprint = hashlib.sha256(f"{train.fingerprint}:{tokenizer.name}".encode()).hexdigest()
    return Data(train, valid, tokenizer, fingerprint[:32], description)


@contextlib.contextmanager
def _held_out(config: TrainConfig, eval_samples: int, eval_seq_length: int):
    """A DataError building the held-out set says which keys change what eval reads (eval reads the same samples
    every time, so it never repeats documents: data.max_epochs is for training)."""
    try:
        yield
    except DataError as exc:
        e, d = config.eval, config.data
        raise DataError(f"the held-out set cannot supply what eval reads ({eval_samples} samples of {eval_seq_length} "
                        f"tokens: eval.batches {e.batches} x micro-batch x data-parallel ranks): {exc}. Lower "
                        f"eval.batches or eval.micro_batch_size, shorten eval.seq_length, hold out more documents "
                        f"(data.valid_fraction, now {d.valid_fraction:g}), or set eval.every=0 to train without "
                        "eval") from None


def _whole(indexed, split: str) -> DocumentSubset:
    """Every document of ``indexed`` as one part (``split`` names it)."""
    return DocumentSubset(indexed, np.arange(len(indexed)), split)


def _separate_valid(config: TrainConfig, held: list[DocumentSubset], cache, eval_samples: int, eval_seq_length: int,
                    seed: int, kinds: dict):
    """The eval set of data.valid_paths: one dataset's samples, or their blend (data.valid_weights)."""
    d = config.data
    with _held_out(config, eval_samples, eval_seq_length):
        if len(held) == 1:
            return GPTDataset(held[0], eval_seq_length, eval_samples, seed, cache_dir=cache,
                              name=held[0].prefix.name + f"-{eval_seq_length}", **kinds)
        parts = [functools.partial(_component, h, eval_seq_length, cache, 1, h.prefix.name + f"-{eval_seq_length}",
                                   **kinds) for h in held]
        try:
            return BlendedDataset(parts, d.valid_weights or [1.0] * len(held), eval_samples, seed=seed,
                                  allow_extreme=d.allow_extreme_weights)
        except ValueError as exc:
            if isinstance(exc, DataError):
                raise
            raise ConfigError(f"data.valid_weights {d.valid_weights}: {exc}") from None


def _component(docs: DocumentSubset, seq_length: int, cache, max_epochs: int, name: str, count: int, seed: int,
               **kinds):
    return GPTDataset(docs, seq_length, count, seed, cache_dir=cache, max_epochs=max_epochs, name=name, **kinds)


