"""Building block drafters: a fresh one for a target (:func:`new_drafter`) or a saved one
(:func:`load_drafter`, which reads exittrain's folders and DFlash folders alike)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

from exittrain.models.dflash_format import is_dflash_folder, load_dflash
from exittrain.models.drafter.block_drafter import BlockDrafter
from exittrain.models.drafter.configuration import DrafterConfig
from exittrain.models.drafter.saved_files import check_finite_weights, weight_files
from exittrain.models.drafter.starting_points import (
    default_heads,
    default_layer_ids,
    layer_copy_problem,
    target_layer_shape,
)
from exittrain.models.target_loading import as_dtype

# the drafter's own logger name: its messages read as the drafter's, whichever file holds the code
logger = logging.getLogger("exittrain.models.drafter")

__all__ = ["load_drafter", "new_drafter"]


def new_drafter(
    target,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    num_key_value_heads: int | None = None,
    head_dim: int | None = None,
    intermediate_size: int | None = None,
    layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    learned_mask: bool = True,
    context_window: int | None = None,
    rope_theta: float | None = None,
    init_from_layers: Sequence[int] | str | None = None,
    copy_ngrams: Sequence[int] | None = None,
    copy_gate_init: float = 0.7,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = torch.float32,
    seed: int | None = None,
) -> BlockDrafter:
    """A fresh drafter for ``target`` (attached), on ``device`` (default: the target's device).

    ``hidden_size`` defaults to the target's (then no input/output projections); ``layer_ids``
    to :func:`~exittrain.models.drafter.starting_points.default_layer_ids`; ``num_heads`` to hidden_size / 64
    (or the largest even head size that divides it), ``num_key_value_heads`` to ``num_heads``,
    ``head_dim`` to hidden_size / num_heads; ``rope_theta`` to 10000. ``init_from_layers`` (one
    target layer id per drafter layer) starts the drafter layers as copies of those target layers
    (:func:`~exittrain.models.drafter.starting_points.copy_target_layers`); the layer shape and rope theta
    then default to the target's. ``"auto"`` copies the target's last layer into every drafter
    layer when :func:`~exittrain.models.drafter.starting_points.layer_copy_problem` finds none and the shape
    settings left to the target allow it, and otherwise starts at random, logging why.
    ``learned_mask=False`` (needs ``mask_token_id``) uses the target embedding of that token as
    the mask rows, as a DFlash drafter does. ``copy_ngrams`` (e.g. [3, 2]; None or [] = off) and
    ``copy_gate_init`` set the n-gram copy branch. ``seed`` makes the initialisation reproducible.
    """
    shape_args = {
        "hidden_size": hidden_size, "num_heads": num_heads, "num_key_value_heads": num_key_value_heads,
        "head_dim": head_dim, "intermediate_size": intermediate_size,
    }
    if isinstance(init_from_layers, str):
        if init_from_layers != "auto":
            raise ValueError(
                f"init_from_layers={init_from_layers!r}: use null (random start), 'auto', or a list of target "
                "layer ids, one per drafter layer"
            )
        problem = layer_copy_problem(target)
        if not problem:
            wanted = target_layer_shape(target)
            clash = {k: v for k, v in shape_args.items() if v is not None and v != wanted[k]}
            if clash:
                problem = f"the drafter sets {clash}, unlike the target's layers {wanted}"
        if problem:
            logger.info("drafter layers start at random (init_from_layers=auto): %s", problem)
            init_from_layers = None
        else:
            init_from_layers = [target.num_layers - 1] * num_layers
    tcfg = target.config
    norm_eps = DrafterConfig.rms_norm_eps
    if init_from_layers is not None:
        shape = target_layer_shape(target)
        shape_args = {k: v if v is not None else shape[k] for k, v in shape_args.items()}
        rope = getattr(tcfg, "rope_parameters", None) or {}
        rope_theta = rope_theta or rope.get("rope_theta") or getattr(tcfg, "rope_theta", None)
        norm_eps = float(getattr(tcfg, "rms_norm_eps", None) or norm_eps)
    shape_args["hidden_size"] = shape_args["hidden_size"] or target.hidden_size
    shape_args["num_heads"] = shape_args["num_heads"] or default_heads(shape_args["hidden_size"])
    layer_ids = (
        target.check_layers(layer_ids, "layer_ids") if layer_ids is not None else default_layer_ids(target.num_layers)
    )
    config = DrafterConfig(
        target_name=target.name,
        target_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        target_num_layers=target.num_layers,
        target_layer_ids=list(layer_ids),
        block_size=block_size,
        num_layers=num_layers,
        **shape_args,
        mask_token_id=mask_token_id,
        learned_mask=learned_mask,
        context_window=context_window,
        copy_ngrams=list(copy_ngrams or []),
        copy_gate_init=copy_gate_init,
        rope_theta=float(rope_theta or 10000.0),
        rms_norm_eps=norm_eps,
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", None) or 32768),
    )
    if seed is not None:
        torch.manual_seed(seed)
    drafter = BlockDrafter(config).attach_target(target)
    drafter.init_mask_embedding()
    if init_from_layers is not None:
        drafter.init_from_target_layers(target, init_from_layers)
    return drafter.to(device=device or target.device, dtype=as_dtype(dtype))


def load_drafter(
    path,
    target,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = torch.float32,
    check_name: bool = True,
    **hf_kwargs,
) -> BlockDrafter:
    """Load a saved drafter and attach ``target``; ValueError if it was saved for another target.

    ``path`` is a folder saved by exittrain, or a DFlash drafter folder (``config.json`` with
    ``architectures: ["DFlashDraftModel"]``: z-lab's, speculators', or one exported by
    :func:`exittrain.models.dflash_format.export_dflash`), read by
    :func:`exittrain.models.dflash_format.load_dflash` with the same pairing checks. A hub id
    (``z-lab/Qwen3-8B-DFlash-b16``) is downloaded first (needs the network or a filled hub cache).

    What ``fit warm_start=`` and ``eval drafter=`` load: weights whose shapes do not fit the saved
    config, or that hold NaN or infinity, raise ValueError naming the file and the tensor before
    any evaluation runs (:mod:`exittrain.models.drafter.saved_files`).
    """
    if isinstance(path, str) and not Path(path).exists() and path.count("/") == 1:
        # a hub id (org/name): fetch the drafter's files once, then read them like a local folder
        hub = {k: hf_kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in hf_kwargs}
        local = snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "mask_embedding.pt"], **hub)
        if is_dflash_folder(local):
            path = local
    if is_dflash_folder(path):
        drafter = load_dflash(path, target, dtype=dtype)
    else:
        drafter = BlockDrafter.from_pretrained(
            path, target=target, check_name=check_name, dtype=as_dtype(dtype), **hf_kwargs
        )
    folder = Path(path)
    files = weight_files(folder) if folder.is_dir() and not is_dflash_folder(folder) else {}
    check_finite_weights(
        drafter.state_dict(),
        file_of=lambda name: files.get(name, folder / "model.safetensors"),
        fix="point warm_start= (fit) or drafter= (eval) at the drafter of a healthy run (RUN_DIR/warmstart_drafter or "
        "RUN_DIR/drafter), or leave warm_start unset to train a fresh drafter",
    )
    return drafter.to(device or target.device)

