"""megakern-export: a megakern checkpoint (torch.distributed.checkpoint, saved under any layout) written as a Hugging
Face checkpoint directory, on the CPU, with no process group and no GPU.

    megakern-export CHECKPOINT OUT_DIR [--dtype bfloat16] [--family llama] [--no-verify]

CHECKPOINT is a step directory or a checkpoint directory (its latest complete step). The model's architecture is the
checkpoint's config.yaml; its tensors are read from the DCP files at their whole shapes (DCP reassembles the shards
of every rank), the fp32 master weights where the run kept them (bf16 runs), else the parameters. Every file is
checked against the manifest's sha256 first (``--no-verify`` skips it). The output is written by
megakern.models.hf.save: nothing is left behind when it fails.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from megakern.checkpoint import CheckpointError, CheckpointManager, checkpoint_keys, read_manifest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_checkpoint(path, *, verify: bool = True):
    """(megakern GPT on the CPU holding the checkpoint's weights, its GPTConfig, the step directory)."""
    from torch.distributed.checkpoint import FileSystemReader

    from megakern.config import ConfigError, load_config
    from megakern.models.gpt import GPT

    found = CheckpointManager.resolve(path)
    if found is None:
        raise CheckpointError(f"no complete checkpoint in {path}")
    read_manifest(found)
    if not (found / "config.yaml").is_file():
        raise CheckpointError(f"{found}: no config.yaml (not a megakern-train checkpoint): its model is unknown")
    try:
        config = load_config(found / "config.yaml").model
    except ConfigError as exc:
        raise CheckpointError(f"{found / 'config.yaml'}: {exc}") from None
    keys = checkpoint_keys(found)
    meta = FileSystemReader(str(found)).read_metadata().state_dict_metadata
    with torch.device("meta"):
        model = GPT(config)
    names = list(model.state_dict())
    tree = {}
    for source in ("model", "master"):
        present = [n for n in names if f"{source}.{n}" in keys]
        if present:
            tree[source] = {n: torch.empty(tuple(meta[f"{source}.{n}"].size),
                                           dtype=meta[f"{source}.{n}"].properties.dtype) for n in present}
    missing = [n for n in names if n not in tree.get("model", {}) and n not in tree.get("master", {})]
    if missing:
        raise CheckpointError(f"{found}: the checkpoint lacks {missing[:6]} of the model its config.yaml describes")
    CheckpointManager(found.parent).load(found, tree, verify=verify, restore_rng=False)
    state = {**tree.get("model", {}), **tree.get("master", {})}  # the fp32 masters where there are some
    return GPT.from_state(config, {n: state[n] for n in names}), config, found


def main(argv: list[str] | None = None) -> int:
    from megakern.models import hf

    parser = argparse.ArgumentParser(prog="megakern-export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a step directory, or a checkpoint directory (its latest)")
    parser.add_argument("out", help="the Hugging Face directory to write (must not exist, or be empty)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="the exported weights' dtype (default: the checkpoint's trained weights')")
    parser.add_argument("--family", choices=sorted(hf.ARCHITECTURES), default=None,
                        help="the Hugging Face architecture (default: the one the model's config matches)")
    parser.add_argument("--no-verify", action="store_true", help="skip the sha256 check of the checkpoint's files")
    args = parser.parse_args(argv)
    try:
        model, config, found = read_checkpoint(args.checkpoint, verify=not args.no_verify)
        out = hf.save(model, Path(args.out), family=args.family, dtype=DTYPES[args.dtype] if args.dtype else None)
    except (CheckpointError, ValueError, FileExistsError, OSError) as exc:
        print(f"megakern-export: {exc}", file=sys.stderr)
        return 2
    print(f"megakern-export: {found} -> {out} ({sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
