"""tree_example on a tiny random Llama target and drafter: a consistent exit law, a JSON round trip, a plot."""

from __future__ import annotations

import json

import pytest

from exittrain.heldout.tree_example import printable_token, tree_example
from exittrain.models import new_drafter
from exittrain.report.plots import plot_draft_tree, tree_layout
from exittrain.run_dir import load_tree_example, save_tree_example
from tests.models.helpers import tiny_target
from tests.report.helpers import assert_png

PROMPT = [5, 9, 17, 3, 22, 8]


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("llama")
    return target, new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0)


def check_law(ex: dict, budget: int) -> None:
    n = ex["num_nodes"]
    assert 1 <= n <= budget
    assert len(ex["tokens"]) == len(ex["token_texts"]) == len(ex["parents"]) == len(ex["depths"]) == n
    assert len(ex["reach"]) == len(ex["missing"]) == len(ex["exit_mass"]) == n + 1
    assert ex["reach"][0] == pytest.approx(1.0, abs=1e-6)
    assert sum(ex["exit_mass"]) == pytest.approx(1.0, abs=1e-5)
    assert sum(ex["reach"]) == pytest.approx(ex["expected_block_length"], abs=1e-5)
    assert ex["coverage"] == pytest.approx(ex["expected_block_length"] - 1.0, abs=1e-5)
    for j, (p, d) in enumerate(zip(ex["parents"], ex["depths"]), start=1):
        assert 0 <= p < j
        assert d == (ex["depths"][p - 1] + 1 if p else 1)
        assert ex["reach"][j] == pytest.approx(ex["reach"][p] * ex["edge"][j - 1], abs=1e-6)
    for r in range(n + 1):
        assert ex["exit_mass"][r] == pytest.approx(ex["reach"][r] * ex["missing"][r], abs=1e-6)
    # the accepted path is a chain from the root ending at the exit row
    rows = ex["accepted_rows"]
    assert ex["block_length"] == len(rows) + 1
    assert [ex["parents"][r - 1] for r in rows] == [0, *rows][:-1]
    assert ex["exit_row"] == (rows[-1] if rows else 0)
    assert ex["accepted_tokens"] == [ex["tokens"][r - 1] for r in rows]


def test_tree_example_greedy(pair, tmp_path):
    target, drafter = pair
    ex = tree_example(target, drafter, PROMPT, budget=16)
    check_law(ex, 16)
    assert ex["temperature"] == 0.0 and ex["law_temperature"] == 1.0
    assert ex["root_token"] == PROMPT[-1] and ex["root_text"] == str(PROMPT[-1])  # no tokenizer: ids as text
    assert ex["token_texts"] == [str(t) for t in ex["tokens"]]
    layout = tree_layout(ex)
    assert len(layout) == ex["num_nodes"] + 1 and all(p is not None for p in layout)
    assert [x for x, _ in layout[1:]] == ex["depths"]

    path = save_tree_example(ex, tmp_path / "tree_example.json")
    back = load_tree_example(path)
    assert back == json.loads(json.dumps(ex))
    assert_png(plot_draft_tree(back, tmp_path / "tree.png"))


def test_tree_example_sampled_and_exact_greedy_law(pair):
    target, drafter = pair
    ex = tree_example(target, drafter, PROMPT, budget=8, temperature=0.8, seed=3)
    check_law(ex, 8)
    assert ex["law_temperature"] == 0.8
    exact = tree_example(target, drafter, PROMPT, budget=8, law_temperature=0.0)
    check_law(exact, 8)
    assert all(r in (0.0, 1.0) for r in exact["reach"])  # one-hot target: every node is reached or not
    # under the greedy law the exit node is the deepest reached node, the one greedy verification stops at
    assert exact["exit_mass"][exact["exit_row"]] == pytest.approx(1.0)


def test_tree_example_of_a_chain_is_the_greedy_chain_a_serving_engine_verifies(pair):
    """``shape="chain"`` (a ``+serve=dflash`` run's tree.shape): K nodes, each the child of the one
    before, each the drafter's argmax at its depth, the same as the DDTree example's first path."""
    target, drafter = pair
    K = drafter.config.num_draft_tokens
    chain = tree_example(target, drafter, PROMPT, budget=16, shape="chain")
    check_law(chain, K)
    assert chain["num_nodes"] == K and chain["parents"] == list(range(K)) and chain["depths"] == list(range(1, K + 1))
    tree = tree_example(target, drafter, PROMPT, budget=16)
    # DDTree's best-first tree holds a prefix of the argmax chain: at each depth its first child
    # (best-first: the highest-scored) is the chain's token, until the tree is wider than deep
    node, held = 0, 0
    for depth in range(1, K + 1):
        child = next((j for j, (p, d) in enumerate(zip(tree["parents"], tree["depths"]), 1) if p == node), None)
        if child is None:
            break
        assert tree["tokens"][child - 1] == chain["tokens"][depth - 1]
        node, held = child, depth
    assert held >= 1
    with pytest.raises(ValueError, match="tree.shape"):
        tree_example(target, drafter, PROMPT, budget=4, shape="star")


def test_tree_example_bad_input(pair, tmp_path):
    target, drafter = pair
    with pytest.raises(ValueError, match="at least 2"):
        tree_example(target, drafter, [5], budget=4)
    with pytest.raises(ValueError, match="budget"):
        tree_example(target, drafter, PROMPT, budget=0)
    with pytest.raises(ValueError, match="temperature"):
        tree_example(target, drafter, PROMPT, temperature=-1.0)
    (tmp_path / "bad.json").write_text('{"tokens": []}')
    with pytest.raises(ValueError, match="not a tree example"):
        load_tree_example(tmp_path / "bad.json")


def test_printable_token():
    assert printable_token("a\nb\t") == "a\\nb\\t"
    assert printable_token(" é€") == " é€"
    assert printable_token("\x00\u200b") == "\\x00\\u200b"
