import pytest
import torch

from exittrain.core import build_tree, exit_law, exit_law_reference
from exittrain.core.exit_law import edge_probabilities, exit_law_from_edges

from .helpers import random_logprobs, random_tree_and_probs


@pytest.mark.parametrize("alpha", [0.0, 1e-4, 0.3])
def test_vectorised_exit_law_matches_loop(alpha):
    g = torch.Generator().manual_seed(11)
    tree, logits = random_tree_and_probs(6, 4, 7, 20, g)
    probs = torch.softmax(logits, -1)
    fast, slow = exit_law(tree, probs, alpha), exit_law_reference(tree, probs, alpha)
    for name in ("edge", "reach", "missing", "exit_mass"):
        torch.testing.assert_close(getattr(fast, name), getattr(slow, name), rtol=1e-10, atol=1e-12)


def test_exit_mass_sums_to_one_and_block_length_is_one_plus_coverage():
    g = torch.Generator().manual_seed(5)
    for concentration in (0.5, 3.0, 10.0):
        tree, logits = random_tree_and_probs(16, 5, 9, 40, g, concentration)
        law = exit_law(tree, torch.softmax(logits, -1))
        torch.testing.assert_close(law.exit_mass.sum(-1), torch.ones(16, dtype=torch.float64))
        torch.testing.assert_close(law.expected_block_length, 1 + law.coverage)
        # E[l] = sum_v E(v) (d(v) + 1) = sum_v P(v)
        by_exit = (law.exit_mass * (tree.positions + 1)).sum(-1)
        torch.testing.assert_close(by_exit, law.expected_block_length)
        # a leaf has rho = 1, padding carries nothing
        has_child = torch.zeros_like(tree.valid_with_root).scatter_(1, tree.parents, tree.valid)
        leaves = tree.valid_with_root & ~has_child
        assert bool((law.missing[leaves] == 1).all())
        assert bool((law.reach[~tree.valid_with_root] == 0).all())


def test_zero_edges_give_exactly_zero_reach():
    lp = torch.log_softmax(torch.tensor([[[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]]), -1)
    tree = build_tree(lp, 5)
    probs = torch.zeros(1, 6, 3)
    probs[..., 2] = 1.0  # the target never emits tokens 0 or 1
    law = exit_law(tree, probs)
    covered = tree.valid & (tree.tokens != 2)
    assert bool((law.reach[:, 1:][covered] == 0).all())
    assert float(law.exit_mass.sum()) == pytest.approx(1.0)


def test_alpha_floors_reach_only():
    g = torch.Generator().manual_seed(2)
    tree, logits = random_tree_and_probs(3, 3, 5, 10, g, 8.0)
    probs = torch.softmax(logits, -1)
    raw, floored = exit_law(tree, probs), exit_law(tree, probs, alpha=0.2)
    torch.testing.assert_close(raw.edge, floored.edge)
    torch.testing.assert_close(raw.missing, floored.missing)
    assert bool((floored.reach >= raw.reach - 1e-12).all()) and bool((floored.reach > raw.reach).any())


def test_bad_input():
    g = torch.Generator().manual_seed(0)
    tree = build_tree(random_logprobs(2, 3, 5, g), 6)
    probs = torch.full((2, 7, 5), 0.2)
    with pytest.raises(ValueError, match=r"\(2, 7, V\)"):
        exit_law(tree, probs[:, :6])
    with pytest.raises(ValueError, match="sum to 1"):
        exit_law(tree, probs * 1.1)
    with pytest.raises(ValueError, match="NaN"):
        exit_law(tree, torch.where(probs > 0, float("nan"), probs))
    with pytest.raises(ValueError, match="alpha"):
        exit_law(tree, probs, alpha=1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        exit_law(tree, torch.full((2, 7, 2), 0.5))


def _interior_reference(tree):
    """Loop twin of DraftTree.interior: per tree, the rows (root-first) that some valid node hangs off."""
    N, B = tree.tokens.shape
    out = []
    for n in range(N):
        parents = {int(tree.parents[n, j]) for j in range(B) if tree.valid[n, j]}
        out.append([0] + sorted(r for r in parents if r > 0))
    return out


@pytest.mark.parametrize("shape", ["ddtree", "chain"])
def test_the_interior_gives_every_edge_from_the_parents_rows_alone(shape):
    """Scoring only the rows that are parents (the interior) gives the whole tree's edges, reach and
    block length exactly; its rows are the loop's, in order, each with its path's tokens."""
    from exittrain.core import shaped_tree

    g = torch.Generator().manual_seed(3)
    for budget, K in ((12, 4), (1, 3), (30, 6)):
        tree = shaped_tree(random_logprobs(9, K, 7, g), budget, shape)
        probs = torch.softmax(torch.randn(9, tree.budget + 1, 7, generator=g, dtype=torch.float64), -1)
        inner, parent_row = tree.interior()
        rows = _interior_reference(tree)
        assert inner.budget == max(map(len, rows)) - 1
        # the interior's rows are the original rows, so their distributions are the whole tree's
        picked = torch.zeros(9, inner.budget + 1, 7, dtype=torch.float64)
        for n, kept in enumerate(rows):
            picked[n, : len(kept)] = probs[n, kept]
            assert inner.valid[n].sum() == len(kept) - 1
            for new, old in enumerate(kept[1:], 1):  # same token, depth and parent, renumbered
                assert int(inner.tokens[n, new - 1]) == int(tree.tokens[n, old - 1])
                assert int(inner.depths[n, new - 1]) == int(tree.depths[n, old - 1])
                assert kept[int(inner.parents[n, new - 1])] == int(tree.parents[n, old - 1])
        whole = exit_law(tree, probs)
        edge = edge_probabilities(tree, picked, parent_row)
        torch.testing.assert_close(edge, whole.edge, rtol=0, atol=0)
        torch.testing.assert_close(exit_law_from_edges(tree, edge).expected_block_length, whole.expected_block_length)
        if shape == "chain":  # a chain's interior is all but its last node
            assert inner.budget == tree.budget - 1
