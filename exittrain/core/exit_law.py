"""The exit law: how the target's probability flows through a draft tree and where it leaves.

Shape legend: N trees, B budget, V vocabulary; "rows" are the B+1 positions root-first
(row 0 = root, row j = node in column j-1).

For a tree T with root r and target next-token distributions ``p_u`` after each row u
(docs/algorithm.md section 4):

- edge probability       ``p(v)   = p_{pi(v)}(x_v)``
- reach probability      ``P(r) = 1``, ``P(v) = P(pi(v)) * p(v)``
- missing probability    ``rho(v) = 1 - sum_{c in children(v)} p(c)``  (a leaf has rho = 1)
- exit mass              ``E(v)   = P(v) * rho(v)``, and ``sum_v E(v) = 1``
- expected block length  ``E[l] = sum_v E(v) (d(v) + 1) = sum_v P(v) = 1 + C(T)``

Assumptions: siblings carry distinct tokens (``build_tree`` guarantees it), so the children's
edge probabilities of a node sum to at most 1; ``p_u`` is the distribution actually sampled
from (after temperature, top-k and top-p). Padding columns get zero reach, zero missing
probability and zero exit mass.

``alpha > 0`` floors the edge probabilities used for the reach, ``P~``: a training weight
(docs/algorithm.md section 4.5), no longer a probability law (the exit masses then need not sum to 1).
``edge`` and ``missing`` always use the raw probabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import DraftTree

__all__ = ["ExitLaw", "exit_law", "exit_law_from_edges", "exit_law_reference", "edge_probabilities", "reach_from_edges"]


@dataclass
class ExitLaw:
    """Per-node quantities of the exit law. ``edge`` is (N, B); the others are (N, B+1), root-first."""

    edge: torch.Tensor
    reach: torch.Tensor
    missing: torch.Tensor
    exit_mass: torch.Tensor

    @property
    def expected_block_length(self) -> torch.Tensor:
        """(N,) ``sum_v P(v)`` over root and nodes: the expected tokens per round, bonus included."""
        return self.reach.sum(-1)

    @property
    def coverage(self) -> torch.Tensor:
        """(N,) target coverage ``C(T) = sum_{v != root} P(v)``."""
        return self.reach[:, 1:].sum(-1)


def check_node_probs(tree: DraftTree, probs: torch.Tensor, *, name: str = "probs") -> None:
    """Validate (N, B+1, V) per-row distributions against a tree; raises ValueError."""
    if not torch.is_tensor(probs) or probs.dim() != 3:
        raise ValueError(f"{name} must be a (N, B+1, V) tensor, got {getattr(probs, 'shape', type(probs))}")
    N, B = tree.tokens.shape
    if probs.shape[:2] != (N, B + 1):
        raise ValueError(
            f"{name} has shape {tuple(probs.shape)} but the tree has N={N} trees of budget B={B}: "
            f"pass one row per root and node, shape ({N}, {B + 1}, V)"
        )
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be floating point, got {probs.dtype}")
    if torch.isnan(probs).any():
        raise ValueError(f"{name} contains NaN; check the target forward")
    if (probs < 0).any() or torch.isinf(probs).any():
        raise ValueError(f"{name} must be probabilities in [0, 1]; apply softmax to logits first")
    total = probs.sum(-1, dtype=torch.float64)
    if not torch.allclose(total, torch.ones_like(total), atol=1e-3):
        worst = (total - 1).abs().argmax()
        n, u = divmod(int(worst), B + 1)
        raise ValueError(
            f"{name} rows must sum to 1; row (tree {n}, row {u}) sums to {float(total[n, u]):.6f}. "
            "Pass softmax(logits), or the warped distribution from warp_probs"
        )
    if tree.budget and int(tree.tokens.max()) >= probs.shape[-1]:  # an empty tree (B = 0) has no token to check
        raise ValueError(
            f"tree tokens reach id {int(tree.tokens.max())} but {name} has V={probs.shape[-1]}: "
            "the tree and the distributions must share one vocabulary"
        )


def edge_probabilities(tree: DraftTree, probs: torch.Tensor, parent_rows: torch.Tensor | None = None) -> torch.Tensor:
    """(N, B) ``p_{pi(v)}(x_v)`` for every node, 0 on padding: one flat gather.

    ``probs``: (N, B+1, V), one row per root and node; or, with ``parent_rows`` (N, B), the rows
    each node's parent reads (:meth:`~exittrain.core.tree.DraftTree.interior`: the parents' rows only)."""
    N, B1, V = probs.shape
    parents = tree.parents if parent_rows is None else parent_rows
    flat_index = parents * V + tree.tokens  # (N, B)
    edge = probs.reshape(N, B1 * V).gather(1, flat_index)
    return torch.where(tree.valid, edge, torch.zeros_like(edge))


def reach_from_edges(tree: DraftTree, edge: torch.Tensor) -> torch.Tensor:
    """(N, B+1) reach ``P`` as ``exp(A @ log p)`` with the ancestor matrix, root-first.

    The masked sum avoids ``0 * log 0`` so that zero edges give exactly zero reach.
    """
    log_edge = torch.cat([edge.new_zeros(edge.shape[0], 1), edge.log()], dim=1)  # (N, B+1), root 0
    A = tree.ancestor_mask  # (N, B+1, B+1)
    log_reach = torch.where(A, log_edge.unsqueeze(1), torch.zeros((), dtype=edge.dtype, device=edge.device))
    reach = log_reach.sum(-1).exp()
    return torch.where(tree.valid_with_root, reach, torch.zeros_like(reach))


def _missing(tree: DraftTree, edge: torch.Tensor) -> torch.Tensor:
    """(N, B+1) ``rho`` by a scatter-add of the children's edges into their parents."""
    child_mass = edge.new_zeros(edge.shape[0], edge.shape[1] + 1)
    child_mass.scatter_add_(1, tree.parents, edge)  # padding edges are 0
    rho = (1.0 - child_mass).clamp_min(0.0)  # rounding can push the sum of children past 1
    return torch.where(tree.valid_with_root, rho, torch.zeros_like(rho))


def exit_law(tree: DraftTree, probs: torch.Tensor, alpha: float = 0.0, *, validate: bool = True) -> ExitLaw:
    """The exit law of N trees under the per-row target distributions ``probs`` (N, B+1, V).

    Vectorised: one gather for the edges, one masked reduction over the ancestor matrix for the
    reach, one scatter-add for the missing probability. ``validate=False`` skips the input checks
    and their host synchronisation.
    """
    if validate:
        check_node_probs(tree, probs)
    return exit_law_from_edges(tree, edge_probabilities(tree, probs), alpha)


def exit_law_from_edges(tree: DraftTree, edge: torch.Tensor, alpha: float = 0.0) -> ExitLaw:
    """The exit law from (N, B) edge probabilities alone (0 on padding): all it depends on."""
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1] (edge probability floor), got {alpha!r}")
    floored = edge
    if alpha > 0:
        floored = torch.where(tree.valid, edge.clamp_min(alpha), torch.zeros_like(edge))
    reach = reach_from_edges(tree, floored)
    missing = _missing(tree, edge)
    return ExitLaw(edge=edge, reach=reach, missing=missing, exit_mass=reach * missing)


def exit_law_reference(tree: DraftTree, probs: torch.Tensor, alpha: float = 0.0) -> ExitLaw:
    """Loop twin of :func:`exit_law`: walks every tree node by node in Python."""
    N, B = tree.tokens.shape
    edge = torch.zeros(N, B, dtype=probs.dtype)
    reach = torch.zeros(N, B + 1, dtype=probs.dtype)
    missing = torch.zeros(N, B + 1, dtype=probs.dtype)
    for n in range(N):
        reach[n, 0] = 1.0
        missing[n, 0] = 1.0
        for j in range(B):
            if not bool(tree.valid[n, j]):
                continue
            parent, token = int(tree.parents[n, j]), int(tree.tokens[n, j])
            p = probs[n, parent, token]
            edge[n, j] = p
            reach[n, j + 1] = reach[n, parent] * max(float(p), alpha)
            missing[n, j + 1] = 1.0
        for j in range(B):
            if bool(tree.valid[n, j]):
                parent = int(tree.parents[n, j])
                missing[n, parent] -= edge[n, j]
    missing = missing.clamp_min(0.0)
    return ExitLaw(edge=edge, reach=reach, missing=missing, exit_mass=reach * missing)
