"""The copy tail: the chain is the copy branch's lookup with a longer horizon, and the graft keeps
a valid draft tree (distinct siblings, parents first, depths from the ancestors) that the exact
verifiers accept, deeper than K when the chain goes on."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import build_tree, exit_law, exit_law_reference, ngram_lookup_reference, verify_greedy, verify_tev
from exittrain.core.copy_tail import copy_chain, copy_only_tree, graft_chain, graft_copy_tail
from tests.core.helpers import random_logprobs


def chain_twin(ids, ngrams, length, earliest=False):
    """copy_chain through the loop twin of the lookup: the leading run of real copy tokens."""
    out = ngram_lookup_reference(ids.view(1, -1), torch.tensor([[ids.numel() - 1]]), ngrams, length,
                                 earliest=earliest)[0][0, 0].tolist()
    return out[: out.index(-1)] if -1 in out else out


def check_tree(tree):
    """The invariants every verifier relies on, read off host lists."""
    tokens, parents, depths, valid = (x[0].tolist() for x in (tree.tokens, tree.parents, tree.depths, tree.valid))
    seen = set()
    for j, (t, p, d, ok) in enumerate(zip(tokens, parents, depths, valid)):
        if not ok:
            continue
        assert p <= j, "parents come before children"
        assert d == (1 if p == 0 else depths[p - 1] + 1)
        assert (p, t) not in seen, "siblings carry distinct tokens"
        seen.add((p, t))
    assert tree.max_depth >= max(d for d, ok in zip(depths, valid) if ok)
    # the ancestor mask counts d + 1 rows (root and self included) for a node of depth d
    counts = tree.ancestor_mask[0].sum(-1)[1:]
    assert all(int(c) == d + 1 for c, d, ok in zip(counts, depths, valid) if ok)


def test_chain_is_the_lookup_with_a_longer_horizon():
    #                   0  1  2  3  4  5  6  7  8  9
    ids = torch.tensor([5, 6, 7, 8, 9, 1, 2, 3, 5, 6])
    # root 6 after 5: (5, 6) ended at 1, so the chain is what followed it, up to the root itself
    assert copy_chain(ids, [3, 2], 12) == [7, 8, 9, 1, 2, 3, 5, 6]
    assert copy_chain(ids, [3, 2], 3) == [7, 8, 9]
    assert copy_chain(ids, [4], 5) == []  # no earlier 4-gram
    assert copy_chain(ids[:1], [1], 5) == [] and copy_chain(ids, [2], 0) == []
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        ids = torch.randint(0, 4, (25,), generator=g)
        for ngrams in ([3, 2], [1], [2, 1]):
            for earliest in (False, True):
                assert copy_chain(ids, ngrams, 9, earliest=earliest) == chain_twin(ids, ngrams, 9, earliest)


def test_the_copy_tail_grafts_the_latest_then_the_earliest_chain():
    #                   0  1  2  3  4  5  6  7  8  9 10
    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 1, 2, 5, 6])
    # root 6 after 5: the latest (5, 6) ended at 6 (chain 1, 2, 5, 6), the earliest at 1 (7, 8, 9, ...)
    assert copy_chain(ids, [2], 4) == [1, 2, 5, 6] and copy_chain(ids, [2], 4, earliest=True) == [7, 8, 9, 5]
    lp = torch.full((1, 2, 12), -30.0)
    lp[0, :, 3] = 0.0  # the drafter's tree: token 3 at depth 1 and 2, no copy in it
    tree = build_tree(lp, 2)
    grafted, added = graft_copy_tail(tree, ids, [2], max_new=3, min_match=0, earliest=True)
    assert added == 6 and grafted.budget == 8
    check_tree(grafted)
    assert grafted.tokens[0, 2:].tolist() == [1, 2, 5, 7, 8, 9]  # both chains beside the tree, under the root
    assert grafted.parents[0, 2:].tolist() == [0, 3, 4, 0, 6, 7]
    latest_only, n = graft_copy_tail(tree, ids, [2], max_new=3, min_match=0)  # the default: the latest chain
    assert n == 3 and torch.equal(latest_only.tokens, graft_chain(tree, [1, 2, 5, 6], 3)[0].tokens)
    # where both chains agree, the second graft walks into the first and goes on from its end
    same = torch.tensor([5, 6, 7, 8, 5, 6, 7, 8, 5, 6])  # latest: 7, 8, 5, 6 (to the root); earliest: 7, 8, 5, 6, 7
    both, n = graft_copy_tail(tree, same, [2], max_new=3, min_match=0, earliest=True)
    check_tree(both)
    assert n == 5 and both.tokens[0, 2:].tolist() == [7, 8, 5, 6, 7] and both.max_depth == 5
    # with copy_match 1 the tree must hold the chain's first token: neither chain is grafted here
    assert graft_copy_tail(tree, ids, [2], max_new=3, min_match=1, earliest=True) == (tree, 0)


def test_graft_walks_the_tree_and_appends_under_the_deepest_node():
    g = torch.Generator().manual_seed(1)
    lp = random_logprobs(1, 3, 12, g)
    tree = build_tree(lp, 6)
    top = lp[0].argmax(-1).tolist()  # with this seed the tree holds the argmax path to depth 3 (depths below)
    grafted, added = graft_chain(tree, top + [11, 10, 9, 8], max_new=3)
    assert added == 3 and grafted.budget == 9 and grafted.max_depth == 6
    check_tree(grafted)
    assert grafted.tokens[0, 6:].tolist() == [11, 10, 9] and grafted.depths[0, 6:].tolist() == [4, 5, 6]
    deepest = next(j + 1 for j in range(6) if tree.depths[0, j] == 3 and tree.tokens[0, j] == top[2])
    assert grafted.parents[0, 6:].tolist() == [deepest, 7, 8]
    assert torch.equal(grafted.tokens[:, :6], tree.tokens) and torch.equal(grafted.parents[:, :6], tree.parents)
    assert torch.isinf(grafted.scores[0, 6:]).all() and torch.equal(grafted.scores[:, :6], tree.scores)


def test_graft_respects_min_match_and_grafts_beside_the_tree_at_zero():
    g = torch.Generator().manual_seed(2)
    lp = random_logprobs(1, 4, 10, g)
    tree = build_tree(lp, 5)
    root_children = {int(t) for t, p in zip(tree.tokens[0], tree.parents[0]) if p == 0}
    stranger = next(t for t in range(10) if t not in root_children)
    same, added = graft_chain(tree, [stranger, 1, 2], max_new=4, min_match=1)
    assert added == 0 and same is tree
    beside, added = graft_chain(tree, [stranger, 1, 2], max_new=4, min_match=0)
    assert added == 3 and beside.parents[0, 5:].tolist() == [0, 6, 7] and beside.max_depth == 4
    check_tree(beside)
    top = lp[0].argmax(-1).tolist()
    assert graft_chain(tree, top[:1] + [stranger], max_new=4, min_match=2)[1] == 0
    assert graft_chain(tree, top[:1] + [stranger], max_new=4, min_match=1)[1] >= 1
    assert graft_chain(tree, top, max_new=0)[1] == 0 and graft_chain(tree, [], max_new=3)[1] == 0
    # a chain the tree already holds whole adds nothing
    assert graft_chain(build_tree(lp, 12), top[:2], max_new=3)[1] == 0


def test_grafted_trees_keep_the_exit_law_and_tev_accepts_them():
    g = torch.Generator().manual_seed(3)
    V = 9
    for trial in range(20):
        lp = random_logprobs(1, 3, V, g)
        tree = build_tree(lp, 4)
        chain = torch.randint(0, V, (7,), generator=g).tolist()
        grafted, added = graft_chain(tree, chain, max_new=5, min_match=0)
        check_tree(grafted)
        logits = torch.randn(1, grafted.budget + 1, V, generator=g, dtype=torch.float64)
        probs = torch.softmax(logits, -1)
        law, twin = exit_law(grafted, probs), exit_law_reference(grafted, probs)
        assert float(law.exit_mass.sum()) == pytest.approx(1.0, abs=1e-9), trial
        assert torch.allclose(law.exit_mass, twin.exit_mass, atol=1e-12), trial
        verdict = verify_tev(grafted, logits, temperature=1.0, generator=torch.Generator().manual_seed(trial))
        assert int(verdict.accept_length[0]) <= grafted.max_depth


def test_graft_needs_one_tree():
    tree = build_tree(random_logprobs(2, 3, 8, torch.Generator().manual_seed(0)), 4)
    with pytest.raises(ValueError, match="N=1"):
        graft_chain(tree, [1, 2], max_new=2)
    with pytest.raises(ValueError, match="max_new"):
        graft_chain(tree.index(slice(0, 1)), [1, 2], max_new=-1)


def test_the_copy_only_tree_is_the_chain_and_verifiers_follow_it():
    tree = copy_only_tree([4, 1, 7])
    check_tree(tree)
    assert tree.tokens.tolist() == [[4, 1, 7]] and tree.parents.tolist() == [[0, 1, 2]]
    assert tree.depths.tolist() == [[1, 2, 3]] and tree.max_depth == 3 and bool(tree.valid.all())
    # the target agrees with the first two tokens only: a greedy verifier accepts 2, then its own token
    logits = torch.full((1, 4, 9), -5.0)
    logits[0, 0, 4] = logits[0, 1, 1] = logits[0, 2, 3] = 5.0
    verdict = verify_greedy(tree, logits)
    assert int(verdict.accept_length[0]) == 2 and int(verdict.bonus[0]) == 3
    with pytest.raises(ValueError, match="at least one chain token"):
        copy_only_tree([])
