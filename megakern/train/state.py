"""A run's checkpoints: what a Trainer saves (``save``: the tensors in the single model's names, the run's state, the
config, each rank's dropout RNG tracker) and how a run resumes from one (``resume``: the model it holds checked
first, the data's fingerprint, the LR schedule kept or replaced as schedule.on_resume says, the tracker restored
under the same layout)."""
from __future__ import annotations

import os
from collections.abc import Mapping
import warnings
from pathlib import Path

from megakern.checkpoint import CheckpointError, CheckpointManager, checkpoint_keys
from megakern.config import to_dict
from megakern.data import DataError
from megakern.train.schedule import LRSchedule

# Model fields that do not change the parameters: a checkpoint loads across changes of these.
RUNTIME_MODEL_FIELDS = ("kernels", "recompute", "ce_chunk", "dropout", "init_from")  # not the architecture


def describe_layout(layout: Mapping) -> str:
    return (f"{layout['world']} ranks (tp {layout['tp']}, pp {layout['pp']}, cp {layout['cp']}, dp {layout['dp']}"
            f"{', sequence parallel' if layout['sequence_parallel'] else ''}, stages {layout['stages']}) at rank "
            f"{layout['rank']}")


def restore_dropout_rng(tracker, saved: Mapping | None, layout: Mapping, log) -> bool:
    """Give this rank's dropout RNG tracker the states it saved, when the checkpoint was written under the same
    layout and seed: the resumed run then draws the masks the uninterrupted run would. Otherwise (another layout,
    another seed, or a checkpoint without tracker states: older, or from one process) the tracker starts again from
    its seed, and ``log`` gets one line saying why. ``saved``: the checkpoint's {"layout", "tracker"} of this rank
    (``save``); ``layout``: this rank's. Returns whether the saved states were restored."""
    if saved is not None and not (isinstance(saved, Mapping) and isinstance(saved.get("layout"), Mapping)
                                  and isinstance(saved.get("tracker"), Mapping)):
        got = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
        raise CheckpointError(f"the checkpoint's dropout RNG states of rank {layout['rank']} are malformed: want "
                              f"a dict of 'layout' and 'tracker' dicts, got {got}")
    if saved is None:
        why = "the checkpoint has no dropout RNG tracker states (saved by one process or an older megakern)"
    elif dict(saved["layout"]) != dict(layout):
        why = (f"the checkpoint was saved by {describe_layout(saved['layout'])}, this run is "
               f"{describe_layout(layout)}")
    elif saved["tracker"].get("seed") != tracker.seed:
        why = f"the checkpoint's tracker seed is {saved['tracker'].get('seed')}"
    else:
        try:
            tracker.load_state_dict(saved["tracker"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"the checkpoint's dropout RNG states of rank {layout['rank']} do not load: "
                                  f"{exc}") from None
        return True
    tracker.load_state_dict({"seed": tracker.seed, "states": {}})
    log(f"note: dropout RNG tracker re-seeded from seed {tracker.seed} (masks differ from the uninterrupted run's): "
        f"{why}")
    return False


# ---------------------------------------------------------------------------------------------------------------


def tensor_tree(trainer, saved_keys: set[str] | None = None) -> dict:
    """The DCP tree: {"model": {name: parameter}, "optim": {...}, "master": {name: fp32 master} (bf16 runs),
    "buffers": {...} (FP8 scaling state)}, in the single model's names (and, over several ranks, full shapes as
    DTensors: ParallelModel.checkpoint_state), so checkpoints move between layouts. For a load (``saved_keys``: the checkpoint's keys), the weights
    this run trains (masters, or the parameters) load from the checkpoint's masters when it has them, else from its
    model."""
    s, loading = trainer.stepper, saved_keys is not None
    tree = s.pmodel.checkpoint_state(s.optimizer, for_load=loading)
    if not loading:
        return tree
    trained = tree.pop("master") if "master" in tree else tree["model"]
    tree.pop("model")
    source = "master" if any(k.startswith("master.") for k in saved_keys) else "model"
    tree[source] = trained
    if "buffers" in tree and not any(k.startswith("buffers.") for k in saved_keys):
        trainer.log("note: the checkpoint has no FP8 scaling state; it starts fresh")
        tree.pop("buffers")
    return tree


def run_state(trainer) -> dict:
    """The run's state saved beside the tensors (what a resume continues from)."""
    return {"consumed_samples": trainer.consumed_samples, "global_batch": trainer.global_batch,
            "seq_length": trainer.seq_length, "data_fingerprint": trainer.data.fingerprint,
            "schedule": trainer.schedule.state_dict(), "nonfinite_total": trainer.nonfinite_total,
            "precision": trainer.precision, "world_size": trainer.env.world, "dp_size": trainer.env.dp_size,
            "config": to_dict(trainer.config)}


def rng_layout(trainer) -> dict:
    """What fixes which dropout streams this rank's tracker holds (its rank's place and the regions/stages)."""
    pm = trainer.stepper.pmodel
    return {"world": trainer.env.world, "rank": trainer.env.rank, "tp": pm.tp, "pp": pm.pp, "cp": pm.cp,
            "dp": pm.dp, "sequence_parallel": bool(pm.sequence_parallel), "stages": [int(s) for s in pm.stage_indices]}


def save(trainer, asynchronous: bool):
    """Checkpoint the trainer's step (every rank): a SavedCheckpoint, or a pending background save."""
    s = trainer.stepper
    # a parallel rank's dropout RNG tracker goes with its RNG states (restored by resume under the same layout)
    rank_state = ({"dropout_rng": {"layout": rng_layout(trainer), "tracker": s.pmodel.rng.state_dict()}}
                  if trainer.env.world > 1 else None)
    return trainer.manager.save(trainer.step, tensor_tree(trainer), state=run_state(trainer),
                                files={"config.yaml": trainer.config_yaml}, rank_state=rank_state,
                                asynchronous=asynchronous)


def resume(trainer) -> None:
    """checkpoint.resume: load the checkpoint it names (or the newest, for auto) into the trainer, or nothing."""
    c, s = trainer.config.checkpoint, trainer.stepper
    if c.resume is None:
        return
    if c.resume == "auto":
        path = trainer.manager.latest()
        if path is None:
            trainer.log(f"checkpoint.resume=auto: no checkpoint in {trainer.ckpt_dir}; starting fresh")
            return
    else:
        path = CheckpointManager.resolve(c.resume)
        if path is None:
            raise CheckpointError(f"checkpoint.resume={c.resume!r}: no complete checkpoint there")
    check_compatible(trainer.config, path)
    tree = tensor_tree(trainer, saved_keys=checkpoint_keys(path))
    state = trainer.manager.load(path, tree, verify=c.verify)
    if trainer.env.world > 1:  # the dropout masks continue where the run stopped (same layout), else from the seed
        rank_state = state["rank_state"] or {}
        saved = rank_state.get("dropout_rng") if isinstance(rank_state, Mapping) else rank_state
        restore_dropout_rng(s.pmodel.rng, saved, rng_layout(trainer),
                            trainer.log if trainer.config.model.dropout else (lambda line: None))
    s.copy_masters()
    if state["data_fingerprint"] != trainer.data.fingerprint:  # contract 34
        message = (f"the data's fingerprint {trainer.data.fingerprint} differs from the checkpoint's "
                   f"{state['data_fingerprint']} ({path}): other files, split, seed or sequence length, so the "
                   "sample order would not continue the checkpoint's")
        if not trainer.config.data.allow_fingerprint_change:
            raise DataError(message + "; set data.allow_fingerprint_change=true to resume anyway")
        warnings.warn(message, stacklevel=2)
    trainer.schedule = resumed_schedule(trainer, state["schedule"], int(state["step"]), path)
    if state["global_batch"] != trainer.global_batch:
        trainer.log(f"note: global batch {trainer.global_batch}, the checkpoint's was {state['global_batch']}")
    if state.get("world_size", 1) != trainer.env.world:
        trainer.log(f"note: {trainer.env.world} rank(s), the checkpoint was saved by {state['world_size']}")
    trainer.step, trainer.consumed_samples = int(state["step"]), int(state["consumed_samples"])
    trainer.nonfinite_total = int(state.get("nonfinite_total", 0))
    steps = trainer.config.train.steps
    if trainer.consumed_samples + (steps - trainer.step) * trainer.global_batch > len(trainer.data.train):
        raise DataError(f"resuming at step {trainer.step} ({trainer.consumed_samples} samples consumed) to step "
                        f"{steps} needs more samples than the data's {len(trainer.data.train)}")
    elsewhere = ("" if Path(os.path.abspath(path)).parent == Path(os.path.abspath(trainer.ckpt_dir)) else
                 f" (the checkpoint's own directory {path.parent} is only read)")
    trainer.log(f"resumed from {path} at step {trainer.step} ({trainer.consumed_samples} samples consumed); this "
                f"run logs to {trainer.run_dir} and saves checkpoints to {trainer.ckpt_dir}{elsewhere}")
    trainer.log(f"LR schedule from here: {trainer.schedule.describe(trainer.step)}")


def resumed_schedule(trainer, saved, step: int, path: Path) -> LRSchedule:
    """schedule.on_resume: keep the checkpoint's schedule (default) or apply this run's; log what changed."""
    mine, config, log = trainer.schedule, trainer.config, trainer.log
    differences = mine.differences(saved) if isinstance(saved, Mapping) else ["(unreadable)"]
    if config.schedule.on_resume == "config":
        if differences:
            try:
                before = f"{LRSchedule.from_state(dict(saved))(step):.3e}"
            except (ValueError, TypeError):
                before = "unknown"
            log(f"note: schedule.on_resume=config: this run's LR schedule applies from step {step + 1} "
                f"(lr {mine(step):.3e}; the checkpoint's schedule would give {before}); it differs in: "
                + "; ".join(differences))
        return mine
    try:
        schedule = LRSchedule.from_state(dict(saved))
    except (ValueError, TypeError) as exc:
        raise CheckpointError(f"{path}: the checkpoint's LR schedule cannot be rebuilt ({exc}); set "
                              "schedule.on_resume=config to follow this run's schedule") from None
    if differences:
        log("note: this run's LR schedule keys differ from the checkpoint's (" + "; ".join(differences)
            + "); the checkpoint's schedule is kept (schedule.on_resume=checkpoint), set "
            "schedule.on_resume=config to apply this run's from the resumed step")
    end = schedule.kwargs["total_steps"]
    if config.train.steps > end:
        log(f"note: train.steps {config.train.steps} runs past the checkpoint's schedule, which ends at "
            f"step {end}: steps {end + 1}..{config.train.steps} run at its final lr "
            f"{schedule(end):.3e} (to extend the decay, e.g. a WSD run, set schedule.on_resume=config)")
    return schedule


def check_compatible(config, path: Path) -> None:
    """CheckpointError naming the model fields that differ (before DCP reports mismatched shapes)."""
    from megakern.config import read_yaml

    saved = read_yaml(path / "config.yaml").get("model", {})
    now = to_dict(config)["model"]
    differ = [f"model.{k}: {saved.get(k)!r} in the checkpoint, {v!r} now" for k, v in now.items()
              if k not in RUNTIME_MODEL_FIELDS and saved.get(k) != v]
    if differ:
        raise CheckpointError(f"{path} holds another model:\n  " + "\n  ".join(differ))
