"""vLLM's outputs as :class:`~exittrain.data.generation.Answer`: the response, its soft labels, a cut answer.

Both engines of :mod:`exittrain.data.vllm_backend` (the offline worker and a server) hand their
outputs here, as token ids and, per generated position, vLLM's ``(token id, log-probability)``
entries. :func:`make_answer` keeps the response up to and including the first EOS
(:func:`~exittrain.data.generation.split_response`) and, with k > 0, that response's soft labels:
:func:`top_k_rows` sorts each position's entries descending and keeps the k largest, which drops
the sampled token vLLM adds to its top k unless it is one of them (ties keep vLLM's order).
:func:`cut_short` names an output the engine stopped at its ``max_model_len`` before
``max_tokens``: no answer. No engine is imported here: torch and the standard library only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exittrain.data.generation import Answer, split_response

# Shapes: r = response length, k = top log-probabilities kept per response position.


def top_k_rows(positions: Sequence[Sequence[tuple[int, float]]], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-position entries -> ``(top_ids (r, k) int32, top_logprobs (r, k) float32)``, sorted descending.

    vLLM returns, at each generated position, its top k plus the sampled token (an extra entry when
    the sampled token is not among the k; the two coincide in greedy decoding). Keeping the k largest
    drops that extra entry; ties keep vLLM's order. A position with fewer than k entries means the
    engine was asked for fewer: RuntimeError.
    """
    ids_rk = torch.zeros(len(positions), k, dtype=torch.int32)
    logp_rk = torch.zeros(len(positions), k, dtype=torch.float32)
    for j, entries in enumerate(positions):
        unique = dict(entries)  # the sampled token may be listed twice (as sampled and as top-k)
        if len(unique) < k:
            raise RuntimeError(f"vLLM returned {len(unique)} log-probabilities at response position {j}, fewer "
                               f"than the {k} requested")
        best = sorted(unique.items(), key=lambda item: -item[1])[:k]
        ids_rk[j] = torch.tensor([t for t, _ in best], dtype=torch.int32)
        logp_rk[j] = torch.tensor([lp for _, lp in best], dtype=torch.float32)
    return ids_rk, logp_rk


def make_answer(
    token_ids: Sequence[int], positions: Sequence[Sequence[tuple[int, float]]] | None, k: int, eos_ids: Sequence[int]
) -> Answer:
    """One engine output as an :class:`Answer`: the response up to and including the first EOS and,
    with k > 0, the soft labels of those r positions (``positions``: vLLM's entries per generated token)."""
    response, finished = split_response(list(token_ids), eos_ids)
    if k <= 0:
        return Answer(response, finished)
    if positions is None or len(positions) < len(response):
        got = "none" if positions is None else len(positions)
        raise RuntimeError(f"vLLM returned log-probabilities for {got} of {len(response)} response tokens")
    top_ids, top_logprobs = top_k_rows(positions[: len(response)], k)
    return Answer(response, finished, None, top_ids, top_logprobs)


def cut_short(finish_reason: str | None, n_tokens: int, max_tokens: int) -> str | None:
    """Why an output that stopped for length before ``max_tokens`` is no answer (the engine's
    ``max_model_len`` cut it), or None for a whole answer."""
    if finish_reason == "length" and n_tokens < max_tokens:
        return (f"the engine stopped the answer at {n_tokens} of max_tokens={max_tokens} tokens: prompt plus "
                "answer exceed its max_model_len (a server's --max-model-len)")
    return None


__all__ = ["cut_short", "make_answer", "top_k_rows"]
