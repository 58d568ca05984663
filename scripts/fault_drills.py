"""Fault drills: every fault the training program must survive, repeated against the real program, showing that
nothing is lost.

    python scripts/fault_drills.py                 # every drill (about 5 minutes on 2 CPU cores), then a table
    python scripts/fault_drills.py kills --count 20 [--async-save]   # only the SIGKILL drill, 20 kills
    python scripts/fault_drills.py tests           # only the drills kept as tests
    python scripts/fault_drills.py --list          # the drills and what each shows

Two kinds of drill:

- ``kills``: megakern-train (one process, CPU, a checkpoint every step) killed with SIGKILL again and again, each
  time once it has saved one more checkpoint than before: half the time as the next save begins (the moment its
  temporary directory appears), half at a random moment up to 0.3 s later; each time restarted with
  checkpoint.resume=auto. After every kill the newest complete checkpoint must verify (every file's
  sha256 against its manifest) and nothing incomplete may look complete; at the end every step's loss, as the
  restarted runs logged it last, must equal an uninterrupted run's bit for bit.
- ``tests``: the faults whose drill is a test of the suite (each feeds the bad case to the real code: a rewritten
  .bin, a second run in the directory, ranks with skewed clocks, real signals, a disk that fills at each step of a
  save, a rank that hangs or dies, ...), run through pytest and reported one line per fault. docs/faults.md lists
  the same faults with what the program does about each.

Exit status 0 when every drill passed. Results are printed as a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from megakern.checkpoint import CheckpointManager, read_manifest, sha256_file

REPO = Path(__file__).resolve().parents[1]

# fault -> the tests that repeat it (pytest node ids, relative to the repository)
DRILLS: list[tuple[str, list[str]]] = [
    ("a .bin rewritten during a run (in place, or replaced)",
     ["tests/train/test_faults.py::test_data_rewritten_during_a_run_stops_it_before_any_checkpoint_records_it",
      "tests/data/test_indexed.py::test_modification_after_open_detected"]),
    ("two runs given one run directory (or one checkpoint.dir)",
     ["tests/train/test_faults.py::test_second_run_in_the_same_directory_is_refused_and_writes_nothing",
      "tests/train/test_faults.py::test_lock_of_a_killed_run_is_recognised_as_stale"]),
    ("ranks whose clocks differ, ranks that see other paths",
     ["tests/train/test_faults.py::test_ranks_share_the_run_directory_rank_zero_names"]),
    ("disk full or an I/O error at any step of a save, `latest` included",
     ["tests/train/test_train_checkpoint.py"]),
    ("a prune or a save killed midway; leftovers at the next start",
     ["tests/train/test_train_checkpoint.py::test_a_removal_killed_midway_never_looks_complete",
      "tests/train/test_train_checkpoint.py::test_leftovers_are_cleared_at_start_not_only_at_the_next_save",
      "tests/train/test_train_checkpoint.py::test_a_commit_killed_before_latest_is_finished_at_the_next_start"]),
    ("one of several ranks failing during a save",
     ["tests/parallel/test_parallel_checkpoint.py"]),
    ("asynchronous saves: failures, SIGKILL in the background write",
     ["tests/test_checkpoint_async.py"]),
    ("SIGTERM / SIGINT, a second signal, a signal to one rank of two",
     ["tests/train/test_faults.py::test_signal_finishes_the_step_saves_and_resumes_exactly",
      "tests/train/test_faults.py::test_second_signal_exits_at_once_without_a_traceback",
      "tests/train/test_faults.py::test_signal_to_one_rank_stops_every_rank_at_the_same_step"]),
    ("a rank that hangs in a step, or dies",
     ["tests/parallel/test_watchdog.py",
      "tests/train/test_faults.py::test_a_hung_rank_is_named_in_the_log_within_the_step_timeout"]),
    ("step timings around evals and saves",
     ["tests/train/test_faults.py::test_step_timings_belong_to_their_steps"]),
    ("start-up errors: a missing rank, an extreme blend, an eval the held-out set cannot feed",
     ["tests/train/test_faults.py::test_a_rank_that_never_comes_is_an_error_line",
      "tests/train/test_faults.py::test_extreme_blend_is_a_config_error_with_the_key_that_allows_it",
      "tests/train/test_faults.py::test_eval_the_held_out_set_cannot_feed_names_the_keys"]),
    ("a resume with a larger train.steps",
     ["tests/train/test_faults.py::test_resume_with_more_steps_keeps_the_schedule"]),
    ("a DataLoader worker that stalls or dies",
     ["tests/data/test_sampler.py"]),
]

TINY = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0",
        "train.device=cpu", "model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.max_seqlen=64",
        "train.micro_batch_size=8", "optim.lr=3e-3", "schedule.warmup_steps=4", "eval.every=0", "log.every=1",
        "checkpoint.every=1", "checkpoint.keep=2"]


# ---------------------------------------------------------------------------------------------------------------
# The SIGKILL drill.

def _losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss as train.log holds it last (a step re-run after a kill is logged again)."""
    losses: dict[int, float] = {}
    log = run_dir / "train.log"
    if log.is_file():
        for line in log.read_text().splitlines():
            if line.startswith("{") and '"train/loss"' in line:
                record = json.loads(line)
                losses[record["step"]] = record["train/loss"]
    return losses


def _check_checkpoints(ckpt_dir: Path) -> str | None:
    """None when the newest complete checkpoint verifies and is what a resume takes; else what is wrong."""
    manager = CheckpointManager(ckpt_dir)
    complete = manager.complete()
    if not complete:
        return None
    newest = complete[-1]
    for path in complete:
        manifest = read_manifest(path)
        for name, entry in manifest["files"].items():
            file = path / name
            if not file.is_file() or file.stat().st_size != entry["size"] or sha256_file(file) != entry["sha256"]:
                return f"{path.name} looks complete but {name} does not match its manifest"
    chosen = manager.latest(warn=False)
    if chosen != newest and not (ckpt_dir / "latest").is_file():
        return f"a resume would take {chosen}, not the newest complete {newest.name}"
    return None


def kill_drill(count: int, steps: int, async_save: bool, data_cache: Path, work: Path, seed: int) -> list[dict]:
    rng = random.Random(seed)
    common = [*TINY, f"train.steps={steps}", f"data.cache_dir={data_cache}",
              f"checkpoint.async_save={str(async_save).lower()}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(run_dir: Path, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "megakern.train", *common, f"log.run_dir={run_dir}", *extra],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=work)

    reference = train(work / "reference")
    _, err = reference.communicate(timeout=1800)
    if reference.returncode != 0:
        raise RuntimeError(f"the uninterrupted reference run failed:\n{err[-3000:]}")
    expected = _losses(work / "reference")

    run_dir, ckpt_dir = work / "killed", work / "killed" / "checkpoints"
    rows = []
    def newest() -> int:
        complete = CheckpointManager(ckpt_dir).complete()
        return int(complete[-1].name.split("_")[1]) if complete else 0

    for i in range(count):
        during_save = i % 2 == 0
        before = newest()
        proc = train(run_dir, "checkpoint.resume=auto")
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and newest() <= before:
            time.sleep(0.005)  # each attempt first makes progress: one more checkpoint than before
        when = time.monotonic() + rng.uniform(0.0, 0.3)
        while proc.poll() is None and time.monotonic() < deadline:
            if during_save and any(ckpt_dir.glob(".tmp-step_*")):
                break  # the next save has begun: kill it midway
            if not during_save and time.monotonic() >= when:
                break
            time.sleep(0.001)
        finished = proc.poll() is not None
        if not finished:
            proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
        complete = CheckpointManager(ckpt_dir).complete()
        problem = _check_checkpoints(ckpt_dir)
        rows.append({"kill": i + 1, "moment": "during a save" if during_save else "at random",
                     "killed": not finished, "newest": complete[-1].name if complete else "-", "problem": problem})
        if finished:
            break
    final = train(run_dir, "checkpoint.resume=auto")
    _, err = final.communicate(timeout=1800)
    got = _losses(run_dir)
    mismatched = [s for s in expected if got.get(s) != expected[s]]
    rows.append({"kill": "end", "moment": "run to the end", "killed": False,
                 "newest": (CheckpointManager(ckpt_dir).complete() or [Path("-")])[-1].name,
                 "problem": (f"exit {final.returncode}: {err[-500:]}" if final.returncode != 0 else
                             f"losses differ from the uninterrupted run's at steps {mismatched[:10]}"
                             if mismatched else None)})
    return rows


# ---------------------------------------------------------------------------------------------------------------
# The drills kept as tests.

def run_test_drills(selected: list[tuple[str, list[str]]]) -> list[dict]:
    ids = sorted({i for _, ids in selected for i in ids})
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *ids],
                       cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cases = []
        if report.is_file():
            for case in ET.parse(report).getroot().iter("testcase"):
                name = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
                failed = case.find("failure") is not None or case.find("error") is not None
                skipped = case.find("skipped") is not None
                cases.append((name, "failed" if failed else "skipped" if skipped else "passed",
                              float(case.get("time", 0))))
    rows = []
    for fault, wanted in selected:
        mine = [c for c in cases if any(c[0].startswith(w.split("::")[0].removesuffix(".py")) and
                                        ("::" not in w or c[0].split("[")[0].endswith(w.split("::")[1]))
                                        for w in wanted)]
        states = [c[1] for c in mine]
        rows.append({"fault": fault, "tests": len(mine), "passed": states.count("passed"),
                     "failed": states.count("failed"), "skipped": states.count("skipped"),
                     "seconds": round(sum(c[2] for c in mine), 1)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("which", nargs="?", choices=["all", "kills", "tests"], default="all")
    parser.add_argument("--count", type=int, default=20, help="SIGKILLs in the kill drill (default 20)")
    parser.add_argument("--steps", type=int, default=40, help="steps of the killed run (default 40)")
    parser.add_argument("--async-save", action="store_true", help="the kill drill with checkpoint.async_save=true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="list the drills and exit")
    args = parser.parse_args(argv)
    if args.list:
        for fault, ids in DRILLS:
            print(f"- {fault}:\n    " + "\n    ".join(ids))
        print(f"- SIGKILL during saves and at random moments, resumed each time (kills --count {args.count})")
        return 0
    ok = True
    if args.which in ("all", "tests"):
        rows = run_test_drills(DRILLS)
        print("| fault | tests | passed | failed | skipped | s |\n|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['fault']} | {r['tests']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['seconds']} |")
            ok &= r["failed"] == 0 and r["tests"] > 0
    if args.which in ("all", "kills"):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            rows = kill_drill(args.count, args.steps, args.async_save, work / "data", work, args.seed)
        print(f"\nSIGKILL drill ({'asynchronous' if args.async_save else 'synchronous'} saves, checkpoint every "
              f"step, {args.steps} steps):\n| kill | moment | killed | newest complete checkpoint | problem |\n"
              "|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['kill']} | {r['moment']} | {'yes' if r['killed'] else 'no'} | {r['newest']} | "
                  f"{r['problem'] or 'none'} |")
            ok &= r["problem"] is None
    print("\nall drills passed" if ok else "\nsome drills FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
