"""Checkpoints: round trip, the ENOSPC drill, a fault at every file operation of a save, removals killed midway,
leftovers cleared at start-up, incomplete and corrupt directories, keep-K, versions, CPU-only loads."""
import errno
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megakern import checkpoint as ck
from megakern.checkpoint import CheckpointError, CheckpointManager

REPO = Path(__file__).resolve().parents[2]


class StandIn(nn.Module):
    """A small model with a norm, a bias-free layer and a buffer (like FP8 scaling state)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.fc = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(5)
        self.out = nn.Linear(5, 3, bias=False)
        self.register_buffer("amax_history", torch.rand(4))

    def forward(self, idx):
        return self.out(self.norm(self.fc(self.emb(idx)))).square().mean()


def trained(steps=3, seed=0):
    torch.manual_seed(seed)
    model = StandIn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(torch.randint(0, 11, (4, 7))).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def tree(model, opt):
    names = {p: n for n, p in model.named_parameters()}
    return {"model": model.state_dict(), "optim": ck.optimizer_state_dict(opt, names)}, names


def save(manager, step, model, opt, **state):
    t, _ = tree(model, opt)
    return manager.save(step, t, state=state, files={"config.yaml": f"step: {step}\n"})


def load_fresh(manager, path=None, seed=99, **kwargs):
    torch.manual_seed(seed)
    model = StandIn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ck.init_optimizer_state(opt)
    t, names = tree(model, opt)
    state = manager.load(path or manager.dir, t, **kwargs)
    model.load_state_dict(t["model"])
    ck.load_optimizer_state_dict(opt, names, t["optim"])
    return model, opt, state


def same(model_a, opt_a, model_b, opt_b):
    sa, sb = model_a.state_dict(), model_b.state_dict()
    if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
        return False
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        a, b = opt_a.state[pa], opt_b.state[pb]
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            return False
    return True


def test_round_trip_with_rng_and_manifest(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    path = save(manager, 3, model, opt, consumed_samples=12)
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    assert path.name == "step_00000003" and (tmp_path / "ckpt" / "latest").read_text() == "step_00000003\n"
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == ck.FORMAT_VERSION and manifest["step"] == 3 and manifest["world_size"] == 1
    on_disk = {p.name for p in path.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk >= {".metadata", "rng-rank00000.pt", "state.json", "config.yaml"}
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == ck.sha256_file(path / name) and entry["size"] == (path / name).stat().st_size

    model2, opt2, state = load_fresh(manager)
    assert same(model, opt, model2, opt2)
    assert state["step"] == 3 and state["consumed_samples"] == 12 and state["path"] == str(path)
    got = (torch.rand(3), random.random(), np.random.rand(2))  # RNG streams continue where the save left them
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and np.array_equal(got[2], expected[2])


class FullDisk(ck.dcp.FileSystemWriter):
    """Writes part of a file, then fails as a full disk does."""

    def write_data(self, plan, planner):
        with open(self.path / "__0_0.distcp", "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, "No space left on device", str(self.path / "__0_0.distcp"))


def test_enospc_drill_keeps_previous_checkpoint(tmp_path, monkeypatch):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    good = save(manager, 3, model, opt, consumed_samples=12)
    before = {p.name: p.read_bytes() for p in good.iterdir()}
    model_later, opt_later = trained(steps=5)

    monkeypatch.setattr(ck, "_storage_writer", lambda path: FullDisk(str(path)))
    with pytest.raises(CheckpointError) as info:
        save(manager, 5, model_later, opt_later, consumed_samples=20)
    message = str(info.value)
    assert "saving checkpoint step 5" in message and "No space left on device" in message and "ENOSPC" in message
    assert f"the previous checkpoint {good} is intact" in message
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000003"]  # temp dir removed
    assert (manager.dir / "latest").read_text() == "step_00000003\n"
    assert {p.name: p.read_bytes() for p in good.iterdir()} == before

    monkeypatch.undo()
    model2, opt2, state = load_fresh(manager)
    assert same(model, opt, model2, opt2) and state["step"] == 3


def test_failure_after_the_tensors_also_cleans_up(tmp_path, monkeypatch):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    real = ck._write_file

    def failing(path, data):
        if path.name == "manifest.json":
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(path))
        real(path, data)

    monkeypatch.setattr(ck, "_write_file", failing)
    with pytest.raises(CheckpointError, match="Disk quota exceeded .*no earlier checkpoint exists"):
        save(manager, 1, model, opt)
    assert list(manager.dir.iterdir()) == []
    assert manager.latest() is None


class Truncating(ck.dcp.FileSystemWriter):
    """Reports success but leaves its data file short (a storage that lost the tail of a write)."""

    def finish(self, metadata, results):
        super().finish(metadata, results)
        data = self.path / "__0_0.distcp"
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)


def test_short_file_is_caught_before_commit(tmp_path, monkeypatch):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    monkeypatch.setattr(ck, "_storage_writer", lambda path: Truncating(str(path)))
    with pytest.raises(CheckpointError, match="was cut short"):
        save(manager, 1, model, opt)
    assert manager.latest() is None and list(manager.dir.iterdir()) == []


def test_incomplete_and_temporary_directories_are_ignored(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    good = save(manager, 3, model, opt)
    # a crash after the rename but before the manifest cannot happen; a copy without one, or a crashed temp dir, can
    broken = manager.dir / "step_00000009"
    shutil.copytree(good, broken)
    (broken / "manifest.json").unlink()
    shutil.copytree(good, manager.dir / ".tmp-step_00000010")
    with pytest.warns(UserWarning, match="names 'step_00000009', which is missing or incomplete; using step_00000003"):
        (manager.dir / "latest").write_text("step_00000009\n")
        assert manager.latest() == good
    (manager.dir / "latest").unlink()
    with pytest.warns(UserWarning, match=r"ignoring incomplete checkpoint directories \['step_00000009'\]"):
        assert manager.latest() == good
    with pytest.raises(CheckpointError, match="is incomplete"):
        CheckpointManager.resolve(broken)
    with pytest.warns(UserWarning):
        model2, opt2, state = load_fresh(manager)
    assert same(model, opt, model2, opt2) and state["step"] == 3
    # the next save removes the stale temporary directory
    save(manager, 4, model, opt)
    assert not (manager.dir / ".tmp-step_00000010").exists()


def test_keep_last_k(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3, 4, 5):
        save(manager, step, model, opt)
    assert [p.name for p in manager.complete()] == ["step_00000004", "step_00000005"]
    keep_all = CheckpointManager(tmp_path / "all", keep=0)
    for step in (1, 2, 3):
        save(keep_all, step, model, opt)
    assert len(keep_all.complete()) == 3


def test_same_step_saved_again_replaces_it(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    save(manager, 3, model, opt, tag="first")
    save(manager, 3, model, opt, tag="second")
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000003"]
    assert load_fresh(manager)[2]["tag"] == "second"


def test_corrupt_file_is_named(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    path = save(manager, 3, model, opt)
    data = path / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError,
                       match=r"__0_0.distcp: sha256 differs from the manifest \(the file is corrupt\)"):
        load_fresh(manager)
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    (path / "state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="state.json: 2 bytes, the manifest says"):
        load_fresh(manager)


def test_format_version_is_checked(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    path = save(manager, 3, model, opt)
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "manifest.json").write_text(json.dumps(manifest | {"format_version": 99}))
    with pytest.raises(CheckpointError, match="checkpoint format version 99; this megakern reads version 1"):
        load_fresh(manager)


def test_cuda_rng_states_are_skipped_where_cuda_is_absent(tmp_path, monkeypatch):
    """A checkpoint written on a GPU machine (CUDA RNG states in its RNG file) loads on a CPU-only one."""
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    real = ck.rng_state
    monkeypatch.setattr(ck, "rng_state", lambda: real() | {"cuda": [torch.zeros(16, dtype=torch.uint8)]})
    save(manager, 3, model, opt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="CUDA RNG states but CUDA is not available here"):
        model2, opt2, _ = load_fresh(manager)
    assert same(model, opt, model2, opt2)


def test_optimizer_state_must_match_by_name():
    model, opt = trained()
    names = {p: n for n, p in model.named_parameters()}
    state = ck.optimizer_state_dict(opt, names)
    assert set(state["state"]) == set(names.values())
    state["state"]["ghost.weight"] = state["state"].pop("fc.weight")
    with pytest.raises(CheckpointError, match=r"missing \['fc.weight'\], unexpected \['ghost.weight'\]"):
        ck.load_optimizer_state_dict(opt, names, state)


def test_init_optimizer_state_leaves_parameters_alone():
    torch.manual_seed(0)
    model = StandIn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    ck.init_optimizer_state(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == len(before)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        CheckpointManager(tmp_path).load(tmp_path / "nothing", {})


# ---------------------------------------------------------------------------------------------------------------
# Faults at every file operation of a save, removals cut short, leftovers cleared at start-up.

class Faults:
    """Counts a save's file operations (ck._write_file, ck._rename, ck._fsync_dir) and fails the ``fail_at``-th
    one as a full disk does (fsync: EIO), and with ``sticky`` every later one of its kind too."""

    def __init__(self, patch, fail_at=None, sticky=False):
        self.ops, self.fail_at, self.sticky, self.failed = [], fail_at, sticky, None
        for kind in ("_write_file", "_rename", "_fsync_dir"):
            patch.setattr(ck, kind, self._wrap(kind, getattr(ck, kind)))

    def _wrap(self, kind, real):
        def op(*args):
            self.ops.append(f"{kind}({', '.join(Path(a).name for a in args if isinstance(a, Path))})")
            if len(self.ops) - 1 == self.fail_at or (self.sticky and self.failed == kind):
                self.failed = kind
                code = errno.EIO if kind == "_fsync_dir" else errno.ENOSPC
                raise OSError(code, os.strerror(code), str(args[0]))
            return real(*args)
        return op


def hidden(manager):
    return sorted(p.name for p in manager.dir.iterdir() if p.name.startswith("."))


@pytest.mark.parametrize("same_step", [False, True], ids=["new-step", "same-step"])
def test_a_fault_at_any_file_operation_leaves_latest_and_the_message_true(tmp_path, same_step):
    """ENOSPC (EIO for syncs) at each write, rename and directory sync of a save (renames also from there on, so
    that undoing fails too): afterwards `latest` names a complete checkpoint, the previous or the new one, the error
    says which and what else is on disk, and after the next start's clearing the same checkpoint loads."""
    old_model, old_opt = trained()
    new_model, new_opt = trained(steps=5)
    step = 3 if same_step else 5

    def attempt(directory, fail_at=None, sticky=False):
        lines = []
        manager = CheckpointManager(directory, keep=1, log=lines.append)
        previous = save(manager, 3, old_model, old_opt, tag="previous")
        with pytest.MonkeyPatch.context() as patch:
            faults = Faults(patch, fail_at, sticky)
            try:
                save(manager, step, new_model, new_opt, tag="new")
                error = None
            except CheckpointError as exc:
                error = str(exc)
        return manager, previous, faults.ops, error, lines

    ops = attempt(tmp_path / "dry")[2]
    assert any(".tmp-latest" in op for op in ops) and len(ops) >= 10, ops
    cases = [(i, False) for i in range(len(ops))] + [(i, True) for i, op in enumerate(ops) if "_rename" in op]
    for i, sticky in cases:
        manager, previous, _, error, lines = attempt(tmp_path / f"{sticky}-{i}", i, sticky)
        case = f"fault at {ops[i]} (op {i}, sticky {sticky}): {error}; log {lines}"
        final, tmp = manager.dir / ck.step_name(step), manager.dir / f".tmp-{ck.step_name(step)}"
        named = (manager.dir / "latest").read_text().strip()
        if error is None:  # the commit went through; only a removal after it failed (logged)
            expect = "new"
            assert manager.latest() == final and named == final.name, case
            assert all(any(name in line for line in lines) for name in hidden(manager)), case
        else:
            assert f"saving checkpoint step {step} to {manager.dir} failed: " in error, case
            assert "No space left on device" in error or "Input/output error" in error, case
            assert ("the temporary directory is left" in error) == tmp.exists(), case
            assert tmp.exists() or "the temporary directory was removed" in error or (
                "the new checkpoint was removed" in error and sticky) or (
                "no temporary directory is left" in error and final.exists()), case
            stories = {"new": f"the new checkpoint {final} is complete and `latest` names it" in error,
                       "previous": f"the previous checkpoint {previous} is intact and `latest` names it" in error,
                       "none": "no checkpoint is in place" in error}
            assert sum(stories.values()) == 1, case
            expect = "new" if stories["new"] else "previous"
            if stories["none"]:  # renames failing from the first one on: the set-aside checkpoint is put back
                assert same_step and sticky and manager.latest(warn=False) is None, case
                assert f"{ck.REPLACED_PREFIX}{final.name} holds" in error and "moves it back" in error, case
            else:
                assert named == manager.latest().name, case
                assert load_fresh(manager)[2]["tag"] == expect, case
            assert all(name in error for name in hidden(manager)), case
        manager.remove_leftovers()
        assert hidden(manager) == [], case
        model, opt, state = load_fresh(manager)
        assert state["tag"] == expect and state["path"] == str(manager.dir / named), case
        assert same(model, opt, *((new_model, new_opt) if expect == "new" else (old_model, old_opt))), case


def test_enospc_writing_latest_removes_the_new_checkpoint_and_says_so(tmp_path, monkeypatch):
    """The full disk found by the pointer's text: it is written before any rename, so nothing new is in place."""
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    good = save(manager, 3, model, opt, tag="previous")
    real = ck._write_file

    def full(path, data):
        if path.name == ".tmp-latest":
            real(path, data[:1])
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(ck, "_write_file", full)
    with pytest.raises(CheckpointError) as info:
        save(manager, 5, model, opt, tag="new")
    assert str(info.value).endswith(f"the temporary directory was removed and the previous checkpoint {good} is "
                                    "intact and `latest` names it")
    assert "committing" in str(info.value) and ".tmp-latest" in str(info.value)
    assert sorted(p.name for p in manager.dir.iterdir()) == ["latest", "step_00000003"]
    monkeypatch.undo()
    assert load_fresh(manager)[2]["tag"] == "previous"


KILLED_WHILE_PRUNING = r"""
import os, signal, sys
import torch
from megakern.checkpoint import CheckpointManager

def arm(line):  # once the removal of the old checkpoint begins: SIGKILL after its first data file is gone
    if line.startswith("removing checkpoint"):
        real = os.unlink
        def unlink(path, *args, **kwargs):
            real(path, *args, **kwargs)
            if os.path.basename(os.fsdecode(path)) != "manifest.json":
                os.kill(os.getpid(), signal.SIGKILL)
        os.unlink = unlink

torch.manual_seed(1)
CheckpointManager(sys.argv[1], keep=1, log=arm).save(2, {"w": torch.randn(64, 64)}, state={"tag": "new"})
print("the save returned: no removal happened")
"""


def test_a_removal_killed_midway_never_looks_complete(tmp_path):
    """A real SIGKILL while keep=1 deletes the previous checkpoint's files: what is left is hidden, never a step
    directory with its manifest and without its data; resume takes the new checkpoint; the next start clears it."""
    directory = tmp_path / "ckpt"
    files = {f"extra{i:02d}.bin": bytes(range(256)) * 64 for i in range(24)}
    CheckpointManager(directory).save(1, {"w": torch.zeros(64, 64)}, state={"tag": "old"}, files=files)
    proc = subprocess.run([sys.executable, "-c", KILLED_WHILE_PRUNING, str(directory)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    manager = CheckpointManager(directory)
    for path in manager.complete():  # whatever looks complete is complete
        for name, entry in ck.read_manifest(path)["files"].items():
            CheckpointManager._check_file(path, name, entry)
    assert [p.name for p in manager.complete()] == ["step_00000002"] and manager.latest() == directory / "step_00000002"
    assert hidden(manager) == [".removing-step_00000001"]
    left = len(list((directory / ".removing-step_00000001").iterdir()))
    assert 0 < left < len(files) + 5  # cut short partway
    tree = {"w": torch.empty(64, 64)}
    torch.manual_seed(1)
    expected = torch.randn(64, 64)
    assert manager.load(directory, tree)["tag"] == "new" and torch.equal(tree["w"], expected)
    lines = []
    manager = CheckpointManager(directory, log=lines.append)
    assert manager.remove_leftovers() == [directory / ".removing-step_00000001"]
    assert lines == [f"removed {directory / '.removing-step_00000001'}, left by an interrupted removal"]
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_00000002"]


def test_leftovers_are_cleared_at_start_not_only_at_the_next_save(tmp_path):
    """What killed saves leave: temporary directories and pointer text removed, a removal's remains removed, a
    checkpoint set aside by a same-step save moved back where its step is missing and removed where it is not."""
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt", keep=0)
    one, three = save(manager, 1, model, opt, tag="one"), save(manager, 3, model, opt, tag="three")
    d = manager.dir
    shutil.copytree(one, d / ".tmp-step_00000004")
    (d / ".tmp-latest").write_text("step_00000004\n")
    shutil.copytree(one, d / ".removing-step_00000000")
    shutil.copytree(one, d / ".replaced-step_00000001")  # step 1 saved again and completed: the old copy goes
    three.rename(d / ".replaced-step_00000003")  # killed between a same-step save's renames: step 3 comes back
    lines = []
    restarted = CheckpointManager(d, log=lines.append)
    assert restarted.latest(warn=False) == one  # `latest` names step 3, which is set aside
    acted = restarted.remove_leftovers()
    assert sorted(p.name for p in acted) == [".removing-step_00000000", ".replaced-step_00000001",
                                             ".replaced-step_00000003", ".tmp-latest", ".tmp-step_00000004"]
    assert len(lines) == 5 and lines[2].startswith(f"moved {d / '.replaced-step_00000003'} back to {three}: ")
    assert lines[1] == (f"removed {d / '.replaced-step_00000001'}, set aside by a save of the same step, which "
                        "completed")
    assert sorted(p.name for p in d.iterdir()) == ["latest", "step_00000001", "step_00000003"]
    assert restarted.latest() == three and load_fresh(restarted)[2]["tag"] == "three"
    assert restarted.remove_leftovers() == [] and len(lines) == 5


KILLED_BEFORE_LATEST = r"""
import os, signal, sys
import torch
from megakern import checkpoint as ck

real = ck._rename
def rename(src, dst):  # SIGKILL at the commit's last rename: the new checkpoint in place, `latest` not yet
    if os.path.basename(src) == ".tmp-latest":
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)

manager = ck.CheckpointManager(sys.argv[1])
manager.save(1, {"w": torch.zeros(8)}, state={"tag": "old"})
ck._rename = rename
manager.save(2, {"w": torch.ones(8)}, state={"tag": "new"})
"""


def test_a_commit_killed_before_latest_is_finished_at_the_next_start(tmp_path):
    """A real SIGKILL between the rename of the new checkpoint and the rename of the pointer: the pointer's text
    (written only once every rank's files are verified) names a complete checkpoint, so the next start finishes the
    commit instead of throwing it away, and a resume takes the new checkpoint."""
    directory = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-c", KILLED_BEFORE_LATEST, str(directory)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert (directory / "latest").read_text().strip() == "step_00000001"
    assert (directory / ".tmp-latest").read_text().strip() == "step_00000002"
    lines = []
    manager = CheckpointManager(directory, log=lines.append)
    assert manager.remove_leftovers() == [directory / ".tmp-latest"]
    assert lines == [f"completed the commit of {directory / 'step_00000002'}, interrupted before `latest` named it: "
                     "it does now"]
    assert manager.latest() == directory / "step_00000002" and hidden(manager) == []
    tree = {"w": torch.empty(8)}
    assert manager.load(directory, tree)["tag"] == "new" and torch.equal(tree["w"], torch.ones(8))
    # pointer text naming something incomplete (a commit undone) is removed, not followed
    (directory / ".tmp-latest").write_text("step_00000007\n")
    (directory / "step_00000007").mkdir()
    assert manager.remove_leftovers() == [directory / ".tmp-latest"]
    assert manager.latest(warn=False) == directory / "step_00000002"


def test_extra_files_cannot_take_the_checkpoints_own_names(tmp_path):
    model, opt = trained()
    manager = CheckpointManager(tmp_path / "ckpt")
    for name in ("manifest.json", "state.json", "rng-rank00000.pt", "__0_0.distcp", "../outside.txt", ""):
        t, _ = tree(model, opt)
        with pytest.raises(CheckpointError, match=rf"capturing the RNG states and the state: save\(files=\.\.\.\): "
                                                  rf"{re.escape(repr(name))} is not a plain file name"):
            manager.save(1, t, state={}, files={name: "x"})
    assert not manager.dir.exists() and not (tmp_path / "outside.txt").exists()
