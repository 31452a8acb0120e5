"""tau of every ``decode: auto`` candidate at T = 0, from one drafter pass per probe row (no decoding).

:func:`candidate_block_lengths` builds, at every answer position of a probe row, the tree each
candidate setting (an :class:`~exittrain.cpu_decode.auto_settings.DecodeSetting`: budget, draft
vocabulary, copy tail, copy lead) would verify there, exactly as the decoder builds it, and
returns the block a T = 0 verifier accepts; :func:`round_starts` and :func:`along_the_rounds` walk
those blocks the way a T = 0 decoder's rounds do, which gives the decoded tau. The module
docstring of :mod:`exittrain.cpu_decode.auto_settings` says how the probe uses them.

Shape legend: A anchors (answer positions of a probe row), K drafter horizon, V vocabulary, D
continuation depth checked (K plus the longest copy tail), T tokens of the row, F target feature
width, H drafter width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exittrain.core import build_tree, check_ngrams, followed_depth
from exittrain.core.copy_tail import copy_chain, copy_only_tree, graft_copy_tail
from exittrain.core.tree import DraftTree
from exittrain.decoding.speculative import COPY_LED, DRAFTED, STEP

__all__ = ["along_the_rounds", "candidate_block_lengths", "round_starts"]




def _tree_at(trees: DraftTree, n: int) -> DraftTree:
    """Tree ``n`` of a batch, as a batch of one (what the decoder grafts onto)."""
    return DraftTree(tokens=trees.tokens[n : n + 1], parents=trees.parents[n : n + 1], depths=trees.depths[n : n + 1],
                     valid=trees.valid[n : n + 1], max_depth=trees.max_depth,
                     scores=None if trees.scores is None else trees.scores[n : n + 1])


def _continuations(ids_T: torch.Tensor, anchors_A: torch.Tensor, depth: int) -> torch.Tensor:
    """(A, D) the tokens after each anchor, -1 (never a tree token) past the row's end."""
    T = ids_T.shape[0]
    src_AD = anchors_A.unsqueeze(1) + torch.arange(1, depth + 1, device=ids_T.device)
    return torch.where(src_AD < T, ids_T[src_AD.clamp(max=T - 1)], torch.full_like(src_AD, -1))


@torch.no_grad()
def candidate_block_lengths(
    target, drafter, rows: Sequence[tuple[torch.Tensor, int]], settings: Sequence,
    vocabs: dict[int, torch.Tensor | None], *, copy_ngrams: Sequence[int] = (3, 2), copy_match: int = 1,
    copy_earliest: bool = False,
) -> dict:
    """Per setting, ``(block lengths, draft nodes, kinds)`` at every anchor of ``rows`` at T = 0.

    ``rows``: ``(ids (T,) long, n_prompt)``, a prompt and the target's greedy answer to it. The
    anchors are the positions from the last prompt token to the last but one token (each has a
    continuation); the decoder's trees there are built from one drafter pass over the row, and
    the block a T = 0 verifier accepts is 1 + how deep the tree holds the greedy continuation.
    Where a setting's round would be copy-led (``copy_lead``: the root's last n tokens occurred
    before), the tree is the copy chain alone and the kind there is ``copy-led``, else ``drafted``
    (a setting's ``miss_steps`` is not read here: :func:`along_the_rounds` places the steps).
    ``copy_ngrams``, ``copy_match`` and ``copy_earliest`` are the decoder's copy-tail settings.
    """
    copy_ngrams = check_ngrams(copy_ngrams, key="copy_ngrams")
    layers = list(drafter.config.target_layer_ids)
    K = drafter.config.num_draft_tokens
    depth = K + max(s.copy_tail for s in settings)
    out = {s: ([], [], []) for s in settings}
    for ids_T, n_prompt in rows:
        ids_T = ids_T.to(target.device)
        if ids_T.shape[0] - n_prompt < 1:
            continue  # no answer token: nothing to score
        features_1TF = target.prefill(ids_T[None], layers=layers).features.float()
        anchors_A = torch.arange(n_prompt - 1, ids_T.shape[0] - 1, device=ids_T.device)
        hidden_AKH, copy = drafter.forward_anchors(features_1TF, ids_T[None], anchors_A[None], apply_lm_head=False,
                                                   with_copy_terms=True)
        labels_AD = _continuations(ids_T, anchors_A, depth)
        # the copy-led rounds' chains: the decoder's own lookup (K + tail tokens on n-gram matches)
        leads = {(s.copy_lead, s.copy_tail) for s in settings if s.copy_lead}
        lead_chains = {key: [copy_chain(ids_T[: a + 1], [key[0]], K + key[1]) for a in anchors_A.tolist()]
                       for key in leads}
        for size in sorted({s.draft_vocab for s in settings}):
            logq_AKV = torch.log_softmax(drafter.head(hidden_AKH, copy, vocabs[size]).float(), dim=-1)
            for budget in sorted({s.budget for s in settings if s.draft_vocab == size}):
                trees = build_tree(logq_AKV, budget, validate=False)
                plain_A = 1 + followed_depth(trees, labels_AD)
                for setting in (s for s in settings if s.draft_vocab == size and s.budget == budget):
                    lengths, nodes, kinds = out[setting]
                    chains = lead_chains.get((setting.copy_lead, setting.copy_tail)) if setting.copy_lead else None
                    if chains is None and (setting.copy_tail == 0 or not copy_ngrams):  # every anchor at once
                        lengths += plain_A.tolist()
                        nodes += [budget] * len(anchors_A)
                        kinds += [DRAFTED] * len(anchors_A)
                        continue
                    for n, a in enumerate(anchors_A.tolist()):  # the decoder's round at anchor a, one at a time
                        if chains is not None and chains[n]:  # copy-led: the chain alone, as the decoder builds it
                            lead_tree = copy_only_tree(chains[n], ids_T.device)
                            lengths.append(1 + int(followed_depth(lead_tree, labels_AD[n : n + 1])[0]))
                            nodes.append(len(chains[n]))
                            kinds.append(COPY_LED)
                            continue
                        kinds.append(DRAFTED)
                        if setting.copy_tail == 0 or not copy_ngrams:
                            lengths.append(int(plain_A[n]))
                            nodes.append(budget)
                            continue
                        tree, added = graft_copy_tail(_tree_at(trees, n), ids_T[: a + 1], copy_ngrams,
                                                      setting.copy_tail, copy_match, earliest=copy_earliest)
                        lengths.append(1 + int(followed_depth(tree, labels_AD[n : n + 1])[0]))
                        nodes.append(budget + added)
    return out


def _rounds(lengths: Sequence[int], kinds: Sequence[str] | None = None, miss_steps: int = 0):
    """Yield ``(anchor, step?)`` for each round of a T = 0 decoder over one row: the decoder's own
    rule (:class:`~exittrain.cpu_decode.round_policy.RoundPolicyDecoder`'s ``miss_steps``,
    :func:`~exittrain.cpu_decode.round_policy.steps_due`): after a drafted round
    of block 1, up to ``miss_steps`` steps of one token follow, unless the anchor's round is
    copy-led (``kinds``), which ends them."""
    i, due = 0, 0
    while i < len(lengths):
        step = due > 0 and kinds[i] != COPY_LED
        yield i, step
        if step:
            due, i = due - 1, i + 1
            continue
        due = miss_steps if kinds is not None and kinds[i] == DRAFTED and int(lengths[i]) == 1 else 0
        i += int(lengths[i])


def round_starts(lengths: Sequence[int]) -> list[int]:
    """The anchors (indices into one row's per-anchor ``lengths``) where a T = 0 decoder starts its
    rounds: the first, then each one block length after the last. At T = 0 the decoder commits the
    target's greedy answer, so this walk is the decoding's own sequence of rounds."""
    return [i for i, _ in _rounds(lengths)]


def along_the_rounds(rows: Sequence[tuple[list, ...]], miss_steps: int = 0) -> tuple[list, ...]:
    """The per-anchor lists of the rounds of every row (:func:`round_starts`), from each row's
    per-anchor ``(block lengths, ...)`` (any further lists: draft nodes, kinds): the decoded
    tau, lower than the mean over every position (a round tends to end where the drafter goes
    wrong, and the next starts there).

    ``miss_steps`` > 0 walks the decoder with steps after a miss (:func:`_rounds`); the rows must
    then be ``(block lengths, draft nodes, kinds)``, and a step round reads ``(1, 0, "step")``."""
    walked: tuple[list, ...] | None = None
    for row in rows:
        if miss_steps and len(row) != 3:
            raise ValueError("along_the_rounds with miss_steps needs rows of (block lengths, draft nodes, kinds)")
        walked = walked or tuple([] for _ in row)
        for i, step in _rounds(row[0], row[2] if miss_steps else None, miss_steps):
            for column, values in zip(walked, (1, 0, STEP) if step else tuple(v[i] for v in row)):
                column.append(values)
    return walked or ([], [])
