"""A run's place: the device (``resolve_device``), the precision (``resolve_precision``), the FP8 recipe, and the
process's place among the ranks (``setup_distributed`` -> Dist and megakern.parallel's mesh: one process gets a
local mesh of ones, without a process group)."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megakern.config import ConfigError, TrainConfig, to_dict


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"train.device={name!r} but CUDA is not available (torch {torch.__version__})")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def resolve_precision(precision: str, device: torch.device) -> str:
    if precision == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision != "fp32" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"train.precision={precision!r}: {torch.cuda.get_device_name(device)} has no bf16")
    return precision



def fp8_recipe(name: str):
    from megakern import fp8

    return {"delayed": fp8.DelayedScaling, "current": fp8.CurrentScaling, "block": fp8.BlockScaling}[name]()


# ---------------------------------------------------------------------------------------------------------------
# Distributed: every run has megakern.parallel's mesh; one process's is local (no process group).

@dataclass
class Dist:
    """This process's place: global rank and world size, the data-parallel rank and size the sampler uses, and
    megakern.parallel's mesh (a local mesh of ones for a single process)."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    mesh: object = None

    @property
    def writer(self) -> bool:
        return self.rank == 0


def setup_distributed(config: TrainConfig, device: torch.device) -> Dist:
    """megakern.parallel's mesh of the run: one process with every parallel size 1 gets a local mesh (no process
    group); otherwise (torchrun) ParallelDims builds the groups, with the rendezvous timeout and a check that every
    rank runs the same config."""
    p = config.parallel
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and max(p.tp, p.pp, p.cp, p.ep) == 1 and p.dp in (-1, 1) and not dist.is_initialized():
        from megakern.parallel import ParallelDims

        return Dist(mesh=ParallelDims(world_size=1).build(device.type))
    if world == 1 and not dist.is_initialized():
        raise ConfigError(f"parallel sizes tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep} need several ranks; "
                          f"launch with torchrun --nproc-per-node N -m megakern.train ...")
    try:
        from megakern.parallel import ParallelDims
    except ImportError as exc:
        raise ConfigError(f"a run over {world} ranks (parallel: tp={p.tp} pp={p.pp} dp={p.dp} cp={p.cp} ep={p.ep}) "
                          f"needs megakern.parallel, which cannot be imported ({exc})") from None
    try:
        mesh = ParallelDims(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, ep=p.ep).build(
            device.type, timeout=p.init_timeout_s, agree={"config": to_dict(config)})
    except ValueError as exc:
        raise ConfigError(f"parallel: {exc}") from None
    return Dist(rank=mesh.rank, world=mesh.dims.world_size, dp_rank=mesh.dp_rank, dp_size=mesh.dims.dp, mesh=mesh)

