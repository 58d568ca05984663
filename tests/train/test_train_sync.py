"""The training step without host-device syncs: with fused AdamW a non-finite step is skipped on the device
(found_inf), the step's figures are read one step later (after the next step is queued), and nothing in the step
reads a device value on the host. Skip-and-count and the halt after train.max_nonfinite hold on both paths (fused:
skipped on the device; foreach: read and skipped on the host). On a CPU host reads are counted (tests/host_reads.py);
on a GPU the step runs under torch.cuda.set_sync_debug_mode("error")."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from host_reads import host_reads
from test_train import TINY, data_cache, trainer  # noqa: F401 (data_cache: the module's shared data fixture)

from megakern.train import StepFigures, TrainingHalted, device_skip
from megakern.train.loop import Loop

# the training program's own files (megakern/train/): where its host reads are counted
TRAINER_FILES = {p.name for p in (Path(__file__).parents[2] / "megakern" / "train").glob("*.py")}


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_nonfinite_steps_are_skipped_counted_then_halt(tmp_path, data_cache, impl):  # noqa: F811
    t = trainer(tmp_path, data_cache, *TINY, "train.steps=9", "eval.every=0", "train.max_nonfinite=3",
                "checkpoint.final=false", f"optim.fused={impl}")
    assert t.stepper.device_skip == (impl == "fused")
    forward, calls, poisoned = t.stepper.pmodel.forward_backward, [0], {3, 4}

    def sometimes_nan(*args, **kwargs):
        calls[0] += 1
        loss = forward(*args, **kwargs)
        return loss * float("nan") if calls[0] in poisoned else loss

    t.stepper.pmodel.forward_backward = sometimes_nan
    before, original_step = {}, t.train_step

    def watched(batches):
        before[t.step + 1] = [p.detach().clone() for p in t.model.parameters()]
        return original_step(batches)

    t.train_step = watched
    result = t.run()
    assert result.skipped_steps == [3, 4] and result.final_step == 9 and t.nonfinite_total == 2
    assert math.isnan(result.losses[3]) and math.isfinite(result.losses[5])
    assert all(torch.equal(a, b) for a, b in zip(before[3], before[5]))  # steps 3 and 4 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(before[5], before[6]))
    steps = {int(s["step"]) for s in t.stepper.optimizer.state.values()}
    assert steps == {7}, steps  # the skipped steps did not advance AdamW's step count (its bias correction)
    assert "step 3: non-finite loss nan" in (tmp_path / "run" / "train.log").read_text()

    halting = trainer(tmp_path, data_cache, *TINY, "train.steps=12", "eval.every=0", "train.max_nonfinite=3",
                      f"optim.fused={impl}", name="halt")
    halting_forward = halting.stepper.pmodel.forward_backward
    halting.stepper.pmodel.forward_backward = lambda *a, **k: halting_forward(*a, **k) * float("nan")
    with pytest.raises(TrainingHalted, match=r"3 steps in a row \(steps 1..3\) had a non-finite loss .* lower optim.lr"):
        halting.run()
    assert halting.nonfinite_total == 3 and halting.step <= 4  # stopped one step behind the device at most


def test_fused_and_foreach_paths_train_alike(tmp_path, data_cache):  # noqa: F811
    common = [*TINY, "train.steps=4", "eval.every=0", "checkpoint.final=false"]
    fused = trainer(tmp_path, data_cache, *common, "optim.fused=fused", name="fused").run()
    foreach = trainer(tmp_path, data_cache, *common, "optim.fused=foreach", name="foreach").run()
    assert sorted(fused.losses) == [1, 2, 3, 4]
    for s in range(1, 5):
        assert fused.losses[s] == pytest.approx(foreach.losses[s], abs=1e-5)


def test_figures_are_read_after_the_next_step_is_queued(tmp_path, data_cache, monkeypatch):  # noqa: F811
    t = trainer(tmp_path, data_cache, *TINY, "train.steps=7", "eval.every=3", "checkpoint.every=5",
                "checkpoint.final=false", "optim.fused=fused")
    events, original_step, original_read = [], t.train_step, StepFigures.read

    def launch(batches):
        events.append(("launch", t.step + 1))
        return original_step(batches)

    def read(self):
        events.append(("read", self.step))
        return original_read(self)

    original_eval = Loop.eval

    def evaluate(loop, result):
        events.append(("eval", t.step))
        return original_eval(loop, result)

    t.train_step = launch
    monkeypatch.setattr(Loop, "eval", evaluate)
    monkeypatch.setattr(StepFigures, "read", read)
    result = t.run()
    assert sorted(result.losses) == list(range(1, 8))
    # steps 1, 2, 4: read once the next is queued; 3, 6: read before their eval; 5: before its checkpoint; 7: at the
    # end, before the final eval
    assert events == [("launch", 1), ("launch", 2), ("read", 1), ("launch", 3), ("read", 2), ("read", 3),
                      ("eval", 3), ("launch", 4), ("launch", 5), ("read", 4), ("read", 5), ("launch", 6),
                      ("read", 6), ("eval", 6), ("launch", 7), ("read", 7), ("eval", 7)]
    assert result.checkpoint is not None and (tmp_path / "run" / "checkpoints").is_dir()


@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast"])
def test_fused_step_reads_no_device_value(tmp_path, data_cache, precision):  # noqa: F811
    """The whole step (data, forward, backward, clipping, found_inf, AdamW) reads no tensor value on the host with
    fused AdamW; the foreach path reads its figures once."""
    t = trainer(tmp_path, data_cache, *TINY, "train.steps=4", "eval.every=0", "optim.fused=fused",
                f"train.precision={precision}", "train.grad_clip=0.5")
    assert device_skip(t.stepper.optimizer) and t.stepper.device_skip
    batches = t.batches(t.data.train, 0, t.draw)
    t.stepper.set_training(True)
    first = t.train_step(batches)  # warm-up: optimizer state allocated
    reads = host_reads(t.train_step, batches)
    assert reads == [], reads
    assert all(math.isfinite(v) for v in first.read()[:2])

    host = trainer(tmp_path, data_cache, *TINY, "train.steps=4", "eval.every=0", "optim.fused=foreach", name="host")
    assert not host.stepper.device_skip
    batches = host.batches(host.data.train, 0, host.draw)
    host.train_step(batches)
    # (foreach AdamW also reads its step counts, host tensors for a CUDA model as well: no sync there)
    ours = [what for what, where in host_reads(host.train_step, batches) if where.split(":")[0] in TRAINER_FILES]
    assert ours == ["Tensor.tolist"]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
def test_gpu_training_step_does_not_sync(tmp_path, data_cache, precision):  # noqa: F811
    """A few steps of a tiny model on the GPU under set_sync_debug_mode("error"): any host-device sync in the
    step (data, forward, backward, clipping, skip flag, fused AdamW, the figures' copy) raises."""
    overrides = [o for o in TINY if o != "train.device=cpu"]
    t = trainer(tmp_path, data_cache, *overrides, "train.device=cuda", "train.cuda_graph=false", "train.steps=6",
                "eval.every=0", f"train.precision={precision}", "train.grad_clip=1.0")
    assert t.stepper.device_skip, "fused AdamW expected on CUDA (optim.fused=auto)"
    batches = t.batches(t.data.train, 0, t.draw)
    t.stepper.set_training(True)
    for _ in range(2):  # warm-up: kernels compiled and autotuned, optimizer state allocated, backends probed
        t.train_step(batches).read()
        t.step += 1
    torch.cuda.synchronize()
    figures = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            figures.append(t.train_step(batches))
            t.step += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    values = [f.read() for f in figures]
    assert [f.step for f in figures] == [3, 4, 5]
    assert all(math.isfinite(loss) and math.isfinite(norm) and stepped for loss, norm, stepped in values), values


LAYOUTS = {"dp2-fsdp": ["parallel.dp=2", "parallel.dp_shard=fsdp"],
           "dp2-ddp": ["parallel.dp=2", "parallel.dp_shard=ddp"],
           "tp2": ["parallel.tp=2"], "pp2": ["parallel.pp=2"], "cp2": ["parallel.cp=2"]}


# every probe of the tests below, its own overrides: run one after the other in one launch of 2 ranks
PROBES = {**{layout: ["optim.fused=fused", *overrides] for layout, overrides in LAYOUTS.items()},
          "foreach-dp2-ddp": ["optim.fused=foreach", *LAYOUTS["dp2-ddp"]]}


@pytest.fixture(scope="module")
def probes(tmp_path_factory, data_cache):  # noqa: F811
    """tests/train/parallel_sync_probe.py on 2 gloo ranks (torchrun), one launch for every probe of PROBES: rank 0's
    {device_skip, reads, figures, skipped, unchanged} of one step by probe name, and the launch's output (a probe
    that failed, and those after it, are absent: their tests fail with that output)."""
    import json
    import sys

    from test_train import REPO, launch

    tmp = tmp_path_factory.mktemp("sync-probes")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(REPO / "tests" / "train" / "parallel_sync_probe.py"), *TINY, "train.micro_batch_size=2",
           "train.global_batch_size=8", "train.steps=5", "eval.every=0", "checkpoint.final=false",
           f"data.cache_dir={data_cache}"]
    for name, overrides in PROBES.items():
        cmd += ["--probe", name, *overrides, f"log.run_dir={tmp / name}"]
    proc = launch(cmd, timeout=900)
    results = {r.pop("run"): r for r in map(json.loads, (line for line in proc.stdout.splitlines()
                                                         if line.startswith("{")))}
    return results, f"exit code {proc.returncode}\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"


def _probe(probes, name: str) -> dict:
    """One probe's result, or a failure with the launch's output."""
    results, output = probes
    assert name in results, f"probe {name} gave no result:\n{output}"
    return results[name]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_parallel_fused_step_reads_no_device_value(probes, layout):
    """Over 2 ranks (FSDP2, DDP, tp with sequence parallel, pipeline, context parallel) the step reads no device value
    with fused AdamW either: the model is told the data pipeline checked the ids, the position ids are the
    ParallelModel's own, and a non-finite step is skipped on the device. A NaN in one rank's gradient makes the
    reduced norm NaN on every rank, and no parameter changes anywhere."""
    probe = _probe(probes, layout)
    assert probe["device_skip"] is True
    assert probe["reads"] == [], probe["reads"]
    loss, norm, stepped = probe["figures"]
    assert math.isfinite(loss) and math.isfinite(norm) and stepped
    assert math.isnan(probe["skipped"][1]) and probe["skipped"][2] is False and probe["unchanged"]


def test_parallel_foreach_step_reads_its_figures_once(probes):
    probe = _probe(probes, "foreach-dp2-ddp")
    assert probe["device_skip"] is False
    assert [what for what, where in probe["reads"] if where.split(":")[0] in TRAINER_FILES] == ["Tensor.tolist"]
    assert probe["skipped"][2] is False and probe["unchanged"]
