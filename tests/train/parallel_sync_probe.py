"""Run under torchrun by test_train_sync.py: build the trainer from the overrides on the command line, run one
warm-up step, then one step watched for host reads of device values; rank 0 prints them as one JSON line.

    parallel_sync_probe.py OVERRIDE... [--probe NAME OVERRIDE...]...

Each ``--probe`` probes a trainer of the common overrides plus its own, one after the other in the same ranks (one
launch for several layouts): rank 0 prints one JSON line per run, {"run": NAME, ...}. Between runs every rank releases
the trainer's process groups (its mesh's and the rest) so that the next builds its own. A run that raises ends the
probe (a non-zero exit), its name on stderr before the traceback. Without ``--probe``: one probe of the overrides.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: host_reads

from host_reads import host_reads  # noqa: E402
from probe_args import split_runs  # noqa: E402

from megakern.config import load_config  # noqa: E402
from megakern.train import Trainer  # noqa: E402


def probe(overrides: list[str]) -> dict:
    """This rank's {device_skip, reads, figures, skipped, unchanged} of one trainer, whose groups are released after."""
    import torch
    import torch.distributed as dist

    config = load_config(None, overrides)
    t = Trainer(config, stream=open(os.devnull, "w"))
    batches = t.batches(t.data.train, 0, t.draw)
    t.stepper.set_training(True)
    t.train_step(batches).read()  # warm-up: optimizer state allocated, schedules built
    t.step += 1
    reads = host_reads(t.train_step, batches)
    figures = t.train_step(batches).read()
    # a non-finite step: one rank's gradient overflows (a NaN in rank 0's shard of the first gradient); the norm,
    # reduced over every group, is NaN on all ranks, which all skip: no parameter may change anywhere
    forward_backward = t.stepper.pmodel.forward_backward

    def overflowing(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        if dist.get_rank() == 0:
            grad = next(p.grad for p in t.model.parameters() if p.grad is not None)
            (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("nan")
        return loss

    t.stepper.pmodel.forward_backward = overflowing

    def full(p):
        p = p.detach()
        return p.full_tensor() if hasattr(p, "full_tensor") else p

    before = [full(p).clone() for p in t.model.parameters()]
    skipped = t.train_step(batches).read()
    unchanged = all(torch.equal(a, full(b)) for a, b in zip(before, t.model.parameters()))
    out = {"device_skip": t.stepper.device_skip, "reads": reads, "figures": figures, "skipped": skipped,
           "unchanged": unchanged}
    t.close()
    if dist.is_initialized():
        dist.barrier()  # every rank done with the groups before any destroys them
        _release(t)
    return out


def _release(t) -> None:
    """The trainer's mesh closed (its groups and torch's DTensor caches of it) and every other group it made
    destroyed; the default group stays for the next run."""
    import gc

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _world

    t.env.mesh.close()
    for group in [g for g in _world.pg_map if g is not dist.group.WORLD]:
        dist.destroy_process_group(group)
    gc.collect()


def parse(argv: list[str]) -> list[tuple[str | None, list[str]]]:
    """[(run name, overrides)]: the common overrides, then each ``--probe NAME``'s own (one unnamed run without)."""
    return split_runs(argv, "--probe") or [(None, list(argv))]


def main() -> None:
    import torch.distributed as dist

    rank0 = int(os.environ.get("RANK", "0")) == 0
    for name, overrides in parse(sys.argv[1:]):
        try:
            out = probe(overrides)
        except BaseException:
            print(f"parallel_sync_probe: run {name} failed on rank {os.environ.get('RANK', '0')}:", file=sys.stderr,
                  flush=True)
            raise
        if rank0:
            print(json.dumps({"run": name, **out}), flush=True)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
