"""Chain-shaped draft trees: the drafter's greedy path, the draft a serving engine verifies.

Shape legend: N trees, K drafter positions, V vocabulary, B budget (nodes, root excluded).

vLLM's and SGLang's DFlash decoding verify one draft per round: the drafter's most likely token
at each of its K positions, a chain. :func:`chain_tree` builds that chain as a :class:`DraftTree`
(node j at depth j, child of node j - 1), so the exit law, the losses, the verifiers and the
target's tree scoring handle it like any other tree. On a chain the exit law's block length is
``1 + sum_k prod_{j<=k} p_j(x_j)``, the expected block length of chain verification
(docs/algorithm.md section 4.6).

:func:`greedy_walk` reads the rounds of a T = 0 decode off the acceptance of every answer
position: a decoded tau without the decode (:mod:`exittrain.heldout.round_walk`).

:func:`chain_tree_reference` is the slow twin: the same chain through :func:`build_tree`, which on
one-hot drafter distributions (log-probability 0 at the argmax, -inf elsewhere) keeps B of the K
nodes of score 0, shallowest first (a child enters the heap only after its parent).
"""

from __future__ import annotations

import torch

from .tree import DraftTree, build_tree

__all__ = ["TREE_SHAPES", "chain_tree", "chain_tree_reference", "graft_chain", "greedy_walk", "shaped_tree"]

TREE_SHAPES = ("ddtree", "chain")
"""The draft trees exittrain trains and measures on: DDTree's best-first tree, or the greedy chain."""


def _check(logprobs_NKV: torch.Tensor, budget: int) -> None:
    if not torch.is_tensor(logprobs_NKV) or logprobs_NKV.dim() != 3:
        shape = tuple(logprobs_NKV.shape) if torch.is_tensor(logprobs_NKV) else type(logprobs_NKV).__name__
        raise ValueError(f"logprobs must be a (N, K, V) tensor of drafter log-probabilities, got {shape}")
    K = logprobs_NKV.shape[1]
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= K:
        raise ValueError(f"a chain's budget must be an int in [1, K={K}] (one node per drafter row), not {budget!r}")


def chain_tree(logprobs_NKV: torch.Tensor, budget: int | None = None) -> DraftTree:
    """The greedy chain of ``budget`` nodes (default K): node j is ``argmax q_j``, child of node j-1.

    ``scores`` are the path log-probabilities (cumulative sums along the chain). ``max_depth`` is K,
    the drafter's horizon, as in :func:`build_tree`'s trees (the node loss and the metrics by depth
    read it), whatever the budget. Ties at the argmax go to ``torch.argmax``'s choice, the lowest
    token id.
    """
    budget = logprobs_NKV.shape[1] if budget is None and torch.is_tensor(logprobs_NKV) else budget
    _check(logprobs_NKV, budget)
    N = logprobs_NKV.shape[0]
    device = logprobs_NKV.device
    best_NB, tokens_NB = logprobs_NKV[:, :budget].max(dim=-1)
    steps_NB = torch.arange(budget, device=device).expand(N, budget)
    return DraftTree(
        tokens=tokens_NB,
        parents=steps_NB.clone(),  # node in column j hangs off column j - 1; column 0 off the root (0)
        depths=steps_NB + 1,
        valid=torch.ones(N, budget, dtype=torch.bool, device=device),
        max_depth=logprobs_NKV.shape[1],
        scores=best_NB.float().cumsum(dim=1),
    )


def chain_tree_reference(logprobs_NKV: torch.Tensor, budget: int | None = None) -> DraftTree:
    """:func:`chain_tree` through :func:`build_tree` on one-hot distributions."""
    budget = logprobs_NKV.shape[1] if budget is None and torch.is_tensor(logprobs_NKV) else budget
    _check(logprobs_NKV, budget)
    argmax_NK = logprobs_NKV.argmax(dim=-1, keepdim=True)
    one_hot = torch.full_like(logprobs_NKV, float("-inf")).scatter(-1, argmax_NK, 0.0)
    return build_tree(one_hot, budget)


def graft_chain(tree: DraftTree, chain: DraftTree) -> tuple[DraftTree, torch.Tensor]:
    """One tree holding both ``tree`` (N trees of B columns) and ``chain`` (N chains of C nodes, from
    :func:`chain_tree`, one per tree, the same root): ``(union, chain_columns)``.

    ``union`` has B + C columns: ``tree``'s first, unchanged, then one column per chain depth d,
    valid only where the chain's node at depth d is not already a node of ``tree`` (a path of
    ``tree`` spelling the chain's first d tokens), hanging off the chain's node at depth d - 1
    wherever that one sits. ``chain_columns`` (N, C) gives the union column of each chain node.
    Every union row sees its own path only, so the target's scores of ``union``'s rows are those of
    ``tree``'s and of ``chain``'s: one forward scores both (docs/algorithm.md section 4.6).
    Siblings carry distinct tokens (``build_tree``), so at most one node of ``tree`` sits on the
    chain at each depth.
    """
    N, B = tree.tokens.shape
    C = chain.budget
    if chain.num_trees != N:
        raise ValueError(f"chain holds {chain.num_trees} chains for {N} trees: one chain per tree, the same root")
    device = tree.tokens.device
    depth_C = torch.arange(1, C + 1, device=device)
    # a tree node is on the chain when its token is the chain's at its depth, and so are its ancestors'
    want_NB = chain.tokens.gather(1, (tree.depths - 1).clamp(0, C - 1))  # a chain has C >= 1 nodes (chain_tree)
    match_NB = tree.valid & (tree.depths <= C) & (tree.tokens == want_NB)
    ok_NB1 = torch.cat([match_NB.new_ones(N, 1), match_NB], 1)  # the root is on every path
    on_NB = ~(tree.ancestor_mask & ~ok_NB1.unsqueeze(1)).any(-1)[:, 1:] & tree.valid
    # per depth d, the column of tree's node on the chain (B where none), and how deep the chain is in tree
    at_NCB = on_NB.unsqueeze(1) & (tree.depths.unsqueeze(1) == depth_C.view(1, C, 1))
    in_tree_NC = at_NCB.any(-1)
    tree_col_NC = torch.where(in_tree_NC, at_NCB.long().argmax(-1), torch.full_like(in_tree_NC, B, dtype=torch.long))
    held_N = in_tree_NC.long().sum(1)  # chain depths 1..held are tree's nodes (paths are prefix-closed)
    extra_NC = depth_C.view(1, C) > held_N.view(N, 1)
    chain_columns = torch.where(extra_NC, B + depth_C.view(1, C) - 1, tree_col_NC)
    # parent row of the chain's node at depth d: its node at depth d - 1 (root-first rows: column + 1)
    above_NC = torch.cat([chain_columns.new_full((N, 1), -1), chain_columns[:, :-1]], 1) + 1
    parents = torch.where(extra_NC, above_NC, torch.zeros_like(above_NC))
    union = DraftTree(
        tokens=torch.cat([tree.tokens, torch.where(extra_NC, chain.tokens, torch.zeros_like(chain.tokens))], 1),
        parents=torch.cat([tree.parents, parents], 1),
        depths=torch.cat([tree.depths, torch.where(extra_NC, depth_C.expand(N, C), torch.zeros_like(parents))], 1),
        valid=torch.cat([tree.valid, extra_NC], 1),
        max_depth=max(tree.max_depth, chain.max_depth),
    )
    return union, chain_columns


def shaped_tree(logprobs_NKV: torch.Tensor, budget: int, shape: str = "ddtree", *, validate: bool = True) -> DraftTree:
    """The N draft trees of ``shape`` over the drafter's (N, K, V) log-probabilities.

    ``ddtree``: :func:`build_tree` of ``budget`` nodes (``validate`` is passed on). ``chain``:
    :func:`chain_tree` of ``min(budget, K)`` nodes, the greedy chain a serving engine verifies.
    """
    if shape == "chain":
        return chain_tree(logprobs_NKV, min(budget, logprobs_NKV.shape[1]))
    if shape == "ddtree":
        return build_tree(logprobs_NKV, budget, validate=validate)
    raise ValueError(f"shape={shape!r}: the tree shape (tree.shape) must be one of {TREE_SHAPES}")


def greedy_walk(accepted_P: torch.Tensor | list[int], stop: int) -> list[int]:
    """The block lengths of the T = 0 rounds that decode a known greedy answer, round by round.

    ``accepted_P`` (P,): the draft tokens a greedy-verified round rooted at answer position p
    accepts; its block length is ``accepted[p] + 1`` (the accepted tokens and the bonus). The first
    round is rooted at position 0, and a round rooted at p commits positions p + 1 .. p + block, so
    the next is rooted at p + block. The walk ends with the first round that commits position
    ``stop`` (p + block >= stop), where a decoder stops (its token limit, or an EOS at ``stop``);
    that round's block is kept whole, as a decoder reports it. ``stop`` 0: no round.

    Exact for a greedy verifier: its output is the answer itself, so a round's acceptance depends
    on its root's position only, whatever rounds came before. Needs the acceptance of every root
    the walk can visit, P >= ``stop``: ValueError otherwise, or on a negative acceptance.
    """
    accepted = accepted_P.tolist() if torch.is_tensor(accepted_P) else list(accepted_P)
    if not isinstance(stop, int) or isinstance(stop, bool) or stop < 0:
        raise ValueError(f"stop must be an answer position >= 0 (where decoding ends), got {stop!r}")
    if len(accepted) < stop:
        raise ValueError(f"accepted holds {len(accepted)} positions but the walk may root a round at every "
                         f"position below stop={stop}: pass the acceptance of positions 0..{stop - 1}")
    if any(a < 0 for a in accepted[:stop]):
        raise ValueError("accepted must count accepted draft tokens, >= 0 at every position")
    blocks, p = [], 0
    while p < stop:
        blocks.append(int(accepted[p]) + 1)
        p += blocks[-1]
    return blocks
