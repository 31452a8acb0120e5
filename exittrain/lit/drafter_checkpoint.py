"""What an ExitTrainModule checkpoint records about its drafter, and the drafter rebuilt from one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from exittrain.models import BlockDrafter, DrafterConfig, TargetModel
from exittrain.models.drafter.saved_files import check_finite_weights
from exittrain.safe_io import load_checkpoint

__all__ = [
    "CHECKPOINT_KEY",
    "check_checkpoint_target",
    "check_state_fits",
    "checkpoint_entry",
    "drafter_from_checkpoint",
]

CHECKPOINT_KEY = "exittrain"
"""Checkpoint entry holding ``drafter_config`` (a JSON-safe dict) and ``target_name``."""


def checkpoint_entry(drafter: BlockDrafter, target: TargetModel) -> dict[str, Any]:
    """The :data:`CHECKPOINT_KEY` entry: the drafter config as plain types (loadable with
    ``weights_only=True``) and the target's name."""
    return {
        "drafter_config": json.loads(drafter.config.to_json_string(use_diff=False)),
        "target_name": target.name,
    }


def check_checkpoint_target(checkpoint: dict[str, Any], target: TargetModel) -> None:
    """ValueError when ``checkpoint`` was trained against another target than ``target``."""
    saved = checkpoint.get(CHECKPOINT_KEY, {}).get("target_name")
    if saved is not None and saved != target.name:
        raise ValueError(
            f"checkpoint was trained against target {saved!r} but this module holds target {target.name!r}; "
            "load the matching target"
        )


def drafter_from_checkpoint(path, target: TargetModel, *, map_location: Any = "cpu") -> BlockDrafter:
    """Rebuild the trained drafter from a Lightning checkpoint alone (config + ``drafter.*`` weights).

    Loads with ``weights_only=True`` (:func:`exittrain.safe_io.load_checkpoint`); the drafter is
    attached to ``target`` (pairing checked). Checkpoints written under ``trainer=fsdp`` are
    single files with the full weights too; a folder (a sharded checkpoint) raises ValueError,
    and so does a missing, corrupt or truncated file or one holding objects the safe load
    refuses (the message names the file and never suggests an unsafe load), a drafter tensor
    missing or shaped unlike the config the checkpoint records, or one holding NaN or infinity
    (each message names the file and the tensor).
    """
    if Path(path).is_dir():
        raise ValueError(
            f"{path} is a folder (a sharded checkpoint, ModelParallelStrategy(save_distributed_checkpoint=True)); "
            "drafters are rebuilt from single-file checkpoints: train with trainer=fsdp, which writes those"
        )
    ckpt = load_checkpoint(
        path,
        what="checkpoint",
        fix="pass another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt of an earlier "
        "run), or re-run the stage",
        map_location=map_location,
    )
    if CHECKPOINT_KEY not in ckpt:
        raise ValueError(f"{path} holds no '{CHECKPOINT_KEY}' entry: not an ExitTrainModule checkpoint")
    config = DrafterConfig.from_dict(ckpt[CHECKPOINT_KEY]["drafter_config"])
    drafter = BlockDrafter(config).attach_target(target)
    prefix = "drafter."
    state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
    fix = f"resume from an earlier checkpoint of the run (RUN_DIR/checkpoints/<stage>/), or re-run the stage: {path}"
    check_state_fits(state, drafter.state_dict(), path=path, fix=fix)
    check_finite_weights(state, file_of=lambda name: f"checkpoint {path} (state_dict['{prefix}{name}'])", fix=fix)
    drafter.load_state_dict(state, strict=True)
    return drafter.to(target.device)


def check_state_fits(state: dict[str, torch.Tensor], model_state: dict[str, torch.Tensor], *, path, fix: str) -> None:
    """ValueError naming the checkpoint ``path`` and the tensor when ``state`` (a drafter's, read from it)
    lacks a tensor of ``model_state`` (the drafter its recorded config builds) or shapes one otherwise."""
    for name, want in model_state.items():
        got = state.get(name)
        if got is None:
            raise ValueError(f"checkpoint {path} lacks the drafter tensor {name} its recorded config has; {fix}")
        if got.shape != want.shape:
            raise ValueError(
                f"checkpoint {path}: drafter tensor {name} has shape {list(got.shape)}, but the drafter config it "
                f"records builds {list(want.shape)} (the file was altered, or mixes two runs); {fix}"
            )
