"""Checkpoints reshard: saved under one (tp, pp, dp) layout with torch.distributed.checkpoint, loaded under another
(and by a plain single-process GPT), training goes on exactly as it would have."""
import torch
import torch.distributed.checkpoint as dcp
from gpt_check import batches, tiny_config, train_and_checkpoint
from rankpool import pool

from megakern.models.gpt import GPT


def test_checkpoint_reshards_across_layouts(tmp_path):
    directory = str(tmp_path / "ckpt")
    saved = pool(4).run(train_and_checkpoint, dict(tp=2, dp=2), dict(dp_shard="fsdp"), directory, save=True)
    # tp2 x dp2 (FSDP) -> pp2 x dp2 (DDP + ZeRO-1, the tied head on the last stage)
    loaded = pool(4).run(train_and_checkpoint, dict(pp=2, dp=2), dict(dp_shard="ddp", zero1=True, microbatches=2),
                         directory, save=False, seed=1)
    for mine in saved + loaded:
        torch.testing.assert_close(torch.tensor(mine), torch.tensor(saved[0]), rtol=1e-4, atol=1e-5)
    # -> one process, no torch.distributed: a plain GPT reads the model's tensors
    cfg = tiny_config("gpt", 2)
    torch.manual_seed(5)
    model = GPT(cfg)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    idx, targets = batches(4, 4, 16, cfg.vocab_size)[2]
    with torch.no_grad():
        torch.testing.assert_close(model(idx, targets).item(), saved[0][0], rtol=1e-4, atol=1e-5)
