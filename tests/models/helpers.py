"""Tiny offline targets and hand-built trees shared by the model tests."""

from __future__ import annotations

import torch

from exittrain.core import DraftTree, build_tree
from exittrain.models import TargetModel

VOCAB = 64


def tiny_target(kind: str = "llama", *, layers: int = 3, seed: int = 0) -> TargetModel:
    """A random tiny causal LM (hidden 32) wrapped as a frozen target; fp32, sdpa, CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,  # sharp attention, so wrong masks show up as large errors
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM, {}),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    }
    config_cls, model_cls, extra = classes[kind]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common, **extra))
    return TargetModel(model, None, name=f"tiny-{kind}")


TARGET_KINDS = ["llama", "qwen2", "qwen3"]


def random_context(seed: int, length: int) -> list[int]:
    """``length`` random token ids in [2, VOCAB) (ids 0 and 1 are left to EOS and padding)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (length,), generator=g).tolist()


def random_trees(n: int, k: int, budget: int, *, seed: int = 0, vocab: int = VOCAB) -> DraftTree:
    """n DDTree trees built from random, fairly peaked drafter distributions."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, vocab, generator=g) * 3.0
    return build_tree(torch.log_softmax(logits, dim=-1), budget)


def path_tokens(tree: DraftTree, n: int, row: int) -> list[int]:
    """Tokens root -> row (root excluded) of tree n; row in the root-included layout (0 = root)."""
    out = []
    while row != 0:
        out.append(int(tree.tokens[n, row - 1]))
        row = int(tree.parents[n, row - 1])
    return out[::-1]


def path_rows(tree: DraftTree, n: int, row: int) -> list[int]:
    """Rows root -> row (root excluded) in the root-included layout."""
    out = []
    while row != 0:
        out.append(row)
        row = int(tree.parents[n, row - 1])
    return out[::-1]


def last_logits(target: TargetModel, ids: list[int]) -> torch.Tensor:
    """(V,) next-token logits of a plain forward over ids."""
    with torch.no_grad():
        return target.model(input_ids=torch.tensor([ids])).logits[0, -1]
