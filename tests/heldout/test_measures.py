"""Held-out exit-law measures on a tiny target and drafter: the analytic tau against Monte-Carlo TEV
decoding, its T -> 0 limit against the greedy block length, the wave oracle against the
one-node-at-a-time oracle, the shared anchors and the argument checks."""

from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch

from exittrain.bench import heldout as bench_heldout
from exittrain.decoding import SpeculativeDecoder
from exittrain.heldout import measures as hl
from exittrain.heldout import row_prefix as row_prefix_module
from exittrain.heldout.row_prefix import row_prefix
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

K = 3  # block size 4
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16]]


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)  # all generation reads of it
    drafter = new_drafter(target, block_size=K + 1, num_layers=1, layer_ids=[2], seed=0).eval()
    return target, drafter


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_analytic_tau_is_the_mean_first_round_block_length_of_tev_decoding(models, temperature):
    target, drafter = models
    budget, seeds = 24, 600
    prompt = torch.tensor([5, 6, 7, 8, 9, 10])
    rows, anchors = [(prompt, len(prompt), None)], [torch.tensor([len(prompt) - 1])]  # root: the last prompt token
    analytic = float(hl.analytic_block_lengths(drafter, target, rows, [2], anchors, budget, temperature)[0][0])
    decoder = SpeculativeDecoder(target, drafter, budget, verifier="tev")
    trees, build = [], decoder._tree
    decoder._tree = lambda *args: trees.append(build(*args)) or trees[-1]
    lengths = torch.tensor([
        float(decoder.generate(prompt, max_new_tokens=1, temperature=temperature, seed=s).rounds[0].block_length)
        for s in range(seeds)
    ])
    # the decoder's first tree is the held-out code's tree at that anchor
    assert torch.equal(trees[0].tokens, hl.drafter_trees(drafter, target, prompt, anchors[0], budget).tokens)
    assert torch.equal(trees[0].parents, hl.drafter_trees(drafter, target, prompt, anchors[0], budget).parents)
    se = float(lengths.std()) / seeds**0.5
    assert analytic > 1.3  # the tree carries real mass, so a wrong tree or law would show
    assert abs(float(lengths.mean()) - analytic) < 3 * se


def test_analytic_tau_tends_to_the_greedy_block_length_at_zero_temperature(models):
    target, drafter = models
    rows = bench_heldout.answer_with_features(target, PROMPTS, [0, 2], max_new_tokens=10, batch=3)
    anchors = hl.heldout_anchors(rows, K, per_row=5, seed=1)
    greedy, _ = bench_heldout.greedy_block_lengths(drafter, rows, [0, 2], budget=6)  # every anchor, in order
    want = [g[a - (n_prompt - 1)] for g, a, (_, n_prompt, _) in zip(greedy, anchors, rows)]
    for temperature, atol in ((0.0, 0.0), (1e-3, 1e-3)):
        got = hl.analytic_block_lengths(drafter, target, rows, [0, 2], anchors, 6, temperature, stored_features=True)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=atol, rtol=0.0)
    assert any(float(w.max()) > 1 for w in want)  # some anchor accepts a draft token: the test can fail


@pytest.mark.parametrize("shape", ["ddtree", "chain"])
def test_scoring_the_trees_interior_gives_the_whole_trees_expected_block_length(models, shape):
    """The fast path scores the root and the nodes with children only; its slow twin scores every
    row of the tree. Equal up to the float rounding of a forward over other rows."""
    from exittrain.core import exit_law, warp_probs

    target, drafter = models
    rows = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=12, batch=2, temperature=1.0, seed=3)
    anchors = hl.heldout_anchors(rows, K, per_row=4, seed=0)
    for budget, temperature in ((8, 1.0), (3, 0.6)):
        fast = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, budget, temperature, shape=shape)
        for (ids, _, _), anchors_A, got in zip(rows, anchors, fast, strict=True):
            tree = hl.drafter_trees(drafter, target, ids, anchors_A, budget, shape=shape)
            logits = target.score_trees(ids[None], anchors_A[None], tree).logits
            want = exit_law(tree, warp_probs(logits, temperature)).expected_block_length.float()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert tree.interior()[0].budget < tree.budget  # the leaves were left out: the paths differ


def test_anchors_are_seeded_shared_and_inside_the_answers(models):
    target, drafter = models
    rows = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=12, batch=2, temperature=1.0, seed=3)
    again = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=12, batch=2, temperature=1.0, seed=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rows, again))  # seeded sampling
    greedy = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=12, batch=2)
    assert any(not torch.equal(a[0], g[0]) for a, g in zip(rows, greedy))
    anchors = hl.heldout_anchors(rows, K, per_row=4, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(anchors, hl.heldout_anchors(rows, K, per_row=4, seed=0)))
    assert any(not torch.equal(a, b) for a, b in zip(anchors, hl.heldout_anchors(rows, K, per_row=4, seed=1)))
    for (ids, n_prompt, _), a in zip(rows, anchors):
        n = max(ids.shape[0] - K - (n_prompt - 1), 0)
        assert a.numel() == min(4, n) and torch.equal(a, a.sort().values) and a.unique().numel() == a.numel()
        assert a.numel() == 0 or (a.min() >= n_prompt - 1 and a.max() < ids.shape[0] - K)
    # two drafters at the same anchors: a paired difference exists, and is 0 against itself
    other = new_drafter(target, block_size=K + 1, num_layers=1, layer_ids=[2], seed=1).eval()
    mine = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, 6, 1.0)
    theirs = hl.analytic_block_lengths(other, target, rows, [2], anchors, 6, 1.0)
    assert [m.shape for m in mine] == [a.shape for a in anchors]
    assert hl.paired_difference(mine, mine) == {"delta": 0.0, "ci95": [0.0, 0.0]}
    pair = hl.paired_difference(theirs, mine)
    mean = float(torch.cat(theirs).mean() - torch.cat(mine).mean())
    assert pair["delta"] == pytest.approx(mean, abs=1e-6) and pair["delta"] != 0.0


@pytest.mark.parametrize("temperature,top_k", [(1.0, None), (0.6, None), (1.0, 5)])
def test_wave_oracle_equals_the_one_node_at_a_time_oracle_and_bounds_the_drafter(models, temperature, top_k):
    target, drafter = models
    rows = hl.answer_rows(target, PROMPTS[:2], [2], max_new_tokens=10, batch=2, temperature=temperature, seed=0)
    anchors = hl.heldout_anchors(rows, K, per_row=3, seed=0)
    budget = 7
    fast = hl.oracle_block_lengths(target, rows, anchors, budget, K, temperature, top_k=top_k)
    slow = hl.oracle_block_lengths_reference(target, rows, anchors, budget, K, temperature, top_k=top_k)
    for f, s in zip(fast, slow):
        torch.testing.assert_close(f, s, atol=1e-4, rtol=0.0)
    drafted = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, budget, temperature, top_k=top_k)
    assert all(bool((f >= d - 1e-5).all()) for f, d in zip(fast, drafted))
    assert all(bool((f > 1.0).all() and (f <= 1 + budget).all()) for f in fast)
    chain = hl.oracle_block_lengths(target, rows, anchors, budget, K, 0.0)
    assert all(bool((c == 1.0 + K).all()) for c in chain)  # T = 0: the greedy chain, depth K


def test_bad_arguments_name_the_option(models):
    target, drafter = models
    rows = [(torch.tensor([5, 6, 7, 8, 9, 10]), 2, None)]
    with pytest.raises(ValueError, match="--analytic-anchors"):
        hl.heldout_anchors(rows, K, per_row=0, seed=0)
    with pytest.raises(ValueError, match="temperature"):
        hl.analytic_block_lengths(drafter, target, rows, [2], [torch.tensor([2])], 4, -0.5)
    with pytest.raises(ValueError, match="temperature"):
        hl.answer_rows(target, PROMPTS, [2], 4, 2, temperature=-1.0)
    with pytest.raises(ValueError, match="--budgets"):
        hl.oracle_block_lengths(target, rows, [torch.tensor([2])], 0, K, 1.0)
    for kwargs, option in (({"budgets": []}, "--budgets"), ({"temperatures": [0.6, -1.0]}, "--temperatures"),
                           ({"analytic_anchors": 0}, "--analytic-anchors")):
        with pytest.raises(ValueError, match=option):  # checked before any model is loaded
            bench_heldout.run(["unused"], prompts=1, skip=0, max_new_tokens=4, **kwargs)


def test_the_rows_causal_pass_runs_once_and_equals_a_fresh_one(models, monkeypatch):
    """One causal pass per row gives the drafter's features and the K/V of every later scoring:
    a second budget, temperature or the oracle on the same row runs none, and the scores equal
    those of score_trees' own pass (exactly for a whole pass, up to float rounding for a row that
    continues its prompt's kept pass)."""
    target, drafter = models
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    rows, anchors = [(ids, 3, None)], [torch.tensor([2, 4])]
    monkeypatch.setattr(row_prefix_module, "_PASSES", OrderedDict())  # no pass from an earlier test
    calls, real = [], target.sequence_prefix
    monkeypatch.setattr(target, "sequence_prefix",
                        lambda ids_LT, *a, **k: calls.append(ids_LT.shape[1]) or real(ids_LT, *a, **k))
    first = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, 4, 1.0)
    again = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, 8, 0.6)
    assert calls == [3, 8], "the prompt's pass, then the row's continuing it; a second budget or temperature: none"
    hl.oracle_block_lengths(target, rows, anchors, 4, K, 1.0)
    hl.oracle_block_lengths(target, rows, anchors, 4, K, 0.6)
    assert calls == [3, 8, 8], "the oracle's waves ran a causal pass each"  # its own, without features
    whole = target.sequence_features(ids[None], [2]).float()
    same = row_prefix(target, ids.clone(), [2]).features  # another tensor of the same tokens: reused
    assert len(calls) == 3 and torch.allclose(same, whole, rtol=0, atol=1e-5) and same.shape == whole.shape
    other = ids.flip(0)
    fresh = row_prefix(target, other, [2]).features  # other tokens, no kept prompt: a whole pass, computed anew
    assert len(calls) == 4 and torch.equal(fresh, target.sequence_features(other[None], [2]).float())
    assert first[0].shape == again[0].shape == (2,)
    # the memoised passes score as score_trees' own
    for row, exact in ((other, True), (ids, False)):
        tree = hl.drafter_trees(drafter, target, row, anchors[0], 4)
        own = target.score_trees(row[None], anchors[0][None], tree).logits
        reused = target.score_trees(row[None], anchors[0][None], tree, prefix=row_prefix(target, row, [2])).logits
        assert torch.equal(own, reused) if exact else torch.allclose(own, reused, rtol=0, atol=1e-4)
    tree = hl.drafter_trees(drafter, target, ids, anchors[0], 4)
    with pytest.raises(ValueError, match="other sequences"):
        target.score_trees(ids[None].flip(1), anchors[0][None], tree, prefix=row_prefix(target, ids, [2]))
    with pytest.raises(ValueError, match="layers"):
        target.score_trees(ids[None], anchors[0][None], tree, layers=[0], prefix=row_prefix(target, ids, [2]))


def test_the_kept_passes_stay_under_the_byte_bound_and_keep_the_newest(models, monkeypatch):
    """Passes beyond KEPT_BYTES go, least recently used first, so a large target's passes cannot fill
    its device; a reused pass counts as recent, and the newest stays even when it alone is over."""
    target, _ = models
    monkeypatch.setattr(row_prefix_module, "_PASSES", OrderedDict())
    rows = [torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]) + i for i in range(4)]  # four passes of one size
    size = row_prefix_module._nbytes(target.sequence_prefix(rows[0][None], [2]))
    assert size > 0
    monkeypatch.setattr(row_prefix_module, "KEPT_BYTES", 2 * size)
    first = row_prefix(target, rows[0], [2])
    row_prefix(target, rows[1], [2])
    assert row_prefix(target, rows[0], [2]) is first  # reused, and now the most recent
    row_prefix(target, rows[2], [2])  # over the bound: rows[1], the least recently used, goes
    kept = [key[1] for key in row_prefix_module._PASSES]
    assert kept == [tuple(rows[0].tolist()), tuple(rows[2].tolist())]
    assert sum(entry[2] for entry in row_prefix_module._PASSES.values()) <= 2 * size
    monkeypatch.setattr(row_prefix_module, "KEPT_BYTES", size // 2)  # not even one pass fits
    newest = row_prefix(target, rows[3], [2])
    assert list(row_prefix_module._PASSES) == [(id(target), tuple(rows[3].tolist()), (2,))]
    assert row_prefix(target, rows[3], [2]) is newest


def test_a_pass_continued_from_its_prompts_equals_a_whole_one(models):
    """sequence_prefix(past=...): the K/V and features of the prompt's pass followed by the rest's
    equal a whole pass's up to float rounding, and the past is left as it was; a past over other
    tokens or layers is refused."""
    target, _ = models
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    whole = target.sequence_prefix(ids, [0, 2])
    past = target.sequence_prefix(ids[:, :5], [0, 2])
    kept = [(k.clone(), v.clone()) for k, v in past.kv]
    continued = target.sequence_prefix(ids, [0, 2], past=past)
    assert continued.features.shape == whole.features.shape == (1, 8, 2 * target.hidden_size)
    assert torch.allclose(continued.features, whole.features, rtol=0, atol=1e-5)
    for (k, v), (wk, wv) in zip(continued.kv, whole.kv, strict=True):
        assert k.shape == wk.shape and torch.allclose(k, wk, rtol=0, atol=1e-5)
        assert torch.allclose(v, wv, rtol=0, atol=1e-5)
    assert all(torch.equal(k, pk) and torch.equal(v, pv) for (k, v), (pk, pv) in zip(kept, past.kv, strict=True))
    for bad, match in ((target.sequence_prefix(ids[:, 1:6], [0, 2]), "first tokens"),
                       (target.sequence_prefix(ids[:, :5], [2]), "layers"), (whole, "covers 8 tokens")):
        with pytest.raises(ValueError, match=match):
            target.sequence_prefix(ids, [0, 2], past=bad)


def test_the_tree_and_chain_measured_together_equal_each_measured_alone(models):
    """expected_block_lengths grafts the chain onto the largest tree and scores both in one forward;
    each equals its own measure (up to the float rounding of a forward over other rows)."""
    target, drafter = models
    rows = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=12, batch=2, temperature=1.0, seed=5)
    anchors = hl.heldout_anchors(rows, K, per_row=4, seed=0)
    drafts = [("ddtree", 2), ("ddtree", 6), ("chain", K)]
    for temperature in (1.0, 0.6):
        together = hl.expected_block_lengths(drafter, target, rows, [2], anchors, drafts, temperature)
        for shape, budget in drafts:
            alone = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, budget, temperature, shape=shape)
            for got, want in zip(together[shape, budget], alone, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the graft scored rows the tree lacks: some anchor's chain leaves the tree of 6 nodes
    from exittrain.core import build_tree, chain_tree, graft_chain

    left = 0
    for (ids, _, _), anchors_A in zip(rows, anchors, strict=True):
        if anchors_A.numel() == 0:
            continue
        logprobs = hl.drafter_logprobs(drafter, target, ids, anchors_A)
        left += int((graft_chain(build_tree(logprobs, 6), chain_tree(logprobs))[1] >= 6).sum())
    assert left > 0


def test_width_groups_pad_each_group_to_its_own_widest():
    """The anchors' interiors are scored in at most three groups: every index once, each group
    padded to its widest, fewer rows than padding all to the widest (and never more)."""
    widths = [9, 2, 3, 10, 2, 6, 3, 9]
    groups = hl.width_groups(widths)
    assert sorted(i for g in groups for i in g) == list(range(len(widths))) and len(groups) <= 3
    padded = sum(len(g) * max(widths[i] for i in g) for g in groups)
    # by hand, the best of the sorted runs {2, 2, 3, 3} {6} {9, 9, 10}: 4 x 3 + 6 + 3 x 10, against 8 x 10
    assert padded == 48 and sorted(map(len, groups)) == [1, 3, 4]
    assert hl.width_groups([4, 4, 4]) == [[0, 1, 2]]  # equal widths: one forward
    assert hl.width_groups([1, 1, 1, 12]) == [[0, 1, 2], [3]]
    assert hl.width_groups([]) == []


def test_a_tree_cut_to_its_first_columns_keeps_every_node():
    from exittrain.core import build_tree

    tree = build_tree(torch.log_softmax(torch.randn(3, 3, 6, generator=torch.Generator().manual_seed(0)), -1), 8)
    inner, _ = tree.interior()
    widest = int(inner.valid.sum(1).max())
    cut = inner.columns(widest)
    assert cut.budget == widest and torch.equal(cut.tokens, inner.tokens[:, :widest])
    assert bool(tree.valid[:, -1].any())  # a full best-first tree: its last column holds nodes
    with pytest.raises(ValueError, match="past column"):
        tree.columns(tree.budget - 1)
