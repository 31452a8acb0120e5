"""Chain trees: against build_tree on one-hot input, and the exit law on a chain against its closed form."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import (
    TREE_SHAPES,
    build_tree,
    chain_tree,
    chain_tree_reference,
    exit_law,
    shaped_tree,
    verify_sequential,
    verify_tev,
    warp_probs,
)

from .helpers import random_logprobs


@pytest.mark.parametrize("budget", [None, 1, 3])
def test_chain_tree_equals_build_tree_on_one_hot_input(budget):
    g = torch.Generator().manual_seed(0)
    logq_NKV = torch.log_softmax(torch.randn(3, 5, 11, generator=g) * 2, dim=-1)
    fast, slow = chain_tree(logq_NKV, budget), chain_tree_reference(logq_NKV, budget)
    B = budget or 5
    assert fast.tokens.shape == (3, B) and fast.max_depth == slow.max_depth == 5  # K, as build_tree's trees
    for name in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(fast, name), getattr(slow, name)), name
    assert torch.equal(fast.tokens, logq_NKV[:, :B].argmax(-1))
    assert torch.equal(fast.parents[0], torch.arange(B))  # node j hangs off node j - 1
    assert torch.allclose(fast.scores, logq_NKV[:, :B].max(-1).values.cumsum(1))


def test_chain_tree_rejects_a_budget_beyond_k():
    logq = torch.log_softmax(torch.randn(1, 4, 6), dim=-1)
    for bad in (0, 5, 2.0):
        with pytest.raises(ValueError, match="budget"):
            chain_tree(logq, bad)
    with pytest.raises(ValueError, match=r"\(N, K, V\)"):
        chain_tree(logq[0])


def test_shaped_tree_is_build_tree_or_the_chain_of_at_most_k_nodes():
    g = torch.Generator().manual_seed(2)
    logq_NKV = random_logprobs(4, 3, 9, g)
    assert TREE_SHAPES == ("ddtree", "chain")
    for budget in (2, 7):
        pairs = [(shaped_tree(logq_NKV, budget), build_tree(logq_NKV, budget)),
                 (shaped_tree(logq_NKV, budget, "chain"), chain_tree(logq_NKV, min(budget, 3)))]
        for got, want in pairs:
            for name in ("tokens", "parents", "depths", "valid", "scores"):
                assert torch.equal(getattr(got, name), getattr(want, name)), name
            assert got.max_depth == want.max_depth == 3
    with pytest.raises(ValueError, match=r"shape='path'.*tree.shape.*\('ddtree', 'chain'\)"):
        shaped_tree(logq_NKV, 4, "path")


def accepted_prefix_sum(tokens_NB: torch.Tensor, probs_NRV: torch.Tensor) -> torch.Tensor:
    """(N,) ``sum_k prod_{j<=k} p_j(x_j)`` by a plain loop: row j - 1 (the root for j = 1) is x_j's conditional."""
    N, B = tokens_NB.shape
    out = torch.zeros(N, dtype=torch.float64)
    for n in range(N):
        prefix = 1.0
        for j in range(B):
            prefix *= float(probs_NRV[n, j, tokens_NB[n, j]])
            out[n] += prefix
    return out


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_exit_law_on_a_chain_is_one_plus_the_sum_of_accepted_prefixes(temperature):
    """E[block length] of chain verification, 1 + sum_k prod_{j<=k} p_j(x_j), is the exit law's sum_v P(v)."""
    g = torch.Generator().manual_seed(7)
    N, K, V, B = 6, 5, 4, 4  # a small vocabulary: the target often agrees with the chain, so the sum is not ~0
    chain = chain_tree(random_logprobs(N, K, V, g), B)
    logits_NRV = torch.randn(N, B + 1, V, generator=g, dtype=torch.float64) * 1.5
    logits_NRV[:, :B].scatter_add_(-1, chain.tokens.unsqueeze(-1), torch.full((N, B, 1), 1.5, dtype=torch.float64))
    probs = warp_probs(logits_NRV, temperature)
    law = exit_law(chain, probs)
    want = 1.0 + accepted_prefix_sum(chain.tokens, probs)
    torch.testing.assert_close(law.expected_block_length, want, rtol=1e-12, atol=1e-12)
    assert float(want.max()) > 1.5  # some chain is accepted deep: a wrong row offset would show
    if temperature == 0:  # the greedy block: 1 + how long the chain follows the target's argmax
        follows = (chain.tokens == logits_NRV[:, :B].argmax(-1)).long().cumprod(-1).sum(-1)
        torch.testing.assert_close(law.expected_block_length, 1.0 + follows.double())


@pytest.mark.parametrize("verifier", [verify_sequential, verify_tev])
def test_chain_verifiers_accept_the_closed_form_length_on_average(verifier):
    """Sequential verification of a one-hot chain (accept x_j with probability p_j(x_j), vLLM's rule for
    greedy drafts) and TEV both have mean block length 1 + sum_k prod_{j<=k} p_j(x_j): 4 standard errors."""
    g = torch.Generator().manual_seed(3)
    K, V, draws, T = 4, 3, 20000, 0.7
    chain = chain_tree(random_logprobs(1, K, V, g))
    logits_1RV = torch.randn(1, K + 1, V, generator=g, dtype=torch.float64)
    logits_1RV[:, :K].scatter_add_(-1, chain.tokens.unsqueeze(-1), torch.full((1, K, 1), 1.0, dtype=torch.float64))
    analytic = float(exit_law(chain, warp_probs(logits_1RV, T)).expected_block_length[0])
    tree_D = type(chain)(tokens=chain.tokens.expand(draws, K), parents=chain.parents.expand(draws, K),
                         depths=chain.depths.expand(draws, K), valid=chain.valid.expand(draws, K), max_depth=K)
    g_draws = torch.Generator().manual_seed(1)
    verdict = verifier(tree_D, logits_1RV.expand(draws, -1, -1), temperature=T, generator=g_draws)
    lengths = verdict.block_length.double()
    se = float(lengths.std()) / draws**0.5
    assert 1.3 < analytic < K + 1
    assert abs(float(lengths.mean()) - analytic) < 4 * se


def test_greedy_walk_follows_the_rounds_and_keeps_the_last_block_whole():
    from exittrain.core import greedy_walk

    # rounds rooted at 0, 3, 4, 6: the last (block 3) commits 7..9, past the stop at 8
    accepted = torch.tensor([2, 9, 9, 0, 1, 9, 2, 9])
    assert greedy_walk(accepted, 8) == [3, 1, 2, 3]
    assert greedy_walk(accepted, 7) == [3, 1, 2, 3]  # the round rooted at 6 commits 7, the stop
    assert greedy_walk(accepted, 6) == [3, 1, 2]
    assert greedy_walk(accepted[1:], 7) != greedy_walk(accepted, 8)[1:]  # a walk one position late differs
    assert greedy_walk([], 0) == []
    with pytest.raises(ValueError, match="positions 0..8"):
        greedy_walk(accepted, 9)
    with pytest.raises(ValueError, match="stop must be"):
        greedy_walk(accepted, -1)
    with pytest.raises(ValueError, match=">= 0"):
        greedy_walk([0, -1], 2)


def test_grafting_the_chain_onto_the_tree_keeps_both_and_adds_only_what_the_tree_lacks():
    """graft_chain against a loop: the tree's columns unchanged; each chain node found on the tree
    where a path spells the chain, else one new column hanging off the chain's node above; the
    union's path to each chain column spells the chain."""
    from exittrain.core import build_tree, chain_tree, graft_chain

    g = torch.Generator().manual_seed(4)
    for budget, K, V in ((6, 4, 5), (1, 3, 4), (20, 5, 6), (3, 6, 3)):
        logprobs = torch.log_softmax(torch.randn(12, K, V, generator=g) * 2, -1)
        tree, chain = build_tree(logprobs, budget), chain_tree(logprobs)
        union, columns = graft_chain(tree, chain)
        B = tree.budget
        assert torch.equal(union.tokens[:, :B], tree.tokens) and torch.equal(union.parents[:, :B], tree.parents)
        held_somewhere = added_somewhere = False
        for n in range(12):
            above = 0  # root-first row of the chain's node above
            for d in range(K):
                token = int(chain.tokens[n, d])
                found = [j for j in range(B) if tree.valid[n, j] and int(tree.parents[n, j]) == above
                         and int(tree.tokens[n, j]) == token]
                col = int(columns[n, d])
                if found:  # on the tree (a node of it hangs off the chain's node above)
                    assert col == found[0]
                    held_somewhere = True
                else:
                    assert col == B + d and bool(union.valid[n, col])
                    added_somewhere = True
                assert int(union.tokens[n, col]) == token and int(union.parents[n, col]) == above
                assert int(union.depths[n, col]) == d + 1
                above = col + 1
            assert int(union.valid[n, B:].sum()) == sum(int(c) >= B for c in columns[n])
        assert added_somewhere and (held_somewhere or budget == 1)
