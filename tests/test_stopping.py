"""megakern/train/stopping.py: signals turned into requests, and the ranks' vote on stopping (real signals, gloo ranks)."""
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from megakern.train.stopping import Interrupted, StopSignals, StopVote
from benchmarks.common import run_launch


def test_first_signal_is_a_request_and_a_second_stops_at_once():
    signals = StopSignals(grace_s=60).install()
    try:
        signals.graceful = True
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.received == "SIGTERM" and signals.count == 1
        with pytest.raises(Interrupted, match=r"SIGINT \(second signal\): stopped without saving"):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # (the handler runs before this returns)
        assert signals._backstop is not None and signals._backstop.is_alive()  # ends the process unless called off
    finally:
        signals.restore()
    assert signals._backstop is None and signal.getsignal(signal.SIGTERM) is not signals._handle


BLOCKED = """
import os, signal, threading, time
from megakern.train.stopping import StopSignals
signals = StopSignals(grace_s=1).install()
signals.graceful = True
os.kill(os.getpid(), signal.SIGTERM)
try:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(1)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    threading.Event().wait(30)  # stuck (as in a blocked collective) instead of unwinding to restore()
print("never")
"""


def test_a_main_thread_that_does_not_unwind_is_ended_by_the_backstop():
    proc = subprocess.run([sys.executable, "-c", BLOCKED], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 75 and proc.stdout == "interrupted\n"
    assert "the main thread did not stop after the signal; exiting with 75" in proc.stderr


def test_a_signal_before_the_loop_stops_at_once():
    lines = []
    signals = StopSignals(log=lines.append, grace_s=60).install()
    try:
        with pytest.raises(Interrupted, match=r"SIGTERM \(signal before the first step\)"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signals.restore()
    assert lines == ["signal before the first step (SIGTERM): exiting now, without a checkpoint"]


def test_one_process_votes_with_itself():
    vote = StopVote(False).agree("SIGINT", "a.bin changed")
    assert vote.signal == "SIGINT" and vote.signal_rank == 0 and vote.errors == {0: "a.bin changed"}
    assert StopVote(False).start(None, None).result().signal is None


VOTERS = """
import json, os
import torch.distributed as dist
from megakern.train.stopping import StopVote

rank = int(os.environ["RANK"])
dist.init_process_group("gloo")
vote = StopVote(True)
seen = []
quiet = vote.start(None, None)                      # step 1: nothing anywhere
second = vote.start("SIGTERM" if rank == 2 else None, "d.bin changed" if rank == 1 else None)   # step 2
for pending in (quiet, second):                     # read a step later, in order
    v = pending.result()
    seen.append([v.signal, v.signal_rank, {str(k): m for k, m in (v.errors or {}).items()}])
seen.append(vars(vote.agree(None, None)))           # settled at once
with open(f"vote{rank}.json", "w") as f:
    json.dump(seen, f)
vote.close()
dist.destroy_process_group()
"""


def test_three_ranks_see_one_vote(tmp_path):
    """A signal on rank 2 and an error on rank 1, each known to every rank at the same vote, with the error's
    message; votes started without waiting are read in order."""
    (tmp_path / "voters.py").write_text(VOTERS)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(port),
           str(tmp_path / "voters.py")]
    proc = run_launch(cmd, cwd=tmp_path, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = [json.loads((tmp_path / f"vote{r}.json").read_text()) for r in range(3)]
    assert seen[0] == seen[1] == seen[2]
    assert seen[0][:2] == [[None, None, {}], ["SIGTERM", 2, {"1": "d.bin changed"}]]
    assert seen[0][2] == {"signal": None, "signal_rank": None, "errors": None}


def test_handlers_only_in_the_main_thread():
    script = textwrap.dedent("""
        import threading
        from megakern.train.stopping import StopSignals
        errors = []
        def install():
            try:
                StopSignals().install()
            except RuntimeError as exc:
                errors.append(str(exc))
        t = threading.Thread(target=install); t.start(); t.join()
        print(errors[0])
        """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert "must run in the main thread" in out.stdout
