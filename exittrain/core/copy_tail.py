"""The copy tail: graft an n-gram copy chain onto a draft tree, past the drafter's horizon K.

Shape legend: T committed positions (the root included), L chain length, B nodes of the
drafter's tree, E nodes the graft appends.

Why: a block drafter proposes at most K tokens per round, so a round that copies a long span of
its context (code restates signatures, names and whole lines) stops at depth K even when the
span goes on. Prompt lookup proposes such spans whole. The copy tail does the same for the part
of the span the tree does not hold: the chain is walked down the tree from the root, and the
tokens after the deepest node that carries it are appended under that node as a chain.

**Chain.** :func:`copy_chain` is the n-gram lookup of the drafter's copy branch
(:func:`~exittrain.core.ngram_copy.ngram_lookup`) at the root, with a longer horizon: the tokens
that followed the latest earlier occurrence of the root's last n tokens (n in ``ngrams``, first
match wins), at most ``length`` of them, and only tokens already committed. ``earliest=True``
takes the earliest occurrence instead.

**Two chains.** :func:`graft_copy_tail`, a round's copy tail, grafts the latest occurrence's
chain and, with ``earliest``, then the earliest one's. Where a text restates its prompt, the
earliest occurrence is mostly the source being restated, while the latest is often a short
phrase the answer itself repeats; per answer position the earliest chain agrees with the
target's greedy continuation for more tokens (``python -m exittrain bench copy``). In rounds,
though, the drafter's tree and the latest chain already hold most of it: the decoded tau rose by
1-3% only (docs/notebook/2026-12-03-two-copy-chains.md), so the decoder leaves it off by default.
Where both chains agree, the second graft walks into the first and goes on from its end.

**Exactness.** The grafted tree depends on the committed text only, never on the target's
scores of this round, and siblings still carry distinct tokens (a chain token that some child
of the graft point already carries would have been walked into). Every verifier of
:mod:`exittrain.core.verify` is exact on any such tree (docs/algorithm.md section 6.1), so decoding with
a copy tail stays lossless. Grafted nodes may be deeper than K: ``max_depth`` grows with them,
and they have no drafter score (``scores`` is -inf there, as on padding, but they are valid).

Batch size 1: this is a decode-time step, written over host lists (a tree of B nodes, a chain
of L tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .ngram_copy import ngram_lookup
from .tree import DraftTree

__all__ = ["copy_chain", "copy_only_tree", "graft_chain", "graft_copy_tail"]


def copy_chain(ids_T: torch.Tensor, ngrams: Sequence[int], length: int, *, earliest: bool = False) -> list[int]:
    """The copy chain at the last position of ``ids_T`` (T,) (the root): up to ``length`` tokens, [] if none.
    It follows the latest earlier occurrence of the root's n-gram, or the earliest with ``earliest``."""
    if length < 1 or ids_T.numel() < 2:
        return []
    ids_1T = ids_T.reshape(1, -1)
    anchor_11 = torch.tensor([[ids_1T.shape[1] - 1]], device=ids_1T.device)
    chain_11L, _ = ngram_lookup(ids_1T, anchor_11, ngrams, length, earliest=earliest)
    chain = chain_11L[0, 0].tolist()
    # copies stop at the root (ngram_lookup's -1): keep the leading run of real tokens
    return chain[: chain.index(-1)] if -1 in chain else chain


def copy_only_tree(chain: Sequence[int], device: torch.device | str = "cpu") -> DraftTree:
    """The tree of a copy-led round: the chain alone, node j under node j - 1, the first under the
    root (one tree, L = ``len(chain)`` nodes, ``max_depth`` L, no drafter score). Like a graft,
    it depends on the committed text only, so every verifier stays exact on it."""
    if not chain:
        raise ValueError("copy_only_tree needs at least one chain token (a copy-led round needs a copy)")
    L = len(chain)
    depths = torch.arange(1, L + 1, device=device).unsqueeze(0)
    return DraftTree(tokens=torch.tensor([list(chain)], dtype=torch.long, device=device), parents=depths - 1,
                     depths=depths, valid=torch.ones(1, L, dtype=torch.bool, device=device), max_depth=L,
                     scores=torch.full((1, L), float("-inf"), device=device))


def graft_chain(tree: DraftTree, chain: Sequence[int], max_new: int, min_match: int = 0) -> tuple[DraftTree, int]:
    """``(tree with the chain's unmatched tokens appended, nodes appended)``.

    Walks ``chain`` from the root: ``chain[0]`` among the root's children, ``chain[1]`` among that
    node's children, and so on. The walk reaches depth m; the next ``max_new`` chain tokens
    ``chain[m:m + max_new]`` become a chain of new nodes under the node reached (the root if
    m = 0), in new columns after the tree's own. Nothing is appended when the walk reaches
    fewer than ``min_match`` tokens (0: graft even beside the tree, at the root), when the chain
    is used up, or when ``max_new`` is 0; the tree itself is returned then. ``tree`` must hold
    one tree (N = 1).
    """
    if tree.num_trees != 1:
        raise ValueError(f"graft_chain decodes one sequence: the tree batch must hold N=1 tree, got {tree.num_trees}")
    if max_new < 0 or min_match < 0:
        raise ValueError(f"max_new and min_match must be >= 0, got {max_new} and {min_match}")
    tokens, parents, valid = tree.tokens[0].tolist(), tree.parents[0].tolist(), tree.valid[0].tolist()
    # (parent row, token) -> the child's row: siblings carry distinct tokens, so the walk is unique
    children = {(p, t): j + 1 for j, (p, t, ok) in enumerate(zip(parents, tokens, valid)) if ok}
    row, depth = 0, 0
    for token in chain:
        nxt = children.get((row, token))
        if nxt is None:
            break
        row, depth = nxt, depth + 1
    new = list(chain[depth : depth + max_new])
    if not new or depth < min_match:
        return tree, 0
    B, E = tree.budget, len(new)
    device = tree.tokens.device
    new_parents = [row] + list(range(B + 1, B + E))  # the graft point, then each new node's predecessor
    new_depths = list(range(depth + 1, depth + E + 1))

    def cat(old: torch.Tensor, values) -> torch.Tensor:
        return torch.cat([old, torch.tensor([values], dtype=old.dtype, device=device)], dim=1)

    grafted = DraftTree(
        tokens=cat(tree.tokens, new),
        parents=cat(tree.parents, new_parents),
        depths=cat(tree.depths, new_depths),
        valid=cat(tree.valid, [True] * E),
        max_depth=max(tree.max_depth, new_depths[-1]),
        scores=None if tree.scores is None else cat(tree.scores, [float("-inf")] * E),
    )
    return grafted, E


def graft_copy_tail(tree: DraftTree, ids_T: torch.Tensor, ngrams: Sequence[int], max_new: int, min_match: int,
                    *, earliest: bool = False) -> tuple[DraftTree, int]:
    """``(tree with the round's copy tail, nodes appended)``: the chain after the latest occurrence of
    the root's n-gram (:func:`copy_chain` over ``ids_T``, the committed ids and the root), grafted by
    :func:`graft_chain` with ``max_new`` and ``min_match``; then, with ``earliest``, the chain after
    the earliest occurrence, grafted the same way (up to ``max_new`` more nodes; its walk runs
    through the first graft too). Each chain is looked up to the drafter tree's depth plus
    ``max_new``, so no node lies deeper than that. The decoder and ``decode: auto``'s probe both
    build their trees here, so the probe scores the trees the decoder verifies."""
    length = tree.max_depth + max_new
    added = 0
    for first in (False, True) if earliest else (False,):
        tree, n = graft_chain(tree, copy_chain(ids_T, ngrams, length, earliest=first), max_new, min_match)
        added += n
    return tree, added
