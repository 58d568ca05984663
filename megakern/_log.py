"""What a run reports: console (a tqdm progress bar and log lines), a log file, TensorBoard scalars, and the
figures behind them (tokens/s, model FLOPs utilization, memory).

Every sink is opened and checked when the run starts (ASSUMPTIONS 29): a log file that cannot be written, or
TensorBoard asked for but not installed or not writable, stops the run before any step, never in the middle of it.

MFU = achieved model FLOP/s per device / the device's dense bf16 peak. The numerator is the model's
``flops_per_token(seq_length)`` (6N plus attention, per token of a training step) x tokens/s on this rank. The peak
comes from the accelerator's name (``PEAK_BF16_FLOPS``, vendors' dense figures, no sparsity); an accelerator not in
the table, or a CPU, shows MFU as n/a (the reason is logged once). Times are integer nanoseconds from
``time.perf_counter_ns`` (ASSUMPTIONS 1, 9); nothing compares clocks across ranks.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import resource
import sys
from pathlib import Path

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


class LoggerError(RuntimeError):
    """A log sink that cannot start (missing package, unwritable directory)."""


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
    return None, f"{name}: not in megakern._log.PEAK_BF16_FLOPS (add its dense bf16 peak to get MFU)"


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
    """Console, ``<run_dir>/train.log`` and TensorBoard (``<run_dir>/tb``), opened and checked at construction.
    The progress bar is drawn only on a terminal.

    Only the writer rank (``enabled``) writes; other ranks get a logger that does nothing.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool, progress: bool, total_steps: int, initial_step: int = 0,
                 enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stdout
        self.bar = self.tb = self.file = None
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
        if tensorboard:
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
        if progress:
            try:
                from tqdm import tqdm
            except ImportError:
                raise LoggerError("log.progress=true needs tqdm: pip install tqdm, or set log.progress=false") from None
            if getattr(self.stream, "isatty", lambda: False)():  # a pipe or a file gets the log lines only
                self.bar = tqdm(total=total_steps, initial=initial_step, file=self.stream, dynamic_ncols=True,
                                unit="step", leave=True, smoothing=0.1)

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
        """TensorBoard scalars of ``step`` and a JSON line in the log file."""
        if not self.enabled or self.file is None:
            return
        if self.tb is not None:
            for name, value in scalars.items():
                if value is not None and math.isfinite(value):
                    self.tb.add_scalar(name, value, step)
        self.file.write(json.dumps({"step": step, **scalars}, allow_nan=True) + "\n")

    def progress(self, step: int, postfix: str) -> None:
        """Move the bar to ``step`` with ``postfix`` (step, loss, lr, tok/s, MFU, memory)."""
        if self.enabled and self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.refresh()

    def text(self, tag: str, text: str, step: int) -> None:
        if self.enabled and self.tb is not None:
            self.tb.add_text(tag, text, step)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.flush()
            self.tb.close()
            self.tb = None
        if self.file is not None:
            self.file.close()
            self.file = None
