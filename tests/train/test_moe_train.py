"""The training program with MoE layers on CPU: configs/moe-tiny.yaml through ``python -m megakern.train`` (the loss
falls, the log and TensorBoard-bound records carry the MoE figures), exact resume with the sigmoid router's bias and
the experts' weights, a step whose router saw non-finite logits skipped with the bias untouched."""
import subprocess
import sys
from pathlib import Path

import torch

from megakern.config import load_config
from megakern.train import Trainer
from megakern.train.log import read_records

REPO = Path(__file__).resolve().parents[2]
QUIET = ["log.tensorboard=false", "log.progress=false", "train.sample_tokens=0", "data.num_workers=0",
         "train.device=cpu"]
SMALL = QUIET + ["train.micro_batch_size=8", "train.seq_length=128", "eval.every=0", "checkpoint.final=false"]
MOE_KEYS = ("moe/tokens_per_expert_min", "moe/tokens_per_expert_max", "moe/tokens_per_expert_mean", "moe/imbalance",
            "moe/dropped", "moe/aux_loss", "moe/z_loss")


def test_moe_tiny_trains_through_the_command_line(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megakern.train", "--config", str(REPO / "configs" / "moe-tiny.yaml"), *SMALL,
           "train.steps=30", "schedule.warmup_steps=10", "log.every=10", "model.moe_capacity_factor=1.5",
           f"log.run_dir={run}", f"data.cache_dir={tmp_path / 'data'}"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert "active per token: 2 of 8 experts" in log
    assert "step     30/30 | loss" in log and "| MoE tokens/expert " in log and " imbalance " in log
    records = [r for r in read_records(run) if "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, 31))
    losses = [r["train/loss"] for r in records]
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < losses[0] - 1.5, losses
    for r in records:
        assert all(k in r for k in MOE_KEYS), sorted(r)
        assert r["moe/tokens_per_expert_mean"] == 8 * 128 * 2 / 8  # a step's tokens x top-2 / 8 experts
        assert 1.0 <= r["moe/imbalance"] and 0.0 <= r["moe/dropped"] < 1.0 and r["moe/aux_loss"] > 0.5
        assert {f"moe/imbalance/block{b}" for b in (1, 2, 3)} <= set(r)
    assert any(r["moe/dropped"] > 0 for r in records)  # capacity 1.5 drops while the router is unbalanced


def _trainer(tmp_path, name, *overrides):
    config = load_config(REPO / "configs" / "moe-tiny.yaml",
                         [*SMALL, "model.n_layer=2", "model.moe_router=sigmoid", "model.moe_bias_update_rate=0.01",
                          "model.moe_renormalize=true", "train.global_batch_size=16", "train.steps=8",
                          *overrides, f"log.run_dir={tmp_path / name}", f"data.cache_dir={tmp_path / 'data'}"])
    return Trainer(config, stream=open(tmp_path / f"{name}.console", "a"))


def _state(trainer):
    layer = trainer.model.moe_layers()[0]
    return layer.router.expert_bias.clone(), layer.w_in.detach().clone(), layer.w_out.detach().clone()


def test_moe_exact_resume(tmp_path):
    """Stopping at step 4 and resuming gives the same losses bit for bit, the same routers' biases and experts."""
    whole_trainer = _trainer(tmp_path, "a", "checkpoint.every=4")
    whole = whole_trainer.run()
    resumed_trainer = _trainer(tmp_path, "b", f"checkpoint.resume={tmp_path / 'a' / 'checkpoints' / 'step_00000004'}")
    assert resumed_trainer.step == 4
    resumed = resumed_trainer.run()
    assert [resumed.losses[s] for s in range(5, 9)] == [whole.losses[s] for s in range(5, 9)]
    bias, w_in, w_out = _state(whole_trainer)
    bias_b, w_in_b, w_out_b = _state(resumed_trainer)
    assert bias.abs().sum() > 0 and torch.equal(bias, bias_b)
    assert torch.equal(w_in, w_in_b) and torch.equal(w_out, w_out_b)


def test_nonfinite_router_logits_skip_the_step_and_keep_the_bias(tmp_path):
    t = _trainer(tmp_path, "c", "train.steps=1")
    layer = t.model.moe_layers()[0]
    with torch.no_grad():
        layer.router.weight[0].fill_(float("inf"))  # sigmoid(+-inf) is finite: only the count tells
    bias = layer.router.expert_bias.clone()
    result = t.run()
    assert result.skipped_steps == [1]
    assert torch.equal(layer.router.expert_bias, bias)
    assert "non-finite MoE router logits" in (tmp_path / "c" / "train.log").read_text()
