"""Checkpoints: round trip, the ENOSPC drill, incomplete and corrupt directories, keep-K, versions, CPU-only loads."""
import errno
import json
import random
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from megakern import checkpoint as ck
from megakern.checkpoint import CheckpointError, CheckpointManager


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
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: sha256 differs from the manifest \(the file is corrupt\)"):
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
