"""The rank pool tells a rank's native crash from a failed check: a rank killed by a signal makes the check run once
more on fresh ranks (with a warning naming the signal), a second crash fails it, and a Python error in a check is
reported at once and never run again."""
import os
import time

import pytest
from rankpool import RankCrashed, pool


def _attempt(log: str, rank: int) -> int:
    """Count this attempt in ``log`` (one line per rank per attempt); the attempt's number on this rank."""
    with open(log, "a") as f:
        f.write(f"{rank}\n")
    with open(log) as f:
        return sum(1 for line in f if line.strip() == str(rank))


def abort_once(log: str) -> int:
    """Rank 1 aborts (as glibc does on a corrupted heap) on its first attempt only."""
    import torch.distributed as dist

    rank = dist.get_rank()
    n = _attempt(log, rank)
    if rank == 1 and n == 1:
        os.abort()
    dist.barrier()
    return n


def abort_always(log: str) -> None:
    import torch.distributed as dist

    _attempt(log, dist.get_rank())
    if dist.get_rank() == 1:
        os.abort()
    dist.barrier()


def raise_error(log: str) -> None:
    import torch.distributed as dist

    _attempt(log, dist.get_rank())
    if dist.get_rank() == 0:
        raise ValueError("a wrong result")


def test_a_crash_runs_the_check_again_on_fresh_ranks(tmp_path):
    log = str(tmp_path / "attempts")
    ranks = pool(2)
    before = ranks.run(os.getpid)
    with pytest.warns(RuntimeWarning, match=r"rank 1 died of SIGABRT[\s\S]*abort_once runs again"):
        assert ranks.run(abort_once, log) == [2, 2]
    assert not ranks.broken and pool(2) is ranks
    after = ranks.run(os.getpid)  # the fresh ranks answer the next check
    assert len(set(after)) == 2 and not set(after) & set(before), (before, after)


def test_a_second_crash_fails_the_check(tmp_path):
    log = str(tmp_path / "attempts")
    start = time.monotonic()
    with pytest.warns(RuntimeWarning), pytest.raises(RankCrashed, match="rank 1 died of SIGABRT"):
        pool(2).run(abort_always, log)
    assert time.monotonic() - start < 60, "a dead rank must not be waited for until the deadline"
    with open(log) as f:
        assert sorted(f.read().split()) == ["0", "0", "1", "1"]


def test_a_python_error_is_not_run_again(tmp_path):
    log = str(tmp_path / "attempts")
    with pytest.raises(AssertionError, match="ValueError: a wrong result") as failure:
        pool(2).run(raise_error, log)
    assert not isinstance(failure.value, RankCrashed)
    with open(log) as f:
        assert sorted(f.read().split()) == ["0", "1"]
    assert not pool(2).broken  # the next pool(2) is a fresh one
