"""Decoded rounds without the decode: rounds walked along the target's own answer, tree or chain.

Shape legend: T prompt + answer positions, P answer positions a round can be rooted at, K drafter
horizon, V vocabulary, F feature width.

Couple a decode with the target's own text y (docs/algorithm.md section 6.1): a round rooted at
answer position p accepts the deepest path of its draft tree that spells y[p+1 ...], with y's next
token as its bonus, and the decode's output is y. The tree is a function of ``prompt + y[: p + 1]``
alone, whatever rounds came before. At T = 0, y is the greedy answer, every exact verifier outputs
it, and the walked rounds are the decode's exactly. At T > 0, y is a sample of the target at T, and
the walked rounds are those of a predraw-and-follow decode whose draws along the path are y's
tokens: distributed as the rounds of any exact verifier at T (TEV, predraw-and-follow, a serving
engine's rejection sampling), so their pooled tau (tokens / rounds) is an unbiased draw of a
decode's. That holds for the recipe's tree of ``budget`` nodes
(:class:`~exittrain.decoding.SpeculativeDecoder`) and for the greedy chain of K nodes a serving
engine verifies (:class:`~exittrain.decoding.chain_decoder.ChainDecoder`). :func:`walked_rounds`
computes the acceptance at every p teacher-forced and walks the rounds:

1. one causal target pass over ``prompt + y`` gives the fp32 features the drafter reads (and the
   K/V for step 4; :class:`~exittrain.heldout.sequence_passes.SequencePasses`: every drafter and
   track walking the same answer shares it), and one drafter pass the states of every anchor, its
   copy branch looking the n-grams up in the ids up to the anchor, as the decoder's does
   (``forward_anchors``);
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
   by the target (``score_trees``, exact) and verified greedily at T = 0, or at T > 0 by
   predraw-and-follow with y's tokens as the draws along its path
   (:func:`~exittrain.core.verify_predraw` with ``given_NL``), as the decoder would.

Where the rounds start: :func:`~exittrain.decoding.chain_decoder.decode_after_prefill` roots the
first round at the target's first token y[0] (``answer`` is the target's answer); the plain
``SpeculativeDecoder.generate(prompt)`` roots it at the prompt's last token, so its walk is
``walked_rounds(prompt[:-1], prompt[-1:] + answer, max_new_tokens + 1)``
(:func:`~exittrain.heldout.decode_eval.evaluate_prompts` walks so).

Cost: one target pass over the prompt and answer, one drafter pass over its anchors, and at most
one scored tree, per prompt, where the decode runs a target and a drafter forward per round.

Where y comes from: :func:`~exittrain.heldout.answers.answer_sets` answers the walked prompts in
batches, every temperature from one prefill (a few times faster than one prompt at a time on a
CPU); the prompts decoded for real at T = 0 keep the one-prompt autoregressive baseline, which
their lossless check compares against.

Limits: exact up to float rounding at T = 0, exact in distribution at T > 0 (one draw of y per
prompt: its noise is the target's sampling, shared by every drafter walking the same y, so two
drafters' rows are paired). The target's features come from one causal pass here and from a
prefill and tree forwards in the decoder, and the drafter drafts every anchor in one batch, so a
near tie at an argmax or a tree's cut may resolve differently; and at T = 0 y must be the decode's
output, which holds while the decode is lossless. The batched answers add one more such source
(padding and a shared prefix change the shapes the target's kernels see); on the code recipe's
first 48 evaluation prompts at 64 tokens they equalled the one-prompt answers on every prompt
(docs/notebook/2026-12-06-batched-answers-and-part-b.md). The tree and chain tracks keep a live
decode of their first prompt at T = 0 to check both
(:func:`~exittrain.heldout.decode_eval.evaluate_prompts`, :func:`~exittrain.heldout.serving_track.chain_rows`).
The plain decoder's tree only: the copy tail and the CPU decode layer's round policies change the
tree, and the walk does not model them.

Drafter temperature (``drafter_temperature``, t_d; ``eval.drafter_temperature``): the tree is built
from ``log_softmax(logits / t_d)`` (:func:`~exittrain.decoding.speculative.draft_logprobs`, the
decoder's own, ``SpeculativeDecoder(..., drafter_temperature=t_d)``), so the walk stays the
decode's at any t_d. A best-first tree ranks paths by log-probabilities summed across depths,
and t_d rescales each depth's around its own normaliser, so it changes which nodes a budget holds.
It does not change the greedy chain (each depth's argmax), which is built from the undivided
log-probabilities at every t_d. Nothing on the walked path reads the drafter's probabilities
beyond the tree: a round accepts the deepest path spelling y (``followed_depth``), and the last
round's verifiers read the target's scores and the tree's tokens only (docs/algorithm.md section
6.1). So at T > 0 too, where the acceptance follows the target's draws, t_d acts through the
tree's shape alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "WALK_SHAPES", "anchor_logprobs", "anchor_trees", "chain_accept_lengths", "chain_block_lengths", "check_live",
    "walk_checks",
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
                 shape: str = "ddtree", drafter_temperature: float = 1.0):
    """The (A trees) DraftTree the plain decoder would draft for a round rooted at each anchor of
    ``ids_1T`` (1, T), the drafter seeing ``features_1TF`` (1, T, F) before the anchor:
    :func:`~exittrain.core.shaped_tree` of :func:`anchor_logprobs` at ``drafter_temperature``
    (``build_tree`` of ``budget`` nodes, or the greedy chain of ``min(budget, K)``, whose argmax
    nodes no drafter temperature moves)."""
    from exittrain.core import shaped_tree

    logq_AKV = anchor_logprobs(drafter, features_1TF, ids_1T, anchors_A, drafter_temperature)
    return shaped_tree(logq_AKV, budget, shape, validate=False)


@torch.no_grad()
def anchor_logprobs(drafter, features_1TF: torch.Tensor, ids_1T: torch.Tensor, anchors_A: torch.Tensor,
                    drafter_temperature: float = 1.0) -> torch.Tensor:
    """(A, K, V) fp32 log-probabilities the drafter gives at each anchor of ``ids_1T`` (1, T), seeing
    ``features_1TF`` (1, T, F) before it, at ``drafter_temperature`` t_d: ``log_softmax(logits / t_d)``
    (:func:`~exittrain.decoding.speculative.draft_logprobs`), what the plain decoder builds a round's
    draft from (1.0: the drafter as trained)."""
    from exittrain.decoding.speculative import draft_logprobs

    logits_AKV = drafter.forward_anchors(features_1TF, ids_1T, anchors_A[None].to(ids_1T.device))
    return draft_logprobs(logits_AKV, drafter_temperature)


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


def chain_block_lengths(logits_NKV: torch.Tensor, labels_NK: torch.Tensor) -> torch.Tensor:
    """(N,) float: 1 + the length of the run of positions where the drafter's argmax equals the label,
    from the first: the block a T = 0 verifier accepts on the greedy chain (bonus included), one per
    anchor. A per-anchor value, not a decode's pooled tau: :func:`walked_rounds` walks such
    acceptances into rounds; the training curve (``heldout/chain_block_length``) averages them.

    Fast path of ``1 + followed_depth(chain_tree(logq), labels)`` (:func:`~exittrain.core.chain_tree`),
    the twin the tests compare it with."""
    hits_NK = (logits_NKV.argmax(-1) == labels_NK).long()
    return 1.0 + hits_NK.cumprod(dim=1).sum(dim=1).float()


def _rows(copy, rows: torch.Tensor, depth: int):
    """The copy terms ``(copy_ids (A, 1), gate_logits (A, 1))`` of ``rows`` at ``depth``; None without the branch."""
    return None if copy is None else tuple(x[rows, depth : depth + 1] for x in copy)


@torch.no_grad()
def walked_rounds(target, drafter, prompt: Sequence[int], answer: Sequence[int], *, max_new_tokens: int,
                  shape: str = "chain", budget: int | None = None, temperature: float = 0.0, seed: int = 0,
                  passes=None, drafter_temperature: float = 1.0) -> list[int]:
    """The block lengths of the rounds that decode ``answer`` after ``prompt``, rooted first at
    ``answer[0]``, walked (see the module): ``shape="chain"`` gives
    ``decode_after_prefill(ChainDecoder(target, drafter), prompt, answer[0], max_new_tokens,
    target.eos_token_ids)``'s rounds; ``shape="ddtree"`` (``budget`` nodes) gives
    ``SpeculativeDecoder(target, drafter, budget=budget, drafter_temperature=drafter_temperature).generate(prompt
    + answer[:1], max_new_tokens - 1)``'s.

    ``answer``: the target's own continuation of ``prompt`` at ``temperature`` (its first token
    included), up to its first EOS or its ``max_new_tokens``-th token; longer answers are cut there.
    At T = 0 it is the greedy answer and the rounds are the decode's, exactly. At T > 0 it is a
    sample of the target at T, and the rounds are those of a predraw-and-follow decode whose draws
    along the path are the answer's tokens: distributed as any exact verifier's rounds at T
    (docs/algorithm.md sections 6.1 and 6.3). The last round's draws past the answer's end are the
    target's, drawn at T by a generator seeded with ``seed``. ``passes``: the
    :class:`~exittrain.heldout.sequence_passes.SequencePasses` of ``target`` that keeps the causal
    passes every drafter and track share (None: a pass for this call alone).

    ``drafter_temperature`` (t_d, a finite number > 0; 1.0 the drafter as trained): the best-first
    tree is built from ``log_softmax(logits / t_d)`` (see the module). The chain is each depth's
    argmax, which t_d does not move: ``shape="chain"`` checks t_d and walks the same rounds at
    every t_d, from the undivided log-probabilities (a division could only tie two logits that
    differ in their last bit).

    Returns [] where the decoder runs no round (an empty answer, ``answer[0]`` an EOS, or
    ``max_new_tokens`` 1). ValueError when ``max_new_tokens`` is not an integer >= 1, the shape is
    unknown, a tree has no budget, the temperature is negative, the drafter temperature is not a finite
    number > 0, or the answer stops short of both an EOS and ``max_new_tokens`` tokens.
    """
    from exittrain.core import VERIFIERS, followed_depth, greedy_walk
    from exittrain.decoding.speculative import check_drafter_temperature
    from exittrain.heldout.sequence_passes import SequencePasses

    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1 (eval.max_new_tokens), got {max_new_tokens!r}")
    if shape not in WALK_SHAPES:
        raise ValueError(f"shape={shape!r}: the walk follows one of {WALK_SHAPES}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature must be a number >= 0 (eval.temperatures), got {temperature!r}")
    drafter_temperature = check_drafter_temperature(drafter_temperature)
    K = int(drafter.config.num_draft_tokens)
    if shape == "chain":
        budget, drafter_temperature = K, 1.0  # the argmax chain, the same at every t_d
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
            "target's whole answer (answer_sets(target, prompts, [temperature], max_new_tokens))")
    if stop == 0:
        return []
    passes = SequencePasses(target) if passes is None else passes
    n = len(prompt)
    ids_T = torch.tensor(list(prompt) + answer[: stop + 1], dtype=torch.long)
    ids_1T = ids_T[None].to(target.device)
    prefix = passes.prefix(ids_T, drafter.config.target_layer_ids, shared=n)  # every drafter and track
    features_1TF = prefix.features
    anchors_P = torch.arange(n, n + stop)  # the roots y[0] .. y[stop - 1]
    # row p: y[p + 1 .. p + K], -1 (no token) past the stop
    padded = torch.cat([ids_T[n:], ids_T.new_full((K,), -1)])
    labels_PK = padded.unfold(0, K, 1)[1 : stop + 1]
    if shape == "chain":
        accepted_P = chain_accept_lengths(drafter, features_1TF, ids_1T, anchors_P, labels_PK).cpu()
    else:
        trees = anchor_trees(drafter, features_1TF, ids_1T, anchors_P, budget, shape, drafter_temperature)
        accepted_P = followed_depth(trees, labels_PK).cpu()
    blocks = greedy_walk(accepted_P, stop)
    last = sum(blocks[:-1])  # the last round's root
    if int(accepted_P[last]) == stop - last < K:  # its tree holds y to the stop: the target decides the rest
        tree = anchor_trees(drafter, features_1TF, ids_1T, torch.tensor([n + last]), budget, shape,
                            drafter_temperature)
        logits = target.score_trees(ids_1T, torch.tensor([[n + last]]), tree, mode="exact", prefix=prefix).logits
        if temperature == 0:
            verdict = VERIFIERS["greedy"](tree, logits, validate=False)
        else:  # the draws along y are y's own tokens; below its end, the target's at T
            verdict = VERIFIERS["predraw"](tree, logits, temperature=temperature, validate=False,
                                           generator=torch.Generator(device=logits.device).manual_seed(seed),
                                           given_NL=ids_T[None, n + last + 1 :])
        blocks[-1] = int(verdict.accept_length[0]) + 1
    return blocks

