"""The held-out greedy block-length benchmark: feature slicing on a tiny target, and a run on the
embedded target."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.bench import heldout as bench_heldout
from exittrain.bench.registry import BENCHES
from exittrain.heldout.measures import paired_difference
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target


def test_heldout_bench_is_registered():
    assert BENCHES["heldout"] == "exittrain.bench.heldout"


def test_greedy_block_lengths_read_the_drafters_own_layers_from_a_superset():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)  # all generation reads of it
    drafter = new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=0)
    rows = bench_heldout.answer_with_features(target, [[5, 6, 7], [8, 9, 10, 11]], [0, 2], max_new_tokens=9, batch=2)
    own = bench_heldout.answer_with_features(target, [[5, 6, 7], [8, 9, 10, 11]], [2], max_new_tokens=9, batch=2)
    got, acc = bench_heldout.greedy_block_lengths(drafter, rows, [0, 2], budget=4)
    want, acc_own = bench_heldout.greedy_block_lengths(drafter, own, [2], budget=4)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(acc, acc_own)
    K = 3
    for (ids, n_prompt, _), lengths in zip(rows, got):
        assert lengths.shape == (ids.shape[0] - K - n_prompt + 1,)  # every answer anchor, the last prompt token first
        assert lengths.min() >= 1 and lengths.max() <= K + 1
    # one drafter pass for several budgets gives each budget's own lengths
    both, acc_both = bench_heldout.greedy_block_lengths_by_budget(drafter, rows, [0, 2], [4, 1])
    one, _ = bench_heldout.greedy_block_lengths(drafter, rows, [0, 2], budget=1)
    assert all(torch.equal(a, b) for a, b in zip(both[4], got)) and torch.equal(acc_both, acc)
    assert all(torch.equal(a, b) for a, b in zip(both[1], one))


def test_paired_difference_is_the_mean_anchor_difference_and_needs_the_same_anchors():
    first = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([2.0, 2.0])]
    better = [torch.tensor([2.0, 2.0, 3.0]), torch.tensor([2.0, 3.0])]  # +1 at 2 of the 5 anchors
    pair = paired_difference(better, first)
    assert pair["delta"] == pytest.approx(0.4)
    low, high = pair["ci95"]
    assert 0.0 <= low <= 0.4 <= high <= 0.5  # each prompt's mean gain lies in [1/3, 1/2]
    same = paired_difference(first, first)
    assert same == {"delta": 0.0, "ci95": [0.0, 0.0]}
    assert paired_difference([torch.tensor([1.0, 2.0]), torch.tensor([2.0, 2.0])], first) is None
    assert paired_difference(first[:1], first) is None


def test_heldout_markdown_shows_the_paired_difference_after_the_first_row():
    rows = [
        {"drafter": "a", "anchors": 5, "greedy_block_length": 2.0, "ci95": [1.9, 2.1], "accuracy_by_depth": [0.5],
         "vs_first": None},
        {"drafter": "b", "anchors": 5, "greedy_block_length": 2.4, "ci95": [2.2, 2.6], "accuracy_by_depth": [0.6],
         "vs_first": {"delta": 0.4, "ci95": [0.25, 0.5]}},
    ]
    md = bench_heldout.to_markdown({"prompts": 2, "domain": "code", "skip": 8, "max_new_tokens": 9, "budget": 4,
                                    "rows": rows})
    assert "| a | 4 | 5 | 2.000 | 1.90-2.10 | - | 0.50 |" in md
    assert "| b | 4 | 5 | 2.400 | 2.20-2.60 | +0.400 (+0.250 to +0.500) | 0.60 |" in md
    assert "analytic tau" not in md  # no temperature > 0: no second table


def test_heldout_markdown_law_table_has_analytic_tau_pairs_oracle_rows_and_efficiency():
    def row(name, greedy, analytic, pair):
        return {"drafter": name, "budget": 4, "anchors": 5, "greedy_block_length": greedy, "ci95": [1.0, 3.0],
                "accuracy_by_depth": [0.5], "vs_first": None,
                "analytic": {"1.0": {"analytic_tau": analytic, "ci95": [1.0, 2.0], "anchors": 4, "vs_first": pair}}}

    result = {"prompts": 2, "domain": "code", "skip": 16, "max_new_tokens": 9, "budgets": [4],
              "temperatures": [0.0, 1.0], "analytic_anchors": 2,
              "rows": [row("a", 2.0, 1.5, None), row("b", 2.4, 1.8, {"delta": 0.3, "ci95": [0.1, 0.5]})],
              "oracle": [{"budget": 4, "temperature": 0.0, "max_depth": 1, "oracle_tau": 2.0},
                         {"budget": 4, "temperature": 1.0, "max_depth": 1, "oracle_tau": 2.5}]}
    md = bench_heldout.to_markdown(result)
    assert "| drafter | B | greedy tau (T=0) | eff | analytic tau T=1 | vs the first (paired 95% CI) | eff |" in md
    assert "| a | 4 | 2.000 | 1.000 | 1.500 | - | 0.600 |" in md
    assert "| b | 4 | 2.400 | 1.200 | 1.800 | +0.300 (+0.100 to +0.500) | 0.720 |" in md
    assert "| oracle | 4 | 2.000 | 1.000 | 2.500 | - | 1.000 |" in md


@pytest.mark.slow
@pytest.mark.real_model
def test_heldout_bench_on_the_embedded_target(tmp_path):
    from exittrain.lit import save_drafter
    from exittrain.models import load_target

    drafter = new_drafter(load_target(None), seed=0)
    save_drafter(drafter, tmp_path / "drafter")
    result = bench_heldout.run([str(tmp_path / "drafter")], prompts=2, skip=8, max_new_tokens=12, budgets=[4],
                               domain="code", batch=2, temperatures=[0.0, 1.0], analytic_anchors=2)
    row = result["rows"][0]
    law = row["analytic"]["1.0"]
    assert law["anchors"] <= 4 and 1.0 <= law["analytic_tau"] < 1 + 4 and law["vs_first"] is None
    oracle = {o["temperature"]: o["oracle_tau"] for o in result["oracle"]}
    assert oracle[0.0] == 1 + 4 and law["analytic_tau"] <= oracle[1.0] <= 1 + 4
    assert result["prompts"] == 2 and row["anchors"] == 2 * (12 - 7 + 1)
    # an untrained drafter: the root's own block, rarely more
    assert 1.0 <= row["greedy_block_length"] < 1.5 and row["ci95"][0] <= row["greedy_block_length"] <= row["ci95"][1]
    assert row["vs_first"] is None and "| greedy tau |" in bench_heldout.to_markdown(result)
    assert "| analytic tau T=1 |" in bench_heldout.to_markdown(result)
