"""The chain columns of the held-out benchmark: the greedy chain's T = 0 block lengths, the analytic chain tau
at the trees' anchors, the pairing against the first drafter, and the markdown table."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.bench import heldout as bench_heldout
from exittrain.core import chain_tree, followed_depth
from exittrain.heldout import measures as hl
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

K = 3
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)  # all generation reads of it
    drafters = [new_drafter(target, block_size=K + 1, num_layers=1, layer_ids=[2], seed=s).eval() for s in (0, 1)]
    return target, drafters


def test_the_greedy_chain_lengths_come_with_the_trees_from_one_drafter_pass(models):
    target, (drafter, _) = models
    rows = bench_heldout.answer_with_features(target, PROMPTS, [0, 2], max_new_tokens=9, batch=2)
    with_chain, acc = bench_heldout.greedy_block_lengths_by_budget(drafter, rows, [0, 2], [4], chain=True)
    plain, acc_plain = bench_heldout.greedy_block_lengths_by_budget(drafter, rows, [0, 2], [4])
    assert set(with_chain) == {4, "chain"} and set(plain) == {4} and torch.equal(acc, acc_plain)
    assert all(torch.equal(a, b) for a, b in zip(with_chain[4], plain[4]))  # the trees' numbers are unchanged
    for (ids, n_prompt, features), got in zip(rows, with_chain["chain"]):
        anchors = torch.arange(n_prompt - 1, ids.shape[0] - K)
        logits = drafter.forward_anchors(features[:, 32:].float()[None], ids[None], anchors[None]).float()
        labels = ids[anchors.unsqueeze(1) + torch.arange(1, K + 1)]
        want = 1.0 + followed_depth(chain_tree(torch.log_softmax(logits, -1)), labels).float()
        assert torch.equal(got, want)
        assert bool((got <= 1 + K).all())


def test_the_analytic_chain_tau_is_paired_against_the_first_drafter_and_tabled(models):
    target, drafters = models
    rows = hl.answer_rows(target, PROMPTS, [2], max_new_tokens=10, batch=2, temperature=1.0, seed=3)
    anchors = hl.heldout_anchors(rows, K, per_row=3, seed=0)
    first, entries = {}, []
    for i, drafter in enumerate(drafters):
        entry = {"drafter": f"d{i}", "K": K, "analytic": {}}
        greedy = [torch.tensor([1.0, 2.0]), torch.tensor([1.0])] if i == 0 else [torch.tensor([2.0, 2.0]),
                                                                                torch.tensor([1.0])]
        analytic = hl.analytic_block_lengths(drafter, target, rows, [2], anchors, K, 1.0, shape="chain")
        bench_heldout._fill_measure(entry, first, (K, 0.0), greedy)
        bench_heldout._fill_measure(entry, first, (K, 1.0), analytic)
        entries.append(entry)
    want = hl.analytic_block_lengths(drafters[1], target, rows, [2], anchors, K, 1.0, shape="chain")
    cell = entries[1]["analytic"]["1.0"]
    assert cell["analytic_tau"] == pytest.approx(float(torch.cat(want).mean()))
    assert entries[0]["analytic"]["1.0"]["vs_first"] is None and entries[0]["vs_first"] is None
    assert entries[1]["vs_first"]["delta"] == pytest.approx(1 / 3)  # +1 at 1 of the 3 greedy anchors
    first_tau = entries[0]["analytic"]["1.0"]["analytic_tau"]
    assert cell["vs_first"]["delta"] == pytest.approx(cell["analytic_tau"] - first_tau)
    md = "\n".join(bench_heldout.chain_table({"temperatures": [0.0, 1.0], "chain": entries}))
    assert "| drafter | K | greedy chain tau (T=0) | vs the first (paired 95% CI) | analytic chain tau T=1 |" in md
    assert "| d1 | 3 | 1.667 | +0.333 (" in md and f"{cell['analytic_tau']:.3f}" in md
