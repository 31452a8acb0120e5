"""The frozen target wrapper: frozen and not a module, layer ids, features on its device, and the
attention it refuses (tiny random Llama / Qwen2 / Qwen3, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from exittrain.models import TargetModel
from tests.models.helpers import TARGET_KINDS, VOCAB, random_context, tiny_target


@pytest.fixture(scope="module", params=TARGET_KINDS)
def target(request) -> TargetModel:
    return tiny_target(request.param)


def test_target_is_frozen_and_not_a_module(target):
    assert not isinstance(target, torch.nn.Module)
    assert all(not p.requires_grad for p in target.model.parameters())
    assert not target.model.training
    assert target.vocab_size == VOCAB and target.hidden_size == 32 and target.num_layers == 3
    assert target.eos_token_ids == [1] and target.eos_token_id == 1
    assert target.input_embeddings.weight.shape == (VOCAB, 32)
    assert target.lm_head.weight.shape == (VOCAB, 32)


def test_features_are_gathered_on_the_target_device(monkeypatch):
    """With device_map the captured layer outputs sit on their layers' GPUs: they meet on target.device."""
    target = tiny_target("llama")
    captured = {0: torch.ones(1, 2, 3), 2: torch.zeros(1, 2, 3)}
    torch.testing.assert_close(target._features(captured, [2, 0]), torch.cat([captured[2], captured[0]], -1))
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("meta")))  # a device they are not on
    assert target._features(captured, [2, 0]).device == torch.device("meta")


def test_rejects_unsupported_attention():
    """A kernel that ignores the 4D tree mask is refused (sliding windows are supported:
    tests/models/test_families.py)."""
    llama = tiny_target("llama").model
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation"):
        TargetModel(llama, name="flash")


def test_layer_ids_follow_hf_hidden_states(target):
    ids = torch.tensor([random_context(4, 7)])
    feats = target.sequence_features(ids, [0, 1])
    with torch.no_grad():
        hf = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    # layer id l is HF hidden_states[l + 1] (before the final norm, which HF applies to the last one)
    torch.testing.assert_close(feats, torch.cat([hf[1], hf[2]], -1), atol=1e-6, rtol=0)
