"""megakern/train/log.py's RunLogger with Weights & Biases beside the log file and TensorBoard: checked at start
(contracts 29 and 35, docs/contracts.md: the package, its version, credentials for online mode, its run starting),
scalars and text to every sink, the run finished at the end, also on errors, and only on the writer rank.

wandb is not installed here and no test may reach the network: a stand-in module in sys.modules records what the
logger asks of it.
"""
import io
import math
import sys
import types

import pytest

from megakern.train import log as _log
from megakern.train.log import LoggerError, RunLogger, WandbOptions, read_records

FLOOR = ".".join(map(str, _log.MIN_WANDB))


class FakeRun:
    def __init__(self, fail_finish=False):
        self.logged, self.finished, self.fail_finish = [], [], fail_finish
        self.name = "fake-run-1"

    def log(self, data, step=None):
        self.logged.append((step, dict(data)))

    def finish(self, exit_code=None):
        self.finished.append(exit_code)
        if self.fail_finish:
            raise ConnectionError("upload interrupted")


def fake_wandb(version="0.19.1", init=None):
    """A module standing in for an installed wandb: ``init`` (default: records its arguments, returns a FakeRun)."""
    mod = types.ModuleType("wandb")
    mod.__file__ = "/site-packages/wandb/__init__.py"
    mod.__version__ = version
    mod.inits, mod.runs = [], []

    def record_init(**kwargs):
        mod.inits.append(kwargs)
        mod.runs.append(FakeRun())
        return mod.runs[-1]

    mod.init = init or record_init
    mod.Table = lambda columns, data: ("table", tuple(columns), tuple(map(tuple, data)))
    return mod


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    """No WANDB_API_KEY, no identity token, an empty home: online mode has no credentials."""
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL", "NETRC"):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def logger(run_dir, wandb=None, **kwargs):
    return RunLogger(run_dir, tensorboard=kwargs.pop("tensorboard", False), progress=False, total_steps=10,
                     stream=io.StringIO(), wandb=wandb, **kwargs)


def test_scalars_and_text_reach_every_sink_and_the_run_is_finished(tmp_path, monkeypatch, no_credentials):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    config = {"format_version": 1, "optim": {"lr": 3e-4}}
    log = logger(tmp_path / "run", WandbOptions("megakern-tests", entity="team", name="tiny"), tensorboard=True,
                 run_config=config)
    assert wandb.inits == [dict(project="megakern-tests", entity="team", name="tiny", mode="online",
                                dir=str(tmp_path / "run"), config=config)]
    log.record(1, {"train/loss": 5.5, "perf/mfu": None, "train/grad_norm": math.inf})
    log.record(2, {"train/loss": 4.25, "eval/loss": 4.5})
    log.text("sample", "def f():", 2)
    log.close()
    log.close()  # closing again does nothing
    run = wandb.runs[0]
    assert run.logged == [(1, {"train/loss": 5.5}), (2, {"train/loss": 4.25, "eval/loss": 4.5}),
                          (2, {"sample": ("table", ("step", "text"), ((2, "def f():"),))})]
    assert run.finished == [0]
    events = EventAccumulator(str(tmp_path / "run" / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 5.5), (2, 4.25)]
    records = read_records(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2] and records[0]["perf/mfu"] is None
    assert "Weights & Biases: run fake-run-1 (project 'megakern-tests', entity 'team', mode online)" in \
        (tmp_path / "run" / "train.log").read_text()


def test_a_failed_run_is_finished_with_exit_code_1_and_a_finish_failure_loses_nothing(tmp_path, monkeypatch,
                                                                                      no_credentials):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    log = logger(tmp_path / "run", WandbOptions("p", mode="offline"))
    log.close(failed=True)
    assert wandb.runs[0].finished == [1]

    wandb.init = lambda **kwargs: FakeRun(fail_finish=True)
    log = logger(tmp_path / "again", WandbOptions("p", mode="offline"))
    log.record(1, {"train/loss": 1.0})
    log.close()  # the log file is still closed, with the failure in it
    text = (tmp_path / "again" / "train.log").read_text()
    assert "warning: Weights & Biases did not finish its run: ConnectionError: upload interrupted" in text
    assert '{"step": 1, "train/loss": 1.0}' in text and log.file is None and log.wandb is None


@pytest.mark.parametrize("module, message", [
    (None, rf"^wandb>={FLOOR} is needed for log.wandb=true \(Weights & Biases logging\) but cannot be imported "
           rf"\(ModuleNotFoundError: .*\); pip install -U 'wandb>={FLOOR}'; or set log.wandb=false$"),
    (fake_wandb("0.16.6"), rf"^wandb>={FLOOR} is needed for log.wandb=true .*, found wandb 0.16.6 "
                           r"\(/site-packages/wandb/__init__.py\); pip install -U"),
    ("shadow", r"'import wandb' found a folder without the package \(/home/me/project/wandb\), which shadows any "
               r"installed one"),
], ids=["missing", "too-old", "shadowed-by-a-run-folder"])
def test_missing_or_old_wandb_stops_the_start(tmp_path, monkeypatch, no_credentials, module, message):
    if module == "shadow":  # wandb's own default run folder, ./wandb, imported as a namespace package
        module = types.ModuleType("wandb")
        module.__path__ = ["/home/me/project/wandb"]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    with pytest.raises(LoggerError, match=message):
        logger(tmp_path / "run", WandbOptions("p"))
    assert "error: LoggerError: wandb>=" in (tmp_path / "run" / "train.log").read_text()


def test_online_mode_needs_credentials(tmp_path, monkeypatch, no_credentials):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    with pytest.raises(LoggerError, match=r"^log.wandb_mode=online needs Weights & Biases credentials for "
                                          r"api.wandb.ai, and none were found: set WANDB_API_KEY, or run `wandb login` "
                                          rf"\(it writes an entry to {no_credentials / '.netrc'}\); or set "
                                          r"log.wandb_mode=offline"):
        logger(tmp_path / "run", WandbOptions("p"))
    assert wandb.inits == []  # refused before any run was started
    netrc = no_credentials / ".netrc"
    netrc.write_text("machine github.com login me password abc\n")  # an entry for another host only
    with pytest.raises(LoggerError, match="needs Weights & Biases credentials for api.wandb.ai"):
        logger(tmp_path / "run", WandbOptions("p"))
    assert _log.wandb_credentials() is None
    netrc.write_text("machine github.com login me password abc\nmachine api.wandb.ai\n  login user\n  password "
                     + "0" * 40 + "\n")
    assert _log.wandb_credentials() == f"the {netrc} entry for api.wandb.ai"
    logger(tmp_path / "run", WandbOptions("p")).close()
    assert wandb.inits[-1]["mode"] == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com:8443")  # a self-hosted server: its own entry
    assert _log.wandb_credentials() is None
    other = no_credentials / "elsewhere.netrc"
    other.write_text("machine wandb.example.com:8443 login user password " + "1" * 40 + "\n")
    monkeypatch.setenv("NETRC", str(other))
    assert _log.wandb_credentials() == f"the {other} entry for wandb.example.com:8443"
    token = no_credentials / "token.jwt"
    token.write_text("eyJ")
    monkeypatch.setenv("WANDB_IDENTITY_TOKEN_FILE", str(token))
    assert _log.wandb_credentials() == f"the identity token file {token}"
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert _log.wandb_credentials() == "WANDB_API_KEY"


def test_unreadable_netrc_is_named(tmp_path, monkeypatch, no_credentials):
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb())
    (no_credentials / ".netrc").write_text("machine api.wandb.ai secret " + "0" * 40 + "\n")
    with pytest.raises(LoggerError, match=rf"log.wandb: the netrc file {no_credentials / '.netrc'} cannot be read "
                                          r"\(bad follower token 'secret'"):
        logger(tmp_path / "run", WandbOptions("p"))
    (no_credentials / ".netrc").write_text("machine api.wandb.ai login user password\n")  # no password
    assert _log.wandb_credentials() is None


def test_offline_mode_needs_no_credentials(tmp_path, monkeypatch, no_credentials):
    wandb = fake_wandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    logger(tmp_path / "run", WandbOptions("p", mode="offline")).close()
    assert wandb.inits[0]["mode"] == "offline" and wandb.runs[0].finished == [0]


def test_init_that_fails_stops_the_start_and_closes_the_other_sinks(tmp_path, monkeypatch, no_credentials):
    def refuse(**kwargs):
        raise RuntimeError("CommError: It appears that you do not have permission to access the requested resource")

    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init=refuse))
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    with pytest.raises(LoggerError, match=r"^Weights & Biases could not start a run \(project 'p', entity 'them', "
                                          r"mode online\): RuntimeError: CommError: It appears .*check the project, "
                                          r"entity and credentials"):
        logger(tmp_path / "run", WandbOptions("p", entity="them"))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb(init=lambda **kwargs: None))
    with pytest.raises(LoggerError, match=r"wandb.init returned None \(is WANDB_MODE=disabled set\?\)"):
        logger(tmp_path / "run", WandbOptions("p"))
    log_text = (tmp_path / "run" / "train.log").read_text()
    assert log_text.count("error: LoggerError: Weights & Biases") == 2  # written, and the file closed each time


def test_only_the_writer_rank_logs_and_checks(tmp_path, monkeypatch, no_credentials):
    monkeypatch.setitem(sys.modules, "wandb", None)  # would fail the check on the writer rank
    quiet = logger(tmp_path / "run", WandbOptions("p"), enabled=False)
    quiet.record(1, {"train/loss": 1.0})
    quiet.text("sample", "x", 1)
    quiet.close(failed=True)
    assert not (tmp_path / "run").exists()


def test_options_are_checked():
    with pytest.raises(ValueError, match="mode must be 'online' or 'offline', got 'disabled'"):
        WandbOptions("p", mode="disabled")
    with pytest.raises(ValueError, match="project must be a non-empty str"):
        WandbOptions(" ")

