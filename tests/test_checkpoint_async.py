"""Asynchronous checkpoint saves in one process: the bytes of a synchronous save; nothing that changes after the
call reaches the checkpoint; one save at a time; a background failure raised at the next wait or save (and printed at
exit when never waited for) with the previous checkpoint intact; a SIGKILL during the background write leaves the
previous checkpoint loadable."""
import errno
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megakern import checkpoint as ck
from megakern.checkpoint import CheckpointError, CheckpointManager, PendingSave

REPO = Path(__file__).resolve().parents[1]


def model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 8), torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    return model, opt


def train_step(model, opt):
    model(torch.randint(0, 13, (4, 5))).square().mean().backward()
    opt.step()
    opt.zero_grad()


def tree(model, opt):
    return {"model": model.state_dict(),
            "optim": ck.optimizer_state_dict(opt, {p: n for n, p in model.named_parameters()})}


def flat(t, prefix=""):
    """{dotted key: a copy of the tensor} of a tree's tensors."""
    out = {}
    for k, v in t.items():
        if isinstance(v, dict):
            out |= flat(v, f"{prefix}{k}.")
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v.detach().clone()
    return out


def load_flat(manager, path, seed=99):
    """The tensors of checkpoint ``path`` loaded into a fresh model and optimizer, and the loaded state."""
    model, opt = model_and_optimizer(seed)
    t = tree(model, opt)
    state = manager.load(path, t)
    return flat(t), state


class Gated(ck.dcp.FileSystemWriter):
    """Holds the background write until ``gate`` is set (so that the test acts while the save is in flight)."""

    gate = threading.Event()

    def write_data(self, plan, planner):
        assert Gated.gate.wait(30), "the test never opened the gate"
        return super().write_data(plan, planner)


class FullDisk(ck.dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        with open(self.path / "__0_0.distcp", "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "__0_0.distcp"))


@pytest.fixture
def gated(monkeypatch):
    Gated.gate.clear()
    monkeypatch.setattr(ck, "_storage_writer", lambda path: Gated(str(path)))
    yield Gated.gate
    Gated.gate.set()


def test_async_save_writes_the_bytes_of_a_sync_save(tmp_path):
    model, opt = model_and_optimizer()
    torch.manual_seed(5)
    sync = CheckpointManager(tmp_path / "sync").save(2, tree(model, opt), state={"tag": 1}, files={"a.txt": "x"})
    torch.manual_seed(5)
    manager = CheckpointManager(tmp_path / "async")
    pending = manager.save(2, tree(model, opt), state={"tag": 1}, files={"a.txt": "x"}, asynchronous=True)
    assert isinstance(pending, PendingSave) and pending.path == tmp_path / "async" / "step_00000002"
    path = pending.wait()
    assert path == pending.path and pending.done() and manager.pending is None and manager.latest() == path
    names = sorted(p.name for p in sync.iterdir())
    assert names == sorted(p.name for p in path.iterdir())
    for name in names:  # .metadata and the manifest carry the save's own ids and paths
        if name not in (".metadata", "manifest.json"):
            assert (sync / name).read_bytes() == (path / name).read_bytes(), name
    a, _ = load_flat(manager, sync)
    b, state = load_flat(manager, path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) and state["tag"] == 1


def test_what_changes_after_the_call_does_not_reach_the_checkpoint(tmp_path, gated):
    model, opt = model_and_optimizer()
    expected = flat(tree(model, opt))
    state, files, rank_state = {"tag": "at the call"}, {"notes.txt": "at the call"}, {"stream": torch.arange(4)}
    torch.manual_seed(11), random.seed(11), np.random.seed(11)
    manager = CheckpointManager(tmp_path / "ckpt")
    pending = manager.save(1, tree(model, opt), state=state, files=files, rank_state=rank_state, asynchronous=True)
    draws = (torch.rand(3), random.random(), np.random.rand(2))  # what the RNG gives after the call
    train_step(model, opt)  # parameters and optimizer state change in place
    state["tag"], files["notes.txt"] = "later", "later"
    rank_state["stream"].add_(100)
    torch.manual_seed(12), random.seed(12), np.random.seed(12)
    assert not pending.done() and not (manager.dir / "step_00000001").exists()
    with pytest.raises(CheckpointError, match="the asynchronous save of checkpoint step 1 .* is still running"):
        pending.wait(timeout=0.05)
    gated.set()
    path = pending.wait()
    assert (path / "notes.txt").read_text() == "at the call"
    got, loaded = load_flat(manager, path)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in got)
    assert loaded["tag"] == "at the call" and torch.equal(loaded["rank_state"]["stream"], torch.arange(4))
    again = (torch.rand(3), random.random(), np.random.rand(2))  # the RNG continues from the call
    assert torch.equal(again[0], draws[0]) and again[1] == draws[1] and np.array_equal(again[2], draws[2])


def test_one_save_at_a_time(tmp_path, gated):
    lines = []
    manager = CheckpointManager(tmp_path / "ckpt", keep=1, log=lines.append)
    model, opt = model_and_optimizer()
    first = manager.save(1, tree(model, opt), state={}, asynchronous=True)
    threading.Timer(0.5, gated.set).start()
    start = time.monotonic()
    second = manager.save(2, tree(model, opt), state={}, asynchronous=True)  # waits for the first
    assert first.done() and time.monotonic() - start >= 0.4 and manager.pending is second
    assert manager.wait() == second.path and manager.pending is None and manager.wait() is None
    assert [p.name for p in manager.complete()] == ["step_00000002"] and manager.latest() == second.path
    assert lines == ["removing checkpoint step_00000001 (checkpoint.keep=1)"]  # noted at the wait, on this thread


def test_a_background_failure_surfaces_at_wait_and_at_the_next_save(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    manager = CheckpointManager(tmp_path / "ckpt")
    good = manager.save(1, tree(model, opt), state={"tag": "previous"})
    monkeypatch.setattr(ck, "_storage_writer", lambda path: FullDisk(str(path)))
    pending = manager.save(2, tree(model, opt), state={"tag": "new"}, asynchronous=True)
    expected = (f"saving checkpoint step 2 to {manager.dir} failed: writing the tensors to "
                f"{manager.dir / '.tmp-step_00000002'}: No space left on device (disk full, errno ENOSPC): "
                f"{manager.dir / '.tmp-step_00000002' / '__0_0.distcp'}; the temporary directory was removed and the "
                f"previous checkpoint {good} is intact and `latest` names it")
    for _ in range(2):
        with pytest.raises(CheckpointError) as info:
            pending.wait()
        assert str(info.value) == expected
    assert manager.wait() is None  # already raised by the pending save itself
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000001"]

    manager.save(3, tree(model, opt), state={"tag": "new"}, asynchronous=True)
    monkeypatch.undo()
    with pytest.raises(CheckpointError, match="saving checkpoint step 3 .*No space left on device"):
        manager.save(4, tree(model, opt), state={"tag": "new"})  # the pending failure comes first
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000001"]  # step 4 never started
    assert manager.save(4, tree(model, opt), state={"tag": "new"}) == manager.dir / "step_00000004"
    assert load_flat(manager, manager.dir)[1]["tag"] == "new"


CHILD = r"""
import sys, time
from pathlib import Path
import torch
from megakern import checkpoint as ck

directory, mode, marker = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])

class Stalled(ck.dcp.FileSystemWriter):  # part of the data file written, then a stall: the parent kills us here
    def write_data(self, plan, planner):
        with open(self.path / "__0_0.distcp", "wb") as f:
            f.write(b"\0" * 4096)
        marker.write_text("writing")
        time.sleep(600)

class FullDisk(ck.dcp.FileSystemWriter):
    def write_data(self, plan, planner):
        raise OSError(28, "No space left on device", str(self.path / "__0_0.distcp"))

manager = ck.CheckpointManager(directory)
torch.manual_seed(0)
weights = torch.randn(32, 32)
manager.save(1, {"w": weights}, state={"tag": "previous"})
ck._storage_writer = lambda path: (Stalled if mode == "kill" else FullDisk)(str(path))
manager.save(2, {"w": weights + 1}, state={"tag": "new"}, asynchronous=True)
if mode == "kill":
    manager.wait()
print("exiting without waiting")
"""


def child(tmp_path, mode):
    directory, marker = tmp_path / "ckpt", tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(directory), mode, str(marker)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode == "kill":
        deadline = time.monotonic() + 120
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    out, err = proc.communicate(timeout=120)
    return directory, proc.returncode, out + err


def test_sigkill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path):
    directory, code, output = child(tmp_path, "kill")
    assert code == -signal.SIGKILL and (tmp_path / "marker").exists(), output
    manager = CheckpointManager(directory)
    assert manager.latest() == directory / "step_00000001"
    t = {"w": torch.empty(32, 32)}
    torch.manual_seed(0)
    expected = torch.randn(32, 32)
    assert manager.load(directory, t)["tag"] == "previous" and torch.equal(t["w"], expected)
    assert manager.remove_leftovers() == [directory / ".tmp-step_00000002"]
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_00000001"]


def test_a_failure_never_waited_for_is_printed_at_exit(tmp_path):
    directory, code, output = child(tmp_path, "exit")
    assert code == 0 and "exiting without waiting" in output, output
    assert (f"megakern: the asynchronous save of checkpoint step 2 failed and was never waited for: saving checkpoint "
            f"step 2 to {directory} failed: writing the tensors to") in output, output
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_00000001"]
