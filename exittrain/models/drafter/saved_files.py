"""Checks on a saved drafter folder before Hugging Face reads it, in our words.

A folder saved by exittrain holds ``config.json`` and safetensors weights named as in a DFlash
draft model (``layers.{i}.self_attn.q_proj.weight``, ``fc.weight``, ...) plus our extensions.
Folders written before the drafter took that layout (``context_proj.weight``,
``layers.{i}.attn.*``) compute another function (no per-head Q/K norms) and are refused with the
fix, never loaded into a model whose norms they do not fill.

Weights are checked before a run uses them (:func:`check_weight_shapes` from the files' headers,
before Hugging Face reads a byte of data; :func:`check_finite_weights` once loaded): a tensor
whose shape does not fit the config, or that holds NaN or infinity, is refused naming the file, the
tensor and the fix, before any evaluation or training step runs on it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from exittrain.safe_io import check_safetensors, load_json_object

__all__ = ["DRAFTER_FIX", "check_finite_weights", "check_saved_files", "check_weight_shapes", "weight_files"]

# what to do about a saved drafter folder whose files are bad (exittrain.safe_io adds the file and the cause)
DRAFTER_FIX = (
    "point warm_start= (fit) or drafter= (eval) at another drafter folder saved by exittrain (RUN_DIR/drafter of a "
    "fit run) or at a DFlash drafter folder, or re-export this one with exittrain.lit.save_drafter(drafter, path)"
)

# tensor names only the drafter layout before the DFlash one used
_OLD_LAYOUT = ("context_proj.weight", "context_norm.weight")


def safetensors_shards(folder: Path, *, what: str, fix: str) -> list[str]:
    """The weight files of a saved Hugging Face folder: every shard ``model.safetensors.index.json``
    names, else ``model.safetensors``. A bad index raises ValueError naming it (``what``) and ``fix``."""
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if not index.is_file():
        return [SAFE_WEIGHTS_NAME]
    weight_map = load_json_object(index, what=f"{what} index", fix=fix).get("weight_map")
    if not isinstance(weight_map, dict):
        raise ValueError(f"{what} index {index} has no 'weight_map' object: {fix}")
    return sorted(set(weight_map.values()))


def check_saved_files(folder: str | os.PathLike, *, config_too: bool = True) -> list[str]:
    """Check the files Hugging Face will read from the saved drafter ``folder``; return the tensor names.

    ``config.json`` (when ``config_too``) must be a JSON object; the weights (``model.safetensors``,
    or every shard named by ``model.safetensors.index.json``) must exist and be whole
    safetensors files (:func:`exittrain.safe_io.check_safetensors`: header and size, no tensor
    data read). Raises ValueError naming the bad file and :data:`DRAFTER_FIX`; a folder with no
    ``*.safetensors`` at all (only a pickled ``.bin``/``.pt``) raises ValueError saying drafters
    load from safetensors only; weights in the layout before the DFlash one raise ValueError
    saying to retrain. A missing ``config.json`` is left to Hugging Face's own error.
    """
    folder = Path(folder)
    if config_too and (folder / "config.json").is_file():
        load_json_object(folder / "config.json", what="drafter config", fix=DRAFTER_FIX)
    if not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir())
        raise ValueError(
            f"drafter folder {folder} holds no *.safetensors weights (found {found}); drafters are loaded "
            "from safetensors only, never from pickled .bin/.pt files: re-export it with "
            "exittrain.lit.save_drafter(drafter, path) or drafter.save_pretrained(path)"
        )
    names: list[str] = []
    for name in safetensors_shards(folder, what="drafter weights", fix=DRAFTER_FIX):
        names += check_safetensors(folder / name, what="drafter weights", fix=DRAFTER_FIX)
    old = [n for n in _OLD_LAYOUT if n in names]
    if old:
        raise ValueError(
            f"drafter folder {folder} was saved by an earlier exittrain (it holds {old}): that drafter had no "
            "per-head query/key norms and cannot be loaded as the current, DFlash-shaped drafter; train a new "
            "one (python -m exittrain fit ...) or warm-start from a DFlash drafter folder"
        )
    return names


def weight_files(folder: str | os.PathLike) -> dict[str, Path]:
    """``tensor name -> the file holding it`` for the saved weights of ``folder`` (headers only)."""
    from safetensors import safe_open

    folder = Path(folder)
    out = {}
    for name in safetensors_shards(folder, what="drafter weights", fix=DRAFTER_FIX):
        with safe_open(str(folder / name), framework="pt") as f:
            out.update({key: folder / name for key in f.keys()})
    return out


def check_weight_shapes(
    folder: str | os.PathLike, expected: Mapping[str, tuple[int, ...]], *, fix: str = DRAFTER_FIX
) -> None:
    """ValueError when a tensor of the saved weights in ``folder`` has another shape than ``expected``
    (``name -> shape``: the model its ``config.json`` builds); a tensor it lacks is left to the model's
    initialisation.
    Reads the files' headers only; the message names the file, the tensor, both shapes and ``fix``."""
    from safetensors import safe_open

    folder = Path(folder)
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for name in safetensors_shards(folder, what="drafter weights", fix=fix):
        with safe_open(str(folder / name), framework="pt") as f:
            found.update({key: (folder / name, tuple(f.get_slice(key).get_shape())) for key in f.keys()})
    for key, shape in expected.items():
        if key not in found:
            continue  # a part saved without it (a branch added since) starts as the model initialises it
        file, got = found[key]
        if got != tuple(shape):
            raise ValueError(
                f"drafter weights {file}: tensor {key} has shape {list(got)}, but {folder / 'config.json'} builds "
                f"it as {list(shape)}: the weights and the config do not belong together (a config edited by hand, "
                f"or files from two drafters); {fix}"
            )


def check_finite_weights(
    tensors: Mapping[str, torch.Tensor], *, file_of: Callable[[str], str | os.PathLike], fix: str = DRAFTER_FIX
) -> None:
    """ValueError naming the first tensor of ``tensors`` that holds NaN or infinity, the file it came
    from (``file_of(name)``), how many of its values are bad, and ``fix``. One pass over the weights."""
    for name, t in tensors.items():
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        bad = int((~torch.isfinite(t)).sum())
        nan = int(torch.isnan(t).sum())
        raise ValueError(
            f"{file_of(name)}: tensor {name} holds {bad} non-finite values of {t.numel()} ({nan} NaN, {bad - nan} "
            f"infinite): the weights were saved from a diverged run or damaged, and no evaluation or training "
            f"step can use them; {fix}"
        )
