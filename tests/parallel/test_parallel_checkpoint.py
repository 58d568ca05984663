"""Checkpoints over gloo ranks: saved under one (tp, pp, dp) layout with torch.distributed.checkpoint, loaded under
another (and by a plain single-process GPT), training goes on exactly as it would have; one rank failing its write,
its checksums or (rank 0) the commit makes every rank raise the same error and leaves the previous checkpoint
(contract 27); asynchronous saves write what synchronous ones do, off the training loop's group."""
import errno
import threading
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from gpt_check import batches, tiny_config, train_and_checkpoint
from rankpool import pool

from megakern import checkpoint as ck
from megakern.checkpoint import CheckpointError, CheckpointManager
from megakern.models.gpt import GPT


def test_checkpoint_reshards_across_layouts(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = pool(4).run(train_and_checkpoint, dict(tp=2, dp=2), dict(dp_shard="fsdp"), directory, save=True)
    # tp2 x dp2 (FSDP) -> pp2 x dp2 (DDP + ZeRO-1, the tied head on the last stage)
    loaded = pool(4).run(train_and_checkpoint, dict(pp=2, dp=2), dict(dp_shard="ddp", zero1=True, microbatches=2),
                         directory, save=False, seed=1)
    for mine in saved + loaded:
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(saved[0]), rtol=1e-4, atol=1e-5)
    # -> one process, no torch.distributed: a plain GPT reads the model's tensors
    cfg = tiny_config("gpt", 2)
    torch.manual_seed(5)
    model = GPT(cfg)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    idx, targets = batches(4, 4, 16, cfg.vocab_size)[2]
    with torch.no_grad():
        torch.testing.assert_close(model(idx, targets).item(), saved[0][0], rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Contract 27: one rank failing during a save; asynchronous saves over gloo ranks. Each check runs on every rank of a
# pool (the functions below run in the ranks' processes) and undoes the faults it injects (the pool lives on).

GATE = threading.Event()  # in each rank's process: holds that rank's background write


class FullDisk(ck.dcp.FileSystemWriter):
    """Part of this rank's data file written, then the disk is full."""

    def write_data(self, plan, planner):
        name = self.path / f"__{dist.get_rank()}_0.distcp"
        with open(name, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(name))


class Gated(ck.dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        assert GATE.wait(60), "the check never opened the gate"
        return super().write_data(plan, planner)


def _tree(rank: int, version: int) -> dict:
    """A replicated tensor (DCP writes it once) and one of this rank's own."""
    g = torch.Generator().manual_seed(100 * version + rank)
    return {"shared": torch.arange(6.0) + version, f"rank{rank}": torch.randn(8, 8, generator=g)}


def _inject(fault: str) -> Callable[[], None]:
    """Make this rank's next save fail at ``fault``; returns the undo."""
    if fault == "write":
        name, fake = "_storage_writer", lambda path: FullDisk(str(path))
    elif fault == "hash":
        def fake(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        name = "sha256_file"
    else:  # the commit: rank 0's manifest hits a full disk
        real_write = ck._write_file

        def fake(path, data):
            if path.name == "manifest.json":
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            real_write(path, data)
        name = "_write_file"
    real = getattr(ck, name)
    setattr(ck, name, fake)
    return lambda: setattr(ck, name, real)


def save_with_a_fault(directory: str, fault: str, failing: int, asynchronous: bool = False):
    """Step 1 saved, then step 2 with ``fault`` on rank ``failing``: this rank's error, the directory's listing after
    it, and whether step 1 then loads (tag and tensors)."""
    rank = dist.get_rank()
    manager = CheckpointManager(directory, timeout_s=30)
    previous = _tree(rank, 1)
    manager.save(1, previous, state={"tag": "previous"})
    undo = _inject(fault) if rank == failing else (lambda: None)
    error = None
    try:
        result = manager.save(2, _tree(rank, 2), state={"tag": "new"}, asynchronous=asynchronous)
        if asynchronous:
            result.wait()
    except CheckpointError as exc:
        error = str(exc)
    finally:
        undo()
    dist.barrier()
    listing = sorted(p.name for p in Path(directory).iterdir())
    got = {k: torch.full_like(v, float("nan")) for k, v in previous.items()}
    state = manager.load(directory, got)
    return error, listing, state["tag"] == "previous" and all(torch.equal(got[k], previous[k]) for k in got)


def check_one_rank_failing(world: int, directory: Path, fault: str, failing: int, cause: str,
                           asynchronous: bool = False) -> None:
    results = pool(world).run(save_with_a_fault, str(directory), fault, failing, asynchronous)
    errors = [error for error, _, _ in results]
    assert all(error == errors[0] for error in errors), errors  # every rank raises, and tells the same story
    assert errors[0] is not None and f"rank {failing}: {cause}" in errors[0], errors[0]
    assert errors[0].startswith(f"saving checkpoint step 2 to {directory} failed: "), errors[0]
    assert errors[0].endswith(f"the temporary directory was removed and the previous checkpoint "
                              f"{directory / 'step_00000001'} is intact and `latest` names it"), errors[0]
    assert all(listing == ["latest", "step_00000001"] and loads for _, listing, loads in results), results
    assert (directory / "latest").read_text() == "step_00000001\n"


def test_one_rank_of_several_failing_its_write(tmp_path):
    check_one_rank_failing(4, tmp_path / "ckpt", "write", 2, "No space left on device (disk full, errno ENOSPC): "
                           f"{tmp_path / 'ckpt' / '.tmp-step_00000002' / '__2_0.distcp'}")


def test_one_rank_failing_its_checksums(tmp_path):
    check_one_rank_failing(2, tmp_path / "ckpt", "hash", 1, "Input/output error (EIO, errno EIO)")


def test_rank_0_failing_the_commit(tmp_path):
    check_one_rank_failing(2, tmp_path / "ckpt", "commit", 0, "No space left on device (disk full, errno ENOSPC): "
                           f"{tmp_path / 'ckpt' / '.tmp-step_00000002' / 'manifest.json'}")


def test_one_rank_failing_a_background_write(tmp_path):
    check_one_rank_failing(2, tmp_path / "ckpt", "write", 1, "No space left on device (disk full, errno ENOSPC): "
                           f"{tmp_path / 'ckpt' / '.tmp-step_00000002' / '__1_0.distcp'}", asynchronous=True)


def async_like_sync(directory: str):
    """The same tree saved synchronously and asynchronously; while the asynchronous one is held in its write, the
    training group runs collectives of its own (the background's are on another group, or this hangs)."""
    rank = dist.get_rank()
    tree = _tree(rank, 1)
    torch.manual_seed(7)
    sync = CheckpointManager(Path(directory) / "sync").save(3, tree, state={"tag": 1})
    torch.manual_seed(7)
    manager = CheckpointManager(Path(directory) / "async", timeout_s=30)
    GATE.clear()
    real = ck._storage_writer
    ck._storage_writer = lambda path: Gated(str(path))
    try:
        pending = manager.save(3, tree, state={"tag": 1}, asynchronous=True)
        before = {k: v.clone() for k, v in tree.items()}
        for v in tree.values():
            v.add_(1000)  # changes after the call stay out of the checkpoint
        total = torch.tensor([float(rank + 1)])
        for _ in range(3):
            dist.all_reduce(total)
        dist.barrier()
        in_flight = not pending.done()
        GATE.set()
        path = pending.wait()
    finally:
        ck._storage_writer = real
        GATE.set()
    same_bytes = [(sync / n).read_bytes() == (path / n).read_bytes()
                  for n in (f"__{rank}_0.distcp", f"rng-rank{rank:05d}.pt", "state.json")]
    got = {k: torch.zeros_like(v) for k, v in tree.items()}
    manager.load(path, got)
    return (in_flight, total.item(), same_bytes, all(torch.equal(got[k], before[k]) for k in got),
            [p.name for p in manager.complete()])


def test_async_save_over_ranks_equals_sync_and_keeps_off_the_training_group(tmp_path):
    for in_flight, total, same_bytes, loads, complete in pool(2).run(async_like_sync, str(tmp_path)):
        assert in_flight and total == 12.0 and all(same_bytes) and loads and complete == ["step_00000003"]
