"""What a run reports: console (a tqdm progress bar and log lines), a log file, TensorBoard scalars, Weights & Biases
(optional), and the figures behind them (tokens/s, model FLOPs utilization, memory).

Every sink is opened and checked when the run starts (contract 29, docs/contracts.md): a log file that cannot be
written, TensorBoard asked for but not installed or not writable, or Weights & Biases asked for but not installed, older
than ``MIN_WANDB`` (contract 35), without credentials for online mode or failing to start its run, stops the run before
any step, never in the middle of it. Credentials are looked up as wandb does, without the network: WANDB_API_KEY,
WANDB_IDENTITY_TOKEN_FILE, or a netrc entry (``wandb login`` writes one) for the host of WANDB_BASE_URL.

MFU = achieved model FLOP/s per device / the device's dense bf16 peak. The numerator is the model's
``flops_per_token(seq_length)`` (6N plus attention, per token of a training step) x tokens/s on this rank. The peak
comes from the accelerator's name (``PEAK_BF16_FLOPS``, vendors' dense figures, no sparsity); an accelerator not in
the table, or a CPU, shows MFU as n/a (the reason is logged once). Times are integer nanoseconds from
``time.perf_counter_ns`` (contracts 1, 9); nothing compares clocks across ranks.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import netrc
import os
import resource
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

import torch

# Dense bf16 tensor-core peak FLOP/s per device, by a substring of the device name (most specific first).
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4e12),
    ("H200", 989.4e12),
    ("H100 PCIe", 756.5e12),
    ("H100 NVL", 835.5e12),
    ("H100", 989.4e12),      # SXM: 'NVIDIA H100 80GB HBM3'
    ("H800 PCIe", 756.5e12),
    ("H800", 989.4e12),
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("B100", 1750e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362.05e12),
    ("L40", 181.05e12),
    ("L4", 121e12),
    ("RTX 4090", 165.2e12),
    ("MI325X", 1307.4e12),
    ("MI300X", 1307.4e12),
    ("MI250X", 383e12),
)


MIN_WANDB = (0, 17, 2)  # the first wandb that imports under numpy 2 (np.float_ and np.complex_ are gone there)
WANDB_HOST = "https://api.wandb.ai"


class LoggerError(RuntimeError):
    """A log sink that cannot start (missing package, unwritable directory, no credentials)."""


@dataclasses.dataclass(frozen=True)
class WandbOptions:
    """A Weights & Biases run (the keys log.wandb_*): ``wandb.init``'s project, entity (None: the account's
    default), name (None: wandb's) and mode ('online' | 'offline')."""

    project: str
    entity: str | None = None
    name: str | None = None
    mode: str = "online"

    def __post_init__(self):
        if self.mode not in ("online", "offline"):
            raise ValueError(f"WandbOptions.mode must be 'online' or 'offline', got {self.mode!r}")
        if not isinstance(self.project, str) or not self.project.strip():
            raise ValueError(f"WandbOptions.project must be a non-empty str, got {self.project!r}")


def netrc_path() -> Path:
    """The netrc file wandb reads and ``wandb login`` writes: $NETRC, else ~/.netrc, else ~/_netrc where only that
    one exists."""
    if os.environ.get("NETRC"):
        return Path(os.environ["NETRC"]).expanduser()
    home = Path("~").expanduser()
    if not (home / ".netrc").exists() and (home / "_netrc").exists():
        return home / "_netrc"
    return home / ".netrc"


def wandb_credentials() -> str | None:
    """Where Weights & Biases finds credentials for its server (WANDB_BASE_URL, default api.wandb.ai), or None if
    nowhere; no network involved. In wandb's order: WANDB_API_KEY, an identity token file (WANDB_IDENTITY_TOKEN_FILE,
    federated identity), a netrc entry for the server's host. A netrc file that cannot be parsed is a LoggerError
    naming it."""
    if os.environ.get("WANDB_API_KEY", "").strip():
        return "WANDB_API_KEY"
    token = os.environ.get("WANDB_IDENTITY_TOKEN_FILE", "").strip()
    if token and Path(token).expanduser().is_file():
        return f"the identity token file {token}"
    host = urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
    path = netrc_path()
    if not path.is_file():
        return None
    try:
        entry = netrc.netrc(str(path)).authenticators(host)
    except (netrc.NetrcParseError, OSError, UnicodeDecodeError) as exc:
        raise LoggerError(f"log.wandb: the netrc file {path} cannot be read ({exc}); fix it, or run `wandb login` "
                          "again") from None
    return f"the {path} entry for {host}" if entry and entry[2] else None


def peak_flops(device: torch.device) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s of ``device``, its name), or (None, why not) when it is unknown."""
    device = torch.device(device)
    if device.type == "cpu":
        return None, "CPU: no peak FLOP/s table for CPUs"
    if device.type != "cuda":
        return None, f"{device.type}: no peak FLOP/s table"
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in name.lower():
            return flops, name
    return None, f"{name}: not in megakern.train.log.PEAK_BF16_FLOPS (add its dense bf16 peak to get MFU)"


def memory_gib(device: torch.device) -> tuple[float, str]:
    """(GiB, what): peak allocated device memory on CUDA; the process's peak resident set on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "peak alloc"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib * (1 if sys.platform == "darwin" else 1024) / 2**30, "peak rss"


def format_count(n: float) -> str:
    """1234567 -> '1.23M'."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def read_records(run_dir) -> list[dict]:
    """The JSON records (``RunLogger.record``: {"step": ..., scalars}) of ``<run_dir>/train.log``, in order; text
    lines are skipped."""
    records = []
    for line in (Path(run_dir) / "train.log").read_text().splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:  # a text line that happens to start with a brace
                continue
    return records


class RunLogger:
    """Console, ``<run_dir>/train.log``, TensorBoard (``<run_dir>/tb``) and Weights & Biases (``wandb``: its options,
    files in ``<run_dir>/wandb``, ``run_config`` given to its run as the config), opened and checked at
    construction; a sink that fails there raises LoggerError after closing those already open. The progress bar is
    drawn only on a terminal. Scalars (``record``) and text (``text``) go to every sink that takes them.

    Only the writer rank (``enabled``) writes; other ranks get a logger that does nothing (and checks nothing).
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress: bool, total_steps: int, initial_step: int = 0,
                 enabled: bool = True, stream=None, wandb: WandbOptions | None = None,
                 run_config: Mapping | None = None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.bar = self.tb = self.file = self.wandb = None
        self._wandb_module = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.file = open(run_dir / "train.log", "a", buffering=1)
            self.file.write(f"# {datetime.datetime.now().isoformat(timespec='seconds')} start, pid {os.getpid()}\n")
            self.file.flush()
        except OSError as exc:
            raise LoggerError(f"cannot write the log file in {run_dir}: {exc}") from None
        try:
            if tensorboard:
                self._open_tensorboard(run_dir)
            if wandb is not None:
                self._open_wandb(run_dir, wandb, run_config)
            if progress:
                self._open_progress(total_steps, initial_step)
        except BaseException as exc:
            if self.file is not None:
                self.file.write(f"error: {type(exc).__name__}: {exc}\n")
            self.close(failed=True)
            raise

    def _open_progress(self, total_steps: int, initial_step: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            raise LoggerError("log.progress=true needs tqdm: pip install tqdm, or set log.progress=false") from None
        if getattr(self.stream, "isatty", lambda: False)():  # a pipe or a file gets the log lines only
            self.bar = tqdm(total=total_steps, initial=initial_step, file=self.stream, dynamic_ncols=True,
                            unit="step", leave=True, smoothing=0.1)

    def _open_tensorboard(self, run_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise LoggerError(f"log.tensorboard=true but TensorBoard cannot be imported ({exc}); "
                              "pip install tensorboard, or set log.tensorboard=false") from None
        try:
            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))
            self.tb.add_text("run", f"started {datetime.datetime.now().isoformat(timespec='seconds')}", 0)
            self.tb.flush()
        except Exception as exc:
            raise LoggerError(f"TensorBoard cannot write to {run_dir / 'tb'}: {exc}") from None
        if not any((run_dir / "tb").glob("events.out.tfevents.*")):
            raise LoggerError(f"TensorBoard wrote no event file in {run_dir / 'tb'}")

    def _open_wandb(self, run_dir: Path, options: WandbOptions, run_config: Mapping | None) -> None:
        from megakern._deps import optional_module

        module, problem = optional_module("wandb", MIN_WANDB, "log.wandb=true (Weights & Biases logging)")
        if module is None:
            raise LoggerError(f"{problem}; or set log.wandb=false")
        if options.mode == "online" and wandb_credentials() is None:
            host = urlparse(os.environ.get("WANDB_BASE_URL") or WANDB_HOST).netloc
            raise LoggerError(f"log.wandb_mode=online needs Weights & Biases credentials for {host}, and none were "
                              f"found: set WANDB_API_KEY, or run `wandb login` (it writes an entry to {netrc_path()}); "
                              "or set log.wandb_mode=offline (`wandb sync` uploads the run later) or log.wandb=false")
        entity = f", entity {options.entity!r}" if options.entity else ""
        where = f"project {options.project!r}{entity}, mode {options.mode}"
        try:
            run = module.init(project=options.project, entity=options.entity, name=options.name, mode=options.mode,
                              dir=str(run_dir), config=dict(run_config or {}))
        except BaseException as exc:  # wandb's errors (CommError, UsageError, ...) and its init timeout
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise LoggerError(f"Weights & Biases could not start a run ({where}): {type(exc).__name__}: {exc}; "
                              "check the project, entity and credentials, or set log.wandb_mode=offline or "
                              "log.wandb=false") from None
        if run is None:
            raise LoggerError(f"Weights & Biases did not start a run ({where}): wandb.init returned None (is "
                              "WANDB_MODE=disabled set?); unset it, or set log.wandb=false")
        self._wandb_module, self.wandb = module, run
        self.file.write(f"# Weights & Biases: run {getattr(run, 'name', None) or '?'} ({where}), files in "
                        f"{run_dir / 'wandb'}\n")

    def line(self, text: str) -> None:
        """A line on the console (above the bar) and in the log file."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)
        if self.file is not None:  # None after close(): console only
            self.file.write(text + "\n")

    def record(self, step: int, scalars: dict[str, float]) -> None:
        """Scalars of ``step``: a JSON line in the log file (all of them), the finite ones to TensorBoard and Weights
        & Biases."""
        if not self.enabled or self.file is None:
            return
        finite = {name: value for name, value in scalars.items() if value is not None and math.isfinite(value)}
        if self.tb is not None:
            for name, value in finite.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None and finite:
            self.wandb.log(finite, step=step)
        self.file.write(json.dumps({"step": step, **scalars}, allow_nan=True) + "\n")

    def progress(self, step: int, postfix: str) -> None:
        """Move the bar to ``step`` with ``postfix`` (step, loss, lr, tok/s, MFU, memory)."""
        if self.enabled and self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()

    def text(self, tag: str, text: str, step: int) -> None:
        """Text under ``tag`` at ``step``: TensorBoard's text, a Weights & Biases table of (step, text)."""
        if not self.enabled:
            return
        if self.tb is not None:
            self.tb.add_text(tag, text, step)
        if self.wandb is not None:
            self.wandb.log({tag: self._wandb_module.Table(columns=["step", "text"], data=[[step, text]])}, step=step)

    def close(self, failed: bool = False) -> None:
        """Close every sink (each one even if another fails to close); ``failed``: the run stopped on an error, which
        Weights & Biases records as the run's exit code 1. Closing again does nothing."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        problems = []
        if self.tb is not None:
            try:
                self.tb.flush()
                self.tb.close()
            except Exception as exc:  # noqa: BLE001 - the other sinks still close
                problems.append(f"TensorBoard did not close: {type(exc).__name__}: {exc}")
            self.tb = None
        if self.wandb is not None:
            try:
                self.wandb.finish(exit_code=1 if failed else 0)
            except Exception as exc:  # noqa: BLE001 - its files stay in <run_dir>/wandb for `wandb sync`
                problems.append(f"Weights & Biases did not finish its run: {type(exc).__name__}: {exc} (its files "
                                "stay in the run directory's wandb/; `wandb sync` uploads them)")
            self.wandb = self._wandb_module = None
        for problem in problems:
            print(f"warning: {problem}", file=self.stream, flush=True)
            if self.file is not None:
                self.file.write(f"warning: {problem}\n")
        if self.file is not None:
            self.file.close()
            self.file = None
