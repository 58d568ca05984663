"""Run under torchrun by test_train.py: several refusals in one launch. The trainer of the common overrides plus each
case's own is built in turn; rank 0 prints one JSON line a case, {"case": NAME, "refused": the ConfigError's message,
or null where the trainer started}.

    parallel_refusal_probe.py OVERRIDE... --case NAME OVERRIDE... [--case NAME OVERRIDE...]...

A refused trainer's process groups are left to the process's end: each case builds its own.
"""
import json
import os
import sys

from probe_args import split_runs  # this script's folder

from megakern.config import ConfigError, load_config
from megakern.train import Trainer


def main() -> None:
    import torch.distributed as dist

    for name, overrides in split_runs(sys.argv[1:], "--case"):
        try:
            Trainer(load_config(None, overrides), stream=open(os.devnull, "w")).close()
            refused = None
        except ConfigError as exc:
            refused = str(exc)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps({"case": name, "refused": refused}), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
