"""Exact tree verifiers: greedy, predraw-and-follow, sequential residual, and TEV.

Shape legend: N trees, B budget, K depth limit, V vocabulary; rows are root-first (B+1).

All four take the target logits of every row, ``logits`` (N, B+1, V), apply one sampling warp
(:func:`warp_probs`: temperature, then top-k, then top-p; temperature 0 is greedy) and return a
:class:`Verdict`. They share the exit law and the bonus law of docs/algorithm.md section 4, so the
output block ``path(exit) + bonus`` is an exact sample of the target: decoding is lossless.

- greedy: follow the argmax child; bonus = argmax at the exit.
- predraw-and-follow: draw ``y_u ~ p_u`` at every row at once, follow matching children.
- sequential residual: at each node try children in column order, accepting child c with
  probability ``r(x_c) / sum(r)`` and zeroing ``r(x_c)`` on rejection; bonus from the residual.
  It walks depth by depth, warps only the rows it visits, tries only the current node's
  children, and synchronises with the host once per depth (its loop bound): the baseline
  the others are measured against.
- TEV: compute the exit mass E of every row at once, draw ``v* ~ E``, then draw the bonus from
  ``p_{v*}`` with v*'s children masked. No walk, no per-level loop. With ``validate=False`` no
  host synchronisation on an accelerator; on a CPU, where a sync is free, it selects the rows
  that have children (a boolean mask index) so as to normalise only those.

Input checks (shapes always; NaN only with ``validate=True``) raise ValueError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .exit_law import exit_law_from_edges
from .tree import DraftTree, at_least_float32

__all__ = [
    "Verdict",
    "warp_probs",
    "sample_categorical",
    "verify_greedy",
    "verify_predraw",
    "verify_sequential",
    "verify_tev",
    "warped_edge_probabilities",
    "VERIFIERS",
]


@dataclass
class Verdict:
    """Outcome of verifying N trees.

    ``exit_node`` (N,) row of the exit node (0 = root); ``accept_length`` (N,) accepted draft
    tokens = depth of the exit node; ``bonus`` (N,) the bonus token; ``accepted_tokens`` (N, K)
    the accepted path's tokens, padded with -1; ``accepted_rows`` (N, K) their rows, padded -1.
    """

    exit_node: torch.Tensor
    accept_length: torch.Tensor
    bonus: torch.Tensor
    accepted_tokens: torch.Tensor
    accepted_rows: torch.Tensor

    @property
    def block_length(self) -> torch.Tensor:
        """(N,) tokens this round yields: accepted draft tokens plus the bonus."""
        return self.accept_length + 1

    def output_tokens(self, n: int = 0) -> list[int]:
        """The round's output block for tree ``n`` (host transfer): accepted path then bonus."""
        length = int(self.accept_length[n])
        return self.accepted_tokens[n, :length].tolist() + [int(self.bonus[n])]


# ----------------------------------------------------------------------------------------------
# sampling helpers


def _check_warp(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(temperature, (int, float)) or temperature < 0 or temperature != temperature:
        raise ValueError(f"temperature must be a number >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def warp_probs(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """The distribution actually decoded from, over the last dim of ``logits`` (..., V).

    Order: temperature, then top-k, then top-p. ``temperature == 0``: one-hot on the argmax (first
    index among ties), and top-k/top-p are moot. top-k keeps every logit >= the k-th largest
    (ties at the boundary are kept). top-p keeps, in descending probability (stable order), each
    token whose preceding cumulative mass is < top_p, so at least one token survives. Computes in
    float32 at least; returns that dtype.
    """
    _check_warp(temperature, top_k, top_p)
    x = at_least_float32(logits)
    if temperature == 0:
        return torch.nn.functional.one_hot(x.argmax(-1), x.shape[-1]).to(x.dtype)
    x = x / temperature
    neg_inf = torch.tensor(float("-inf"), dtype=x.dtype, device=x.device)
    if top_k is not None and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = torch.where(x < kth, neg_inf, x)
    if top_p is not None and top_p < 1.0:
        probs = torch.softmax(x, dim=-1)
        sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p
        drop = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, mass_before >= top_p)
        x = torch.where(drop, neg_inf, x)
    return torch.softmax(x, dim=-1)


def sample_categorical(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw per row of (R, X) non-negative ``weights`` (need not be normalised), by inverse CDF.

    One uniform per row; zero-weight entries are never drawn (``searchsorted(right=True)``). A row
    of all zeros returns an arbitrary in-range index instead of raising, so no host sync happens.
    """
    cdf = weights.cumsum(-1)
    u = torch.rand(weights.shape[:-1] + (1,), generator=generator, device=weights.device, dtype=cdf.dtype)
    index = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return index.squeeze(-1).clamp_max(weights.shape[-1] - 1)


# ----------------------------------------------------------------------------------------------
# shared pieces


def _check_logits(tree: DraftTree, logits: torch.Tensor, validate: bool) -> None:
    N, B = tree.tokens.shape
    if not torch.is_tensor(logits) or logits.dim() != 3 or logits.shape[:2] != (N, B + 1):
        shape = tuple(logits.shape) if torch.is_tensor(logits) else type(logits).__name__
        raise ValueError(
            f"logits must be ({N}, {B + 1}, V): one row of target logits for the root and each node of "
            f"the {N} trees of budget {B}; got {shape}"
        )
    if validate and torch.isnan(logits).any():
        raise ValueError("logits contains NaN; check the target forward (dtype overflow?)")


def _verdict(tree: DraftTree, exit_node: torch.Tensor, bonus: torch.Tensor) -> Verdict:
    """Assemble a Verdict: the exit node's path read off the ancestor mask, no host sync."""
    N, B = tree.tokens.shape
    K = tree.max_depth
    rows = torch.arange(N, device=exit_node.device)
    on_path = tree.ancestor_mask[rows, exit_node]  # (N, B+1)
    on_path[:, 0] = False  # the root is not an accepted draft token
    slot = torch.where(on_path, tree.positions - 1, K)  # depth-1, or a spare slot K
    tokens_rows = torch.cat([tree.tokens.new_zeros(N, 1), tree.tokens], 1)  # new_zeros: an empty tree has no column
    row_ids = torch.arange(B + 1, device=exit_node.device).expand(N, B + 1)
    accepted_tokens = torch.full((N, K + 1), -1, dtype=torch.long, device=exit_node.device)
    accepted_rows = torch.full_like(accepted_tokens, -1)
    accepted_tokens.scatter_(1, slot, torch.where(on_path, tokens_rows, -1))
    accepted_rows.scatter_(1, slot, torch.where(on_path, row_ids, -1))
    return Verdict(
        exit_node=exit_node,
        accept_length=tree.positions.gather(1, exit_node.unsqueeze(1)).squeeze(1),
        bonus=bonus,
        accepted_tokens=accepted_tokens[:, :K],
        accepted_rows=accepted_rows[:, :K],
    )


def _follow(tree: DraftTree, draws: torch.Tensor) -> Verdict:
    """Follow, from the root, the child whose token equals the row's draw (N, B+1)."""
    parent_draw = draws.gather(1, tree.parents)  # (N, B)
    match = tree.valid & (tree.tokens == parent_draw)
    match_rows = torch.cat([match.new_ones(match.shape[0], 1), match], 1)  # (N, B+1)
    # a row is reached iff every row on its path (root included) matched its parent's draw
    reached = ~(tree.ancestor_mask & ~match_rows.unsqueeze(1)).any(-1)  # (N, B+1)
    depth_if_reached = torch.where(reached, tree.positions, -1)
    exit_node = depth_if_reached.argmax(-1)  # siblings are distinct: one reached row per depth
    return _verdict(tree, exit_node, draws.gather(1, exit_node.unsqueeze(1)).squeeze(1))


# ----------------------------------------------------------------------------------------------
# the four verifiers


def verify_greedy(tree: DraftTree, logits: torch.Tensor, *, validate: bool = True) -> Verdict:
    """Temperature-0 verification: follow the argmax child; deterministic."""
    _check_logits(tree, logits, validate)
    return _follow(tree, logits.argmax(-1))


def verify_predraw(
    tree: DraftTree,
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
    given_NL: torch.Tensor | None = None,
) -> Verdict:
    """Predraw-and-follow: one independent draw per row, then follow the matching children.

    ``given_NL`` (N, L), optional: the draws of the first L depths are given, every row at depth
    d < L drawing ``given_NL[n, d]`` (the target text already known after the root) and every deeper
    row drawing from the warped target as usual. This is the round a decode runs when the target's
    text is known up to L tokens after the root and unknown beyond (the last round of a walk along a
    sampled answer, :mod:`exittrain.heldout.round_walk`): given a text the target drew, the round's
    law is predraw-and-follow's conditioned on it (docs/algorithm.md sections 6.1 and 6.3). Rows off
    the text's path are never reached through the given draws, so only the path's draws matter.
    """
    _check_logits(tree, logits, validate)
    probs = warp_probs(logits, temperature, top_k, top_p)
    N, B1, V = probs.shape
    draws = sample_categorical(probs.reshape(N * B1, V), generator).view(N, B1)
    if given_NL is not None:
        if given_NL.dim() != 2 or given_NL.shape[0] != N:
            raise ValueError(f"given_NL has shape {tuple(given_NL.shape)}: need (N={N}, L) tokens after each root")
        L = given_NL.shape[1]
        if L:
            depth_NB1 = tree.positions.expand(N, B1)
            given = given_NL.to(draws.device).gather(1, depth_NB1.clamp(max=L - 1))
            draws = torch.where(depth_NB1 < L, given, draws)
    return _follow(tree, draws)


def verify_sequential(
    tree: DraftTree,
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> Verdict:
    """Sequential residual verification (EAGLE/SpecInfer style, deterministic drafts).

    Batched over trees, sequential over depths and over sibling slots (children are tried in
    column order, i.e. the drafter's score order).
    """
    _check_logits(tree, logits, validate)
    N = tree.tokens.shape[0]
    device = logits.device
    rows = torch.arange(N, device=device)

    def row_probs(row: torch.Tensor) -> torch.Tensor:  # warp only the rows the walk visits
        return warp_probs(logits[rows, row], temperature, top_k, top_p)

    sibling_rank = tree.sibling_rank  # (N, B) children are tried in column order

    current = torch.zeros(N, dtype=torch.long, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    residual = row_probs(current)  # (N, V)
    total = residual.sum(-1)
    for _ in range(tree.max_depth):
        accepted = torch.zeros_like(done)
        children = tree.valid & (tree.parents == current.unsqueeze(1)) & ~done.unsqueeze(1)  # (N, B)
        n_slots = int(children.sum(-1).max())  # host sync once per depth: the walk's nature
        if n_slots == 0:
            break
        for slot in range(n_slots):
            is_slot = children & (sibling_rank == slot)
            trying = is_slot.any(-1) & ~accepted
            column = is_slot.to(torch.uint8).argmax(-1)
            token = tree.tokens[rows, column]
            mass = residual[rows, token]
            u = torch.rand(N, generator=generator, device=device, dtype=residual.dtype)
            accept = trying & (u * total < mass)
            reject = trying & ~accept
            residual[rows, token] = torch.where(reject, torch.zeros_like(mass), mass)
            total = torch.where(reject, total - mass, total)
            current = torch.where(accept, column + 1, current)
            accepted |= accept
        done |= ~accepted
        residual = torch.where(accepted.unsqueeze(1), row_probs(current), residual)
        total = torch.where(accepted, residual.sum(-1), total)
    bonus = sample_categorical(residual, generator)
    return _verdict(tree, current, bonus)


def warped_edge_probabilities(
    tree: DraftTree,
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> torch.Tensor:
    """(N, B) warped edge probabilities ``p_{pi(v)}(x_v)``, 0 on padding.

    Without top-k/top-p this needs only one log-normaliser per row, so the (N, B+1, V) warped
    distribution is never materialised; with them it falls back to :func:`warp_probs`.
    """
    _check_warp(temperature, top_k, top_p)
    N, B1, V = logits.shape
    flat_index = tree.parents * V + tree.tokens  # (N, B)
    if temperature == 0:
        best = logits.argmax(-1)  # (N, B+1)
        edge = (best.gather(1, tree.parents) == tree.tokens).to(at_least_float32(logits[:1, :1, :1]).dtype)
    elif top_k is None and (top_p is None or top_p >= 1.0):
        x = at_least_float32(logits)
        x = x if temperature == 1 else x / temperature
        if x.device.type == "cpu":
            # the exp over V dominates on a CPU and a host sync costs nothing there: normalise only
            # the rows that have children (on an accelerator, all rows, with no sync)
            has_child = torch.zeros_like(tree.valid_with_root).scatter_(1, tree.parents, tree.valid)
            log_norm = torch.zeros(N, B1, dtype=x.dtype, device=x.device)
            log_norm[has_child] = torch.logsumexp(x[has_child], dim=-1)
        else:
            log_norm = torch.logsumexp(x, dim=-1)  # (N, B+1)
        edge = (x.reshape(N, B1 * V).gather(1, flat_index) - log_norm.gather(1, tree.parents)).exp()
    else:
        edge = warp_probs(logits, temperature, top_k, top_p).reshape(N, B1 * V).gather(1, flat_index)
    return torch.where(tree.valid, edge, torch.zeros_like(edge))


def verify_tev(
    tree: DraftTree,
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    validate: bool = True,
) -> Verdict:
    """Tree Exit Verification: one exit-node draw from E, one bonus draw from the masked row."""
    _check_logits(tree, logits, validate)
    N, B1, V = logits.shape
    edge = warped_edge_probabilities(tree, logits, temperature, top_k, top_p)  # (N, B)
    law = exit_law_from_edges(tree, edge)  # E for every row at once
    exit_node = sample_categorical(law.exit_mass, generator)  # (N,)
    rows = torch.arange(N, device=logits.device)
    bonus_row = warp_probs(logits[rows, exit_node], temperature, top_k, top_p)  # (N, V)
    bonus_row = bonus_row.masked_fill(tree.child_token_mask(V, rows=exit_node), 0.0)
    return _verdict(tree, exit_node, sample_categorical(bonus_row, generator))


VERIFIERS = {
    "greedy": verify_greedy,
    "predraw": verify_predraw,
    "sequential": verify_sequential,
    "tev": verify_tev,
}
