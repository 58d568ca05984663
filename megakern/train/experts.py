"""The MoE layers' figures of a training step (MoEStats): their statistics gathered over the step's micro-batches and
ranks, the sigmoid routers' bias update, and what the log shows.

Each MoE layer adds, in each training micro-batch's backward, to its row of one (L, E + 6) fp32 device tensor
(models/moe.py: tokens routed per expert, kept and routed assignments, its aux and z losses, non-finite router
logits, the micro-batch's share). After the step's forward and backward the rows are summed over the ranks that saw
other tokens of the step (data and context parallel, tensor parallel's token shards) and over the pipeline stages
(each holds its own layers' rows): every rank then has the step's whole statistics, on the device. From them:

    per layer: tokens per expert min / max / mean, dropped fraction, aux loss, z loss  (appended to the step's values,
               which reach the host with the loss: no extra read)
    the routers' balancing biases updated from the step's loads (skipped on the device with the step)
    the step skipped when a router saw non-finite logits
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megakern.models.moe import AUX, KEPT, NONFINITE, ROUTED, SHARE, Z, stat_width

PER_LAYER = ("tokens_min", "tokens_max", "tokens_mean", "dropped", "aux", "z")


class MoEStats:
    """The statistics tensor of ``pmodel``'s MoE layers (a megakern.parallel ParallelModel of a GPT with experts)."""

    def __init__(self, pmodel, device: torch.device):
        config = pmodel.config
        self.blocks, self.n_experts = list(config.moe_blocks), config.n_experts
        self.gpts = pmodel.gpts
        self.stats = torch.zeros(len(self.blocks), stat_width(self.n_experts), dtype=torch.float32, device=device)
        for g in self.gpts:
            g.track_moe_statistics(self.stats)
        mesh = pmodel.mesh
        self.groups = []
        if pmodel.dp * pmodel.cp > 1:
            self.groups.append(mesh.dp_cp_group)
        if pmodel.sequence_parallel:  # each tp rank routed its own token shard (without it: the same tokens)
            self.groups.append(mesh.tp_group)
        if pmodel.pp > 1:
            self.groups.append(mesh.pp_group)
        self.total = None

    @property
    def width(self) -> int:
        """Values this adds to a step's figures."""
        return len(self.blocks) * len(PER_LAYER) + 1

    def begin(self) -> None:
        """Before the step's forward and backward."""
        self.stats.zero_()

    def reduce(self) -> torch.Tensor:
        """After the backward: the step's statistics summed over every rank (kept for ``figures`` and
        ``update_bias``)."""
        total = self.stats.clone()
        for group in self.groups:
            dist.all_reduce(total, group=group)
        self.total = total
        return total

    def nonfinite(self) -> torch.Tensor:
        """Device bool: a router saw a non-finite logit during the step."""
        return self.total[:, self.n_experts + NONFINITE].sum() > 0

    def figures(self) -> torch.Tensor:
        """(width,) fp32: per layer PER_LAYER, then the count of non-finite router logits."""
        t, e = self.total, self.n_experts
        counts = t[:, :e]
        share = t[:, e + SHARE].clamp(min=1e-12)
        per_layer = torch.stack([counts.amin(1), counts.amax(1), counts.mean(1),
                                 1.0 - t[:, e + KEPT] / t[:, e + ROUTED].clamp(min=1.0),
                                 t[:, e + AUX] / share, t[:, e + Z] / share], dim=1)
        return torch.cat([per_layer.reshape(-1), t[:, e + NONFINITE].sum().reshape(1)])

    def update_bias(self, skip: torch.Tensor) -> None:
        """The sigmoid routers' balancing biases from the step's loads; unchanged where ``skip`` (device) is set."""
        for g in self.gpts:
            g.update_expert_bias(self.total[:, :self.n_experts], skip)

    def summary(self, values: list[float]) -> dict[str, float]:
        """What a step's ``figures`` (read on the host) log: tokens per expert min / max / mean (over experts and
        layers), imbalance (the worst layer's max / mean), dropped fraction, aux and z losses (means over layers),
        non-finite router logits; and each layer's imbalance ('imbalance/block<i>')."""
        n = len(PER_LAYER)
        rows = [values[i * n:(i + 1) * n] for i in range(len(self.blocks))]
        imbalance = [r[1] / r[2] if r[2] > 0 else float("nan") for r in rows]
        out = {"tokens_per_expert_min": min(r[0] for r in rows), "tokens_per_expert_max": max(r[1] for r in rows),
               "tokens_per_expert_mean": sum(r[2] for r in rows) / len(rows), "imbalance": max(imbalance),
               "dropped": sum(r[3] for r in rows) / len(rows), "aux_loss": sum(r[4] for r in rows) / len(rows),
               "z_loss": sum(r[5] for r in rows) / len(rows), "nonfinite_logits": values[len(rows) * n]}
        out.update({f"imbalance/block{b}": imb for b, imb in zip(self.blocks, imbalance)})
        return out
