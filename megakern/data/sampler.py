"""Data-parallel batches of a pretraining dataset, resumable, with the ranks checked to agree (contracts 2, 12, 18 and
32 of docs/contracts.md).

``PretrainingSampler`` is Megatron's MegatronPretrainingSampler: the samples consumed_samples, consumed_samples + 1,
... are cut into global batches of micro_batch_size * data_parallel_size consecutive samples, and rank r takes
the r-th micro_batch_size of each. The stream is a pure function of consumed_samples, so a run restarted from a
checkpoint's consumed_samples continues exactly where it stopped, with any data-parallel size: the global
stream, each global batch's slices concatenated in rank order, is consumed_samples, consumed_samples + 1, ...
whatever the split. The training program keeps consumed_samples (samples of completed steps, over all ranks) in
its checkpoint. With gradient accumulation a step draws several global batches; making the step count fit
the data is the training program's check.

``build_dataloader`` waits for each batch at most ``timeout`` seconds: a worker stuck reading (a hung network
filesystem) or gone stops the run with a DataError naming the dataset, instead of a silent hang.

``check_ranks_agree`` runs before step 1: every data-parallel rank must hold the same dataset fingerprint and
consumed_samples, or all of them stop with an error naming the odd ranks, instead of training on different data.
"""
from __future__ import annotations

import datetime
import hashlib
import os
import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from megakern.data.gpt_dataset import _int_arg
from megakern.data.indexed import DataError


class PretrainingSampler:
    """Batch sampler of this rank's micro-batches (lists of sample indices) of [consumed_samples, total_samples).

    drop_last: stop after the last full global batch; False also serves the remainder, split as evenly as the
    ranks allow (sizes differ by at most one; every rank must get a sample, else ValueError at construction).
    """

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int, data_parallel_rank: int,
                 data_parallel_size: int, *, drop_last: bool = True):
        self.total_samples = _int_arg("total_samples", total_samples, 1)
        self.consumed_samples = _int_arg("consumed_samples", consumed_samples, 0)
        self.micro_batch_size = _int_arg("micro_batch_size", micro_batch_size, 1)
        self.data_parallel_size = _int_arg("data_parallel_size", data_parallel_size, 1)
        self.data_parallel_rank = _int_arg("data_parallel_rank", data_parallel_rank, 0)
        self.drop_last = drop_last
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is not below data_parallel_size "
                             f"{data_parallel_size}")
        if self.consumed_samples > self.total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} exceeds total_samples {total_samples}: the "
                             f"checkpoint is from a longer run or a larger dataset")
        self.global_batch = self.micro_batch_size * self.data_parallel_size
        if self.global_batch > self.total_samples:
            raise ValueError(f"a global batch of micro_batch_size {micro_batch_size} x data_parallel_size "
                             f"{data_parallel_size} = {self.global_batch} samples exceeds the dataset's "
                             f"{total_samples} samples")
        left = self.total_samples - self.consumed_samples
        self.end = self.total_samples if not drop_last else self.total_samples - left % self.global_batch
        tail = (self.end - self.consumed_samples) % self.global_batch
        if 0 < tail < self.data_parallel_size:
            raise ValueError(f"drop_last=False leaves a last batch of {tail} samples for {data_parallel_size} "
                             f"ranks; some ranks would get none (use drop_last=True)")

    def __iter__(self):
        rank, micro = self.data_parallel_rank, self.micro_batch_size
        for start in range(self.consumed_samples, self.end, self.global_batch):
            size = min(self.global_batch, self.end - start)
            if size == self.global_batch:
                first = start + rank * micro
                yield list(range(first, first + micro))
            else:  # the remainder with drop_last=False: near-equal contiguous slices
                share, extra = divmod(size, self.data_parallel_size)
                first = start + rank * share + min(rank, extra)
                yield list(range(first, first + share + (rank < extra)))

    def __len__(self) -> int:
        return -(-(self.end - self.consumed_samples) // self.global_batch)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose iterators turn a worker's timeout or death into a DataError naming the dataset."""

    def __iter__(self):
        return self._checked(super().__iter__())

    def _checked(self, batches):
        name = getattr(self.dataset, "name", type(self.dataset).__name__)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except RuntimeError as exc:
                text = str(exc)
                if text.startswith("DataLoader timed out after"):
                    raise DataError(
                        f"{name}: no batch from the DataLoader's {self.num_workers} worker process(es) within "
                        f"{self.timeout:g} s (a worker is stuck reading, e.g. on a hung network filesystem, or "
                        "deadlocked): check the data files' storage, or raise the timeout (data.loader_timeout_s)"
                    ) from exc
                if text.startswith("DataLoader worker"):  # "... exited unexpectedly", "... is killed by signal"
                    raise DataError(f"{name}: a DataLoader worker process died ({text}): a crash, a signal, or the "
                                    "OS out of memory (see dmesg); the batch it was reading never came") from exc
                raise
            yield batch


def build_dataloader(dataset, sampler: PretrainingSampler, num_workers: int = 2, pin_memory: bool = True, *,
                     timeout: float = 600.0) -> torch.utils.data.DataLoader:
    """A DataLoader over ``dataset`` in ``sampler``'s batches.

    The sampler must cover the dataset exactly (total_samples == len(dataset)). num_workers above the usable
    CPUs is capped to them with a warning; memory is pinned only where CUDA is available. With worker processes,
    each batch is waited for at most ``timeout`` seconds (> 0); a wait that runs out, or a worker that dies, raises
    DataError naming the dataset (its ``name``) and what to do. Without workers the batches are read in this
    process and there is nothing to wait for.
    """
    if sampler.total_samples != len(dataset):
        raise DataError(f"the sampler's total_samples {sampler.total_samples} != the dataset's {len(dataset)} "
                        f"samples; build the sampler from len(dataset)")
    num_workers = _int_arg("num_workers", num_workers, 0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
    if num_workers > (cpus := usable_cpus()):
        warnings.warn(f"num_workers={num_workers} exceeds the {cpus} usable CPUs; using {cpus}", stacklevel=2)
        num_workers = cpus
    return _Loader(dataset, batch_sampler=sampler, num_workers=num_workers,
                   pin_memory=pin_memory and torch.cuda.is_available(), timeout=float(timeout) if num_workers else 0)


def check_ranks_agree(fingerprint: str, consumed_samples: int, group=None, timeout: float = 300.0) -> bool:
    """True when every rank of ``group`` (default: the world) holds this ``fingerprint`` and ``consumed_samples``.

    Each rank contributes 16 bytes (8 of sha256(fingerprint), consumed_samples) to an all-gather; any difference
    raises DataError on every rank, naming the ranks and their values. An all-gather that fails or does not
    finish within ``timeout`` seconds raises RuntimeError. Without an initialized torch.distributed there is nothing to
    compare: True.
    """
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be a non-empty str, got {fingerprint!r}")
    consumed_samples = _int_arg("consumed_samples", consumed_samples, 0)
    if not (dist.is_available() and dist.is_initialized()):
        return True
    backend = str(dist.get_backend(group))
    device = (torch.device("cpu") if "gloo" in backend or backend == "mpi"
              else torch.accelerator.current_accelerator())
    digest = int.from_bytes(hashlib.sha256(fingerprint.encode()).digest()[:8], "big", signed=True)
    mine = torch.tensor([digest, consumed_samples], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as exc:
        raise RuntimeError(f"rank {dist.get_rank()}: the all-gather of check_ranks_agree failed or did not finish "
                           f"within {timeout:g} s (a rank stopped, hangs, or skipped the check): {exc}") from exc
    ranks_of = defaultdict(list)
    for i, row in enumerate(gathered):
        digest_i, consumed_i = row.tolist()
        rank = i if group is None else dist.get_global_rank(group, i)
        ranks_of[(digest_i.to_bytes(8, "big", signed=True).hex(), consumed_i)].append(rank)
    if len(ranks_of) == 1:
        return True
    values = sorted(ranks_of.items(), key=lambda kv: (-len(kv[1]), kv[1]))
    odd = sorted(r for _, ranks in values[1:] for r in ranks)
    lines = [f"  ranks {ranks}: fingerprint digest {d}, consumed_samples {c}" for (d, c), ranks in values]
    raise DataError(f"data-parallel ranks disagree on the data before step 1; ranks {odd} differ from the majority "
                    f"(this rank, {dist.get_rank()}, has fingerprint {fingerprint}):\n" + "\n".join(lines))
