"""Chain-shaped draft trees: the drafter's greedy path, the tree a serving engine verifies.

Shape legend: N trees, K drafter positions, V vocabulary, B budget (nodes, root excluded).

vLLM's and SGLang's DFlash decoding verify one draft per round: the drafter's most likely token
at each of its K positions, a chain. :func:`chain_tree` builds that chain as a
:class:`~exittrain.core.DraftTree` (node j at depth j, child of node j - 1), so our exact
verifiers and target cache handle it like any other tree, and :class:`ChainDecoder` is
:class:`~exittrain.decoding.SpeculativeDecoder` with the chain in place of the best-first tree.
Its acceptance length at temperature 0 is the number a serving engine reports for the same
drafter on the same prompts.

:func:`chain_tree_reference` is the slow twin: the same chain through
:func:`~exittrain.core.build_tree`, which on one-hot drafter distributions (log-probability 0
at the argmax, -inf elsewhere) keeps exactly the K nodes of score 0, shallowest first.
"""

from __future__ import annotations

import torch

from exittrain.core import DraftTree, build_tree
from exittrain.decoding import SpeculativeDecoder

__all__ = ["ChainDecoder", "chain_tree", "chain_tree_reference"]


def _check(logprobs_NKV: torch.Tensor, budget: int) -> None:
    if not torch.is_tensor(logprobs_NKV) or logprobs_NKV.dim() != 3:
        shape = tuple(logprobs_NKV.shape) if torch.is_tensor(logprobs_NKV) else type(logprobs_NKV).__name__
        raise ValueError(f"logprobs must be a (N, K, V) tensor of drafter log-probabilities, got {shape}")
    K = logprobs_NKV.shape[1]
    if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= K:
        raise ValueError(f"a chain's budget must be an int in [1, K={K}] (one node per drafter row), not {budget!r}")


def chain_tree(logprobs_NKV: torch.Tensor, budget: int | None = None) -> DraftTree:
    """The greedy chain of ``budget`` nodes (default K): node j is ``argmax q_j``, child of node j-1.

    ``scores`` are the path log-probabilities (cumulative sums along the chain). Ties at the
    argmax go to ``torch.argmax``'s choice, the lowest token id.
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
        max_depth=budget,
        scores=best_NB.float().cumsum(dim=1),
    )


def chain_tree_reference(logprobs_NKV: torch.Tensor, budget: int | None = None) -> DraftTree:
    """:func:`chain_tree` through :func:`~exittrain.core.build_tree` on one-hot distributions."""
    budget = logprobs_NKV.shape[1] if budget is None and torch.is_tensor(logprobs_NKV) else budget
    _check(logprobs_NKV, budget)
    argmax_NK = logprobs_NKV[:, :budget].argmax(dim=-1, keepdim=True)
    one_hot = torch.full_like(logprobs_NKV[:, :budget], float("-inf")).scatter(-1, argmax_NK, 0.0)
    return build_tree(one_hot, budget)


class ChainDecoder(SpeculativeDecoder):
    """:class:`SpeculativeDecoder` whose round verifies the drafter's greedy chain of ``budget`` nodes.

    ``budget`` must not exceed the drafter's K (a chain has one node per drafter position).
    """

    def __init__(
        self, target, drafter, budget: int | None = None, verifier: str = "greedy", drafter_cache: bool = True
    ):
        K = int(drafter.config.num_draft_tokens)
        budget = K if budget is None else budget
        if not isinstance(budget, int) or isinstance(budget, bool) or not 1 <= budget <= K:
            raise ValueError(f"budget={budget!r}: a chain has at most K={K} nodes (the drafter's draft tokens)")
        super().__init__(target, drafter, budget=budget, verifier=verifier, drafter_cache=drafter_cache)

    def _tree(self, logq_1KV: torch.Tensor, context, root_1: torch.Tensor) -> DraftTree:
        return chain_tree(logq_1KV, self.budget)
