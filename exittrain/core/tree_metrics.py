"""Subsets of a batch of draft trees and the tree metrics of their exit law.

Shape legend: N trees of a batch, n selected trees, B budget (rows root-first: B + 1), K depth limit.
"""

from __future__ import annotations

import torch

from .exit_law import ExitLaw
from .tree import DraftTree

__all__ = ["select_trees", "tree_metrics", "tree_metrics_reference"]


def select_trees(trees: DraftTree, index: torch.Tensor) -> DraftTree:
    """The trees ``index`` (n,) of a batch, as a new :class:`DraftTree`."""
    return DraftTree(
        tokens=trees.tokens[index],
        parents=trees.parents[index],
        depths=trees.depths[index],
        valid=trees.valid[index],
        max_depth=trees.max_depth,
        scores=trees.scores[index] if trees.scores is not None else None,
    )


@torch.no_grad()
def tree_metrics(trees: DraftTree, law: ExitLaw) -> dict[str, torch.Tensor]:
    """Means over n >= 1 trees of an exit law: analytic block length, coverage, exit mass by depth.

    Keys: ``analytic_block_length`` (``sum_v P(v)``), ``coverage`` (``sum_{v != root} P(v)``),
    ``mean_exit_depth`` (``sum_v E(v) d(v)``), ``exit_mass_d{d}`` for d = 0..K (root = depth 0).
    """
    K = trees.max_depth
    depth_onehot = torch.nn.functional.one_hot(trees.positions, K + 1).to(law.exit_mass.dtype)  # (n, B+1, K+1)
    by_depth = torch.einsum("nb,nbd->d", law.exit_mass, depth_onehot) / law.exit_mass.shape[0]  # (K+1,)
    out = {
        "analytic_block_length": law.expected_block_length.mean(),
        "coverage": law.coverage.mean(),
        "mean_exit_depth": (by_depth * torch.arange(K + 1, dtype=by_depth.dtype, device=by_depth.device)).sum(),
    }
    out.update({f"exit_mass_d{d}": by_depth[d] for d in range(K + 1)})
    return out


def tree_metrics_reference(trees: DraftTree, law: ExitLaw) -> dict[str, float]:
    """Loop twin of :func:`tree_metrics`, node by node, as Python floats."""
    n, K = trees.num_trees, trees.max_depth
    mass = [0.0] * (K + 1)
    for i in range(n):
        for j in range(trees.budget + 1):
            depth = 0 if j == 0 else int(trees.depths[i, j - 1])
            mass[depth] += float(law.exit_mass[i, j]) / n
    out = {
        "analytic_block_length": sum(float(x) for x in law.expected_block_length) / n,
        "coverage": sum(float(x) for x in law.coverage) / n,
        "mean_exit_depth": sum(d * m for d, m in enumerate(mass)),
    }
    out.update({f"exit_mass_d{d}": mass[d] for d in range(K + 1)})
    return out
