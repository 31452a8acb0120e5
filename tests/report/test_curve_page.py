"""RESULTS.md's learning curve: bench curve's results/curve/ shown with its plot and table, or "not measured yet"."""

from __future__ import annotations

import pytest

from exittrain.report import results_page
from exittrain.report.plots import plot_learning_curve
from tests.report.helpers import write_json
from tests.report.test_results_page import PAGE, make_root

HOST = {"cpu_model": "Test CPU", "cpu_capability": "AVX2", "gpu": None, "torch": "2.13.0", "shared": False}


def _point(recipe: str, step: int, cpu_s: float, tokens: int, chain: float) -> dict:
    return {"recipe": recipe, "step": step, "stage": None if step == 0 else "pretrain", "cpu_s": cpu_s,
            "wall_s": cpu_s / 2, "train_tokens": tokens, "chain_tau": chain, "chain_ci95": [chain - 0.1, chain + 0.1],
            "chain_K": 7, "tree_tau": chain + 0.5, "tree_ci95": [chain + 0.4, chain + 0.6], "budget": 16,
            "temperature": 0.0, "prompts": 32, "cpu_model": "Test CPU", "cpu_capability": "AVX2"}


def _curve() -> dict:
    points = [_point("default", 0, 228.0, 0, 1.01), _point("default", 100, 330.0, 90000, 1.45),
              _point("2x-prompts", 0, 456.0, 0, 1.01), _point("2x-prompts", 100, 560.0, 91000, 1.52)]
    return {"domain": "code", "command": "python -m exittrain bench curve", "prompts": 32, "temperature": 0.0,
            "budget": 16, "host": HOST, "points": points,
            "recipes": [{"name": "default", "data": {"cpu_s": 228.0}},
                        {"name": "2x-prompts", "data": {"cpu_s": 456.0}}]}


def test_the_page_shows_the_curve_when_results_hold_one_and_says_so_when_not(tmp_path):
    root = make_root(tmp_path / "without", [])
    text = results_page.write_page(root)
    assert "## Learning curve" in text and "Not measured yet: no `results/curve/curve.json`" in text

    root = make_root(tmp_path / "with", [])
    write_json(root / "results" / "curve" / "curve.json", _curve())
    text = results_page.write_page(root)
    assert "Not measured yet: no `results/curve" not in text
    assert "![served tau against training CPU-seconds and training tokens](results/curve/curve.png)" in text
    assert "[curve.json](results/curve/curve.json), on Test CPU (`AVX2`)" in text
    assert "python -m exittrain bench curve" in text
    assert "| default | 100 | pretrain | 330 | 165 | 90000 | 1.450 [1.35, 1.55] | 1.950 [1.85, 2.05] |" in text
    assert "| 2x-prompts | 0 | start | 456 |" in text and "chain tau K=7" in text and "tree tau B=16" in text
    assert results_page.write_page(root, check=True) == text  # the curve's files give the same page
    # the curve's own folder holds no result summary: load_results does not read it
    assert results_page.load_results(root / "results") == []


def test_a_curve_point_without_a_key_names_the_file_and_the_point(tmp_path):
    curve = _curve()
    del curve["points"][2]["train_tokens"]
    root = make_root(tmp_path, [], PAGE)
    write_json(root / "results" / "curve" / "curve.json", curve)
    with pytest.raises(ValueError, match=r"curve\.json points\[2\]: missing key 'train_tokens'"):
        results_page.write_page(root)


def test_the_curve_plot_has_both_panels_and_refuses_what_it_cannot_draw(tmp_path):
    path = plot_learning_curve(_curve(), tmp_path / "curve.png")
    assert path.stat().st_size > 5000
    with pytest.raises(ValueError, match="no points"):
        plot_learning_curve({"points": []}, tmp_path / "none.png")
    bad = _curve()
    del bad["points"][1]["tree_ci95"]
    with pytest.raises(ValueError, match="point 1 lacks tree_ci95"):
        plot_learning_curve(bad, tmp_path / "bad.png")
