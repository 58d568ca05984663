"""The step watchdog: a rank stuck in a step, SIGKILLed or frozen (SIGSTOP) is named by the others within the step
timeout, every rank ends with the watchdog's exit code; a normal run says nothing and leaves no thread; the
diagnosis itself (which ranks are named, and how); bad input; the cost per step.

The multi-rank tests run real gloo ranks, forked from a forkserver that has imported megakern.parallel once (a
fresh interpreter takes seconds to import it on a loaded machine)."""
import json
import multiprocessing as mp
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from rankpool import free_port

from megakern.parallel import (WATCHDOG_EXIT_CODE, ParallelDims, ParallelMesh, Rendezvous, StepWatchdog,
                               WatchdogError)
from megakern.parallel.watchdog import Seen, verdict

STEP_TIMEOUT_S, HEARTBEAT_S = 2.0, 0.25  # stale after max(4 * 0.25, 2) = 2 s
STEP_S = 0.3  # each step's "compute": longer than a heartbeat, as real steps are
LATE_S = 6.0  # how long after the step timeout a rank may still be running (scheduling on 2 shared cores)


# ---- ranks in processes --------------------------------------------------------------------------------------------
def _rank(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    """One rank: 5 steps (compute, then an all_reduce) and an eval phase under a watchdog; in step 3 one rank
    misbehaves as ``scenario`` says, mid-step. Writes its log and "@key value" markers to out/rank<r>.log."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    path = Path(out) / f"rank{rank}.log"

    def log(text):
        with open(path, "a") as f:
            f.write(text + "\n")

    def mark(key, value):
        log(f"@{key} {json.dumps(value)}")

    mesh = ParallelDims().build("cpu", timeout=30.0, backend="gloo")
    mark("who", f"{os.uname().nodename}:{os.getpid()}")
    fault, victim = scenario.split(":")
    try:
        with StepWatchdog(mesh, timeout_s=STEP_TIMEOUT_S, log=log, heartbeat_s=HEARTBEAT_S,
                          on_timeout=lambda text: mark("on_timeout", text)) as watchdog:
            for step in range(1, 6):
                with watchdog.phase("step", step):
                    if step == 3:
                        mark("step3", time.monotonic())
                    time.sleep(STEP_S)
                    if step == 3:
                        if rank == int(victim):
                            if fault == "sleep":
                                time.sleep(60)
                            elif fault == "kill":
                                os.kill(os.getpid(), signal.SIGKILL)
                            elif fault == "stop":
                                os.kill(os.getpid(), signal.SIGSTOP)
                            elif fault == "raise":
                                raise ValueError("shard 7 is corrupt")
                    dist.all_reduce(torch.ones(4))
            with watchdog.phase("eval", 5):
                dist.all_reduce(torch.ones(4))
        mark("threads", [t.name for t in threading.enumerate() if t is not threading.main_thread()])
        dist.barrier()
        if rank == 0:
            keys = [f"{watchdog.prefix}/hb/{r}" for r in range(world)]
            mark("final", [json.loads(v) for v in mesh.store.multi_get(keys)])
            mark("store", [type(mesh.store).__name__, mesh.rendezvous.address, mesh.rendezvous.host])
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the test reads it
        mark("raised", f"{type(exc).__name__}: {exc}"[:300])
        if fault == "raise" and rank == int(victim):
            time.sleep(60)  # an exception path that never ends (the test kills it)
        os._exit(3)
    dist.destroy_process_group()
    os._exit(0)


def _launch(tmp_path: Path, scenario: str, world: int = 3, limit_s: float = 60.0, stopped=()):
    """Run ``world`` ranks; (exit codes, when each ended on the monotonic clock, each rank's log lines). Ranks in
    ``stopped`` (SIGSTOPped) are not waited for: killed once the others have ended."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megakern.parallel"])
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, scenario, str(tmp_path)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    ended = [None] * world
    deadline = time.monotonic() + limit_s
    try:
        while time.monotonic() < deadline and any(ended[r] is None for r in range(world) if r not in stopped):
            for r, p in enumerate(procs):
                if ended[r] is None and p.exitcode is not None:
                    ended[r] = time.monotonic()
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()  # a stopped (SIGSTOP) rank too
            p.join(5)
    logs = [(tmp_path / f"rank{r}.log").read_text().splitlines() if (tmp_path / f"rank{r}.log").exists() else []
            for r in range(world)]
    return [p.exitcode for p in procs], ended, logs


def _marks(lines, key):
    return [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith(f"@{key} ")]


def _messages(lines):
    return [line for line in lines if not line.startswith("@")]


def _check_ended_in_time(ranks, ended, logs):
    for r in ranks:
        took = ended[r] - _marks(logs[r], "step3")[0]
        assert took < STEP_S + STEP_TIMEOUT_S + LATE_S, f"rank {r} ended {took:.1f} s after step 3 began"


def test_rank_stuck_in_a_step_is_named_alive_and_every_rank_ends(tmp_path):
    codes, ended, logs = _launch(tmp_path, "sleep:1")
    assert codes == [WATCHDOG_EXIT_CODE] * 3, (codes, logs)
    _check_ended_in_time([0, 1, 2], ended, logs)
    who = _marks(logs[1], "who")[0]
    text = "\n".join(_messages(logs[0]))
    assert f"1 rank did not arrive: rank 1 ({who}) is still in step 3" in text, text
    assert "(heartbeat" in text and "ago: alive, stuck)" in text, text
    assert "at _rank (test_watchdog.py:" in text, text  # where its main thread is: the sleep, not a collective
    assert "Ranks 0, 2 wait in step 3" in text and f"exit code {WATCHDOG_EXIT_CODE}" in text, text
    assert text.startswith("error: step watchdog: rank ") and len(_messages(logs[0])) == 1, text
    for r in range(3):  # every rank: one line (the verdict, or its summary), the hook called with it
        lines = _messages(logs[r])
        assert len(lines) == 1 and "rank 1" in lines[0] and "is still in step 3" in lines[0], logs[r]
        assert "alive, stuck)" in lines[0] and _marks(logs[r], "on_timeout") == lines, logs[r]


def test_rank_frozen_by_sigstop_is_named_gone_within_the_step_timeout(tmp_path):
    codes, ended, logs = _launch(tmp_path, "stop:2", stopped=(2,))
    assert codes[:2] == [WATCHDOG_EXIT_CODE] * 2, (codes, logs)  # rank 2 is stopped, then killed by the test
    _check_ended_in_time([0, 1], ended, logs)
    who = _marks(logs[2], "who")[0]
    text = "\n".join(_messages(logs[0]))
    assert f"rank 2 ({who}): no heartbeat for " in text and "(process gone or frozen?), last seen in step 3" in text, \
        text
    assert "Ranks 0-1 wait in step 3" in text, text
    assert "rank 2 gone (no heartbeat for" in "\n".join(_messages(logs[1])), logs[1]


def test_sigkilled_rank_is_named_by_the_survivors(tmp_path):
    """gloo fails the survivors' collective at once ("Connection closed by peer", no rank): the watchdog names the
    rank, then the survivors' exception goes on (their exit code 3 here, not the watchdog's)."""
    codes, ended, logs = _launch(tmp_path, "kill:2")
    assert codes == [3, 3, -signal.SIGKILL], (codes, logs)
    who = _marks(logs[2], "who")[0]
    text = "\n".join(_messages(logs[0]))
    assert text.startswith("step watchdog: rank ") and "failed in step 3: RuntimeError" in text, text
    assert f"1 rank did not arrive: rank 2 ({who}): no heartbeat for" in text, text
    assert "(process gone or frozen?), last seen in step 3" in text, text
    assert "rank 2 gone (no heartbeat for" in "\n".join(_messages(logs[1])), logs[1]
    for r in (0, 1):
        assert "gloo" in _marks(logs[r], "raised")[0] and "by peer" in _marks(logs[r], "raised")[0]
        assert ended[r] - _marks(logs[r], "step3")[0] < STEP_S + 2.0 + LATE_S  # stale_s, then the verdict


def test_sigkilled_store_host_is_named_by_the_survivors(tmp_path):
    codes, ended, logs = _launch(tmp_path, "kill:0")
    assert codes == [-signal.SIGKILL, 3, 3], (codes, logs)
    who = _marks(logs[0], "who")[0]
    for r in (1, 2):
        text = "\n".join(_messages(logs[r]))
        assert "failed in step 3: RuntimeError" in text, text
        assert "The rendezvous store at tcp://127.0.0.1:" in text, text
        assert f"hosted by rank 0 ({who}), stopped answering" in text, text
        assert f"rank 0 ({who}) is gone or unreachable" in text, text


def test_failed_rank_is_named_in_rank_0s_log_and_the_waiting_ranks_end(tmp_path):
    """Rank 2's step raises and its process lingers; ranks 0-1 wait in a gloo collective that never errors (as NCCL
    ranks would): rank 0's log names rank 2 and its exception, and both end after the grace period."""
    codes, ended, logs = _launch(tmp_path, "raise:2", stopped=(2,))
    assert codes[:2] == [WATCHDOG_EXIT_CODE] * 2, (codes, logs)
    who = _marks(logs[2], "who")[0]
    text = _messages(logs[0])
    assert text[0] == f"step watchdog: rank 2 ({who}) failed in step 3: ValueError: shard 7 is corrupt. Ranks 0-1 " \
                      "wait in step 3.", text
    assert "is still running" in text[1] and "after the verdict (rank 2 failed in step 3)" in text[1], text
    assert _messages(logs[1])[0] in [f"step watchdog: rank 2 failed in step 3 (rank {r}'s log has the details)"
                                     for r in (0, 2)], logs[1]  # the two diagnosing ranks: 0 and the last
    for r in (0, 1):  # the verdict comes about a heartbeat after the error; the grace is stale_s + 2 heartbeats
        took = ended[r] - _marks(logs[r], "step3")[0]
        assert took < STEP_S + 2.0 + 2 * HEARTBEAT_S + LATE_S, f"rank {r} ended {took:.1f} s after step 3 began"


def test_normal_run_says_nothing_and_leaves_no_thread(tmp_path):
    codes, _, logs = _launch(tmp_path, "none:-1")
    assert codes == [0, 0, 0], (codes, logs)
    for r in range(3):
        assert _messages(logs[r]) == [] and _marks(logs[r], "on_timeout") == [], logs[r]
        assert _marks(logs[r], "threads") == [[]], logs[r]
    final = _marks(logs[0], "final")[0]
    assert [s["closed"] for s in final] == [True] * 3 and {s["phase"] for s in final} == {"eval"}, final
    kind, address, host = _marks(logs[0], "store")[0]
    assert kind == "TCPStore" and address.startswith("tcp://127.0.0.1:"), (kind, address)
    assert host == f"rank 0 ({_marks(logs[0], 'who')[0]})", host


# ---- the diagnosis (no processes) ----------------------------------------------------------------------------------
def _state(step, *, open_=True, comm=True, who="n:1", **extra):
    return {"who": who, "phase": "step", "step": step, "seq": 1 if open_ else 2, "open": open_, "for": 12.0,
            "where": "all_reduce (distributed/distributed_c10d.py:2870)" if comm else "__next__ (loader.py:88)",
            "comm": comm, **extra}


def test_verdict_names_the_rank_behind_and_the_gone_rank():
    seen = {0: Seen(_state(42), 0.3), 1: Seen(_state(42), 0.4), 2: Seen(_state(42), 65.0),
            3: Seen(_state(41, comm=False, who="n:3"), 2.0), 4: Seen(None, 9.0), 5: Seen(_state(42), 70.0, False)}
    summary, text, named = verdict("rank 0 (n:0) has been in step 42 for 301 s", seen, 20.0, hang=True)
    assert named == [2, 3, 4, 5]
    assert "4 ranks did not arrive: rank 2 (n:1): no heartbeat for 65 s (process gone or frozen?), last seen in " \
           "step 42 for 12 s at all_reduce" in text, text
    assert "rank 5 (n:1): no heartbeat in the 70 s watched" in text, text
    assert "rank 4: no heartbeat at all (it never started its watchdog" in text, text
    assert "rank 3 (n:3) is still in step 41 for 12 s at __next__ (loader.py:88) (heartbeat 2.0 s ago: alive, " \
           "stuck)" in text, text
    assert "Ranks 0-1 wait in step 42." in text and text.endswith(f"exit code {WATCHDOG_EXIT_CODE}."), text
    assert summary.startswith("rank 2 gone (no heartbeat for 65 s); rank 5 gone") and \
        "rank 3 is still in step 41 (alive, stuck)" in summary, summary


def test_verdict_in_one_step_names_the_rank_outside_the_collective():
    seen = {0: Seen(_state(7), 0.1), 1: Seen(_state(7, comm=False), 0.2), 2: Seen(_state(7), 0.1)}
    _, text, named = verdict("t", seen, 2.0, hang=True)
    assert named == [1] and "rank 1 (n:1) is still in step 7 for 12 s at __next__" in text, text
    # all inside torch.distributed (or all outside): nobody to name, and the message says what is left
    _, text, named = verdict("t", {r: Seen(_state(7), 0.1) for r in range(3)}, 2.0, hang=True)
    assert named == [] and "No rank is behind, gone or outside torch.distributed" in text, text
    assert "Ranks 0-2 are in step 7 (at all_reduce" in text, text


def test_verdict_of_a_failure_and_of_finished_ranks():
    seen = {0: Seen(_state(3, open_=False, failed="DataError: shard 7 is corrupt"), 0.1),
            1: Seen(_state(3), 0.2), 2: Seen({**_state(5, open_=False), "closed": True}, 50.0)}
    summary, text, named = verdict("rank 0 (n:1) failed in step 3: DataError: shard 7 is corrupt", seen, 2.0,
                                   hang=False)
    assert named == [0] and text.count("DataError") == 1, text  # the trigger says it once
    assert text.startswith("step watchdog: rank 0") and text.endswith("Rank 1 waits in step 3."), text
    assert "rank 2" not in text and summary == "rank 0 failed in step 3", (summary, text)


def test_verdict_at_scale_lists_ranges_and_groups_alike_failures():
    seen = {r: Seen(_state(3), 30.0) for r in range(12)}  # a node's worth gone
    seen |= {r: Seen(_state(3, open_=False, failed="DataError: x"), 0.1) for r in (12, 13, 14)}
    seen |= {r: Seen(_state(3), 0.1) for r in range(15, 64)}
    summary, text, named = verdict("rank 15 (n:1) has been in step 3 for 300 s", seen, 20.0, hang=True)
    assert named == list(range(15)) and text.count("no heartbeat for 30 s") == 8, text
    assert "12 ranks did not arrive: " in text and "; ranks 8-11 are gone too. " in text, text
    assert "Ranks 12-14 failed in step 3: DataError: x. Ranks 15-63 wait in step 3." in text, text
    assert summary.endswith("rank 7 gone (no heartbeat for 30 s); 4 more; ranks 12-14 failed in step 3"), summary


# ---- bad input, and the cost per step (one process, an in-memory store) ------------------------------------------
@pytest.mark.parametrize("kwargs,error,message", [
    (dict(timeout_s=0), ValueError, "parallel.step_timeout_s must be a finite number of seconds > 0, got 0"),
    (dict(timeout_s=-5.0), ValueError, "parallel.step_timeout_s must be a finite number of seconds > 0, got -5.0"),
    (dict(first_timeout_s=0.0), ValueError, "parallel.init_timeout_s must be a finite number of seconds > 0"),
    (dict(timeout_s=700, first_timeout_s=600), ValueError,
     "parallel.step_timeout_s = 700 s is longer than parallel.init_timeout_s = 600 s, the collectives' own "
     "timeout, which would fire first"),
    (dict(heartbeat_s=40), ValueError, "heartbeat_s must be > 0 and at most a third of parallel.step_timeout_s"),
    (dict(rank=2, world=2), ValueError, "rank 2 is outside the world of 2 ranks"),
    (dict(world=None), ValueError, "world must be an int, got None"),
    (dict(first_steps=-1), ValueError, "first_steps must be an int >= 0, got -1"),
    (dict(log="train.log"), TypeError, "log must be callable, got str"),
])
def test_bad_arguments(kwargs, error, message):
    args = dict(rank=0, world=1, timeout_s=100.0, first_timeout_s=600.0) | kwargs
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        StepWatchdog(dist.HashStore(), **args)


def test_bad_sources_and_order():
    with pytest.raises(TypeError, match="source must be a ParallelMesh or a torch.distributed.Store, got str"):
        StepWatchdog("tcp://127.0.0.1:29500", 0, 1, 10.0, 60.0)
    mesh = ParallelMesh.__new__(ParallelMesh)  # a mesh built on a process group made elsewhere: no rendezvous
    mesh.rendezvous = None
    with pytest.raises(ValueError, match="this ParallelMesh has no rendezvous store"):
        StepWatchdog(mesh)
    watchdog = StepWatchdog(dist.HashStore(), 0, 1, 10.0, 60.0)
    with pytest.raises(WatchdogError, match=r"begin_phase\('step', 1\): the watchdog is not started"):
        watchdog.begin_step(1)
    with watchdog:
        watchdog.begin_step(1)
        with pytest.raises(WatchdogError, match=r"begin_phase\('eval', 1\): step 1 is still open"):
            watchdog.begin_phase("eval", 1)
        with pytest.raises(WatchdogError, match=r"end_phase\('step', 2\): step 1 is open"):
            watchdog.end_step(2)
        with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
            watchdog.end_step(1) or watchdog.begin_step(2, timeout_s=0)
        with pytest.raises(WatchdogError, match="already started"):
            watchdog.start()
    with pytest.raises(WatchdogError, match="the watchdog is closed"):
        watchdog.begin_step(3)
    with pytest.raises(RuntimeError, match="rendezvous= was given, but torch.distributed is not initialized"):
        ParallelDims().build("cpu", rendezvous=Rendezvous(dist.HashStore(), "tcp://x:1", "rank 0"))


def test_first_steps_and_phases_get_the_long_timeout():
    with StepWatchdog(dist.HashStore(), 0, 1, 10.0, 60.0, first_steps=2) as watchdog:
        limits = []
        for step in (1, 2, 3):
            watchdog.begin_step(step)
            limits.append(watchdog._phase.limit)
            watchdog.end_step(step)
        with watchdog.phase("checkpoint", 3):
            limits.append(watchdog._phase.limit)
        with watchdog.phase("eval", 3, timeout_s=5):
            limits.append(watchdog._phase.limit)
    assert limits == [60.0, 60.0, 10.0, 60.0, 5.0]


def test_cost_per_step_and_no_thread_left():
    before = set(threading.enumerate())
    with StepWatchdog(dist.HashStore(), 0, 1, 100.0, 600.0, heartbeat_s=0.05) as watchdog:
        n = 20000
        start = time.perf_counter_ns()
        for step in range(1, n + 1):
            watchdog.begin_step(step)
            watchdog.end_step(step)
        per_step_us = (time.perf_counter_ns() - start) / n / 1e3
        time.sleep(0.2)  # a few heartbeats
    assert per_step_us < 50, f"{per_step_us:.1f} us per step"
    assert set(threading.enumerate()) == before
