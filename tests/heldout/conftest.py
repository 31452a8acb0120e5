"""The tiny target and prompts the walks' and the answers' tests share."""

from __future__ import annotations

import pytest
import torch

TINY_VOCAB = 16  # small, so the target's greedy answers repeat and a briefly trained drafter accepts often


@pytest.fixture(scope="module")
def target():
    """A tiny fp32 Llama whose EOS (id 1) ends some greedy answers early."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from exittrain.models import TargetModel

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, eos_token_id=1, attn_implementation="sdpa")
    return TargetModel(LlamaForCausalLM(config), None, name="tiny-llama-v16")


@pytest.fixture(scope="module")
def prompts():
    """Eight prompts of 6 to 10 tokens (no EOS among them)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, TINY_VOCAB, (6 + i % 5,), generator=g).tolist() for i in range(8)]
