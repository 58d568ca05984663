"""Dropout under model parallelism: an RNG-state tracker (Megatron's CudaRNGStatesTracker, device-agnostic).

Dropout draws from the default generator of the activations' device (``torch.default_generator`` on CPU,
``torch.cuda.default_generators[i]`` on GPU i). A rank's default generator is shared with everything else that
draws on it (data order, sampling, initialization), so under model parallelism it cannot say which ranks must draw
the same mask. The tracker keeps one generator state per *region* and stage; ``with tracker.fork(region, stage):``
swaps the device's default generator to that state for the block of code and saves the advanced state back on
exit (also on an error), leaving the default generator exactly as it was.

Regions (seeds derived from one common ``seed`` and the rank's coordinates, hashed so no two collide):

| region | seed depends on | use |
|---|---|---|
| ``"replicated"`` | seed, pipeline stage, dp rank, cp rank | activations that are whole and equal on the tp ranks |
| ``"tensor_parallel"`` | the same and the tp rank | activations split over tp (heads, or token shards) |

- Replicated activations (the residual stream without sequence parallelism) must get the *same* mask on every
  tp rank, or the ranks' copies drift apart: the common seed.
- Activations split over tp draw *different* masks per tp rank. This includes the sequence-parallel regions: their
  shards hold different tokens, and a common seed would repeat one mask pattern in every shard (token t of shard 0
  and token t + T/tp of shard 1 dropped together), so, as in Megatron-LM, they draw from the tp-offset seed.
- dp and cp ranks hold different data: their seeds differ, as do the pipeline stages' (different layers).

With these streams a parallel model cannot reproduce the single-process model's masks bit for bit where the
activation is split over tp: the single model draws one (B, T, C) mask in one stream, the ranks draw (B, T/tp, C)
shards in tp independent streams. It is the single model *with the masks the ranks drew* (concatenated), which is
what the tests check; with replicated activations (tp without sequence parallel, or tp = 1) a single-process
model forked to the same "replicated" state draws the very same masks.

The tracker is an explicit object (no module state): ``parallelize`` builds one per ParallelModel (or takes one).
"""
from __future__ import annotations

import contextlib
import hashlib

import torch

REGIONS = ("replicated", "tensor_parallel")


def default_generator(device) -> torch.Generator:
    """The generator that random ops on ``device`` draw from by default."""
    device = torch.device(device)
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type, None)
    gens = getattr(module, "default_generators", None)
    if gens is None:
        raise ValueError(f"RNGTracker: no default generators for device type {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_initialized():
        torch.cuda.init()  # default_generators is empty until CUDA is initialized
        gens = torch.cuda.default_generators
    index = device.index if device.index is not None else getattr(module, "current_device")()
    return gens[index]


def region_seed(seed: int, region: str, *, stage: int = 0, dp_rank: int = 0, cp_rank: int = 0,
                tp_rank: int = 0) -> int:
    """The 63-bit seed of a region for a rank's coordinates (``tp_rank`` counts only in "tensor_parallel")."""
    if region not in REGIONS:
        raise ValueError(f"RNGTracker: unknown region {region!r}; regions: {', '.join(REGIONS)}")
    key = (int(seed), region, int(stage), int(dp_rank), int(cp_rank), int(tp_rank) if region != "replicated" else 0)
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little") & (2**63 - 1)


class RNGTracker:
    """Generator states per (region, stage) for one rank; see the module docstring.

    ``seed``: common to all ranks; ``device``: where the activations live (its default generator is forked);
    ``dp_rank``, ``cp_rank``, ``tp_rank``: this rank's coordinates (a ParallelMesh gives them: ``from_mesh``).
    """

    def __init__(self, seed: int, device="cpu", *, dp_rank: int = 0, cp_rank: int = 0, tp_rank: int = 0):
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"RNGTracker: seed must be an int, got {seed!r}")
        self.seed, self.device = seed, torch.device(device)
        self.dp_rank, self.cp_rank, self.tp_rank = dp_rank, cp_rank, tp_rank
        self._states: dict[tuple[str, int], torch.Tensor] = {}
        self._active = False

    @classmethod
    def from_mesh(cls, seed: int, mesh) -> RNGTracker:
        """The tracker of this rank of a ParallelMesh."""
        return cls(seed, mesh.device, dp_rank=mesh.dp_rank, cp_rank=mesh.cp_rank, tp_rank=mesh.tp_rank)

    def seed_of(self, region: str, stage: int = 0) -> int:
        return region_seed(self.seed, region, stage=stage, dp_rank=self.dp_rank, cp_rank=self.cp_rank,
                           tp_rank=self.tp_rank)

    def _initial_state(self, region: str, stage: int) -> torch.Tensor:
        gen = torch.Generator(device=self.device)
        gen.manual_seed(self.seed_of(region, stage))
        return gen.get_state()

    @contextlib.contextmanager
    def fork(self, region: str, stage: int = 0):
        """Run the block with the device's default generator at this (region, stage)'s state; on exit keep the
        advanced state for next time and give the default generator its own state back. Not reentrant."""
        if self._active:
            raise RuntimeError("RNGTracker.fork: already inside a fork (regions do not nest)")
        key = (region, stage)
        if key not in self._states:
            self._states[key] = self._initial_state(region, stage)
        gen = default_generator(self.device)
        saved = gen.get_state()
        gen.set_state(self._states[key])
        self._active = True
        try:
            yield
        finally:
            self._active = False
            self._states[key] = gen.get_state()
            gen.set_state(saved)

    def state_dict(self) -> dict:
        """{"seed", "states": {"region/stage": ByteTensor}} (to resume a run with the same masks)."""
        return {"seed": self.seed, "states": {f"{r}/{s}": t.clone() for (r, s), t in self._states.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"RNGTracker: the saved states are of seed {state.get('seed')}, this tracker's is "
                             f"{self.seed}")
        states = {}
        for key, t in state["states"].items():
            region, stage = key.rsplit("/", 1)
            if region not in REGIONS:
                raise ValueError(f"RNGTracker: unknown region {region!r} in the saved states")
            states[(region, int(stage))] = t.clone()
        self._states = states

    def __repr__(self) -> str:
        return (f"RNGTracker(seed={self.seed}, device={self.device}, dp {self.dp_rank}, cp {self.cp_rank}, "
                f"tp {self.tp_rank})")
