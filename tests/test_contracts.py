"""docs/contracts.md, the table of the 36 contracts: every contract has one row, and every module, function and test a
row names exists, so the table cannot rot. Then the contracts that have a check and no home of their own for its
test: no wall-clock arithmetic and integer-ns timings (1, 9), no sys.path edits (15, 19), a CUDA device asked for where
there is none (4), a lock wait that times out (2), eval lengths against the model's positions (28), the final
sample's length against the context (8).
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import textwrap
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from megakern.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "contracts.md"
CONTRACTS = 36
COLUMNS = ("#", "assumption", "contract", "checked in", "tests")
CODE = re.compile(r"^(?P<path>[\w./-]+\.(?:py|toml|cpp|cu|h|md|in|cfg|txt))(?::\s*(?P<names>[\w.]+(?:,\s*[\w.]+)*))?$")
TEST = re.compile(r"^(?P<path>tests/[\w./-]+\.py)::(?P<name>[\w:]+?)(?:\[[^\]]*\])?$")


def table_rows() -> dict[int, dict[str, str]]:
    """{contract number: {column: cell}} of the table's rows (lines of the form | N | ... |)."""
    rows = {}
    for number, line in enumerate(TABLE.read_text().splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells or not cells[0].isdigit():
            continue
        assert len(cells) == len(COLUMNS), f"{TABLE.name} line {number}: {len(cells)} cells, want {len(COLUMNS)}"
        n = int(cells[0])
        assert n not in rows, f"{TABLE.name} line {number}: contract {n} has a second row"
        rows[n] = dict(zip(COLUMNS, cells))
    return rows


@lru_cache(maxsize=None)
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def defines(tree: ast.AST, dotted: str) -> bool:
    """Whether ``tree`` (a module) defines ``dotted``: a function, class or assignment, or Class.member."""
    node, parts = tree, dotted.split(".")
    for part in parts:
        found = None
        for child in getattr(node, "body", []):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == part:
                found = child
            elif isinstance(child, ast.Assign) and any(isinstance(t, ast.Name) and t.id == part for t in child.targets):
                found = child
            elif isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name) and child.target.id == part:
                found = child
        if found is None:
            return False
        node = found
    return True


def test_every_contract_has_one_full_row():
    rows = table_rows()
    assert sorted(rows) == list(range(1, CONTRACTS + 1)), f"rows for {sorted(rows)}"
    for n, row in rows.items():
        assert all(row[c] for c in COLUMNS), f"contract {n}: an empty cell"
        spans = re.findall(r"`([^`]+)`", row["checked in"])
        assert any(CODE.match(s) for s in spans) or "(in progress" in row["checked in"] \
            or row["checked in"].startswith("nothing"), f"contract {n}: the check names no module"
        tests = re.findall(r"`([^`]+)`", row["tests"])
        assert any(TEST.match(t) for t in tests) or "(in progress" in row["tests"] \
            or row["tests"].startswith("none"), f"contract {n}: no test named"


def test_named_modules_functions_and_tests_exist():
    problems = []
    for n, row in table_rows().items():
        for span in re.findall(r"`([^`]+)`", " ".join(row.values())):
            if (m := TEST.match(span)) is not None:
                path = ROOT / m["path"]
                if not path.is_file():
                    problems.append(f"contract {n}: {m['path']} does not exist")
                elif not defines(parsed(path), m["name"].replace("::", ".")) or not m["name"].split("::")[-1] \
                        .startswith("test_"):
                    problems.append(f"contract {n}: {m['path']} has no test {m['name']}")
            elif (m := CODE.match(span)) is not None:
                path = ROOT / m["path"]
                if not path.is_file():
                    problems.append(f"contract {n}: {m['path']} does not exist")
                    continue
                for name in filter(None, re.split(r",\s*", m["names"] or "")):
                    if not path.suffix == ".py" or not defines(parsed(path), name):
                        problems.append(f"contract {n}: {m['path']} does not define {name}")
            elif "::" in span or span.startswith("tests/"):
                problems.append(f"contract {n}: `{span}` is not of the form tests/FILE.py::test_name")
    assert not problems, "docs/contracts.md names what is not there:\n  " + "\n  ".join(problems)


def test_the_table_checker_catches_rot(tmp_path):
    """The checks above fail on a renamed test, a removed method and a misspelt file (they can fail)."""
    tree = parsed(ROOT / "megakern" / "checkpoint.py")
    assert defines(tree, "CheckpointManager.save") and not defines(tree, "CheckpointManager.sav")
    assert defines(tree, "FORMAT_VERSION") and not defines(tree, "save")
    assert TEST.match("tests/data/test_indexed.py::test_corruption_detected[missing-bin]")["name"] == \
        "test_corruption_detected"
    assert CODE.match("megakern/train/log.py: RunLogger.__init__, wandb_credentials")["names"] == \
        "RunLogger.__init__, wandb_credentials"
    assert TEST.match("megakern/train/log.py::x") is None and CODE.match("log.wandb") is None


# ---- contracts 1 and 9: no wall-clock arithmetic; step timings in integer ns -------------------------------------
def package_files():
    """The sources that ship or run as programs: megakern/, parallel/, models/, profiles/, scripts/."""
    for folder in ("megakern", "parallel", "models", "profiles", "scripts"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def _is_call(node, module: str, names: set[str]) -> bool:
    """``module.name(...)`` or ``module.module.name(...)`` (datetime.datetime.now) for a name in ``names``."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names):
        return False
    owner = node.func.value
    return (isinstance(owner, ast.Name) and owner.id == module) or (
        isinstance(owner, ast.Attribute) and owner.attr == module)


def wall_clock_uses(tree: ast.AST) -> list[str]:
    """time.time()/time_ns() anywhere, and datetime's now()/utcnow()/today() inside a subtraction or comparison."""
    found = []
    for node in ast.walk(tree):
        if _is_call(node, "time", {"time", "time_ns"}):
            found.append(f"line {node.lineno}: time.{node.func.attr}()")
        if isinstance(node, ast.ImportFrom) and node.module == "time":
            found += [f"line {node.lineno}: from time import {a.name}" for a in node.names if a.name in
                      ("time", "time_ns")]
        operands = ([node.left, node.right] if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub)
                    else [node.left, *node.comparators] if isinstance(node, ast.Compare) else [])
        for operand in operands:
            if any(_is_call(n, "datetime", {"now", "utcnow", "today"}) for n in ast.walk(operand)):
                found.append(f"line {node.lineno}: the wall clock (datetime) in arithmetic")
    return found


def test_no_wall_clock_arithmetic_and_integer_ns_step_timings():
    """Contract 1: ranks' clocks may differ and jump (NTP): durations come from each rank's monotonic clock or CUDA
    events, never from the wall clock (which names things only: run directories, log stamps). Contract 9: the
    trainer and the logger time steps in integer ns (perf_counter_ns), not float seconds (time.monotonic() serves
    deadlines only)."""
    problems = [f"{p.relative_to(ROOT)} {u}" for p in package_files() for u in wall_clock_uses(parsed(p))]
    assert not problems, "wall-clock time used for durations:\n  " + "\n  ".join(problems)
    trainer = sorted((ROOT / "megakern/train").glob("*.py"))
    assert len(trainer) > 5
    for path in trainer:
        floats = [n.lineno for n in ast.walk(parsed(path)) if _is_call(n, "time", {"perf_counter", "process_time"})]
        assert not floats, f"{path.name}: float-second clocks at lines {floats}; time with time.perf_counter_ns"
    assert any(_is_call(n, "time", {"perf_counter_ns"}) for n in ast.walk(parsed(ROOT / "megakern/train/figures.py")))
    bad = ast.parse(textwrap.dedent("""
        import datetime, time
        took = time.time() - start
        late = datetime.datetime.now() - started > limit
        stamp = datetime.datetime.now().strftime("%H%M")
    """))
    assert sorted(wall_clock_uses(bad)) == ["line 3: time.time()", "line 4: the wall clock (datetime) in arithmetic",
                                    "line 4: the wall clock (datetime) in arithmetic"]


# ---- contracts 15 and 19: an installed package, no path tricks ---------------------------------------------------
def test_no_sys_path_edits():
    """Imports resolve through the installed package (tests/test_package.py installs it); nothing that ships or runs
    as a program edits sys.path or adds site directories. (benchmarks/: being moved off sys.path edits.)"""
    problems = []
    for path in package_files():
        for node in ast.walk(parsed(path)):
            if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                    and node.value.id == "sys") or _is_call(node, "site", {"addsitedir"}):
                problems.append(f"{path.relative_to(ROOT)} line {node.lineno}")
    assert not problems, "sys.path edited (use the installed package):\n  " + "\n  ".join(problems)


# ---- contract 4: device-agnostic; CUDA asked for where there is none ---------------------------------------------
def test_cuda_asked_for_without_cuda_is_a_config_error(monkeypatch):
    from megakern.train import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"train.device='cuda:1' but CUDA is not available \(torch "):
        resolve_device("cuda:1")


# ---- contract 2: a lock wait with a timeout ----------------------------------------------------------------------
def test_default_corpus_lock_wait_times_out_naming_the_lock(tmp_path):
    """A second process holding the default corpus's build lock (a stuck build): the wait ends after its timeout
    with an error naming the lock file, instead of hanging."""
    from megakern.data.corpus import _exclusive

    lock = tmp_path / "corpus.lock"
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('locked', flush=True)\ntime.sleep(60)",
                               str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(TimeoutError, match=f"{lock} has been locked by another process for over 0 s"):
            with _exclusive(lock, 0.3):
                pass
    finally:
        holder.kill()
        holder.wait(timeout=30)
        holder.stdout.close()
    with _exclusive(lock, 5.0):  # released with its holder
        pass


# ---- contracts 28 and 8: eval lengths and the sample's length against the model's positions ----------------------
QUIET = ["log.tensorboard=false", "log.progress=false", "data.num_workers=0", "train.device=cpu",
         "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.max_seqlen=64", "train.micro_batch_size=2",
         "train.seq_length=16", "train.steps=2", "eval.batches=2", "checkpoint.final=false"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    from megakern.data import load_tokenizer
    from megakern.data.preprocess import preprocess_documents

    words = ["def", "return", "self", "import", "class", "for", "in", "if", "else", "value"]
    texts = [" ".join(words[(d * 7 + i * 3) % len(words)] for i in range(300)) for d in range(30)]
    prefix = tmp_path_factory.mktemp("data") / "words"
    preprocess_documents(texts, load_tokenizer("byte"), prefix, progress=False)
    return prefix


def build(tmp_path, dataset, *overrides, name="run"):
    from megakern.train import Trainer

    config = load_config(None, [*QUIET, f"data.paths=[{dataset}]", f"log.run_dir={tmp_path / name}", *overrides])
    return Trainer(config, stream=open(tmp_path / f"{name}.console", "a"))


def test_eval_longer_than_training_up_to_the_model_positions(tmp_path, dataset):
    """Contract 28: an eval length beyond model.max_seqlen is refused before anything is built (positions beyond it
    were never trained and are not allocated); up to it, eval runs at a longer length than training does."""
    with pytest.raises(ConfigError, match="eval.seq_length 65 exceeds model.max_seqlen 64"):
        load_config(None, [*QUIET, "eval.seq_length=65"])
    t = build(tmp_path, dataset, "eval.seq_length=64")
    assert (t.seq_length, t.eval_seq_length) == (16, 64)
    assert t.data.valid[0]["tokens"].shape == (65,)  # 64 inputs and their targets
    loss = t.evaluate()
    assert loss.dtype == torch.float32 and loss.dim() == 0 and torch.isfinite(loss)


def test_final_sample_is_bounded_by_the_context(tmp_path, dataset, monkeypatch):
    """Contract 8: train.sample_tokens beyond what model.max_seqlen leaves after the prompt is cut to fit; a prompt
    that fills the context skips the sample with a log line."""
    from megakern.models import generate as gen

    asked = []
    real = gen.generate
    monkeypatch.setattr(gen, "generate", lambda model, idx, n, **kw: asked.append((idx.shape[1], n)) or
                        real(model, idx, n, **kw))
    t = build(tmp_path, dataset, "train.sample_tokens=1000", "train.sample_prompt=def ", "train.sample_top_k=1")
    assert isinstance(t.sample(), str) and asked == [(4, 60)]  # 'def ' is 4 bytes: 60 more fill the 64 positions
    full = build(tmp_path, dataset, "train.sample_tokens=5", f"train.sample_prompt={'x' * 64}", name="full")
    assert full.sample() is None and len(asked) == 1
    log = (tmp_path / "full" / "train.log").read_text()
    assert "sample: skipped, the prompt's 64 tokens fill model.max_seqlen" in log
