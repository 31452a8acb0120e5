"""Warm starts and checkpoints are checked when they load: non-finite weights, or a tensor shaped unlike
the config, are refused naming the file, the tensor and the fix, before any evaluation runs."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.lit.drafter_checkpoint import CHECKPOINT_KEY, drafter_from_checkpoint
from exittrain.models import load_drafter, new_drafter


@pytest.fixture
def drafter(tiny_llama_target):
    torch.manual_seed(0)
    return new_drafter(tiny_llama_target, num_layers=1, block_size=4)


def _poison(folder, name: str, value: float) -> None:
    weights = load_file(str(folder / "model.safetensors"))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[3] = value
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_a_warm_start_with_nan_weights_is_refused_naming_the_file_and_the_tensor(tmp_path, tiny_llama_target, drafter):
    drafter.save_pretrained(tmp_path)
    load_drafter(tmp_path, tiny_llama_target)  # the negative control: as saved, it loads
    name = "layers.0.self_attn.q_proj.weight"
    _poison(tmp_path, name, float("nan"))
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, tiny_llama_target)
    text = str(err.value)
    assert str(tmp_path / "model.safetensors") in text and f"tensor {name}" in text
    assert "1 non-finite values" in text and "(1 NaN, 0 infinite)" in text and "point warm_start=" in text

    # what fit builds before the data and any evaluation (exittrain.build.build_drafter): refused there
    from omegaconf import OmegaConf

    from exittrain.build import build_drafter

    with pytest.raises(ValueError, match=f"tensor {name} holds 1 non-finite"):
        build_drafter(OmegaConf.create({"warm_start": str(tmp_path)}), tiny_llama_target)

    _poison(tmp_path, name, 1.0)
    _poison(tmp_path, "fc.weight", float("-inf"))
    with pytest.raises(ValueError, match=r"tensor fc.weight holds 1 non-finite values .*\(0 NaN, 1 infinite\)"):
        load_drafter(tmp_path, tiny_llama_target)


def test_a_warm_start_whose_tensor_does_not_fit_its_config_is_refused_from_the_headers(
    tmp_path, tiny_llama_target, drafter
):
    drafter.save_pretrained(tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    rows, cols = weights["fc.weight"].shape
    weights["fc.weight"] = torch.zeros(rows, cols + 3)
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path, tiny_llama_target)
    text = str(err.value)
    assert str(tmp_path / "model.safetensors") in text and "tensor fc.weight" in text
    assert f"[{rows}, {cols + 3}]" in text and f"builds it as [{rows}, {cols}]" in text and "point warm_start=" in text


def _checkpoint(drafter, target, path, **changes) -> None:
    from exittrain.lit.drafter_checkpoint import checkpoint_entry

    state = {f"drafter.{k}": v.clone() for k, v in drafter.state_dict().items()}
    state.update(changes)
    torch.save({"state_dict": state, CHECKPOINT_KEY: checkpoint_entry(drafter, target), "global_step": 3}, path)


def test_a_checkpoint_with_nan_or_misshaped_weights_is_refused_naming_the_tensor(tmp_path, tiny_llama_target, drafter):
    path = tmp_path / "last.ckpt"
    _checkpoint(drafter, tiny_llama_target, path)
    drafter_from_checkpoint(path, tiny_llama_target)  # the negative control
    AtomicCheckpointIO().load_checkpoint(path)

    bad = drafter.state_dict()["norm.weight"].clone()
    bad[0] = float("nan")
    _checkpoint(drafter, tiny_llama_target, path, **{"drafter.norm.weight": bad})
    with pytest.raises(ValueError, match=r"checkpoint .*last.ckpt \(state_dict\['drafter.norm.weight'\]\): tensor"):
        drafter_from_checkpoint(path, tiny_llama_target)
    # what fit ckpt_path=... resumes through: refused before Lightning restores the module
    with pytest.raises(ValueError, match=r"state_dict\['drafter.norm.weight'\].*leave ckpt_path unset"):
        AtomicCheckpointIO().load_checkpoint(path)

    wide = torch.zeros(drafter.state_dict()["fc.weight"].shape[0], 5)
    _checkpoint(drafter, tiny_llama_target, path, **{"drafter.fc.weight": wide})
    with pytest.raises(ValueError, match=r"drafter tensor fc.weight has shape \[\d+, 5\], but the drafter config"):
        drafter_from_checkpoint(path, tiny_llama_target)
