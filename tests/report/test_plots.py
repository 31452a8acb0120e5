"""Plot functions on small inputs: valid, non-trivial PNGs; ValueError on nothing to plot."""

from __future__ import annotations

import random
import warnings

import pytest

from exittrain.heldout.decode_eval import summarize
from exittrain.report import plots
from tests.report.helpers import assert_png, prompt_rows, tree_example_dict


def test_tau_vs_budget_with_ci_and_oracle(tmp_path):
    rows = summarize(prompt_rows("warm_start", 1.8)) + summarize(prompt_rows("exittrain", 2.4))
    out = plots.plot_tau_vs_budget(rows, tmp_path / "sub" / "tau.png", title="tau")
    assert out == tmp_path / "sub" / "tau.png"
    assert_png(out)


def test_tau_vs_budget_plain_rows_several_temperatures(tmp_path):
    rows = [{"label": "a", "budget": b, "tau": 1 + b / 16, "temperature": t} for b in (4, 8, 32) for t in (0.0, 1.0)]
    assert_png(plots.plot_tau_vs_budget(rows, tmp_path / "tau.png"))


def test_tau_vs_budget_rejects_bad_rows(tmp_path):
    with pytest.raises(ValueError, match="no rows"):
        plots.plot_tau_vs_budget([], tmp_path / "x.png")
    with pytest.raises(ValueError, match="lacks"):
        plots.plot_tau_vs_budget([{"budget": 4}], tmp_path / "x.png")


def test_block_length_histogram(tmp_path):
    data = {"warm_start": [1, 1, 2, 3, 1, 2], "exittrain": [2, 3, 4, 2, 3, 5, 1]}
    assert_png(plots.plot_block_length_histogram(data, tmp_path / "h.png"))
    with pytest.warns(UserWarning, match="'empty'"):
        plots.plot_block_length_histogram({**data, "empty": []}, tmp_path / "h2.png")
    with pytest.raises(ValueError, match="empty"), pytest.warns(UserWarning):
        plots.plot_block_length_histogram({"a": []}, tmp_path / "h3.png")


def test_exit_mass_by_depth(tmp_path):
    data = {"warm_start": [0.5, 0.3, 0.15, 0.05], "exittrain": [0.3, 0.3, 0.25, 0.1, 0.05]}
    assert_png(plots.plot_exit_mass_by_depth(data, tmp_path / "e.png"))
    with pytest.raises(ValueError):
        plots.plot_exit_mass_by_depth({}, tmp_path / "e2.png")


def test_training_curves_accepts_history_layouts(tmp_path):
    history = {
        "warm_start": [{"step": 10, "block_length": 1.2}, {"step": 20, "block_length": 1.5}],
        "exittrain": [{"step": 30, "val/block_length": 1.7}, (40, 1.9)],
    }
    assert_png(plots.plot_training_curves(history, tmp_path / "t.png", stage_starts={"exittrain": 25}))
    with pytest.raises(ValueError, match="lacks"):
        plots.plot_training_curves({"a": [{"block_length": 1.0}]}, tmp_path / "t2.png")


def test_display_token():
    assert plots.display_token(" the") == "␣the"
    assert plots.display_token("a\nb") == "a\\nb"
    assert plots.display_token("x" * 30, max_chars=8) == "x" * 7 + "…"
    assert plots.display_token("") == "∅"
    assert plots.display_token("  ") == "␣␣"


def test_tree_layout_places_every_node():
    ex = tree_example_dict()
    layout = plots.tree_layout(ex)
    assert len(layout) == len(ex["tokens"]) + 1
    assert layout[0][0] == 0
    for j, (p, d) in enumerate(zip(ex["parents"], ex["depths"]), start=1):
        assert layout[j][0] == d
        kids = [layout[c][1] for c, q in enumerate(ex["parents"], start=1) if q == p]
        assert min(kids) <= layout[p][1] <= max(kids)  # a parent sits among its children
    leaves = [layout[j][1] for j in range(1, 6) if j not in ex["parents"]]
    assert sorted(leaves) == list(range(len(leaves)))  # one slot per leaf, no overlap


def _random_tree(n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    parents, depths = [], []
    for j in range(1, n + 1):
        p = rng.randrange(0, j) if rng.random() < 0.7 else 0
        while p and depths[p - 1] >= 6:
            p = parents[p - 1]
        parents.append(p)
        depths.append(1 + (depths[p - 1] if p else 0))
    reach = [1.0] + [0.0] * n
    for j, p in enumerate(parents, start=1):
        reach[j] = reach[p] * rng.uniform(0.05, 0.5)
    exit_mass = [r / 2 for r in reach]
    return {"tokens": list(range(n)), "token_texts": [f"tok{j}" for j in range(n)], "parents": parents,
            "depths": depths, "reach": reach, "exit_mass": exit_mass, "accepted_rows": [1], "exit_row": 1}


def test_plot_draft_tree_scales_with_the_tree(tmp_path):
    small = assert_png(plots.plot_draft_tree(tree_example_dict(), tmp_path / "small.png"))
    big_ex = _random_tree(32)
    assert len(plots.tree_layout(big_ex)) == 33
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. missing glyphs or mathtext trouble would warn
        big = assert_png(plots.plot_draft_tree(big_ex, tmp_path / "big.png"))
    assert big[1] > small[1]


def test_plot_draft_tree_rejects_bad_examples(tmp_path):
    ex = tree_example_dict()
    with pytest.raises(ValueError, match="lacks"):
        plots.plot_draft_tree({k: v for k, v in ex.items() if k != "reach"}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="root first"):
        plots.plot_draft_tree({**ex, "reach": ex["reach"][1:]}, tmp_path / "x.png")
    with pytest.raises(ValueError, match="precede"):
        plots.plot_draft_tree({**ex, "parents": [0, 3, 1, 1, 3]}, tmp_path / "x.png")
