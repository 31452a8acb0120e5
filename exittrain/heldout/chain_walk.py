"""The chain track's decoded rounds without the decode: greedy rounds walked along the target's answer.

Shape legend: T prompt + answer positions, P answer positions a round can be rooted at, K drafter
horizon, V vocabulary, F feature width.

At T = 0 with the greedy verifier, :class:`~exittrain.decoding.chain_decoder.ChainDecoder` outputs
the target's greedy answer y (every verifier is lossless), and a round rooted at answer position p
accepts the longest prefix of the drafter's greedy chain that equals y[p+1 ...]: a function of
``prompt + y[: p + 1]`` alone, whatever rounds came before. :func:`walked_chain_rounds` computes
that acceptance at every p teacher-forced and walks the rounds:

1. one causal target pass over ``prompt + y`` gives the fp32 features the drafter reads (and the
   K/V for step 4), and one drafter pass the pre-head states of every anchor, its copy branch
   looking the n-grams up in the ids up to the anchor, as the decoder's does
   (``forward_anchors``, as the expected chain tau's chains are drafted);
2. :func:`chain_accept_lengths`: the accepted length at p is the run of depths whose greedy chain
   token (the argmax of the drafter's log-probabilities there, :func:`~exittrain.core.chain_tree`'s
   node) is y's. The LM head, most of the drafter's cost, runs depth by depth on the anchors whose
   chain still matches, so a drafter that accepts 1 token a round pays about 2 head rows an anchor,
   not K. Its twin is ``followed_depth(drafter_trees(..., shape="chain"), labels)``
   (:func:`~exittrain.core.followed_depth`, :func:`~exittrain.heldout.measures.drafter_trees`);
3. :func:`~exittrain.core.greedy_walk` walks the rounds from where
   :func:`~exittrain.decoding.chain_decoder.decode_after_prefill` starts them (the root y[0], the
   target's first token from the prefill) to where the decoder stops (``max_new_tokens`` tokens or
   an EOS), counting them as the decoder does;
4. the decoder reports a round's whole block, even past the stop. The last round's chain may hold
   y to its end, and then what it accepts beyond is the target's to say: that one chain is scored
   by the target (``score_trees``, exact) and verified greedily, as the decoder would.

Cost: one target pass over the prompt and answer, one drafter pass over its anchors, and at most
one scored chain, per prompt, where the decode runs a target and a drafter forward per round.

Limits: exact up to float rounding. The target's features come from one causal pass here and from
a prefill and tree forwards in the decoder, so a drafter's near tie at its argmax may resolve
differently; and y must be the decode's output, which holds while the decode is lossless. The
chain track keeps a live decode of its first prompt to check both
(:func:`~exittrain.heldout.serving_track.chain_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["chain_accept_lengths", "walked_chain_rounds"]


@torch.no_grad()
def chain_accept_lengths(drafter, features_1TF: torch.Tensor, ids_1T: torch.Tensor, anchors_P: torch.Tensor,
                         labels_PK: torch.Tensor) -> torch.Tensor:
    """(P,) long: how many of ``labels_PK[p]`` (the K tokens after anchor p; -1 = none) the drafter's
    greedy chain at anchor ``anchors_P[p]`` of ``ids_1T`` matches, from the first: the draft tokens a
    T = 0 round accepts there when the labels are the target's greedy continuation.

    The drafter sees ``features_1TF`` (1, T, F) before each anchor (``forward_anchors``); the head
    runs at depth j only on the anchors that matched depths < j (see the module).
    """
    P, K = labels_PK.shape
    hidden_PKH, copy = drafter.forward_anchors(features_1TF, ids_1T, anchors_P[None].to(ids_1T.device),
                                               apply_lm_head=False, with_copy_terms=True)
    labels_PK = labels_PK.to(hidden_PKH.device)
    accepted_P = torch.zeros(P, dtype=torch.long, device=hidden_PKH.device)
    alive = torch.arange(P, device=hidden_PKH.device)  # anchors whose chain matched every depth so far
    for j in range(K):
        if alive.numel() == 0:
            break
        logits_A1V = drafter.head(hidden_PKH[alive, j : j + 1], _rows(copy, alive, j))
        token_A = torch.log_softmax(logits_A1V.float(), dim=-1).argmax(-1)[:, 0]  # the decoder's chain node
        alive = alive[token_A == labels_PK[alive, j]]
        accepted_P[alive] += 1
    return accepted_P


def _rows(copy, rows: torch.Tensor, depth: int):
    """The copy terms ``(copy_ids (A, 1), gate_logits (A, 1))`` of ``rows`` at ``depth``; None without the branch."""
    return None if copy is None else tuple(x[rows, depth : depth + 1] for x in copy)


@torch.no_grad()
def walked_chain_rounds(target, drafter, prompt: Sequence[int], answer: Sequence[int], *,
                        max_new_tokens: int) -> list[int]:
    """The block lengths of ``decode_after_prefill(ChainDecoder(target, drafter, verifier="greedy"),
    prompt, answer[0], max_new_tokens, target.eos_token_ids)``'s rounds, walked (see the module).

    ``answer``: the target's greedy answer to ``prompt`` (as
    :func:`~exittrain.decoding.autoregressive_generate` gives it at T = 0), up to its first EOS or
    its ``max_new_tokens``-th token; longer answers are cut there. Returns [] where the decoder
    runs no round (an empty answer, ``answer[0]`` an EOS, or ``max_new_tokens`` 1). ValueError when
    ``max_new_tokens`` is not an integer >= 1 or the answer stops short of both an EOS and
    ``max_new_tokens`` tokens.
    """
    from exittrain.core import VERIFIERS, greedy_walk
    from exittrain.heldout.measures import drafter_trees

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (eval.max_new_tokens), got {max_new_tokens!r}")
    answer = [int(t) for t in answer]
    if not answer:
        return []
    eos = set(target.eos_token_ids)
    limit = max_new_tokens - 1  # the rounds decode max_new_tokens - 1 tokens after the prefill's one
    stop = min(next((i for i, t in enumerate(answer) if t in eos), limit), limit)  # the last position decoded
    if len(answer) <= stop:
        raise ValueError(
            f"answer has {len(answer)} tokens, no EOS and fewer than max_new_tokens={max_new_tokens}: pass the "
            "target's whole greedy answer (autoregressive_generate(target, prompt, max_new_tokens))")
    if stop == 0:
        return []
    K = int(drafter.config.num_draft_tokens)
    n = len(prompt)
    ids_T = torch.tensor(list(prompt) + answer[: stop + 1], dtype=torch.long)
    ids_1T = ids_T[None].to(target.device)
    prefix = target.sequence_prefix(ids_1T, list(drafter.config.target_layer_ids))
    features_1TF = prefix.features.float()
    anchors_P = torch.arange(n, n + stop)  # the roots y[0] .. y[stop - 1]
    # row p: y[p + 1 .. p + K], -1 (no token) past the stop
    padded = torch.cat([ids_T[n:], ids_T.new_full((K,), -1)])
    labels_PK = padded.unfold(0, K, 1)[1 : stop + 1]
    accepted_P = chain_accept_lengths(drafter, features_1TF, ids_1T, anchors_P, labels_PK).cpu()
    blocks = greedy_walk(accepted_P, stop)
    last = sum(blocks[:-1])  # the last round's root
    if int(accepted_P[last]) == stop - last < K:  # its chain holds y to the stop: the target decides the rest
        tree = drafter_trees(drafter, target, ids_T, torch.tensor([n + last]), K, features_1TF[0], shape="chain")
        logits = target.score_trees(ids_1T, torch.tensor([[n + last]]), tree, mode="exact", prefix=prefix).logits
        blocks[-1] = int(VERIFIERS["greedy"](tree, logits, validate=False).accept_length[0]) + 1
    return blocks
