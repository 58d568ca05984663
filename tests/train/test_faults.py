"""The training program under faults, on CPU: nothing lost, and every fault a clear line.

Data files changed during a run, two runs in one directory, ranks whose clocks differ or that see other paths,
SIGTERM / SIGINT (real signals to a real process, one rank of two included), step timings around evals and saves,
start-up errors (a missing rank, an extreme blend, an eval the held-out set cannot feed) reaching stderr and the log,
and a resume with a longer train.steps keeping the checkpoint's schedule.
"""
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from megakern.train.log import read_records
from megakern.checkpoint import CheckpointManager
from megakern.config import ConfigError
from megakern.data import DataError
from megakern.train.run_dir import RunDirError, RunLock
from megakern.train.schedule import lr_at
from megakern.train.stopping import EXIT_INTERRUPTED
from ports import free_port
from test_train import REPO, TINY, _small_dataset, data_cache, trainer  # noqa: F401 (fixture)
from benchmarks.common import run_launch, stop_launch

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _complete(ckpt_dir: Path) -> list[str]:
    return [p.name for p in CheckpointManager(ckpt_dir).complete()]


# ---------------------------------------------------------------------------------------------------------------
# Data files changed under a run.

@pytest.mark.parametrize("how", ["in place", "replaced"])
def test_data_rewritten_during_a_run_stops_it_before_any_checkpoint_records_it(tmp_path, data_cache, how):
    """The .bin rewritten after step 3 of 8 (in place with its mtime restored, or replaced by a rename): the run
    stops at the check after the step that could first read it, naming the file, and the checkpoint due at step 4
    is not written; the one of step 2 stays the latest."""
    prefix = _small_dataset(tmp_path / "d", 1)
    t = trainer(tmp_path, data_cache, *TINY, f"data.paths=[{prefix}]", "train.steps=8", "eval.every=0",
                "checkpoint.every=2", "train.micro_batch_size=2", "model.max_seqlen=32")
    bin_path = prefix.with_name("d.bin")
    step_once = t.train_step

    def step_and_rewrite(batches):
        figures = step_once(batches)
        if t.step == 2:  # the third step is about to start: the file changes under it
            st = bin_path.stat()
            if how == "in place":
                data = bytearray(bin_path.read_bytes())
                data[-200:] = np.full(100, ord("z"), dtype=np.uint16).tobytes()
                with open(bin_path, "r+b") as f:
                    f.write(data)
                os.utime(bin_path, ns=(st.st_atime_ns, st.st_mtime_ns))
            else:
                _small_dataset(tmp_path / "other", 7)
                os.replace(tmp_path / "other.bin", bin_path)
        return figures

    t.train_step = step_and_rewrite
    with pytest.raises(DataError, match=rf"d\.bin: changed on disk since it was opened .* stopped after step 3, no "
                                        "checkpoint of it written"):
        t.run()
    assert _complete(tmp_path / "run" / "checkpoints") == ["step_00000002"]
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    log = (tmp_path / "run" / "train.log").read_text()
    assert "error: DataError: " in log and "d.bin: changed on disk" in log


def test_data_check_costs_microseconds(tmp_path):
    """What the check after every step costs: a stat of the .bin and the .idx (here well under a millisecond)."""
    from megakern.data import IndexedDataset

    ds = IndexedDataset(_small_dataset(tmp_path / "d", 1))
    start = time.perf_counter_ns()
    for _ in range(1000):
        ds.check_unmodified()
    assert (time.perf_counter_ns() - start) / 1000 < 1e6  # ns per check; typically 5-20 us


# ---------------------------------------------------------------------------------------------------------------
# One run per directory.

def test_second_run_in_the_same_directory_is_refused_and_writes_nothing(tmp_path, data_cache):
    first = trainer(tmp_path, data_cache, *TINY, "train.steps=2", "eval.every=0")
    log = tmp_path / "run" / "train.log"
    before = log.read_text()
    with pytest.raises(RunDirError, match=rf"the run directory {tmp_path / 'run'} is in use by another run \(pid "
                                          rf"{os.getpid()} on .*\); choose another directory"):
        trainer(tmp_path, data_cache, *TINY, "train.steps=2", "eval.every=0", name="run")
    assert log.read_text() == before  # the second run wrote nothing into the first one's log
    # the same checkpoint directory under two run directories: refused too
    other = trainer(tmp_path, data_cache, *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}", name="other")
    with pytest.raises(RunDirError, match=rf"the checkpoint directory \(checkpoint.dir\) {tmp_path / 'ckpt'} is in "
                                          "use by another run"):
        trainer(tmp_path, data_cache, *TINY, f"checkpoint.dir={tmp_path / 'ckpt'}", name="third")
    assert not (tmp_path / "third" / "train.log").exists()
    other.close()
    first.run()  # released at the end of the run
    second = trainer(tmp_path, data_cache, *TINY, "train.steps=2", "eval.every=0", name="run")
    second.close()
    assert f"was last held by pid {os.getpid()}" in log.read_text()


def test_lock_of_a_killed_run_is_recognised_as_stale(tmp_path):
    """A run killed with SIGKILL holds no lock (the kernel drops it): the next run takes the directory and names
    the dead holder."""
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from megakern.train.run_dir import RunLock
        lock = RunLock({str(tmp_path / 'run')!r}, "run directory")
        print("locked", flush=True)
        time.sleep(600)
        """)], stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {holder.pid} on "):
            RunLock(tmp_path / "run", "run directory")
    finally:
        holder.kill()
        holder.wait()
    lock = RunLock(tmp_path / "run", "run directory")
    assert lock.previous["pid"] == holder.pid
    lock.release()


RANK_HARNESS = """
import datetime, json, os, sys
import torch.distributed as dist
from megakern.train import run_dir

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
out = {}

real = datetime.datetime


class Skewed(real):  # rank 1's clock runs 5 s ahead
    @classmethod
    def now(cls, tz=None):
        return real.now(tz) + datetime.timedelta(seconds=5 * rank)


run_dir.datetime.datetime = Skewed
dirs = run_dir.claim_run_dirs(None, None, writer=rank == 0, distributed=True)
out["fresh"] = [str(dirs.run_dir), str(dirs.ckpt_dir)]
dirs.release()

if rank == 1:  # a rank started elsewhere sees the relative directory somewhere else
    os.makedirs("elsewhere", exist_ok=True)
    os.chdir("elsewhere")
try:
    run_dir.claim_run_dirs("relative-run", None, writer=rank == 0, distributed=True)
    out["cwd"] = "no error"
except run_dir.RunDirError as exc:
    out["cwd"] = str(exc)
if rank == 1:
    os.chdir("..")

held = run_dir.RunLock("busy", "run directory") if rank == 0 else None
dist.barrier()
try:
    run_dir.claim_run_dirs("busy", None, writer=rank == 0, distributed=True)
    out["busy"] = "no error"
except run_dir.RunDirError as exc:
    out["busy"] = str(exc)
with open(f"rank{rank}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_ranks_share_the_run_directory_rank_zero_names(tmp_path):
    """Two gloo ranks whose clocks are 5 s apart get one run directory (rank 0's); a rank that sees the directory
    at another absolute path stops both with both paths named; a directory rank 0 cannot lock stops both."""
    (tmp_path / "harness.py").write_text(RANK_HARNESS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
           str(tmp_path / "harness.py")]
    proc = run_launch(cmd, cwd=tmp_path, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["fresh"] == r1["fresh"] and r0["fresh"][0].startswith("runs/")
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [Path(r0["fresh"][0]).name]
    for got in (r0["cwd"], r1["cwd"]):
        assert (f"rank 0 has run directory {tmp_path / 'relative-run'}" in got
                and f"rank 1 has {tmp_path / 'elsewhere' / 'relative-run'}" in got)
    assert r0["busy"].startswith(f"the run directory busy is in use by another run (pid ")
    assert r1["busy"].startswith("rank 0: the run directory busy is in use")


# ---------------------------------------------------------------------------------------------------------------
# Signals: finish the step, save, exit with EXIT_INTERRUPTED; a second signal exits at once.

_STARTED: list[subprocess.Popen] = []


@pytest.fixture(autouse=True)
def _nothing_left_running():
    """A run ``_start`` started that is still going when its test ends (a failed assertion, a timeout) is stopped
    with its ranks."""
    yield
    while _STARTED:
        proc = _STARTED.pop()
        if proc.poll() is None:
            stop_launch(proc, grace=10.0)


def _start(tmp_path: Path, data_cache: Path, *overrides, ranks: int = 1, patch: str = ""):
    """megakern-train in a process of its own (or ``ranks`` under torchrun), in a session of its own, each rank
    writing its pid to pid<rank>; ``patch``: Python run in the process first (to slow something down)."""
    args = [*TINY, "schedule.decay=constant", "train.steps=3000", "eval.every=0", "log.every=1",
            f"data.cache_dir={data_cache}", f"log.run_dir={tmp_path / 'run'}", *overrides]
    (tmp_path / "main.py").write_text(f"import os, sys\nfrom megakern import train\n{patch}\n"
                                      "open(f'pid{os.environ.get(\"RANK\", 0)}', 'w').write(str(os.getpid()))\n"
                                      "sys.exit(train.main(sys.argv[1:]))\n")
    launch = ([] if ranks == 1 else
              ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone"])
    cmd = [sys.executable, *launch, str(tmp_path / "main.py"), *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)
    _STARTED.append(proc)
    return proc


def _wait_for_step(tmp_path: Path, step: int, proc, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = tmp_path / "run" / "train.log"
        if log.is_file() and any(r.get("step", 0) >= step for r in read_records(tmp_path / "run")):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    stop_launch(proc, grace=10.0)
    pytest.fail(f"no step {step} within {timeout} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_finishes_the_step_saves_and_resumes_exactly(tmp_path, data_cache, sig):
    proc = _start(tmp_path, data_cache)
    _wait_for_step(tmp_path, 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in err
    log = (tmp_path / "run" / "train.log").read_text()
    name = sig.name
    stopped = [line for line in log.splitlines() if line.startswith(f"stopped by {name} after step ")]
    assert len(stopped) == 1, log[-2000:]
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert _complete(tmp_path / "run" / "checkpoints") == [ckpt.name]
    assert f"continue with checkpoint.resume={tmp_path / 'run' / 'checkpoints'}" in stopped[0]
    logged = {r["step"]: r["train/loss"] for r in read_records(tmp_path / "run") if "train/loss" in r}
    assert max(logged) == step  # every finished step logged, none after the checkpoint

    common = [*TINY, "schedule.decay=constant", "eval.every=0", f"train.steps={step + 2}"]
    resumed = trainer(tmp_path, data_cache, *common, f"checkpoint.resume={ckpt}", name="resumed").run()
    whole = trainer(tmp_path, data_cache, *common, "checkpoint.final=false", name="whole").run()
    assert [resumed.losses[s] for s in (step + 1, step + 2)] == [whole.losses[s] for s in (step + 1, step + 2)]
    assert [logged[s] for s in range(1, step + 1)] == [whole.losses[s] for s in range(1, step + 1)]


SLOW_SAVE = """
import time
from megakern import checkpoint
_hash_share = checkpoint.CheckpointManager._hash_share
def _slow(self, *args):
    open("saving", "w").close()
    time.sleep(60)
    return _hash_share(self, *args)
checkpoint.CheckpointManager._hash_share = _slow
"""


def test_second_signal_exits_at_once_without_a_traceback(tmp_path, data_cache):
    """The first SIGTERM starts the stop's checkpoint (a save made slow here); a second one, mid-save, ends the
    process within seconds: no traceback, exit EXIT_INTERRUPTED, the half-written checkpoint's temporary directory
    removed and no incomplete checkpoint left looking complete."""
    proc = _start(tmp_path, data_cache, patch=SLOW_SAVE)
    _wait_for_step(tmp_path, 2, proc)
    proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 120
    while not (tmp_path / "saving").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    second = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert time.monotonic() - second < 30  # the save sleeps 60 s: well inside that, with slack for a loaded machine
    assert proc.returncode == EXIT_INTERRUPTED
    assert "Traceback" not in err and "second signal (SIGTERM): exiting now, without a checkpoint" in err, err
    assert "megakern-train: stopped: SIGTERM (second signal): stopped without saving" in err
    log = (tmp_path / "run" / "train.log").read_text()
    assert "stopped: SIGTERM (second signal): stopped without saving" in log
    ckpts = tmp_path / "run" / "checkpoints"
    assert _complete(ckpts) == [] and not list(ckpts.glob(".tmp-*"))


def _two_ranks(device: str) -> list[str]:
    """Overrides for two data-parallel ranks on ``device`` (gloo on CPUs; NCCL, a GPU each, where two exist)."""
    pytest.importorskip("megakern.parallel")
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            pytest.skip(f"needs 2 GPUs, this machine has {torch.cuda.device_count()}")
    return ["parallel.dp=2", "parallel.dp_shard=ddp", "train.micro_batch_size=4", f"train.device={device}"]


TWO_RANK_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", TWO_RANK_DEVICES)
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(tmp_path, data_cache, device):
    """SIGTERM reaches rank 1 of 2 only (as when one node is preempted): both ranks finish the same step, save one
    checkpoint together, and exit with EXIT_INTERRUPTED."""
    proc = _start(tmp_path, data_cache, *_two_ranks(device), ranks=2)
    _wait_for_step(tmp_path, 3, proc)
    os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0  # torchrun reports its workers' exit code 75 as a failure
    assert f"exitcode  : {EXIT_INTERRUPTED}" in err or f"exit code {EXIT_INTERRUPTED}" in out + err, err[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    assert "rank 1 received SIGTERM" in log
    stopped = [line for line in log.splitlines() if line.startswith("stopped by SIGTERM after step ")]
    assert len(stopped) == 1
    step = int(stopped[0].split("after step ")[1].split(":")[0])
    ckpt = tmp_path / "run" / "checkpoints" / f"step_{step:08d}"
    assert _complete(tmp_path / "run" / "checkpoints") == [ckpt.name]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert {"rng-rank00000.pt", "rng-rank00001.pt"} <= set(manifest["files"])


HANG_RANK_1 = """
import time
_step = train.Trainer.train_step
def _train_step(self, batches):
    if os.environ["RANK"] == "1" and self.step == 3:
        time.sleep(600)
    return _step(self, batches)
train.Trainer.train_step = _train_step
"""


@pytest.mark.parametrize("device", TWO_RANK_DEVICES)
def test_a_hung_rank_is_named_in_the_log_within_the_step_timeout(tmp_path, data_cache, device):
    """Rank 1 of 2 hangs in step 4: within parallel.step_timeout_s (and well before the collectives' timeout)
    the run's log names rank 1 as alive and stuck in step 4, and every rank ends with the watchdog's exit code
    (over NCCL too, whose communicators the watchdog aborts)."""
    overrides = _two_ranks(device)
    from megakern.parallel.watchdog import EXIT_CODE

    start = time.monotonic()
    proc = _start(tmp_path, data_cache, *overrides, "parallel.step_timeout_s=4", "parallel.init_timeout_s=120",
                  ranks=2, patch=HANG_RANK_1)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode != 0 and time.monotonic() - start < 100
    assert f"exitcode  : {EXIT_CODE}" in err, err[-3000:]
    log = (tmp_path / "run" / "train.log").read_text()
    line = [x for x in log.splitlines() if x.startswith("error: step watchdog: ")]
    assert len(line) == 1 and "rank 1 " in line[0] and "is still in step 4" in line[0] and "alive, stuck" in line[0]


# ---------------------------------------------------------------------------------------------------------------
# Every logged figure belongs to its step.

def test_step_timings_belong_to_their_steps(tmp_path, data_cache):
    """Step 5 of 8 takes 3 s longer (its data is slow): its logged time says so, and its neighbours' do not; the
    steps right before an eval and a save (2, 4, 6) are timed like any other, not as ~0."""
    t = trainer(tmp_path, data_cache, *TINY, "train.steps=8", "eval.every=2", "checkpoint.every=4",
                "train.micro_batch_size=2")
    step_once = t.train_step

    def slow_fifth(batches):
        if t.step == 4:
            time.sleep(3.0)
        return step_once(batches)

    t.train_step = slow_fifth
    t.run()
    ms = {r["step"]: r["perf/step_ms"] for r in read_records(tmp_path / "run") if "perf/step_ms" in r}
    assert sorted(ms) == list(range(1, 9))
    assert ms[5] >= 3000
    assert ms[4] < ms[5] - 2000 and ms[6] < ms[5] - 2000, ms  # the sleep is credited to step 5 alone
    assert all(ms[s] > 1.0 for s in ms), ms  # a tiny model's step is milliseconds; 0.2 ms was a misattribution


# ---------------------------------------------------------------------------------------------------------------
# Start-up errors: one line on stderr, the same in train.log, nothing half-made left behind.

def test_extreme_blend_is_a_config_error_with_the_key_that_allows_it(tmp_path, data_cache):
    a, b = _small_dataset(tmp_path / "a", 1), _small_dataset(tmp_path / "b", 2)
    cmd = [sys.executable, "-m", "megakern.train", *TINY, f"data.paths=[{a}, {b}]", "data.weights=[1e6, 0.001]",
           "train.steps=2", f"data.cache_dir={data_cache}", f"log.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    line = [x for x in proc.stderr.splitlines() if x.startswith("megakern-train: error: ")]
    assert len(line) == 1 and "data.weights [1000000.0, 0.001]" in line[0]
    assert "set data.allow_extreme_weights=true" in line[0]
    assert line[0].split("error: ", 1)[1] in (tmp_path / "run" / "train.log").read_text()
    # allowed, the ratio passes; what the blend can then give is the next check, naming the keys again
    with pytest.raises(ConfigError, match=r"dataset 1 \(weight 1e-09\) would get 0 of 8 samples; raise train.steps "
                                          "or train.global_batch_size or drop it from the blend"):
        trainer(tmp_path, data_cache, *TINY, f"data.paths=[{a}, {b}]", "data.weights=[1e6, 0.001]",
                "data.allow_extreme_weights=true", "train.steps=1", name="allowed")


def test_eval_the_held_out_set_cannot_feed_names_the_keys(tmp_path, data_cache):
    with pytest.raises(DataError, match=r"the held-out set cannot supply what eval reads \(40000 samples of 64 "
                                        r"tokens.*Lower eval.batches or eval.micro_batch_size.*data.valid_fraction, "
                                        r"now 0.05\), or set eval.every=0"):
        trainer(tmp_path, data_cache, *TINY, "eval.batches=5000")
    assert "error: DataError: the held-out set cannot supply" in (tmp_path / "run" / "train.log").read_text()


def test_a_rank_that_never_comes_is_an_error_line(tmp_path, data_cache):
    """Rank 0 of a world of 2 whose rank 1 never starts: one error line naming the missing rank after
    parallel.init_timeout_s, no traceback, no run directory made."""
    pytest.importorskip("megakern.parallel")
    env = {**ENV, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    cmd = [sys.executable, "-m", "megakern.train", *TINY, "parallel.dp=2", "parallel.init_timeout_s=3",
           f"data.cache_dir={data_cache}", f"log.run_dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith("megakern-train: error: rendezvous at tcp://127.0.0.1:") and proc.stderr.count("\n") == 1
    assert "ranks [1] of 2 did not join within 3 s" in proc.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.gpu
def test_gpu_eval_micro_batch_that_does_not_fit_stops_the_run_after_its_first_step(tmp_path, data_cache):
    """Contract 28: an eval micro-batch of 64x a training one's tokens, on a GPU limited to 256 MiB, runs out of
    memory in the probe right after step 1 (not at the first eval), as a ConfigError naming the keys; one that fits
    is logged as fitting."""
    import torch

    common = [*TINY, "train.device=cuda", "train.cuda_graph=false", "model.n_embd=512", "model.n_head=8",
              "train.steps=6", "eval.every=6",
              "data.valid_fraction=0.2", "checkpoint.final=false"]
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(256 * 2**20 / total)
    try:
        big = trainer(tmp_path, data_cache, *common, "eval.micro_batch_size=512", "eval.batches=1", name="big")
        with pytest.raises(ConfigError, match=r"eval's micro-batch of 512 x 64 tokens \(training's: 8 x 64\) does not "
                                              r"fit in the memory training leaves .*lower eval.micro_batch_size"):
            big.run()
        assert max(r["step"] for r in read_records(tmp_path / "big") if "train/loss" in r) == 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    trainer(tmp_path, data_cache, *common, "eval.micro_batch_size=16", "eval.batches=1", name="fits").run()
    assert "eval memory: a micro-batch of 16 x 64 tokens fits beside training" in (
        tmp_path / "fits" / "train.log").read_text()


# ---------------------------------------------------------------------------------------------------------------
# A resume keeps the checkpoint's LR schedule unless schedule.on_resume=config.

@pytest.mark.parametrize("on_resume", ["checkpoint", "config"])
def test_resume_with_more_steps_keeps_the_schedule(tmp_path, data_cache, on_resume):
    common = [*TINY, "eval.every=0", "schedule.warmup_steps=2", "optim.lr=1e-2", "schedule.min_lr=1e-3"]
    trainer(tmp_path, data_cache, *common, "train.steps=6", name="first").run()
    ckpt = tmp_path / "first" / "checkpoints"
    trainer(tmp_path, data_cache, *common, "train.steps=10", f"checkpoint.resume={ckpt}",
            f"schedule.on_resume={on_resume}", name="longer").run()
    lrs = {r["step"]: r["train/lr"] for r in read_records(tmp_path / "longer") if "train/lr" in r}
    kwargs = dict(lr=1e-2, warmup_steps=2, min_lr=1e-3)
    total = 6 if on_resume == "checkpoint" else 10
    for step in range(7, 11):
        assert math.isclose(lrs[step], lr_at(step - 1, total_steps=total, **kwargs), rel_tol=1e-9)
    log = (tmp_path / "longer" / "train.log").read_text()
    if on_resume == "checkpoint":
        assert all(math.isclose(lrs[s], 1e-3) for s in range(7, 11))
        assert ("train.steps 10 runs past the checkpoint's schedule, which ends at step 6: steps 7..10 run at its "
                "final lr 1.000e-03") in log
        assert "LR schedule from here: step 7 at lr 1.000e-03, past the schedule's end (step 6)" in log
    else:
        assert "schedule.on_resume=config: this run's LR schedule applies from step 7" in log
        assert "LR schedule from here: step 7 at lr" in log and "cosine decay to 1.000e-03 at step 10" in log
    assert f"this run logs to {tmp_path / 'longer'} and saves checkpoints to {tmp_path / 'longer' / 'checkpoints'}" \
        f" (the checkpoint's own directory {ckpt} is only read)" in log


def test_profile_on_a_cpu_prints_no_error(tmp_path, data_cache):
    """--profile on a CPU: no ERROR line (with a CUDA build of torch on a machine without a GPU, libkineto logs a
    spurious "gpuGetDeviceCount failed" when the profiler starts unless its log level is raised first)."""
    env = {k: v for k, v in ENV.items() if k != "KINETO_LOG_LEVEL"}
    cmd = [sys.executable, "-m", "megakern.train", "--profile", *TINY, f"data.cache_dir={data_cache}",
           f"log.run_dir={tmp_path / 'run'}", f"log.profile_dir={tmp_path / 'profiles'}"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in (proc.stdout + proc.stderr).splitlines() if "ERROR" in line]
    assert "profile: " in proc.stdout


def test_config_keys_of_the_fault_handling_are_documented():
    from megakern.config import describe_fields

    text = describe_fields()
    for key in ("data.allow_extreme_weights", "schedule.on_resume"):
        assert key in text
    with pytest.raises(ConfigError, match="schedule.on_resume"):
        from megakern.config import load_config

        load_config(None, ["schedule.on_resume=sometimes"])
