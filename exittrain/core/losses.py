"""Training objectives: block cross-entropy and the ExitTrain node losses (docs/algorithm.md section 8).

Shape legend: N anchors (trees), K drafter positions, V vocabulary, B budget.

**Block cross-entropy** ``L_tok``: the mean over anchors and positions of ``-log q_k(x_{a+k})``,
optionally weighted by ``gamma^(k-1)`` (a weighted mean: ``sum w ce / sum w``). With soft labels
each position carries a sparse distribution instead of one token: S label ids ``y_s`` with
probabilities ``pi_s`` (summing to 1), and the term is ``-sum_s pi_s log q_k(y_s)``.
:func:`mix_soft_labels` builds them from the answer token and the target's top-S next-token
log-probabilities: ``(1 - beta) onehot(x_{a+k}) + beta softmax(top-S log-probs)``, the target's
distribution renormalised over its S most likely tokens.

**ExitTrain node loss** ``L_exit = (1 / N_nodes) sum_v w(v) (-log q_{d(v)}(x_v))`` over the valid
nodes of all trees, with ``w`` one of:

- ``flow``:    ``w = P~(v)``, the reach from floored edges (pass ``exit_law(..., alpha)``);
- ``exit``:    ``w = P~(v) rho(v) d(v)``;
- ``missing``: a soft label of what the tree omitted: for every row v with ``d(v) < K``,
  ``P(v) p_v(y)`` for each token y that is not one of v's children, supervising
  ``q_{d(v)+1}``; normalised by the same ``N_nodes``.

**Sampled block cross-entropy** (training only; evaluation keeps the full vocabulary): the
softmax of ``q_k`` runs over a shared candidate set ``C`` = every label of the batch (U distinct
tokens) plus ``m`` negatives drawn uniformly without replacement from the other ``V - U`` tokens.
The logits of the negatives get ``+ log((V - U) / m)``, so ``sum_{y in C} exp(logit'(y))`` is an
unbiased estimate of the full partition ``Z`` (the log of it, and so the loss, is consistent:
exact when ``m = V - U``, slightly low for small ``m``). Cost: ``(U + m) / V`` of the LM head.

Rows sharing a depth share ``q_d``, so each loss is computed as one soft-label cross-entropy
per (anchor, depth) row: ``sum_v w(v)(-log q_d(x_v)) = sum_y W_d(y) (-log q_d(y))``.
The weights and soft labels are detached: gradients reach the drafter logits only.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .exit_law import ExitLaw
from .ngram_copy import mix_copy
from .tree import DraftTree, at_least_float32

__all__ = [
    "WEIGHT_TYPES",
    "block_cross_entropy",
    "exit_node_loss",
    "block_cross_entropy_reference",
    "exit_node_loss_reference",
    "mix_soft_labels",
    "sample_vocabulary",
    "sampled_block_cross_entropy",
    "sampled_block_cross_entropy_reference",
    "soft_labels",
]

WEIGHT_TYPES = ("flow", "exit", "missing")


def block_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    gamma: float | None = None,
    label_mask: torch.Tensor | None = None,
    label_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted mean of ``-log q_k(labels[:, k])`` over (N, K); ``logits`` (N, K, V).

    ``gamma`` weights position k (1-based) by ``gamma^(k-1)``; ``label_mask`` (N, K) bool excludes
    positions (e.g. past the end of a sequence). Soft labels: ``labels`` (N, K, S) ids with
    ``label_probs`` (N, K, S) (each row a distribution over its S ids; repeats add up), and the
    term of (n, k) is ``-sum_s label_probs[n, k, s] log q_k(labels[n, k, s])``. Returns a scalar.
    """
    _check_labels(logits, labels, label_probs, "logits")
    N, K, V = logits.shape
    weight_NK = _position_weights(N, K, gamma, label_mask, at_least_float32(logits).dtype, logits.device)
    if label_probs is None:
        ce_NK = torch.nn.functional.cross_entropy(
            at_least_float32(logits.reshape(N * K, V)), labels.reshape(N * K), reduction="none"
        ).view(N, K)
    else:
        logq_NKV = torch.log_softmax(at_least_float32(logits), dim=-1)
        ce_NK = _soft_cross_entropy(logq_NKV, labels, label_probs)
    return (ce_NK * weight_NK).sum() / weight_NK.sum().clamp_min(1e-12)


def block_cross_entropy_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    gamma: float | None = None,
    label_mask: torch.Tensor | None = None,
    label_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Loop twin of :func:`block_cross_entropy`: one term per (n, k) and label id."""

    def term(n: int, k: int) -> torch.Tensor:
        logq = torch.log_softmax(at_least_float32(logits[n, k]), dim=-1)
        return sum(-p * logq[y] for y, p in _label_pairs(labels, label_probs, n, k))

    return _weighted_loop_mean(logits, gamma, label_mask, term)


def _label_pairs(labels: torch.Tensor, label_probs: torch.Tensor | None, n: int, k: int) -> list[tuple[int, float]]:
    """The (label id, probability) pairs of position (n, k): the hard label with 1, or the soft ones above 0."""
    if label_probs is None:
        return [(int(labels[n, k]), 1.0)]
    return [(int(y), float(p)) for y, p in zip(labels[n, k], label_probs[n, k]) if float(p) > 0]


def _weighted_loop_mean(
    scores: torch.Tensor,
    gamma: float | None,
    label_mask: torch.Tensor | None,
    term: Callable[[int, int], torch.Tensor],
) -> torch.Tensor:
    """The loop twins' ``sum w term(n, k) / sum w`` over the unmasked (n, k) of ``scores`` (N, K, *), w = gamma^k."""
    N, K = scores.shape[:2]
    total = scores.new_zeros((), dtype=at_least_float32(scores).dtype)
    weight_sum = 0.0
    for n in range(N):
        for k in range(K):
            if label_mask is not None and not bool(label_mask[n, k]):
                continue
            w = 1.0 if gamma is None else gamma**k
            total = total + w * term(n, k)
            weight_sum += w
    return total / max(weight_sum, 1e-12)


def _check_labels(scores: torch.Tensor, labels: torch.Tensor, label_probs: torch.Tensor | None, name: str) -> None:
    """Hard labels (N, K) for ``scores`` (N, K, *), or soft ones: ids and probabilities (N, K, S)."""
    N_K = tuple(scores.shape[:2])
    hard = label_probs is None and tuple(labels.shape) == N_K
    soft = (
        label_probs is not None
        and labels.dim() == 3
        and tuple(labels.shape[:2]) == N_K
        and label_probs.shape == labels.shape
    )
    if scores.dim() != 3 or not (hard or soft):
        raise ValueError(
            f"{name} must be (N, K, *) with labels (N, K), or with labels and label_probs both (N, K, S); got "
            f"{name} {tuple(scores.shape)}, labels {tuple(labels.shape)}, label_probs "
            f"{None if label_probs is None else tuple(label_probs.shape)}"
        )


def _check_copy(copy_ids: torch.Tensor | None, gate_logits: torch.Tensor | None, N: int, K: int) -> bool:
    """Whether the copy branch takes part; both (N, K) or both None, else ValueError."""
    if copy_ids is None and gate_logits is None:
        return False
    if copy_ids is None or gate_logits is None or copy_ids.shape != (N, K) or gate_logits.shape != (N, K):
        raise ValueError(
            f"copy_ids and copy_gate_logits must both be (N={N}, K={K}) or both None, got "
            f"{None if copy_ids is None else tuple(copy_ids.shape)} and "
            f"{None if gate_logits is None else tuple(gate_logits.shape)}"
        )
    return True


def _soft_cross_entropy(logq_NKC: torch.Tensor, index_NKS: torch.Tensor, probs_NKS: torch.Tensor) -> torch.Tensor:
    """(N, K) ``-sum_s probs log q(index_s)``; zero-probability entries contribute nothing (even at -inf)."""
    picked = logq_NKC.gather(2, index_NKS)
    probs = probs_NKS.to(picked.dtype)
    return -torch.where(probs > 0, probs * picked, torch.zeros_like(picked)).sum(-1)


def mix_soft_labels(
    labels: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, weight: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Soft labels ``(1 - weight) onehot(labels) + weight softmax(top_logprobs)`` as sparse ids and probabilities.

    ``labels`` (N, K) the answer tokens; ``top_ids`` and ``top_logprobs`` (N, K, S): the target's S
    most likely next tokens at each label position and their log-probabilities (``-inf`` marks an
    empty slot). The top-S mass is renormalised to 1. Returns ``(ids (N, K, 1 + S) long, probs
    (N, K, 1 + S) float32)``, the answer token first. ``weight`` in [0, 1]; a position whose S slots
    are all empty keeps the answer token alone.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"soft label weight must be in [0, 1], got {weight!r}")
    if top_ids.dim() != 3 or top_ids.shape[:2] != labels.shape or top_logprobs.shape != top_ids.shape:
        raise ValueError(
            f"top_ids and top_logprobs must be (N, K, S) over labels (N, K) = {tuple(labels.shape)}; got "
            f"{tuple(top_ids.shape)} and {tuple(top_logprobs.shape)}"
        )
    logp = top_logprobs.float()
    empty = torch.isneginf(logp).all(-1, keepdim=True)  # (N, K, 1)
    soft = torch.softmax(torch.where(empty, torch.zeros_like(logp), logp), dim=-1)  # (N, K, S)
    beta = torch.where(empty, torch.zeros_like(empty, dtype=soft.dtype), torch.full_like(soft[..., :1], weight))
    probs = torch.cat([1.0 - beta, beta * soft], dim=-1)
    ids = torch.cat([labels.unsqueeze(-1), top_ids.to(labels.dtype)], dim=-1)
    return ids, probs


def _position_weights(
    N: int, K: int, gamma: float | None, label_mask: torch.Tensor | None, dtype, device
) -> torch.Tensor:
    if gamma is not None and not 0 < gamma <= 1:
        # A decay written as a length scale L, exp(-(k-1)/L) (the reference recipe's "gamma 7"),
        # is this base at exp(-1/L); a base above 1 would weight the deep positions most.
        raise ValueError(
            f"gamma must be in (0, 1] (the base of gamma^(k-1)) or None, got {gamma!r}; "
            "a length scale L is gamma = exp(-1/L)"
        )
    weight = torch.ones(K, dtype=dtype, device=device)
    if gamma is not None:
        weight = gamma ** torch.arange(K, dtype=dtype, device=device)
    weight_NK = weight.expand(N, K)
    if label_mask is not None:
        weight_NK = weight_NK * label_mask.to(device=device, dtype=dtype)
    return weight_NK


def sample_vocabulary(
    labels: torch.Tensor, vocab_size: int, num_negatives: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidate set of the sampled block cross-entropy.

    Returns ``(candidates (U + m,) long, log_correction (U + m,) float32, label_index labels.shape)``:
    the U distinct ``labels`` (sorted) first, then ``m = min(num_negatives, V - U)`` other tokens
    drawn uniformly without replacement with ``generator`` (on the CPU; the result moves to the
    labels' device); ``log_correction`` is 0 for labels and ``log((V - U) / m)`` for negatives;
    ``label_index`` locates every label in ``candidates``.
    """
    if num_negatives < 0:
        raise ValueError(f"num_negatives must be >= 0, got {num_negatives}")
    device = labels.device
    flat = labels.reshape(-1).to("cpu", torch.long)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
        raise ValueError(f"labels must lie in [0, vocab_size={vocab_size})")
    uniq, inverse = torch.unique(flat, sorted=True, return_inverse=True)
    U = int(uniq.numel())
    m = min(int(num_negatives), vocab_size - U)
    if m > 0:
        is_label = torch.zeros(vocab_size, dtype=torch.bool)
        is_label[uniq] = True
        others = (~is_label).nonzero().squeeze(1)  # (V - U,)
        negatives = others[torch.randperm(others.numel(), generator=generator)[:m]]
    else:
        negatives = torch.zeros(0, dtype=torch.long)
    candidates = torch.cat([uniq, negatives])
    correction = torch.zeros(U + m, dtype=torch.float32)
    if m > 0:
        correction[U:] = math.log((vocab_size - U) / m)
    return candidates.to(device), correction.to(device), inverse.view(labels.shape).to(device)


def sampled_block_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    num_negatives: int,
    generator: torch.Generator | None = None,
    *,
    gamma: float | None = None,
    label_mask: torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    label_probs: torch.Tensor | None = None,
    copy_ids: torch.Tensor | None = None,
    copy_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`block_cross_entropy` over a sampled vocabulary (see the module docstring).

    ``hidden`` (N, K, H): the pre-head states of ``q_1..q_K``; ``lm_head_weight`` (V, H) (and the
    optional bias (V,)): the LM head, ``logits = hidden @ W.T + b``; ``labels`` (N, K);
    ``num_negatives`` m; ``gamma``, ``label_mask`` and soft labels (``labels`` (N, K, S) with
    ``label_probs``) as in :func:`block_cross_entropy`; every soft label id is a candidate.
    ``copy_ids`` and ``copy_gate_logits`` (N, K): the drafter's n-gram copy branch
    (:mod:`.ngram_copy`; -1 = no copy token), mixed into the sampled ``q_k`` before the loss; the
    copy tokens join the candidates. Equals :func:`block_cross_entropy` of the full (mixed)
    log-probabilities when ``m >= V - U``. Returns a scalar.
    """
    _check_labels(hidden, labels, label_probs, "hidden")
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden.shape[2]:
        raise ValueError(f"lm_head_weight must be (V, H={hidden.shape[2]}), got {tuple(lm_head_weight.shape)}")
    N, K, _ = hidden.shape
    V = lm_head_weight.shape[0]
    copying = _check_copy(copy_ids, copy_gate_logits, N, K)
    wanted = labels if not copying else torch.cat([labels.reshape(-1), copy_ids[copy_ids >= 0].to(labels.dtype)])
    candidates, correction, wanted_index = sample_vocabulary(wanted, V, num_negatives, generator)
    label_index = wanted_index.reshape(-1)[: labels.numel()].view(labels.shape)
    weight = lm_head_weight[candidates]  # (C, H)
    logits = hidden @ weight.to(hidden.dtype).T  # (N, K, C); bf16 under autocast
    if lm_head_bias is not None:
        logits = logits + lm_head_bias[candidates].to(logits.dtype)
    logits = at_least_float32(logits) + correction.to(at_least_float32(logits).dtype)
    if copying:
        copy_index = torch.full_like(copy_ids, -1)
        copy_index[copy_ids >= 0] = wanted_index.reshape(-1)[labels.numel() :].to(copy_index.dtype)
        logq = mix_copy(torch.log_softmax(logits, dim=-1), copy_index, copy_gate_logits)
        hard_index = label_index.unsqueeze(-1) if label_probs is None else label_index
        probs = torch.ones_like(hard_index, dtype=logq.dtype) if label_probs is None else label_probs
        ce_NK = _soft_cross_entropy(logq, hard_index, probs)
    elif label_probs is None:
        ce_NK = torch.nn.functional.cross_entropy(
            logits.reshape(N * K, -1), label_index.reshape(N * K), reduction="none"
        ).view(N, K)
    else:
        ce_NK = _soft_cross_entropy(torch.log_softmax(logits, dim=-1), label_index, label_probs)
    weight_NK = _position_weights(N, K, gamma, label_mask, ce_NK.dtype, ce_NK.device)
    return (ce_NK * weight_NK).sum() / weight_NK.sum().clamp_min(1e-12)


def sampled_block_cross_entropy_reference(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    candidates: torch.Tensor,
    log_correction: torch.Tensor,
    *,
    gamma: float | None = None,
    label_mask: torch.Tensor | None = None,
    label_probs: torch.Tensor | None = None,
    copy_ids: torch.Tensor | None = None,
    copy_gate_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Loop twin of :func:`sampled_block_cross_entropy` on a given candidate set: one term per (n, k)
    and label id; the copy mixture in probability space, ``(1 - g) p(y) + g [y = c]``."""
    cand = [int(c) for c in candidates]

    def term(n: int, k: int) -> torch.Tensor:
        h = at_least_float32(hidden[n, k])
        logits = [h @ at_least_float32(lm_head_weight[c]) + float(log_correction[i]) for i, c in enumerate(cand)]
        log_z = torch.logsumexp(torch.stack(logits), 0)
        c = -1 if copy_ids is None else int(copy_ids[n, k])
        g = 0.0 if c < 0 else torch.sigmoid(at_least_float32(copy_gate_logits[n, k]))

        def logq(y: int) -> torch.Tensor:
            p = torch.exp(h @ at_least_float32(lm_head_weight[y]) - log_z)
            return torch.log((1 - g) * p + (g if y == c else 0.0))

        return sum(-p * logq(y) for y, p in _label_pairs(labels, label_probs, n, k))

    return _weighted_loop_mean(hidden, gamma, label_mask, term)


def _node_weights(tree: DraftTree, law: ExitLaw, weight_type: str) -> torch.Tensor:
    """(N, B) weight of every node for the ``flow`` and ``exit`` losses, 0 on padding."""
    reach = law.reach[:, 1:]
    if weight_type == "flow":
        w = reach
    else:
        w = reach * law.missing[:, 1:] * tree.depths.to(reach.dtype)
    return torch.where(tree.valid, w, torch.zeros_like(w))


def soft_labels(
    tree: DraftTree,
    law: ExitLaw,
    weight_type: str,
    vocab_size: int,
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """(N, K, V) detached soft labels ``W_d(y)`` such that the loss is ``sum W * (-log q)``.

    ``probs`` (N, B+1, V), the target's per-row distributions, is needed for ``missing`` only.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {WEIGHT_TYPES}, got {weight_type!r}")
    N, B = tree.tokens.shape
    K, V = tree.max_depth, vocab_size
    dtype = law.reach.dtype
    device = law.reach.device
    flat = torch.zeros(N, K * V + 1, dtype=dtype, device=device)  # spare last column for padding
    node_index = torch.where(tree.valid, (tree.depths - 1) * V + tree.tokens, K * V)  # (N, B)
    if weight_type in ("flow", "exit"):
        flat.scatter_add_(1, node_index, _node_weights(tree, law, weight_type))
        return flat[:, : K * V].view(N, K, V).detach()

    if probs is None:
        raise ValueError("weight_type='missing' needs the target's per-row probs (N, B+1, V)")
    # sum over rows v at depth d < K of P(v) p_v, as the label of q_{d+1} ...
    depth_onehot = torch.nn.functional.one_hot(tree.positions, K + 1)[..., :K]  # (N, B+1, K)
    row_weight = depth_onehot.to(dtype) * (law.reach * tree.valid_with_root).unsqueeze(-1)
    label = torch.einsum("nbk,nbv->nkv", row_weight, probs.to(dtype))
    # ... minus the children's tokens, which the tree did cover: P(parent) * p(child)
    covered = law.reach.gather(1, tree.parents) * law.edge
    flat.scatter_add_(1, node_index, torch.where(tree.valid, covered, torch.zeros_like(covered)))
    label = label - flat[:, : K * V].view(N, K, V)
    return label.clamp_min(0.0).detach()


def exit_node_loss(
    logits: torch.Tensor,
    tree: DraftTree,
    law: ExitLaw,
    weight_type: str = "flow",
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """The ExitTrain node loss for drafter ``logits`` (N, K, V) on the trees built from them.

    ``law`` must come from :func:`exit_law` on the same trees (with the training ``alpha``);
    ``probs`` (N, B+1, V) is required for ``missing``. Normalised by the number of valid nodes.
    """
    N, K, V = logits.shape
    if tree.tokens.shape[0] != N or tree.max_depth != K:
        raise ValueError(
            f"logits are (N={N}, K={K}, V) but the trees are N={tree.tokens.shape[0]}, K={tree.max_depth}: "
            "build the trees from these logits"
        )
    label_NKV = soft_labels(tree, law, weight_type, V, probs)
    logq = torch.log_softmax(at_least_float32(logits), dim=-1)
    n_nodes = tree.valid.sum().clamp_min(1)
    return -(label_NKV.to(logq.dtype) * logq).sum() / n_nodes


def exit_node_loss_reference(
    logits: torch.Tensor,
    tree: DraftTree,
    law: ExitLaw,
    weight_type: str = "flow",
    probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Loop twin of :func:`exit_node_loss`: one term per node (and per omitted token)."""
    logq = torch.log_softmax(at_least_float32(logits), dim=-1)
    N, B = tree.tokens.shape
    K, V = logits.shape[1], logits.shape[2]
    total = logq.new_zeros(())
    n_nodes = 0
    for n in range(N):
        children: dict[int, set[int]] = {}
        for j in range(B):
            if not bool(tree.valid[n, j]):
                continue
            n_nodes += 1
            d, x, parent = int(tree.depths[n, j]), int(tree.tokens[n, j]), int(tree.parents[n, j])
            children.setdefault(parent, set()).add(x)
            if weight_type == "flow":
                w = law.reach[n, j + 1]
            elif weight_type == "exit":
                w = law.reach[n, j + 1] * law.missing[n, j + 1] * d
            else:
                continue
            total = total - w.detach() * logq[n, d - 1, x]
        if weight_type == "missing":
            for row in range(B + 1):
                depth = 0 if row == 0 else int(tree.depths[n, row - 1])
                if (row > 0 and not bool(tree.valid[n, row - 1])) or depth >= K:
                    continue
                for y in range(V):
                    if y in children.get(row, set()):
                        continue
                    w = law.reach[n, row] * probs[n, row, y]
                    total = total - w.detach() * logq[n, depth, y]
    return total / max(n_nodes, 1)
