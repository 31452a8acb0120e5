"""Grouped masked attention: equal to transformers' sdpa with repeated keys, scoped to its block, and
an explicit option of the target (``grouped_attention``), never a process-wide switch."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.integrations import sdpa_attention

from exittrain.models import grouped_attention
from exittrain.models.grouped_attention import (
    GROUPED_SDPA,
    grouped_query_attention,
    grouped_sdpa_forward,
)
from tests.models.helpers import path_tokens, random_context, random_trees, tiny_target


def _attention_inputs(N: int, heads: int, kv_heads: int, Q: int, KV: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    D = 8
    query = torch.randn(N, heads, Q, D, generator=g)
    key = torch.randn(N, kv_heads, KV, D, generator=g)
    value = torch.randn(N, kv_heads, KV, D, generator=g)
    allowed = torch.rand(N, 1, Q, KV, generator=g) < 0.6
    allowed[..., 0] = True  # every row sees one key at least
    module = types.SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True)
    return module, query, key, value, allowed


@pytest.mark.parametrize("kind", ["additive", "bool"])
@pytest.mark.parametrize("N,heads,kv_heads", [(1, 9, 3), (3, 4, 2), (2, 4, 1)])
def test_grouped_equals_sdpa_with_repeated_keys(kind, N, heads, kv_heads):
    module, query, key, value, allowed = _attention_inputs(N, heads, kv_heads, Q=5, KV=23)
    additive = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    mask = allowed if kind == "bool" else additive
    got, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention.sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
    assert got.shape == (N, 5, heads, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_grouped_path_never_repeats_keys_and_hands_the_rest_to_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or x.repeat_interleave(n, dim=1))
    module, query, key, value, allowed = _attention_inputs(2, 6, 2, Q=4, KV=11)
    grouped_sdpa_forward(module, query, key, value, allowed)
    assert calls == []
    # dropout is not applied by the grouped call: sdpa takes it, and repeats the keys under the mask
    grouped_sdpa_forward(module, query, key, value, allowed, dropout=0.1)
    assert calls == [3, 3]
    # no mask: sdpa, which runs grouped on its own (no repeat)
    calls.clear()
    out, _ = grouped_sdpa_forward(module, query, key, value, None)
    assert calls == [] and out.shape == (2, 4, 6, 8)


def test_block_switches_sdpa_only_and_restores_it_after_an_error():
    target = tiny_target("llama")
    config = target.config
    assert config._attn_implementation == "sdpa"
    with grouped_query_attention(config):
        assert config._attn_implementation == GROUPED_SDPA
        with grouped_query_attention(config):  # nested: left as it is
            assert config._attn_implementation == GROUPED_SDPA
        assert config._attn_implementation == GROUPED_SDPA
    assert config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError), grouped_query_attention(config):
        raise RuntimeError("boom")
    assert config._attn_implementation == "sdpa"
    config._attn_implementation = "eager"
    with grouped_query_attention(config):
        assert config._attn_implementation == "eager"


def test_tree_forward_runs_grouped_and_matches_sequential_paths(monkeypatch):
    """Every layer of a tree forward takes the grouped path, and the rows still equal plain
    forwards of their paths (the exactness the decode tests check, here with the path counted)."""
    target = tiny_target("llama")
    seen = []
    real = grouped_attention.F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(kwargs.get("enable_gqa"))
        return real(*args, **kwargs)

    monkeypatch.setattr(grouped_attention.F, "scaled_dot_product_attention", spy)
    context = random_context(3, 12)
    tree = random_trees(1, 3, 6, seed=4)
    cache = target.prefill(torch.tensor([context[:-1]])).cache
    seen.clear()
    logits = target.tree_forward(cache, context[-1], tree).logits[0]
    assert seen == [True] * target.num_layers
    assert target.config._attn_implementation == "sdpa"
    for row in range(tree.budget + 1):
        ids = torch.tensor([context + path_tokens(tree, 0, row)])
        want = target.model(input_ids=ids).logits[0, -1]
        torch.testing.assert_close(logits[row], want, rtol=1e-4, atol=1e-4)


def test_a_target_made_without_grouped_attention_runs_sdpa_with_repeated_keys(monkeypatch):
    """``grouped_attention=False`` (the reference twin, for side-by-side timing) is an option of the
    target it is given to: its tree forwards repeat the keys and give the grouped forward's logits,
    while the target it was made from still runs grouped."""
    target = tiny_target("llama")
    twin = target.with_options(grouped_attention=False)
    assert target.grouped_attention and not twin.grouped_attention and twin.model is target.model
    calls = []
    real_repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: calls.append(n) or real_repeat(x, n))
    context, tree = random_context(3, 12), random_trees(1, 3, 6, seed=4)

    def tree_logits(t):
        cache = t.prefill(torch.tensor([context[:-1]])).cache
        calls.clear()
        return t.tree_forward(cache, context[-1], tree).logits

    grouped = tree_logits(target)
    assert calls == []
    repeated = tree_logits(twin)
    assert len(calls) == 2 * target.num_layers  # keys and values, every layer
    torch.testing.assert_close(repeated, grouped, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="grouped_attention must be True or False"):
        target.with_options(grouped_attention="off")
