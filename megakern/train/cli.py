"""The console script ``megakern-train`` (``python -m megakern.train``): the config from defaults, --config and
key=value overrides, the run, and exit codes (0 done; 1 an error; 2 a config error; 75 stopped by a signal)."""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch.distributed as dist

from megakern.checkpoint import CheckpointError
from megakern.config import ConfigError, describe_fields, load_config, to_yaml
from megakern.data import DataError
from megakern.train.log import LoggerError
from megakern.train.loop import TrainingHalted
from megakern.train.run_dir import RunDirError
from megakern.train.stopping import EXIT_INTERRUPTED, Interrupted, StopSignals
from megakern.train.trainer import Trainer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="megakern-train", description="Train a GPT built from megakern's kernels. Config: defaults (gpt-tiny "
        "on the default corpus), then --config FILE, then key=value overrides (optim.lr=3e-4 model.n_layer=12).")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides (see --help-config)")
    parser.add_argument("--config", type=Path, help="a YAML file of sections (configs/*.yaml)")
    parser.add_argument("--profile", action="store_true",
                        help="run log.profile_wait + warmup + active steps under torch.profiler, write a trace and a "
                             "top-kernels table into log.profile_dir, and stop")
    parser.add_argument("--help-config", action="store_true", help="list every config key and exit")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    return parser.parse_args(argv)


def expected_errors() -> tuple[type[BaseException], ...]:
    """The errors a run reports as one ``megakern-train: error:`` line (and a log line): bad config, data,
    checkpoints, log sinks, run directories, a halted run, and megakern.parallel's start-up failures (a rank that
    never joined, ranks that disagree)."""
    errors: tuple = (ConfigError, DataError, CheckpointError, LoggerError, TrainingHalted, RunDirError)
    try:
        from megakern.parallel.dims import DisagreementError, RendezvousError

        errors += (RendezvousError, DisagreementError)
    except ImportError:
        pass
    return errors


def main(argv=None) -> int:
    """The console script. Exit codes: 0 done; 1 an error (one line on stderr, and in train.log once the run
    directory exists); 2 a config error; EXIT_INTERRUPTED (75) stopped by SIGTERM / SIGINT after saving a
    checkpoint, or by a second signal without one."""
    args = parse_args(argv)
    trainer = None
    signals = StopSignals(log=lambda line: print(f"megakern-train: {line}", file=sys.stderr, flush=True))
    try:
        if args.help_config:
            print(describe_fields())
            return 0
        config = load_config(args.config, args.overrides)
        if args.print_config:
            print(to_yaml(config), end="")
            return 0
        signals.install()
        trainer = Trainer(config, profile=args.profile, signals=signals)
        result = trainer.run()  # (releases a CUDA-graph step: NCCL's teardown would wait on a live graph's work)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank done with its collectives before any tears its process group down
        return EXIT_INTERRUPTED if result.stopped_by else 0
    except expected_errors() as exc:
        print(f"megakern-train: error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ConfigError) else 1
    except (Interrupted, KeyboardInterrupt) as exc:
        print(f"megakern-train: stopped: {exc or 'interrupted'}", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signals.restore()
        live_graph = trainer is not None and trainer.graph is not None and trainer.graph.live
        if dist.is_available() and dist.is_initialized() and not live_graph:
            dist.destroy_process_group()  # (after an error with a live graph: left to the exit, which aborts NCCL)
            # the process groups' objects (and gloo's worker threads) live on while the trainer's groups and meshes
            # reference them: collected here, while the interpreter is alive. Left to the exit, a gloo worker could
            # still be freeing the last collectives' tensors during finalization, and aborted the process
            # ("terminate called without an active exception") after a complete run
            trainer = None
            gc.collect()

