"""Decoding with the frozen target: tree forward and cache commit against plain sequential forwards
of each root->node path (tiny random Llama / Qwen2 / Qwen3, fp32, CPU; and the embedded SmolLM2)."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import DraftTree
from exittrain.models import TargetModel, load_target
from tests.models.helpers import (
    TARGET_KINDS,
    VOCAB,
    last_logits,
    path_rows,
    path_tokens,
    random_context,
    random_trees,
    tiny_target,
)

ATOL = 2e-5


@pytest.fixture(scope="module", params=TARGET_KINDS)
def target(request) -> TargetModel:
    return tiny_target(request.param)


def test_tree_forward_matches_sequential_paths(target):
    context = random_context(1, 9)
    root = 5
    tree = random_trees(1, k=4, budget=12, seed=3)
    prefill = target.prefill(torch.tensor([context]), layers=[0, 2])
    assert prefill.logits.shape == (1, VOCAB) and prefill.features.shape == (1, 9, 64)
    torch.testing.assert_close(prefill.logits[0], last_logits(target, context), atol=ATOL, rtol=0)

    out = target.tree_forward(prefill.cache, root, tree, layers=[1])
    assert out.logits.shape == (1, 13, VOCAB) and out.features.shape == (1, 13, 32)
    assert prefill.cache.get_seq_length() == 9 + 13
    for row in range(13):
        ids = context + [root] + path_tokens(tree, 0, row)
        torch.testing.assert_close(out.logits[0, row], last_logits(target, ids), atol=ATOL, rtol=0)
        feats = target.sequence_features(torch.tensor([ids]), layers=[1])[0, -1]
        torch.testing.assert_close(out.features[0, row], feats, atol=ATOL, rtol=0)


def test_tree_forward_padding_nodes_are_harmless(target):
    context = random_context(2, 6)
    full = random_trees(1, k=3, budget=6, seed=4)
    # the same tree padded with 3 columns (token 0, parent 0, depth 0, invalid)
    pad = lambda t, v: torch.cat([t, torch.full((1, 3), v, dtype=t.dtype)], dim=1)  # noqa: E731
    padded = DraftTree(pad(full.tokens, 0), pad(full.parents, 0), pad(full.depths, 0), pad(full.valid, False), 3)
    a = target.tree_forward(target.prefill(torch.tensor([context])).cache, 7, full).logits
    b = target.tree_forward(target.prefill(torch.tensor([context])).cache, 7, padded).logits
    torch.testing.assert_close(b[:, :7], a, atol=ATOL, rtol=0)


@pytest.mark.parametrize("reference", [False, True], ids=["fast", "reference"])
@pytest.mark.parametrize("leaf_choice", ["deepest", "root_only"])
def test_commit_equals_fresh_prefill(target, leaf_choice, reference):
    context = random_context(5, 8)
    root = 9
    tree = random_trees(1, k=4, budget=10, seed=6)
    pre = target.prefill(torch.tensor([context]))
    target.tree_forward(pre.cache, root, tree)
    if leaf_choice == "deepest":
        leaf = int(tree.depths[0].argmax()) + 1
        accepted = path_rows(tree, 0, leaf)
        assert len(accepted) >= 3
    else:
        accepted = []
    target.commit(pre.cache, context_len=8, accepted_node_columns=accepted, reference=reference)
    sequence = context + [root] + [int(tree.tokens[0, j - 1]) for j in accepted]
    assert pre.cache.get_seq_length() == len(sequence)

    fresh = target.prefill(torch.tensor([sequence])).cache
    for got, want in zip(pre.cache.layers, fresh.layers, strict=True):
        torch.testing.assert_close(got.keys, want.keys, atol=ATOL, rtol=0)
        torch.testing.assert_close(got.values, want.values, atol=ATOL, rtol=0)
    # and the next round scores like a plain forward of the accepted sequence
    nxt = target.tree_forward(pre.cache, 11, random_trees(1, k=2, budget=3, seed=7))
    torch.testing.assert_close(nxt.logits[0, 0], last_logits(target, sequence + [11]), atol=ATOL, rtol=0)


def test_fast_commit_equals_its_reference_twin_round_after_round(target):
    """Three rounds of tree forward and commit, the fast path beside the full gather: the caches
    hold the same keys and values after each (exactly: both copy the same numbers)."""
    context = random_context(2, 9)
    caches = [target.prefill(torch.tensor([context])).cache for _ in range(2)]
    for round_ in range(3):
        tree = random_trees(1, k=4, budget=8, seed=10 + round_)
        leaf = int(tree.depths[0].argmax()) + 1
        accepted = path_rows(tree, 0, leaf)
        for cache, reference in zip(caches, (False, True)):
            C = cache.get_seq_length()
            target.tree_forward(cache, 5 + round_, tree)
            target.commit(cache, C, accepted, reference=reference)
        for fast, slow in zip(caches[0].layers, caches[1].layers, strict=True):
            assert torch.equal(fast.keys, slow.keys) and torch.equal(fast.values, slow.values)


def test_commit_rejects_bad_columns(target):
    pre = target.prefill(torch.tensor([random_context(1, 4)]))
    target.tree_forward(pre.cache, 3, random_trees(1, k=2, budget=4, seed=1))
    with pytest.raises(ValueError, match="accepted_node_columns"):
        target.commit(pre.cache, 4, [5])
    with pytest.raises(ValueError, match="accepted_node_columns"):
        target.commit(pre.cache, 4, [0])
    with pytest.raises(ValueError, match="context_len"):
        target.commit(pre.cache, 9, [1])


@pytest.mark.real_model
def test_embedded_smollm2_tree_forward_matches_sequential(tmp_path_factory):
    target = load_target(None)
    assert target.num_layers == 30 and target.hidden_size == 576 and target.vocab_size == 49152
    assert all(not p.requires_grad for p in target.model.parameters())
    prompt = target.tokenizer("def fibonacci(n):\n    ", return_tensors="pt").input_ids
    pre = target.prefill(prompt, layers=[2, 15, 28])
    assert pre.features.shape == (1, prompt.shape[1], 3 * 576)
    root = int(pre.logits[0].argmax())
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(1, 3, target.vocab_size, generator=g) * 4, -1)
    from exittrain.core import build_tree

    tree = build_tree(logp, 6)
    out = target.tree_forward(pre.cache, root, tree)
    context = prompt[0].tolist()
    for row in range(7):
        ids = context + [root] + path_tokens(tree, 0, row)
        torch.testing.assert_close(out.logits[0, row], last_logits(target, ids), atol=2e-4, rtol=0)
