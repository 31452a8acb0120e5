"""The training objective of a block drafter as a plain function: losses and tree metrics of one batch.

No Lightning here: :func:`compute_losses` takes ``(drafter, target, batch, settings)`` and a
generator, so the LightningModule (:class:`exittrain.lit.ExitTrainModule`), the ablation and the
benches all call the same code.

Shape legend: L sequences in a batch, T sequence length, A anchors per sequence, N = L * A
anchors (trees; row n = l * A + a), n valid anchors, K = ``num_draft_tokens`` drafter positions,
V vocabulary, B tree budget (rows root-first: B + 1), F target feature width, S soft-label width.

One batch (docs/algorithm.md sections 7-9):

1. ``features`` (L, T, F) = the frozen target's hidden states of the drafter's layers, no grad, fp32.
   With ``feature_cache`` they come from the batch (``features``, bf16, put there by the data's
   feature store, :mod:`exittrain.data.feature_store`); a batch without them has them computed
   by the target and rounded to bf16 too, so every step reads bf16-rounded features.
   Without ``feature_cache`` the target computes them for every batch, in fp32.
2. Anchors: :func:`exittrain.core.sample_anchors` picks A positions per sequence whose K labels
   ``x_{a+1..a+K}`` lie inside the sequence and inside the loss mask, with the caller's generator
   (the module seeds it by ``(seed, global_step, rank)``: reproducible and resume-consistent).
3. ``logits`` (N, K, V) = ``drafter.forward_anchors``; ``L_tok`` = block cross-entropy on the
   valid anchors (optionally decayed by ``gamma``). With ``soft_labels`` and ``soft_label_weight``
   beta > 0 each label is ``(1 - beta) onehot(x_{a+k}) + beta pi``, pi the target's next-token
   distribution renormalised over its top ``soft_label_top_k`` tokens
   (:func:`exittrain.core.mix_soft_labels`). pi comes from the batch (``top_ids`` and
   ``top_logprobs``, kept by the regeneration and served by the feature store); a batch without
   them (or with another S) has them computed by one target forward (with a warning).
4. With ``exit_loss``: trees from the detached logits (``tree_shape``: DDTree's best-first tree of
   ``budget`` nodes, or the drafter's greedy chain of ``min(budget, K)`` nodes, the draft a serving
   engine verifies; docs/algorithm.md section 4.6), target scores of every tree row, the exit
   law (edges floored at ``alpha`` for the weights) and the node loss of ``weight_type`` on the
   valid anchors; ``loss = lambda_tok * L_tok + lambda_exit * L_exit``. Otherwise
   ``loss = lambda_tok * L_tok``, and with ``metrics`` the trees are still built and scored,
   without gradients, for the metrics.

Metrics always use the raw law (alpha = 0): ``analytic_block_length`` is the mean over the valid
trees of ``sum_v P(v)``, the block length TEV achieves on that tree in expectation;
``greedy_block_length`` is 1 + how deep each tree holds the row's own next K tokens
(:func:`exittrain.core.followed_depth`), the block a T = 0 verifier accepts when the answers are
the target's own greedy ones. ``weight_type="missing"`` uses the raw reach P(v) (docs/algorithm.md
section 8.3), so ``alpha`` only affects ``flow`` and ``exit``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch

from exittrain.core import (
    TREE_SHAPES,
    WEIGHT_TYPES,
    block_cross_entropy,
    exit_law,
    exit_node_loss,
    followed_depth,
    mix_soft_labels,
    sample_anchors,
    sampled_block_cross_entropy,
    select_trees,
    shaped_tree,
    tree_metrics,
    warp_probs,
)
from exittrain.core.exit_law import edge_probabilities, exit_law_from_edges
from exittrain.timing import StageTimer

log = logging.getLogger(__name__)

__all__ = [
    "OBJECTIVE_PARTS",
    "SCORING_MODES",
    "STAGES",
    "ObjectiveOutput",
    "ObjectiveSettings",
    "batch_features",
    "batch_top_logprobs",
    "compute_losses",
]

STAGES = ("pretrain", "exittrain")
SCORING_MODES = ("exact", "windowed")
OBJECTIVE_PARTS = ("features", "draft", "tree", "score", "exit")
"""The parts :func:`compute_losses` times: target features, drafter forward + block CE (+ accuracy),
tree build, target scoring, exit law + node loss + tree metrics (0 for a part that did not run)."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def settings_check(values: dict) -> Callable[[bool, str, str], None]:
    """``need(ok, key, fix)``: raise ``ValueError("key=value: fix")`` over ``values`` unless ``ok``."""

    def need(ok: bool, key: str, fix: str) -> None:
        if not ok:
            raise ValueError(f"{key}={values[key]!r}: {fix}")

    return need


def is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class ObjectiveSettings:
    """What one training step computes; every field is validated (``ValueError`` naming the key).

    Attributes:
        stage: ``"pretrain"`` (block CE) or ``"exittrain"`` (block CE + exit node loss).
        anchors_per_seq: A, anchors sampled per sequence and step.
        budget: B, nodes per draft tree (a chain has ``min(B, K)``).
        weight_type: the node weight of ``L_exit``, one of :data:`exittrain.core.WEIGHT_TYPES`.
        alpha: floor of the edge probabilities in the training weights (``flow``, ``exit``).
        lambda_tok, lambda_exit: loss weights.
        gamma: position decay ``gamma^(k-1)`` of the block CE, gamma in (0, 1], or None.
        scoring, window, score_chunk_size: how the target scores the trees
            (:meth:`TargetModel.score_trees` ``mode``, ``window``, ``chunk_size``).
        context_window: drafter context window override (None: the drafter config's).
        analytic_every: in ``pretrain``, build and score trees for the metrics every this many
            steps (0 = never). ``exittrain`` computes them every step anyway.
        seed: seeds the anchor sampling (with the global step and rank).
        vocab_sample: None trains the block CE over the full vocabulary; an int m trains it, in
            ``pretrain`` training steps only, over the step's labels plus m random negatives
            (:func:`exittrain.core.sampled_block_cross_entropy`). ``exittrain`` steps need the full
            logits for the node loss, and validation always uses the full vocabulary.
        feature_cache: True reads the target features from the batch (the data's feature store,
            bf16); False has the target compute them every step (fp32), and the data keeps none.
        soft_label_weight: beta in [0, 1] of the soft labels; 0 trains on the answer tokens alone.
        soft_label_top_k: S, the target tokens per position in pi.
        law_temperature: temperature of the target distribution the node loss's weights (and
            ``missing``'s labels) are computed from (docs/algorithm.md section 4.4): 1 is the raw law, 0
            the one-hot argmax of a T = 0 decoder. The tree metrics always use the raw law.
        tree_shape: the training trees (and the metrics' trees), one of :data:`TREE_SHAPES`:
            ``ddtree`` DDTree's best-first tree of B nodes, ``chain`` the drafter's greedy chain of
            ``min(B, K)`` nodes (:func:`exittrain.core.chain_tree`), the one draft vLLM and SGLang
            verify, whose exit-law block length is their expected acceptance length.
    """

    stage: str = "exittrain"
    anchors_per_seq: int = 32
    budget: int = 16
    weight_type: str = "flow"
    alpha: float = 1e-4
    lambda_tok: float = 1.0
    lambda_exit: float = 1.0
    gamma: float | None = 0.5
    scoring: str = "exact"
    window: int = 64
    score_chunk_size: int | None = None
    context_window: int | None = None
    analytic_every: int = 200
    seed: int = 0
    vocab_sample: int | None = 4096
    feature_cache: bool = True
    soft_label_weight: float = 1.0
    soft_label_top_k: int = 16
    law_temperature: float = 1.0
    tree_shape: str = "ddtree"

    def __post_init__(self) -> None:
        a = asdict(self)
        need = settings_check(a)

        need(a["stage"] in STAGES, "stage", f"must be one of {STAGES} (pretrain = block CE only)")
        need(_is_int(a["anchors_per_seq"]) and a["anchors_per_seq"] >= 1, "anchors_per_seq", "need an int >= 1")
        need(_is_int(a["budget"]) and a["budget"] >= 1, "budget", "need an int >= 1 (draft nodes per tree)")
        need(a["weight_type"] in WEIGHT_TYPES, "weight_type", f"must be one of {WEIGHT_TYPES}")
        need(is_number(a["alpha"]) and 0.0 <= a["alpha"] <= 1.0, "alpha", "need a float in [0, 1] (edge floor)")
        need(is_number(a["lambda_tok"]) and a["lambda_tok"] >= 0, "lambda_tok", "need a float >= 0")
        need(is_number(a["lambda_exit"]) and a["lambda_exit"] >= 0, "lambda_exit", "need a float >= 0")
        need(
            a["gamma"] is None or (is_number(a["gamma"]) and 0 < a["gamma"] <= 1),
            "gamma",
            "need None or a float in (0, 1], the base of the decay gamma^(k-1); a decay written as a length "
            "scale L, exp(-(k-1)/L) (the reference recipe's 'gamma 7'), is gamma = exp(-1/L) (0.867 for L = 7)",
        )
        need(a["scoring"] in SCORING_MODES, "scoring", f"must be one of {SCORING_MODES}")
        need(
            _is_int(a["window"]) and a["window"] >= 1, "window", "need an int >= 1 (prefix tokens in windowed scoring)"
        )
        need(
            a["score_chunk_size"] is None or (_is_int(a["score_chunk_size"]) and a["score_chunk_size"] >= 1),
            "score_chunk_size",
            "need None (all anchors at once) or an int >= 1",
        )
        need(
            a["context_window"] is None or (_is_int(a["context_window"]) and a["context_window"] >= 1),
            "context_window",
            "need None (drafter config default) or an int >= 1",
        )
        need(
            _is_int(a["analytic_every"]) and a["analytic_every"] >= 0, "analytic_every", "need an int >= 0 (0 = never)"
        )
        need(_is_int(a["seed"]), "seed", "need an int")
        need(
            a["vocab_sample"] is None or (_is_int(a["vocab_sample"]) and a["vocab_sample"] >= 1),
            "vocab_sample",
            "need None (full softmax) or an int >= 1 (random negatives per step)",
        )
        need(
            isinstance(a["feature_cache"], bool),
            "feature_cache",
            "need a bool (True reads the target features the data keeps, False computes them every step)",
        )
        need(
            is_number(a["soft_label_weight"]) and 0 <= a["soft_label_weight"] <= 1,
            "soft_label_weight",
            "need a float in [0, 1] (0 = the answer tokens, 1 = the target's top-k distributions)",
        )
        need(_is_int(a["soft_label_top_k"]) and a["soft_label_top_k"] >= 1, "soft_label_top_k", "need an int >= 1")
        need(
            is_number(a["law_temperature"]) and a["law_temperature"] >= 0,
            "law_temperature",
            "need a float >= 0 (1 = the target's raw law, 0 = its greedy one-hot law)",
        )
        need(
            a["tree_shape"] in TREE_SHAPES,
            "tree_shape",
            f"tree.shape must be one of {TREE_SHAPES} (ddtree = DDTree's best-first tree, chain = the drafter's "
            "greedy chain that vLLM and SGLang verify)",
        )
        if a["stage"] == "exittrain":
            need(
                a["lambda_tok"] + a["lambda_exit"] > 0, "lambda_exit", "lambda_tok and lambda_exit are both 0: no loss"
            )
        else:
            need(a["lambda_tok"] > 0, "lambda_tok", "stage='pretrain' trains on block CE only: need lambda_tok > 0")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class ObjectiveOutput(NamedTuple):
    """What :func:`compute_losses` returns.

    ``values``: ``loss``, ``loss_tok``, ``anchors`` (valid count), ``acc_d{k}``, and with the exit
    loss ``loss_exit``, with trees the :func:`exittrain.core.tree_metrics` keys and
    ``greedy_block_length`` (0-dim tensors). ``times_ms``: :data:`OBJECTIVE_PARTS` in ms.
    ``feature_rows_computed``: rows of the batch whose features the target computed.
    """

    values: dict[str, torch.Tensor]
    times_ms: dict[str, float]
    feature_rows_computed: int


def _lengths(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    lengths = batch.get("lengths")
    if lengths is None and batch.get("attention_mask") is not None:
        lengths = batch["attention_mask"].sum(1)
    return lengths


def _beyond_length(batch: Mapping[str, torch.Tensor], device: torch.device) -> torch.Tensor | None:
    """(L, T) bool: True after each row's end (right padding); None when the batch has no lengths."""
    lengths = _lengths(batch)
    if lengths is None:
        return None
    T = batch["input_ids"].shape[1]
    return torch.arange(T, device=device).unsqueeze(0) >= lengths.to(device).view(-1, 1)


@torch.no_grad()
def batch_features(drafter, target, batch: Mapping[str, torch.Tensor], settings: ObjectiveSettings):
    """``(features (L, T, F) fp32 on the target's device, rows the target computed)`` for ``batch``.

    With ``settings.feature_cache`` and a batch that carries ``features`` (and ``feature_layers``,
    which must be the drafter's ``target_layer_ids``): those, and 0 rows computed. Otherwise one
    ``sequence_features`` call on the whole batch; with ``feature_cache`` rounded to bf16 and zero
    after each row's end, exactly as the store serves them.
    """
    input_ids = batch["input_ids"]  # (L, T)
    layers = [int(x) for x in drafter.config.target_layer_ids]
    stored = batch.get("features") if settings.feature_cache else None
    if stored is not None:
        kept = batch.get("feature_layers")
        kept = None if kept is None else [int(x) for x in kept.tolist()]
        if kept != layers:
            raise ValueError(
                f"the batch carries target features of layers {kept} but the drafter reads layers {layers}; "
                f"build the DataModule with feature_layers={layers} (a fresh regeneration keeps them) or set "
                "feature_cache=False"
            )
        return stored.to(target.device).float(), 0
    features = target.sequence_features(input_ids, layers).float()
    if settings.feature_cache:
        features = features.bfloat16().float()
        pad = _beyond_length(batch, features.device)
        if pad is not None:
            features = features.masked_fill(pad.unsqueeze(-1), 0.0)
    return features, int(input_ids.shape[0])


_warned_top_forward = False


@torch.no_grad()
def batch_top_logprobs(target, batch: Mapping[str, torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's top-``k`` tokens and log-probabilities (L, T, k) of ``batch``, long and fp32, on its device.

    Entry (l, t) describes token t given the tokens before it; ``-inf`` (id 0) where unknown: after
    the row's end, and, for rows the regeneration kept them for, over the prompt. From the batch's
    ``top_ids`` / ``top_logprobs`` when they hold k tokens per position; else one target forward
    (:meth:`TargetModel.token_top_logprobs`), with a warning the first time.
    """
    global _warned_top_forward
    input_ids = batch["input_ids"]  # (L, T)
    device = input_ids.device
    top_ids = batch.get("top_ids")
    if top_ids is not None and top_ids.shape[-1] == k:
        return top_ids.to(device, torch.long), batch["top_logprobs"].to(device).float()
    if not _warned_top_forward:
        log.warning(
            "soft labels: the target runs a forward over every batch because the data keeps no top-%d "
            "log-probabilities (a cache entry written without them, or with another soft_label_top_k); delete "
            "the cache entry to regenerate it with them, or set soft_label_weight=0",
            k,
        )
        _warned_top_forward = True
    ids, logp = target.token_top_logprobs(input_ids, k)  # (L, T, k) on the CPU
    pad = _beyond_length(batch, ids.device)
    if pad is not None:
        ids = ids.masked_fill(pad.unsqueeze(-1), 0)
        logp = logp.masked_fill(pad.unsqueeze(-1), -torch.inf)
    return ids.to(device, torch.long), logp.to(device)


EDGE_CHUNK_ELEMENTS = 1 << 24
""":func:`tree_edges` takes the softmax of at most this many logits at a time (64 MB in fp32), a whole tree at least."""


@torch.no_grad()
def tree_edges(trees, logits_NBV: torch.Tensor, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """(n, B) edge probabilities ``p_{pi(v)}(x_v)`` of the trees ``index`` (n,) of ``trees`` (N trees)
    under the target's rows ``logits_NBV`` (N, B+1, V): softmax, or :func:`exittrain.core.warp_probs`
    at ``temperature`` != 1.

    Equal to ``edge_probabilities(select_trees(trees, index), softmax(logits_NBV[index]))`` (the
    softmax of a row does not depend on the other rows), but the (n, B+1, V) distribution is
    built a few trees at a time (:data:`EDGE_CHUNK_ELEMENTS`), never whole beside the logits: on a
    validation batch of SmolLM2-135M (8 rows, 32 anchors, B = 16) that whole tensor and the
    indexed copy of the logits took 1.7 GB.
    """
    B1, V = logits_NBV.shape[1], logits_NBV.shape[2]
    step = max(1, EDGE_CHUNK_ELEMENTS // (B1 * V))
    edges = []
    for n0 in range(0, index.numel(), step):
        rows = index[n0 : n0 + step]
        chunk = logits_NBV[rows].float()
        probs = torch.softmax(chunk, dim=-1) if temperature == 1.0 else warp_probs(chunk, temperature)
        edges.append(edge_probabilities(select_trees(trees, rows), probs))
    return torch.cat(edges) if edges else logits_NBV.new_zeros(0, B1 - 1, dtype=torch.float32)


def compute_losses(
    drafter,
    target,
    batch: Mapping[str, torch.Tensor],
    settings: ObjectiveSettings,
    generator: torch.Generator,
    *,
    exit_loss: bool,
    metrics: bool,
    vocab_sample: int | None = None,
    soft_labels: bool = False,
) -> ObjectiveOutput:
    """Losses and metrics of one batch (see the module docstring).

    ``batch``: ``input_ids`` (L, T) long, ``loss_mask`` (L, T) bool, ``lengths`` (L,) or
    ``attention_mask`` (L, T) (right padding), and optionally what the feature store adds
    (:class:`exittrain.data.collate.Collator`). With ``exit_loss`` or ``metrics`` (and at least one
    valid anchor) ``values`` holds the tree metrics of the raw law. Gradients flow into ``loss``
    from the drafter logits only. ``vocab_sample`` m (ignored with ``exit_loss``): the block CE over
    the labels plus m random negatives; the full logits are then computed (without gradients) only
    when ``metrics`` asks, and ``acc_d{k}`` is reported only then. ``soft_labels``: the block CE
    takes the soft labels of ``soft_label_weight`` (when it is > 0; accuracies and tree metrics
    keep the answer tokens).
    """
    s = settings
    timer = StageTimer(target.device, OBJECTIVE_PARTS)
    input_ids = batch["input_ids"]  # (L, T)
    K = drafter.config.num_draft_tokens
    features, rows_computed = batch_features(drafter, target, batch, s)  # (L, T, F) fp32, no grad
    timer.lap("features")

    anchors_LA, valid_LA = sample_anchors(batch["loss_mask"], _lengths(batch), s.anchors_per_seq, K, generator)
    L, A = anchors_LA.shape
    sampled = vocab_sample is not None and not exit_loss
    # (N, K, V) logits (the copy-mixed log-probabilities with the copy branch), or (N, K, H)
    # pre-head states when sampled; copy: the branch's (copy ids, gate logits), or None
    out, copy = drafter.forward_anchors(
        features,
        input_ids,
        anchors_LA,
        context_window=s.context_window,
        apply_lm_head=not sampled,
        with_copy_terms=True,
    )
    label_pos = (anchors_LA.unsqueeze(-1) + torch.arange(1, K + 1, device=anchors_LA.device)).clamp_max(
        input_ids.shape[1] - 1
    )  # (L, A, K); clamped only for invalid anchors
    labels = input_ids.gather(1, label_pos.reshape(L, A * K)).reshape(L * A, K)  # (N, K)
    valid_N = valid_LA.reshape(-1)
    label_mask = valid_N.unsqueeze(1).expand(-1, K)
    loss_labels, label_probs = labels, None
    if soft_labels and s.soft_label_weight > 0:
        top_ids_LTS, top_logp_LTS = batch_top_logprobs(target, batch, s.soft_label_top_k)
        S = top_ids_LTS.shape[-1]
        at = label_pos.reshape(L, A * K, 1).expand(-1, -1, S)
        top_ids = top_ids_LTS.gather(1, at).reshape(L * A, K, S)
        top_logp = top_logp_LTS.gather(1, at).reshape(L * A, K, S)
        loss_labels, label_probs = mix_soft_labels(labels, top_ids, top_logp, s.soft_label_weight)
    if sampled:
        head = target.lm_head
        loss_tok = sampled_block_cross_entropy(
            out,
            head.weight,
            loss_labels,
            vocab_sample,
            generator,
            gamma=s.gamma,
            label_mask=label_mask,
            lm_head_bias=getattr(head, "bias", None),
            label_probs=label_probs,
            copy_ids=None if copy is None else copy[0],
            copy_gate_logits=None if copy is None else copy[1],
        )
        logits = None
        if metrics:
            with torch.no_grad():
                logits = drafter.head(out.detach(), None if copy is None else (copy[0], copy[1].detach()))
    else:
        logits = out
        loss_tok = block_cross_entropy(
            logits, loss_labels, gamma=s.gamma, label_mask=label_mask, label_probs=label_probs
        )
    values: dict[str, torch.Tensor] = {"loss_tok": loss_tok}
    index = valid_N.nonzero().squeeze(1)  # (n,)
    n_valid = int(index.numel())
    values["anchors"] = torch.tensor(float(n_valid))
    with torch.no_grad():
        if n_valid and logits is not None:
            hit = (logits.argmax(-1)[index] == labels[index]).float().mean(0)  # (K,)
            values.update({f"acc_d{k + 1}": hit[k] for k in range(K)})
    timer.lap("draft")

    loss = s.lambda_tok * loss_tok
    if (exit_loss or metrics) and n_valid:
        with torch.no_grad():
            logq_NKV = torch.log_softmax(logits.detach().float(), dim=-1)
            trees = shaped_tree(logq_NKV, s.budget, s.tree_shape, validate=False)
            del logq_NKV  # (N, K, V): only the trees read it
            timer.lap("tree")
            scores_NBV = target.score_trees(
                input_ids, anchors_LA, trees, mode=s.scoring, window=s.window, chunk_size=s.score_chunk_size
            ).logits  # (N, B+1, V)
            # the node loss's "missing" labels read every row's whole distribution; everything else
            # reads the tree's edges, taken a few trees at a time (tree_edges)
            probs = torch.softmax(scores_NBV[index].float(), dim=-1) if exit_loss and s.weight_type == "missing" \
                else None  # (n, B+1, V)
            edges = tree_edges(trees, scores_NBV, index) if probs is None else None  # (n, B)
            timer.lap("score")
            trees_v = select_trees(trees, index)
            law_raw = exit_law_from_edges(trees_v, edges) if probs is None else exit_law(trees_v, probs, 0.0,
                                                                                          validate=False)
            values.update(tree_metrics(trees_v, law_raw))
            values["greedy_block_length"] = 1.0 + followed_depth(trees_v, labels[index]).float().mean()
        if exit_loss:
            law_probs, law_w = probs, law_raw
            alpha = s.alpha if s.weight_type != "missing" else 0.0
            warped = s.law_temperature != 1.0
            with torch.no_grad():
                if warped and probs is not None:
                    law_probs = warp_probs(scores_NBV[index], s.law_temperature)
                elif warped:
                    edges = tree_edges(trees, scores_NBV, index, s.law_temperature)
                if alpha > 0 or warped:
                    law_w = exit_law(trees_v, law_probs, alpha, validate=False) if probs is not None \
                        else exit_law_from_edges(trees_v, edges, alpha)
            del scores_NBV
            loss_exit = exit_node_loss(logits[index], trees_v, law_w, s.weight_type, law_probs)
            values["loss_exit"] = loss_exit
            loss = loss + s.lambda_exit * loss_exit
        timer.lap("exit")
    elif exit_loss:
        values["loss_exit"] = out.sum() * 0.0  # no valid anchor: a zero that keeps the graph
    values["loss"] = loss
    return ObjectiveOutput(values, timer.ms, rows_computed)
