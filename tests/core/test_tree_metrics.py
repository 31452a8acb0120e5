"""Tree subsets and the exit-law means (exittrain.core.tree_metrics) against their loop twin."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import build_tree, exit_law, select_trees, tree_metrics, tree_metrics_reference

from .helpers import random_logprobs


@pytest.mark.parametrize("seed", range(4))
def test_tree_metrics_equal_the_loop_twin(seed):
    g = torch.Generator().manual_seed(seed)
    N, K, V, B = 5, 3, 7, 6
    trees = build_tree(random_logprobs(N, K, V, g), B)
    probs = torch.softmax(torch.randn(N, B + 1, V, generator=g), -1)
    index = torch.tensor([4, 0, 2])
    sub = select_trees(trees, index)
    for name in ("tokens", "parents", "depths", "valid", "scores"):
        assert torch.equal(getattr(sub, name), getattr(trees, name)[index]), name
    assert sub.max_depth == K
    law = exit_law(sub, probs[index])
    fast, slow = tree_metrics(sub, law), tree_metrics_reference(sub, law)
    assert set(fast) == set(slow) == {"analytic_block_length", "coverage", "mean_exit_depth",
                                      *(f"exit_mass_d{d}" for d in range(K + 1))}
    for key, value in slow.items():
        assert float(fast[key]) == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert sum(slow[f"exit_mass_d{d}"] for d in range(K + 1)) == pytest.approx(1.0, abs=1e-5)
