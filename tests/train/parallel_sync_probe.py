"""Run under torchrun by test_train_sync.py: build the trainer from the overrides on the command line, run one
warm-up step, then one step watched for host reads of device values; rank 0 prints them as one JSON line."""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: host_reads

from host_reads import host_reads  # noqa: E402

from megakern.config import load_config  # noqa: E402
from megakern.train import Trainer  # noqa: E402


def main() -> None:
    config = load_config(None, sys.argv[1:])
    t = Trainer(config, stream=open(os.devnull, "w"))
    batches = t.batches(t.data.train, 0, t.draw)
    t.stepper.set_training(True)
    t.train_step(batches).read()  # warm-up: optimizer state allocated, schedules built
    t.step += 1
    reads = host_reads(t.train_step, batches)
    figures = t.train_step(batches).read()
    # a non-finite step: one rank's gradient overflows (a NaN in rank 0's shard of the first gradient); the norm,
    # reduced over every group, is NaN on all ranks, which all skip: no parameter may change anywhere
    import torch
    import torch.distributed as dist

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
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps({"device_skip": t.stepper.device_skip, "reads": reads, "figures": figures, "skipped": skipped,
                          "unchanged": unchanged}))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
