"""The chain decoder: our decoder verifying the draft a serving engine verifies.

vLLM's and SGLang's DFlash decoding verify one draft per round: the drafter's most likely token
at each of its K positions, a chain (:func:`exittrain.core.chain_tree`, pure math in core).
:class:`ChainDecoder` is :class:`~exittrain.decoding.speculative.SpeculativeDecoder` with that chain in place
of the best-first tree. Its acceptance length at temperature 0 is the number a serving engine
reports for the same drafter on the same prompts; at T > 0, with a verifier at T, its expected
block length is the chain's exit-law tau (docs/algorithm.md section 4.6).
"""

from __future__ import annotations

import torch

from exittrain.core import DraftTree, chain_tree
from exittrain.decoding.speculative import SpeculativeDecoder

__all__ = ["ChainDecoder", "decode_after_prefill"]


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


def decode_after_prefill(decoder: SpeculativeDecoder, prompt: list[int], first: int, max_new_tokens: int,
                         eos_token_ids) -> tuple[list[int], list]:
    """Decode as a serving engine counts its rounds: the prefill emits the target's first token
    ``first`` with no draft, and rounds start from ``prompt + [first]``.

    Returns ``(tokens, rounds)``: the ``max_new_tokens`` (or fewer) new tokens, ``first`` included,
    and the decoder's rounds after it; no round when ``first`` ends the answer (an EOS) or
    ``max_new_tokens`` is 1. So the mean block length over these rounds is comparable, round for
    round, with vLLM's mean acceptance length on the same prompt.
    """
    if first in eos_token_ids or max_new_tokens <= 1:
        return [first], []
    result = decoder.generate(list(prompt) + [first], max_new_tokens - 1)
    return [first] + result.tokens, result.rounds
