"""Decoded rounds without the decode: greedy rounds walked along the target's answer, tree or chain.

Shape legend: T prompt + answer positions, P answer positions a round can be rooted at, K drafter
horizon, V vocabulary, F feature width.

At T = 0 every exact verifier outputs the target's greedy answer y, and a round rooted at answer
position p accepts the deepest path of its draft tree that spells y[p+1 ...]: a function of
``prompt + y[: p + 1]`` alone, whatever rounds came before. That holds for the recipe's tree of
``budget`` nodes (:class:`~exittrain.decoding.SpeculativeDecoder`) and for the greedy chain of K
nodes a serving engine verifies (:class:`~exittrain.decoding.chain_decoder.ChainDecoder`).
:func:`walked_rounds` computes that acceptance at every p teacher-forced and walks the rounds:

1. one causal target pass over ``prompt + y`` gives the fp32 features the drafter reads (and the
   K/V for step 4; :func:`~exittrain.heldout.row_prefix.row_prefix`: every drafter and track walking
   the same answer shares it), and one drafter pass the states of every anchor, its copy branch looking the
   n-grams up in the ids up to the anchor, as the decoder's does (``forward_anchors``);
2. the accepted length at p: for the chain, :func:`chain_accept_lengths`, the run of depths whose
   greedy chain token (the argmax of the drafter's log-probabilities there,
   :func:`~exittrain.core.chain_tree`'s node) is y's. The LM head, most of the drafter's cost, runs
   depth by depth on the anchors whose chain still matches, so a drafter that accepts 1 token a
   round pays about 2 head rows an anchor, not K. Its twin, and the tree's acceptance, is
   ``followed_depth(anchor_trees(..., shape=shape), labels)`` (:func:`~exittrain.core.followed_depth`,
   :func:`anchor_trees`: :func:`~exittrain.core.build_tree` as the plain decoder builds each
   round's tree);
3. :func:`~exittrain.core.greedy_walk` walks the rounds from the first root y[0] to where the
   decoder stops (``max_new_tokens`` tokens or an EOS), counting them as the decoder does;
4. the decoder reports a round's whole block, even past the stop. The last round's tree may hold
   y to its end, and then what it accepts beyond is the target's to say: that one tree is scored
   by the target (``score_trees``, exact) and verified greedily, as the decoder would.

Where the rounds start: :func:`~exittrain.decoding.chain_decoder.decode_after_prefill` roots the
first round at the target's first token y[0] (``answer`` is the target's answer); the plain
``SpeculativeDecoder.generate(prompt)`` roots it at the prompt's last token, so its walk is
``walked_rounds(prompt[:-1], prompt[-1:] + answer, max_new_tokens + 1)``
(:func:`~exittrain.heldout.decode_eval.evaluate_prompts` walks so).

Cost: one target pass over the prompt and answer, one drafter pass over its anchors, and at most
one scored tree, per prompt, where the decode runs a target and a drafter forward per round.

Where y comes from: :func:`~exittrain.heldout.measures.greedy_answers` answers the walked prompts
in batches (a few times faster than one prompt at a time on a CPU); the prompts decoded
for real keep the one-prompt autoregressive baseline, which their lossless check compares against.

Limits: T = 0 only, and exact up to float rounding. The target's features come from one causal
pass here and from a prefill and tree forwards in the decoder, and the drafter drafts every
anchor in one batch, so a near tie at an argmax or a tree's cut may resolve differently; and y
must be the decode's output, which holds while the decode is lossless. The batched answers add
one more such source (padding and a shared prefix change the shapes the target's kernels see); on
the code recipe's first 48 evaluation prompts at 64 tokens they equalled the one-prompt answers on
every prompt (docs/notebook/2026-12-06-batched-answers-and-part-b.md). The tree and chain tracks
keep a live decode of their first prompt to check both
(:func:`~exittrain.heldout.decode_eval.evaluate_prompts`, :func:`~exittrain.heldout.serving_track.chain_rows`).
The plain decoder's tree only: the copy tail and the CPU decode layer's round policies change the
tree, and the walk does not model them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "WALK_SHAPES", "anchor_logprobs", "anchor_trees", "chain_accept_lengths", "check_live", "walk_checks",
    "walked_rounds",
]

WALK_SHAPES = ("ddtree", "chain")  # the draft trees walked: the plain decoder's best-first tree, the greedy chain


def check_live(live) -> None:
    """ValueError unless ``live`` (how many prompts a walking track decodes for real) is an integer
    >= 0, or None (decode every prompt, walk none)."""
    if live is not None and (not isinstance(live, int) or isinstance(live, bool) or live < 0):
        raise ValueError(f"live={live!r}: the prompts decoded for real must be an integer >= 0, or None for all")


def walk_checks(rows: Sequence[dict]) -> dict:
    """What a walking track's summary says of its live checks, from its per-prompt rows: ``live``, the
    prompts decoded for real (rows without ``decoded`` were), and ``walk_exact``, whether every walk
    checked against a decode (``walk_matches_decode``) gave its rounds; absent where none was checked."""
    out = {"live": sum(bool(r.get("decoded", True)) for r in rows)}
    checked = [r["walk_matches_decode"] for r in rows if "walk_matches_decode" in r]
    if checked:
        out["walk_exact"] = all(checked)
    return out


@torch.no_grad()
def anchor_trees(drafter, features_1TF: torch.Tensor, ids_1T: torch.Tensor, anchors_A: torch.Tensor, budget: int,
                 shape: str = "ddtree"):
    """The (A trees) DraftTree the plain decoder would draft for a round rooted at each anchor of
    ``ids_1T`` (1, T), the drafter seeing ``features_1TF`` (1, T, F) before the anchor:
    :func:`~exittrain.core.shaped_tree` of :func:`anchor_logprobs` (``build_tree`` of ``budget``
    nodes, or the greedy chain of ``min(budget, K)``)."""
    from exittrain.core import shaped_tree

    return shaped_tree(anchor_logprobs(drafter, features_1TF, ids_1T, anchors_A), budget, shape, validate=False)


@torch.no_grad()
def anchor_logprobs(drafter, features_1TF: torch.Tensor, ids_1T: torch.Tensor, anchors_A: torch.Tensor) -> torch.Tensor:
    """(A, K, V) fp32 log-probabilities the drafter gives at each anchor of ``ids_1T`` (1, T), seeing
    ``features_1TF`` (1, T, F) before it: what the plain decoder builds a round's draft from."""
    logits_AKV = drafter.forward_anchors(features_1TF, ids_1T, anchors_A[None].to(ids_1T.device)).float()
    return torch.log_softmax(logits_AKV, -1)


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
def walked_rounds(target, drafter, prompt: Sequence[int], answer: Sequence[int], *, max_new_tokens: int,
                  shape: str = "chain", budget: int | None = None) -> list[int]:
    """The block lengths of the T = 0 rounds that decode ``answer`` after ``prompt``, rooted first at
    ``answer[0]``, walked (see the module): ``shape="chain"`` gives
    ``decode_after_prefill(ChainDecoder(target, drafter, verifier="greedy"), prompt, answer[0],
    max_new_tokens, target.eos_token_ids)``'s rounds; ``shape="ddtree"`` (``budget`` nodes) gives
    ``SpeculativeDecoder(target, drafter, budget=budget).generate(prompt + answer[:1], max_new_tokens - 1)``'s.

    ``answer``: the target's greedy continuation of ``prompt`` (its first token included), up to
    its first EOS or its ``max_new_tokens``-th token; longer answers are cut there. Returns [] where
    the decoder runs no round (an empty answer, ``answer[0]`` an EOS, or ``max_new_tokens`` 1).
    ValueError when ``max_new_tokens`` is not an integer >= 1, the shape is unknown, a tree has no
    budget, or the answer stops short of both an EOS and ``max_new_tokens`` tokens.
    """
    from exittrain.core import VERIFIERS, followed_depth, greedy_walk
    from exittrain.heldout.row_prefix import row_prefix

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (eval.max_new_tokens), got {max_new_tokens!r}")
    if shape not in WALK_SHAPES:
        raise ValueError(f"shape={shape!r}: the walk follows one of {WALK_SHAPES}")
    K = int(drafter.config.num_draft_tokens)
    if shape == "chain":
        budget = K
    elif not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"a walked tree needs its budget, an integer >= 1 (eval.budgets), got {budget!r}")
    answer = [int(t) for t in answer]
    if not answer:
        return []
    eos = set(target.eos_token_ids)
    limit = max_new_tokens - 1  # the rounds decode max_new_tokens - 1 tokens after the first root
    stop = min(next((i for i, t in enumerate(answer) if t in eos), limit), limit)  # the last position decoded
    if len(answer) <= stop:
        raise ValueError(
            f"answer has {len(answer)} tokens, no EOS and fewer than max_new_tokens={max_new_tokens}: pass the "
            "target's whole greedy answer (autoregressive_generate(target, prompt, max_new_tokens))")
    if stop == 0:
        return []
    n = len(prompt)
    ids_T = torch.tensor(list(prompt) + answer[: stop + 1], dtype=torch.long)
    ids_1T = ids_T[None].to(target.device)
    prefix = row_prefix(target, ids_T, drafter.config.target_layer_ids, shared=n)  # every drafter and track
    features_1TF = prefix.features
    anchors_P = torch.arange(n, n + stop)  # the roots y[0] .. y[stop - 1]
    # row p: y[p + 1 .. p + K], -1 (no token) past the stop
    padded = torch.cat([ids_T[n:], ids_T.new_full((K,), -1)])
    labels_PK = padded.unfold(0, K, 1)[1 : stop + 1]
    if shape == "chain":
        accepted_P = chain_accept_lengths(drafter, features_1TF, ids_1T, anchors_P, labels_PK).cpu()
    else:
        trees = anchor_trees(drafter, features_1TF, ids_1T, anchors_P, budget, shape)
        accepted_P = followed_depth(trees, labels_PK).cpu()
    blocks = greedy_walk(accepted_P, stop)
    last = sum(blocks[:-1])  # the last round's root
    if int(accepted_P[last]) == stop - last < K:  # its tree holds y to the stop: the target decides the rest
        tree = anchor_trees(drafter, features_1TF, ids_1T, torch.tensor([n + last]), budget, shape)
        logits = target.score_trees(ids_1T, torch.tensor([[n + last]]), tree, mode="exact", prefix=prefix).logits
        blocks[-1] = int(VERIFIERS["greedy"](tree, logits, validate=False).accept_length[0]) + 1
    return blocks
