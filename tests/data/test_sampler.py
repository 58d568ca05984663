"""megakern/data/sampler.py: data-parallel batches, exact resumption across data-parallel sizes (contract 12,
docs/contracts.md), the dataloader's checks (contracts 18, 32) and its timeout and dead workers (contract 2), and ranks
agreeing before step 1, on 3 gloo ranks."""
import os
import time
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megakern.data import sampler as sampler_module
from megakern.data.gpt_dataset import GPTDataset
from megakern.data.indexed import DataError, IndexedDataset, IndexedDatasetWriter
from megakern.data.sampler import PretrainingSampler, build_dataloader, check_ranks_agree


def rank_batches(total, consumed, micro, dp, drop_last=True):
    """Every rank's batches: [rank][step] -> list of sample indices."""
    return [list(PretrainingSampler(total, consumed, micro, r, dp, drop_last=drop_last)) for r in range(dp)]


def global_stream(total, consumed, micro, dp, drop_last=True):
    """The samples of each global batch, concatenated in rank order, step after step."""
    batches = rank_batches(total, consumed, micro, dp, drop_last)
    assert len({len(b) for b in batches}) == 1, "ranks would take different numbers of steps"
    return [i for step in zip(*batches) for batch in step for i in batch]


def test_megatron_layout():
    assert rank_batches(20, 0, 2, 2) == [[[0, 1], [4, 5], [8, 9], [12, 13], [16, 17]],
                                         [[2, 3], [6, 7], [10, 11], [14, 15], [18, 19]]]
    assert rank_batches(11, 0, 2, 2) == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]  # drop_last: 8, 9, 10 dropped
    assert [len(PretrainingSampler(11, 0, 2, r, 2)) for r in range(2)] == [2, 2]


def test_resume_is_exact():
    full = rank_batches(1000, 0, 4, 3)
    for step in (0, 1, 17, 83):
        resumed = rank_batches(1000, step * 12, 4, 3)
        assert resumed == [batches[step:] for batches in full]
        assert len(PretrainingSampler(1000, step * 12, 4, 0, 3)) == len(resumed[0])


@pytest.mark.parametrize("consumed", [0, 96, 100])
def test_resume_with_another_data_parallel_size(consumed):
    """The global stream from consumed_samples on is the same whatever the split into ranks and micro-batches."""
    for micro, dp in [(8, 1), (4, 2), (2, 4), (1, 8), (1, 3)]:
        stream = global_stream(1000, consumed, micro, dp)
        assert stream == list(range(consumed, consumed + len(stream))), (micro, dp)
        assert 1000 - consumed - len(stream) < micro * dp  # only a partial global batch dropped
    before = global_stream(1000, 0, 4, 2)[:96]  # 12 steps on 2 ranks, then resumed on 4
    assert before + global_stream(1000, 96, 2, 4) == list(range(1000))[:96 + len(global_stream(1000, 96, 2, 4))]


def test_remainder_without_drop_last():
    batches = rank_batches(23, 0, 2, 3, drop_last=False)  # 3 global batches of 6, then 5 samples left
    assert [b[-1] for b in batches] == [[18, 19], [20, 21], [22]]
    assert global_stream(23, 0, 2, 3, drop_last=False) == list(range(23))
    assert [len(PretrainingSampler(23, 0, 2, r, 3, drop_last=False)) for r in range(3)] == [4, 4, 4]
    with pytest.raises(ValueError, match="drop_last=False leaves a last batch of 1 samples for 3 ranks"):
        PretrainingSampler(19, 0, 2, 0, 3, drop_last=False)


@pytest.mark.parametrize("args, match", [
    ((100, 0, 2, 2, 2), "data_parallel_rank 2 is not below data_parallel_size 2"),
    ((100, 0, 2, 0, 0), "data_parallel_size must be an integer >= 1, got 0"),
    ((100, 0, 0, 0, 1), "micro_batch_size must be an integer >= 1, got 0"),
    ((100, -1, 2, 0, 1), "consumed_samples must be an integer >= 0"),
    ((100, 101, 2, 0, 1), "consumed_samples 101 exceeds total_samples 100"),
    ((100, 0, 8, 0, 16), "micro_batch_size 8 x data_parallel_size 16 = 128 samples exceeds the dataset's 100"),
    ((0, 0, 1, 0, 1), "total_samples must be an integer >= 1"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        PretrainingSampler(*args)


def small_gpt_dataset(tmp_path, seq_length=4):
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(tmp_path / "d", 300) as w:
        for k in rng.integers(1, 20, 40):
            w.add_document(rng.integers(0, 300, k))
    return GPTDataset(IndexedDataset(tmp_path / "d"), seq_length, None, seed=0)


def test_dataloader_caps_workers_and_checks_sizes(tmp_path, monkeypatch):
    dataset = small_gpt_dataset(tmp_path)
    sampler = PretrainingSampler(len(dataset), 8, 2, 1, 2)
    monkeypatch.setattr(sampler_module, "usable_cpus", lambda: 1)
    with pytest.warns(UserWarning, match="num_workers=4 exceeds the 1 usable CPUs; using 1"):
        loader = build_dataloader(dataset, sampler, num_workers=4, pin_memory=True)
    assert loader.num_workers == 1 and loader.pin_memory == torch.cuda.is_available()
    batches = list(loader)
    assert len(batches) == len(sampler)
    for batch, indices in zip(batches, sampler):
        assert batch["tokens"].shape == (2, 5)
        assert torch.equal(batch["tokens"], torch.stack([dataset[i]["tokens"] for i in indices]))
    with pytest.raises(DataError, match=f"total_samples {len(dataset) - 1} != the dataset's {len(dataset)} samples"):
        build_dataloader(dataset, PretrainingSampler(len(dataset) - 1, 0, 2, 0, 2), num_workers=0)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 0"):
        build_dataloader(dataset, sampler, num_workers=-1)


def test_ranks_agree_without_distributed():
    assert not dist.is_initialized()
    assert check_ranks_agree("any", 0) is True
    with pytest.raises(ValueError, match="fingerprint must be a non-empty str"):
        check_ranks_agree(b"bytes", 0)


def _ranks(rank, world, init_file, timeout_case):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    try:
        if timeout_case:  # rank 2 never arrives
            if rank == 2:
                time.sleep(2)
                return
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=f"rank {rank}: the all-gather of check_ranks_agree failed or did "
                                                   "not finish within 1 s"):
                check_ranks_agree("fp", 5, timeout=1)
            # well before the group's 30 s timeout: the check's own 1 s bounded the wait (slack for a loaded machine)
            assert time.monotonic() - start < 10
            return
        assert check_ranks_agree("fp", 5, timeout=10) is True
        with pytest.raises(DataError, match=r"ranks \[1\] differ from the majority \(this rank, "
                                            rf"{rank}, has fingerprint {'odd' if rank == 1 else 'fp'}\)"):
            check_ranks_agree("odd" if rank == 1 else "fp", 5, timeout=10)
        with pytest.raises(DataError, match=r"ranks \[0\] differ.*\n  ranks \[1, 2\]: .*consumed_samples 5\n"
                                            r"  ranks \[0\]: .*consumed_samples 4$"):
            check_ranks_agree("fp", 4 if rank == 0 else 5, timeout=10)
        group = dist.new_group([1, 2])
        if rank > 0:  # a subgroup names global ranks
            with pytest.raises(DataError, match=r"ranks \[2\] differ.*\n  ranks \[1\]: .*\n  ranks \[2\]: "):
                check_ranks_agree(f"fp{rank}", 5, group=group, timeout=10)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("timeout_case", [False, True], ids=["agree-and-disagree", "timeout"])
def test_check_ranks_agree_on_gloo(tmp_path, timeout_case):
    mp.spawn(_ranks, args=(3, tmp_path / "init", timeout_case), nprocs=3, join=True)


class Stalling(torch.utils.data.Dataset):
    """A stand-in dataset whose read of sample 2 in a worker process stalls ``hang`` seconds or kills the process
    (``die``), as a read from a hung network filesystem or a worker killed for memory does."""

    name = "stalling-data"

    def __init__(self, hang: float = 0.0, die: bool = False):
        self.hang, self.die = hang, die

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is not None and i == 2:  # the first batch comes, the second does not
            if self.die:
                os._exit(3)
            time.sleep(self.hang)
        return {"tokens": torch.full((3,), i)}


def test_dataloader_wait_times_out_with_the_dataset_named():
    """Contract 2: a batch that does not come within the timeout stops the run with an error, not a silent hang."""
    loader = build_dataloader(Stalling(hang=3.0), PretrainingSampler(8, 0, 2, 0, 1), num_workers=1, timeout=1.0)
    batches = iter(loader)
    assert next(batches)["tokens"][:, 0].tolist() == [0, 1]
    with pytest.raises(DataError, match=r"^stalling-data: no batch from the DataLoader's 1 worker process\(es\) within "
                                        r"1 s .*raise the timeout \(data.loader_timeout_s\)"):
        next(batches)  # (raised once the stalled worker is shut down: after its read, here 3 s)


def test_dataloader_worker_death_names_the_dataset():
    loader = build_dataloader(Stalling(die=True), PretrainingSampler(8, 0, 2, 0, 1), num_workers=1, timeout=30)
    with pytest.raises(DataError, match=r"^stalling-data: a DataLoader worker process died \(DataLoader worker "
                                        r"\(pid.*exited unexpectedly"):
        list(loader)


def test_dataloader_timeout_argument():
    dataset = Stalling()
    sampler = PretrainingSampler(8, 0, 2, 0, 1)
    for bad in (0, -1.0, float("inf"), float("nan"), True, "60"):
        with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
            build_dataloader(dataset, sampler, num_workers=0, timeout=bad)
    assert build_dataloader(dataset, sampler, num_workers=0, timeout=5).timeout == 0  # read in this process
    assert build_dataloader(dataset, sampler, num_workers=1, timeout=5).timeout == 5.0
