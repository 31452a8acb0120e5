"""The n-gram copy branch of the drafter: look the root's last n tokens up in the context and mix
the tokens that followed them there into ``q_1..q_K``.

Shape legend: L sequences, T positions, A anchors per sequence, N = L * A anchors, K drafter
positions, C candidate tokens (the vocabulary, or a sampled subset of it).

**Lookup.** At an anchor a (root ``x_a``), for each n in ``ngrams`` (tried in the order given,
longest first by convention) find the latest end position ``e < a`` with
``x_{e-n+1..e} = x_{a-n+1..a}``. The first n that matches gives the copy tokens
``c_k = x_{e+k}`` for the depths k with ``e + k <= a``: only tokens the drafter has already seen
(the context and the root), never the labels. Negative ids (padding) never match and are never
copied. Depths without a copy token get -1, and so does every depth of an anchor without a match.

**Mixture.** With a gate ``g = sigmoid(gate_logit)`` per (anchor, depth) that has a copy token,
``q'_k = (1 - g) q_k + g onehot(c_k)``; depths without one keep ``q_k``. In log space over any
candidate axis that holds ``c_k``: ``log q' = log q + log(1 - g)`` everywhere, and at ``c_k``
``logaddexp(log q(c_k) + log(1 - g), log g)``. ``q'`` still sums to 1 and depends on the context
only, not on the tree path (docs/algorithm.md section 1.2), so tree building, the exit law and every
verifier use it unchanged; the verifiers stay exact whatever the drafter proposes.

Why: answers often restate their prompt (code restates its signature and docstring), and a small
drafter that reads target features learns such copies slowly (docs/notebook/2026-12-01-copy-branch.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_ngrams", "mix_copy", "mix_copy_reference", "ngram_lookup", "ngram_lookup_reference"]


def check_ngrams(ngrams: Sequence[int], key: str = "copy_ngrams") -> list[int]:
    """``ngrams`` as a list of distinct positive ints; ValueError naming ``key`` otherwise."""
    values = list(ngrams)
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in values) or len(set(values)) != len(values):
        raise ValueError(
            f"{key} must be distinct positive n-gram lengths, longest first (e.g. [3, 2]; [] turns the copy "
            f"branch off), got {values!r}"
        )
    return values


def ngram_lookup(
    ids_LT: torch.Tensor, anchors_LA: torch.Tensor, ngrams: Sequence[int], horizon: int, *, earliest: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The copy tokens of every anchor (see the module docstring).

    ``ids_LT`` (L, T) token ids (negative = padding); ``anchors_LA`` (L, A) root positions;
    ``ngrams`` the n-gram lengths to try in order; ``horizon`` K. Returns ``(copy_ids (L, A, K)
    long, order (L, A) long)``: the copy tokens (-1 where none) and the index in ``ngrams`` of the
    n that matched (-1 where none). Memory O(L * A * T) per n.

    ``earliest=True`` copies from the earliest matching end ``e`` instead of the latest: the
    decode-time copy tail's second chain (:func:`exittrain.core.copy_tail.graft_copy_tail`). The
    drafter's copy branch keeps the latest.
    """
    ngrams = check_ngrams(ngrams)
    if ids_LT.dim() != 2 or anchors_LA.dim() != 2 or anchors_LA.shape[0] != ids_LT.shape[0]:
        raise ValueError(
            f"ids_LT must be (L, T) and anchors_LA (L, A), got {tuple(ids_LT.shape)} and {tuple(anchors_LA.shape)}"
        )
    L, T = ids_LT.shape
    A = anchors_LA.shape[1]
    device = ids_LT.device
    ids = ids_LT.long()
    anchors = anchors_LA.to(device=device, dtype=torch.long)
    copy_ids = torch.full((L, A, horizon), -1, dtype=torch.long, device=device)
    order = torch.full((L, A), -1, dtype=torch.long, device=device)
    if A == 0 or T == 0 or horizon < 1:
        return copy_ids, order
    positions = torch.arange(T, device=device)
    before = positions.view(1, 1, T) < anchors.unsqueeze(-1)  # (L, A, T): end positions e < a
    depth = torch.arange(1, horizon + 1, device=device)
    for index, n in enumerate(ngrams):
        match = before.clone()
        for i in range(n):
            # x_{e-i} for every end e (-1 before the start) against x_{a-i} of every anchor
            shifted_LT = torch.cat([ids.new_full((L, i), -1), ids[:, : T - i]], dim=1) if i else ids
            key_LA = torch.where(anchors - i >= 0, ids.gather(1, (anchors - i).clamp_min(0)), ids.new_full((), -1))
            match &= (shifted_LT.unsqueeze(1) == key_LA.unsqueeze(-1)) & (shifted_LT.unsqueeze(1) >= 0)
        found = match.any(-1) & (order < 0)  # (L, A): a match, and no longer n matched first
        if earliest:  # (L, A) earliest e (T where none: masked by found below)
            end = torch.where(match, positions.view(1, 1, T), positions.new_full((), T)).amin(-1)
        else:  # (L, A) latest e
            end = torch.where(match, positions.view(1, 1, T), positions.new_full((), -1)).amax(-1)
        src = end.unsqueeze(-1) + depth  # (L, A, K) positions e + k
        ok = found.unsqueeze(-1) & (src <= anchors.unsqueeze(-1))
        tokens = ids.gather(1, src.clamp(0, T - 1).reshape(L, A * horizon)).reshape(L, A, horizon)
        ok &= tokens >= 0
        copy_ids = torch.where(ok, tokens, copy_ids)
        order = torch.where(found, torch.full_like(order, index), order)
    return copy_ids, order


def ngram_lookup_reference(
    ids_LT: torch.Tensor, anchors_LA: torch.Tensor, ngrams: Sequence[int], horizon: int, *, earliest: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loop twin of :func:`ngram_lookup`: a scan of plain lists per anchor, backwards from the
    anchor (forwards from the start with ``earliest``)."""
    L, A = anchors_LA.shape
    copy_ids = torch.full((L, A, horizon), -1, dtype=torch.long)
    order = torch.full((L, A), -1, dtype=torch.long)
    for l in range(L):  # noqa: E741
        seq = [int(x) for x in ids_LT[l]]
        for j in range(A):
            a = int(anchors_LA[l, j])
            for index, n in enumerate(ngrams):
                if a - n + 1 < 0 or any(x < 0 for x in seq[a - n + 1 : a + 1]):
                    continue
                key = seq[a - n + 1 : a + 1]
                ends = range(n - 1, a) if earliest else range(a - 1, n - 2, -1)
                end = next((e for e in ends if seq[e - n + 1 : e + 1] == key), None)
                if end is None:
                    continue
                order[l, j] = index
                for k in range(1, horizon + 1):
                    if end + k <= a and seq[end + k] >= 0:
                        copy_ids[l, j, k - 1] = seq[end + k]
                break
    return copy_ids, order


def mix_copy(logq_NKC: torch.Tensor, copy_index_NK: torch.Tensor, gate_logits_NK: torch.Tensor) -> torch.Tensor:
    """Log of ``(1 - g) q + g onehot(copy)`` over the candidate axis (see the module docstring).

    ``logq_NKC`` (N, K, C) normalised log-probabilities; ``copy_index_NK`` (N, K) long, the copy
    token's index on the candidate axis or -1 (that position keeps ``logq``); ``gate_logits_NK``
    (N, K), ``g = sigmoid``. Returns (N, K, C) in the dtype of ``logq_NKC`` (at least float32
    is advised: the mixture adds log-probabilities). Differentiable in ``logq`` and the gate.
    """
    if logq_NKC.dim() != 3 or copy_index_NK.shape != logq_NKC.shape[:2] or gate_logits_NK.shape != copy_index_NK.shape:
        raise ValueError(
            f"logq_NKC must be (N, K, C) with copy_index_NK and gate_logits_NK (N, K); got {tuple(logq_NKC.shape)}, "
            f"{tuple(copy_index_NK.shape)} and {tuple(gate_logits_NK.shape)}"
        )
    has = copy_index_NK >= 0  # (N, K)
    gate = gate_logits_NK.to(logq_NKC.dtype)
    log_keep = torch.where(has, torch.nn.functional.logsigmoid(-gate), torch.zeros_like(gate))  # log(1 - g), or 0
    mixed = logq_NKC + log_keep.unsqueeze(-1)
    index = copy_index_NK.clamp_min(0).unsqueeze(-1)  # (N, K, 1)
    current = mixed.gather(2, index)
    at_copy = torch.logaddexp(current, torch.nn.functional.logsigmoid(gate).unsqueeze(-1))
    return mixed.scatter(2, index, torch.where(has.unsqueeze(-1), at_copy, current))


def mix_copy_reference(
    logq_NKC: torch.Tensor, copy_index_NK: torch.Tensor, gate_logits_NK: torch.Tensor
) -> torch.Tensor:
    """Loop twin of :func:`mix_copy` in probability space: ``log((1 - g) exp(logq) + g onehot)`` per (n, k)."""
    N, K, _ = logq_NKC.shape
    out = logq_NKC.detach().double().clone()
    for n in range(N):
        for k in range(K):
            c = int(copy_index_NK[n, k])
            if c < 0:
                continue
            g = float(torch.sigmoid(gate_logits_NK[n, k].double()))
            q = (1.0 - g) * out[n, k].exp()
            q[c] += g
            out[n, k] = q.log()
    return out
