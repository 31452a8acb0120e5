"""The LightningModule of drafter training: block cross-entropy warm start and ExitTrain.

Shape legend: L sequences in a batch, T sequence length, A anchors per sequence, N = L * A
anchors (trees; row n = l * A + a), n valid anchors, K = block_size - 1 drafter positions,
V vocabulary, B tree budget (rows root-first: B + 1), F target feature width.

One training step (ALGORITHM.md sections 6-8):

1. ``features`` (L, T, F) = the frozen target's hidden states of the drafter's layers, no grad, fp32;
   with ``feature_cache=True`` read from a per-row cache (computed on a row's first visit, bf16).
2. Anchors: :func:`sample_anchors` picks A positions per sequence whose K labels
   ``x_{a+1..a+K}`` lie inside the sequence and inside the loss mask (the root ``x_a`` itself may
   be the last prompt token). Seeded by ``(seed, global_step, rank)``: reproducible and
   resume-consistent. Sequences with fewer candidates repeat some and mask the repeats out.
3. ``logits`` (N, K, V) = ``drafter.forward_anchors``; ``L_tok`` = block cross-entropy on the
   valid anchors (optionally decayed by ``gamma``). With ``soft_label_weight`` beta > 0 each
   training label is the soft label ``(1 - beta) onehot(x_{a+k}) + beta pi``, pi the target's
   next-token distribution at that position renormalised over its top ``soft_label_top_k``
   tokens (:func:`exittrain.core.mix_soft_labels`). Those come from the regeneration
   (:meth:`exittrain.data.ExitTrainDataModule.captured_top_logprobs`), or else from one target
   forward per row on its first visit (:meth:`TargetModel.token_top_logprobs`), and are kept per
   row. Validation's ``val/loss_tok`` stays the hard-label CE, comparable across settings.
4. ``stage="exittrain"``: trees from the detached logits, target scores of every tree row, the
   exit law (edges floored at ``alpha`` for the weights) and the node loss of ``weight_type`` on
   the valid anchors; ``loss = lambda_tok * L_tok + lambda_exit * L_exit``.
   ``stage="pretrain"``: ``loss = lambda_tok * L_tok``; every ``analytic_every`` steps the trees
   are still built and scored, without gradients, for the metrics only.

Metrics always use the raw law (alpha = 0): ``train/analytic_block_length`` is the mean over the
step's valid trees of ``sum_v P(v)``, the block length TEV achieves on that tree in expectation.
Logged per step (``self.log``, on_step): ``train/loss``, ``train/loss_tok``, ``train/loss_exit``
(exittrain), ``train/acc_d{k}`` (k = 1..K: argmax of q_k equals the label), ``train/anchors``
(valid anchors), ``lr``, ``train/time_{part}_ms`` (:data:`TIMED_PARTS`), ``train/anchors_per_s``
and, when trees are scored, ``train/analytic_block_length``, ``train/greedy_block_length``,
``train/coverage``, ``train/mean_exit_depth`` and ``train/exit_mass_d{d}`` (d = 0..K, mean over
trees; they sum to 1). ``greedy_block_length`` is 1 + how deep each tree holds the row's own
next K tokens (:func:`exittrain.core.followed_depth`): with greedily regenerated answers, the
block a T = 0 verifier accepts at every anchor, i.e. decoded tau at T = 0 measured on all the
anchors of the batch instead of a few decoded prompts (exact when the answers came from the target
itself; a bf16 copy's answers agree with the fp32 target at ~99% of positions).
Lightning keeps re-sending an on_step value until the epoch ends, so with ``analytic_every > 1``
the tree metrics repeat the latest measurement on the steps in between (the times do not: they
are logged every step, 0 for the parts skipped). Validation logs ``val/loss_tok``,
``val/analytic_block_length``, ``val/greedy_block_length`` and ``val/coverage`` per epoch, weighted
by valid anchors.
With ``feature_cache=True`` training also logs ``train/feature_cache_rows`` (rows cached so far)
and ``train/feature_rows_computed`` (rows of the step whose features the target computed).

Feature cache (``feature_cache=True``): the target is frozen and causal, so the features of a
row's real positions ``[0, length)`` are a pure function of its tokens (right padding never
reaches them; see :meth:`TargetModel.sequence_features`). The module keeps them, keyed by the
batch's ``row_id`` (:class:`exittrain.data.collate.Collator`), in bf16 on the CPU, and computes
only the rows of a batch it has not seen, in one ``sequence_features`` call on that sub-batch.
Every step's features are the bf16-rounded values, cached or not, so a row gives the same loss
on every visit. Memory: rows x length x F x 2 bytes, e.g. 400 rows x 500 tokens x F = 1728
(3 layers of SmolLM2-135M, hidden 576) x 2 = 0.7 GB of host memory (per process). Validation
rows share the cache under their own ids. The cache is derived data: never checkpointed. When
the trainer's datamodule kept the features during regeneration
(:meth:`exittrain.data.ExitTrainDataModule.captured_features`), :meth:`setup` fills the cache with
them and no row needs a target forward at all.

``weight_type="missing"`` uses the raw reach P(v) (ALGORITHM.md section 7 and
:mod:`exittrain.core.losses` define that loss with P, not the floored P~), so ``alpha`` only
affects ``flow`` and ``exit``.

The target is a plain attribute (``TargetModel`` is not an ``nn.Module``): the drafter is the
only submodule, so its parameters are the only trainable ones and the only checkpoint entries.
The target must already sit on the device the trainer puts the module on (checked at fit start).

Sharding (``trainer=fsdp``, :class:`exittrain.lit.sharding.DrafterFSDPStrategy`): the strategy
gives the module a device mesh, and :meth:`ExitTrainModule.configure_model` shards the drafter
over it with FSDP2 (``fully_shard``); the target stays whole on every rank. Under any other
strategy there is no mesh and ``configure_model`` does nothing. Lightning's ``FSDPStrategy``
(FSDP1) is refused at setup: use ``trainer=fsdp``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from exittrain.core import (
    WEIGHT_TYPES,
    DraftTree,
    block_cross_entropy,
    build_tree,
    exit_law,
    exit_node_loss,
    followed_depth,
    mix_soft_labels,
    sampled_block_cross_entropy,
    warp_probs,
)
from exittrain.core.exit_law import ExitLaw
from exittrain.lit.sharding import shard_drafter
from exittrain.models import BlockDrafter, DrafterConfig, TargetModel
from exittrain.safe_io import load_checkpoint

log = logging.getLogger(__name__)

__all__ = [
    "STAGES",
    "SCORING_MODES",
    "TIMED_PARTS",
    "ExitTrainModule",
    "WarmupCosine",
    "anchor_generator",
    "check_module_args",
    "sample_anchors",
    "select_trees",
    "tree_metrics",
]

STAGES = ("pretrain", "exittrain")
SCORING_MODES = ("exact", "windowed")
TIMED_PARTS = ("features", "draft", "tree", "score", "exit", "backward", "step")
"""Logged as ``train/time_{part}_ms`` every step: target features, drafter forward + block CE
(+ accuracy), tree build, target scoring, exit law + node loss + tree metrics, backward, and the
whole optimizer step (which contains the others; parts that did not run in a step report 0)."""

CHECKPOINT_KEY = "exittrain"
"""Checkpoint entry holding ``drafter_config`` (a JSON-safe dict) and ``target_name``."""


# ----------------------------------------------------------------------------------------------
# anchors


def anchor_generator(seed: int, step: int, rank: int = 0, stream: int = 0) -> torch.Generator:
    """A CPU generator seeded from ``(seed, step, rank, stream)``; stream 0 = train, 1 = validation."""
    mixed = (int(seed) * 1_000_003 + int(step)) * 1_009 + int(rank) * 7 + int(stream)
    return torch.Generator(device="cpu").manual_seed(mixed % (2**63 - 1))


def sample_anchors(
    loss_mask_LT: torch.Tensor,
    lengths_L: torch.Tensor | None,
    num_anchors: int,
    horizon: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``num_anchors`` A anchor positions per sequence without replacement.

    Candidates of sequence l: positions a with ``a + K < lengths[l]`` (K = ``horizon``) whose label
    positions ``a+1..a+K`` are all in ``loss_mask_LT`` (the root ``x_a`` itself need not be).
    Returns ``(anchors_LA long, valid_LA bool)`` on the mask's device. A sequence with c < A
    candidates fills slots c..A-1 with repeats of its own candidates (valid False); with c = 0
    every slot is position 0 and invalid. Sampling runs on the CPU with ``generator`` (one
    uniform key per position), so the result does not depend on the device.
    """
    if loss_mask_LT.dim() != 2:
        raise ValueError(f"loss_mask must be (L, T), got {tuple(loss_mask_LT.shape)}")
    device = loss_mask_LT.device
    mask = loss_mask_LT.detach().to("cpu", torch.bool)
    L, T = mask.shape
    if lengths_L is not None:
        mask &= torch.arange(T).unsqueeze(0) < lengths_L.detach().to("cpu").view(L, 1)
    # count of masked labels in a+1..a+K via a cumulative sum: cs[j] = mask[:, :j].sum()
    cs = torch.nn.functional.pad(mask.long().cumsum(1), (1, 0))  # (L, T+1)
    cand = torch.zeros(L, T, dtype=torch.bool)
    if T > horizon:
        a = torch.arange(T - horizon)
        cand[:, : T - horizon] = (cs[:, a + horizon + 1] - cs[:, a + 1]) == horizon
    keys = torch.rand(L, T, generator=generator)
    keys = torch.where(cand, keys, torch.full_like(keys, -1.0))
    order = torch.argsort(keys, dim=1, descending=True, stable=True)  # candidates first, random order
    count = cand.sum(1, keepdim=True)  # (L, 1)
    slot = torch.arange(num_anchors).unsqueeze(0)  # (1, A)
    anchors = order.gather(1, slot % count.clamp_min(1))  # repeats wrap around the candidates
    valid = slot < count
    anchors = torch.where(count > 0, anchors, torch.zeros_like(anchors))
    return anchors.to(device), valid.to(device)


# ----------------------------------------------------------------------------------------------
# trees and metrics


def select_trees(trees: DraftTree, index: torch.Tensor) -> DraftTree:
    """The trees ``index`` (n,) of a batch, as a new :class:`DraftTree`."""
    return DraftTree(
        tokens=trees.tokens[index],
        parents=trees.parents[index],
        depths=trees.depths[index],
        valid=trees.valid[index],
        max_depth=trees.max_depth,
        scores=trees.scores[index] if trees.scores is not None else None,
    )


@torch.no_grad()
def tree_metrics(trees: DraftTree, law: ExitLaw) -> dict[str, torch.Tensor]:
    """Means over n >= 1 trees of the raw exit law: analytic block length, coverage, exit mass by depth.

    Keys: ``analytic_block_length`` (``sum_v P(v)``), ``coverage`` (``sum_{v != root} P(v)``),
    ``mean_exit_depth`` (``sum_v E(v) d(v)``), ``exit_mass_d{d}`` for d = 0..K (root = depth 0).
    """
    K = trees.max_depth
    depth_onehot = torch.nn.functional.one_hot(trees.positions, K + 1).to(law.exit_mass.dtype)  # (n, B+1, K+1)
    by_depth = torch.einsum("nb,nbd->d", law.exit_mass, depth_onehot) / law.exit_mass.shape[0]  # (K+1,)
    out = {
        "analytic_block_length": law.expected_block_length.mean(),
        "coverage": law.coverage.mean(),
        "mean_exit_depth": (by_depth * torch.arange(K + 1, dtype=by_depth.dtype, device=by_depth.device)).sum(),
    }
    out.update({f"exit_mass_d{d}": by_depth[d] for d in range(K + 1)})
    return out


# ----------------------------------------------------------------------------------------------
# schedule


class WarmupCosine:
    """LR factor: linear warmup over ``warmup_steps`` then cosine from 1 to ``min_ratio`` at ``total_steps``.

    A callable object (not a closure) so that ``LambdaLR.state_dict`` stores its fields and a
    checkpoint restores the same schedule. After ``total_steps`` the factor stays at ``min_ratio``.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float):
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------------------------
# timing


class _StageTimer:
    """perf_counter laps in ms; synchronises CUDA first so the parts are real device time."""

    def __init__(self, device: torch.device, parts: tuple[str, ...] = ()):
        self._sync = torch.cuda.synchronize if device.type == "cuda" else None
        self.ms: dict[str, float] = dict.fromkeys(parts, 0.0)  # parts that do not run this step report 0
        self._t = self._now()

    def _now(self) -> float:
        if self._sync is not None:
            self._sync()
        return time.perf_counter()

    def lap(self, part: str) -> None:
        now = self._now()
        self.ms[part] = self.ms.get(part, 0.0) + (now - self._t) * 1e3
        self._t = now


# ----------------------------------------------------------------------------------------------
# validation of arguments


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_args(a: Mapping[str, Any]) -> None:
    def need(ok: bool, key: str, fix: str) -> None:
        if not ok:
            raise ValueError(f"{key}={a[key]!r}: {fix}")

    need(a["stage"] in STAGES, "stage", f"must be one of {STAGES} (pretrain = block CE only)")
    need(_is_int(a["anchors_per_seq"]) and a["anchors_per_seq"] >= 1, "anchors_per_seq", "need an int >= 1")
    need(_is_int(a["budget"]) and a["budget"] >= 1, "budget", "need an int >= 1 (draft nodes per tree)")
    need(a["weight_type"] in WEIGHT_TYPES, "weight_type", f"must be one of {WEIGHT_TYPES}")
    need(_is_number(a["alpha"]) and 0.0 <= a["alpha"] <= 1.0, "alpha", "need a float in [0, 1] (edge floor)")
    need(_is_number(a["lambda_tok"]) and a["lambda_tok"] >= 0, "lambda_tok", "need a float >= 0")
    need(_is_number(a["lambda_exit"]) and a["lambda_exit"] >= 0, "lambda_exit", "need a float >= 0")
    need(
        a["gamma"] is None or (_is_number(a["gamma"]) and 0 < a["gamma"] <= 1),
        "gamma",
        "need None or a float in (0, 1], the base of the decay gamma^(k-1); a decay written as a length "
        "scale L, exp(-(k-1)/L) (the reference recipe's 'gamma 7'), is gamma = exp(-1/L) (0.867 for L = 7)",
    )
    need(a["scoring"] in SCORING_MODES, "scoring", f"must be one of {SCORING_MODES}")
    need(_is_int(a["window"]) and a["window"] >= 1, "window", "need an int >= 1 (prefix tokens in windowed scoring)")
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
    need(_is_number(a["lr"]) and a["lr"] > 0, "lr", "need a float > 0")
    need(_is_number(a["weight_decay"]) and a["weight_decay"] >= 0, "weight_decay", "need a float >= 0")
    need(_is_number(a["warmup_ratio"]) and 0 <= a["warmup_ratio"] < 1, "warmup_ratio", "need a float in [0, 1)")
    need(_is_number(a["min_lr_ratio"]) and 0 <= a["min_lr_ratio"] <= 1, "min_lr_ratio", "need a float in [0, 1]")
    need(_is_int(a["analytic_every"]) and a["analytic_every"] >= 0, "analytic_every", "need an int >= 0 (0 = never)")
    need(_is_int(a["seed"]), "seed", "need an int")
    need(
        a["vocab_sample"] is None or (_is_int(a["vocab_sample"]) and a["vocab_sample"] >= 1),
        "vocab_sample",
        "need None (full softmax) or an int >= 1 (random negatives per step)",
    )
    need(isinstance(a["feature_cache"], bool), "feature_cache", "need a bool (True caches the target features)")
    need(
        _is_number(a["soft_label_weight"]) and 0 <= a["soft_label_weight"] <= 1,
        "soft_label_weight",
        "need a float in [0, 1] (0 = the answer tokens, 1 = the target's top-k distributions)",
    )
    need(_is_int(a["soft_label_top_k"]) and a["soft_label_top_k"] >= 1, "soft_label_top_k", "need an int >= 1")
    need(
        _is_number(a["law_temperature"]) and a["law_temperature"] >= 0,
        "law_temperature",
        "need a float >= 0 (1 = the target's raw law, 0 = its greedy one-hot law)",
    )
    if a["stage"] == "exittrain":
        need(a["lambda_tok"] + a["lambda_exit"] > 0, "lambda_exit", "lambda_tok and lambda_exit are both 0: no loss")
    else:
        need(a["lambda_tok"] > 0, "lambda_tok", "stage='pretrain' trains on block CE only: need lambda_tok > 0")


def check_module_args(**kwargs: Any) -> None:
    """Validate :class:`ExitTrainModule` keyword arguments (all but ``drafter`` and ``target``) alone.

    Missing arguments take the constructor's defaults. Raises the constructor's ``ValueError`` for a
    bad value, and a ``ValueError`` listing the known names for an unknown one. ``fit`` calls it on
    every stage's arguments before loading the target, so that a bad objective or stage override
    fails at once instead of after regeneration and the earlier stages.
    """
    params = inspect.signature(ExitTrainModule.__init__).parameters
    defaults = {name: p.default for name, p in params.items() if p.kind is p.KEYWORD_ONLY}
    unknown = sorted(set(kwargs) - set(defaults))
    if unknown:
        raise ValueError(f"unknown ExitTrainModule arguments {unknown}; the known ones are {sorted(defaults)}")
    _check_args({**defaults, **kwargs})


def _config_dict(config: DrafterConfig) -> dict[str, Any]:
    """The drafter config as a JSON-safe dict of plain types (loadable with ``weights_only=True``)."""
    return json.loads(config.to_json_string(use_diff=False))


# ----------------------------------------------------------------------------------------------
# the module


class ExitTrainModule(pl.LightningModule):
    """Trains a :class:`BlockDrafter` against a frozen :class:`TargetModel` (see the module docstring).

    Args:
        drafter: the model to train; becomes the only submodule (attached to ``target`` if needed).
        target: the frozen target; a plain attribute, never registered or checkpointed.
        stage: ``"pretrain"`` (block CE) or ``"exittrain"`` (block CE + exit node loss).
        anchors_per_seq: A, anchors sampled per sequence and step.
        budget: B, nodes per draft tree.
        weight_type: the node weight of ``L_exit``, one of :data:`exittrain.core.WEIGHT_TYPES`.
        alpha: floor of the edge probabilities in the training weights (``flow``, ``exit``).
        lambda_tok, lambda_exit: loss weights.
        gamma: position decay ``gamma^(k-1)`` of the block CE, gamma in (0, 1], or None.
        scoring, window, score_chunk_size: how the target scores the trees
            (:meth:`TargetModel.score_trees` ``mode``, ``window``, ``chunk_size``).
        context_window: drafter context window override (None: the drafter config's).
        lr, weight_decay: AdamW; weight decay applies to matrices only (not norms or the mask embedding).
        warmup_ratio, min_lr_ratio: linear warmup over that fraction of
            ``trainer.estimated_stepping_batches``, then cosine to ``min_lr_ratio * lr``.
        analytic_every: in ``pretrain``, build and score trees for the metrics every this many
            steps (0 = never). ``exittrain`` computes them every step anyway.
        seed: seeds the anchor sampling (with the global step and rank).
        feature_cache: keep each row's target features (bf16, CPU) after its first visit and reuse
            them, keyed by the batch's ``row_id`` (required then); see the module docstring for the
            exactness argument and the memory cost. False computes them every step.
        vocab_sample: None trains the block CE over the full vocabulary; an int m trains it, in
            ``pretrain`` training steps only, with :func:`exittrain.core.sampled_block_cross_entropy`
            over the step's labels plus m random negatives (drawn with the anchor generator), which
            skips most of the LM head. The logged ``train/loss_tok`` is then the sampled estimate, and
            ``train/acc_d{k}`` and the tree metrics are logged only on the ``analytic_every`` steps
            (they need the full logits). ``exittrain`` steps need the full logits with gradients for
            the node loss, so their block CE stays exact; validation always uses the full vocabulary.
        soft_label_weight: beta in [0, 1]: training labels ``(1 - beta) onehot(answer token) + beta
            pi`` (see the module docstring); 0 trains on the answer tokens alone.
        soft_label_top_k: S, the target tokens per position in pi (the regeneration must keep
            the same S for its log-probabilities to be used).
        law_temperature: the temperature of the target distribution that the node loss's weights
            (and ``missing``'s labels) are computed from: ALGORITHM.md section 4 says the exit law
            holds for the distribution actually decoded. 1 is the raw law; 0 is the one-hot argmax,
            the law of a T = 0 decoder. The logged tree metrics always use the raw law.

    Every argument is validated; a bad value raises ``ValueError`` naming the key.
    """

    def __init__(
        self,
        drafter: BlockDrafter,
        target: TargetModel,
        *,
        stage: str = "exittrain",
        anchors_per_seq: int = 8,
        budget: int = 16,
        weight_type: str = "flow",
        alpha: float = 1e-4,
        lambda_tok: float = 1.0,
        lambda_exit: float = 0.1,
        gamma: float | None = None,
        scoring: str = "exact",
        window: int = 64,
        score_chunk_size: int | None = None,
        context_window: int | None = None,
        lr: float = 6e-4,
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.02,
        min_lr_ratio: float = 0.1,
        analytic_every: int = 1,
        seed: int = 0,
        vocab_sample: int | None = None,
        feature_cache: bool = False,
        soft_label_weight: float = 0.0,
        soft_label_top_k: int = 16,
        law_temperature: float = 1.0,
    ) -> None:
        super().__init__()
        args = dict(locals())
        args.pop("self"), args.pop("__class__", None)
        _check_args(args)
        if not isinstance(drafter, BlockDrafter):
            raise ValueError(
                f"drafter must be a BlockDrafter, got {type(drafter).__name__}; build one with new_drafter"
            )
        if not isinstance(target, TargetModel):
            raise ValueError(f"target must be a TargetModel, got {type(target).__name__}; load one with load_target")
        if not drafter.has_target:
            drafter.attach_target(target)
        self.save_hyperparameters(ignore=["drafter", "target"])
        self.drafter = drafter
        self.target = target  # not an nn.Module: a plain attribute, outside parameters() and state_dict()
        self._t_step: float | None = None  # start of the current optimizer step (first accumulated batch)
        self._t_backward: float | None = None
        self._step_anchors = 0  # valid anchors since the last optimizer step
        # feature_cache: row_id -> (input ids (n,) int32, features (n, F) bf16), both on the CPU; never saved
        self._feature_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._feature_rows_computed = 0  # rows of the latest compute_losses whose features the target computed
        # soft labels: row_id -> (start, top ids (r, S) int32, log-probs (r, S) float32) of tokens start..start+r-1
        # (the response only when the regeneration kept them: prompts are never labels); never saved
        self._top_cache: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}
        self._warned_top_forward = False

    # -- properties -----------------------------------------------------------------------------

    @property
    def horizon(self) -> int:
        """K, tokens the drafter predicts per anchor."""
        return self.drafter.config.block_size - 1

    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    @property
    def feature_cache_rows(self) -> int:
        """Rows whose target features are cached (0 without ``feature_cache``)."""
        return len(self._feature_cache)

    def clear_feature_cache(self) -> None:
        """Drop every cached row (e.g. to free host memory); they are recomputed on their next visit."""
        self._feature_cache.clear()

    def preload_features(self, rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Cache features computed elsewhere: ``row_id -> (input ids (n,) int32, features (n, F) bf16)``.

        The regeneration keeps them while the target answers (in ``data.generation.dtype``); the
        cache's own entries come from the trainer's forward (bf16 autocast under ``bf16-mixed``).
        Both are bf16-rounded features of the same target, not bitwise equal. Rows already cached
        are kept. Features of the wrong shape raise ValueError.
        """
        width = self.drafter.config.feature_size
        for row_id, (ids, feats) in rows.items():
            if feats.dim() != 2 or feats.shape != (ids.numel(), width):
                raise ValueError(
                    f"preloaded features of row {row_id} have shape {tuple(feats.shape)}; need "
                    f"({ids.numel()}, {width}) for {ids.numel()} tokens and target layers "
                    f"{self.drafter.config.target_layer_ids}"
                )
            self._feature_cache.setdefault(int(row_id), (ids.to(torch.int32), feats.to(torch.bfloat16)))

    def preload_top_logprobs(self, rows: Mapping[int, tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """Keep the target's top-S log-probabilities of rows computed elsewhere (the regeneration):
        ``row_id -> (start, ids (r, S) int32, log-probabilities (r, S) float32)``, entry j for token
        ``start + j`` of the row, ``start + r`` its length
        (:meth:`exittrain.data.ExitTrainDataModule.captured_top_logprobs`). S must equal
        ``soft_label_top_k``; another width raises ValueError. Rows already kept are kept.
        """
        k = self.hparams.soft_label_top_k
        for row_id, (start, ids, logp) in rows.items():
            if ids.dim() != 2 or ids.shape != logp.shape or ids.shape[1] != k or start < 0:
                raise ValueError(
                    f"preloaded top log-probabilities of row {row_id} have shapes {tuple(ids.shape)} and "
                    f"{tuple(logp.shape)} from token {start}; need (r, soft_label_top_k={k}) for both from a token "
                    f">= 0: regenerate with top_logprobs={k} or set soft_label_top_k to the stored width"
                )
            self._top_cache.setdefault(int(row_id), (int(start), ids.to(torch.int32), logp.float()))

    def share_feature_cache(self, other: ExitTrainModule) -> None:
        """Read and fill ``other``'s feature cache from now on (same target, layers and data).

        For several fits over the same rows (the ablation's arms): the target features of a row
        are computed once. The drafters must read the same target layers.
        """
        mine, theirs = self.drafter.config.target_layer_ids, other.drafter.config.target_layer_ids
        if mine != theirs or self.target is not other.target:
            raise ValueError(
                f"cannot share a feature cache between drafters reading target layers {mine} and {theirs} "
                "(or different targets); give each module its own cache"
            )
        self._feature_cache = other._feature_cache
        if self.hparams.soft_label_top_k == other.hparams.soft_label_top_k:
            self._top_cache = other._top_cache  # the same rows' soft labels

    # -- checkpoint -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "drafter_config": _config_dict(self.drafter.config),
            "target_name": self.target.name,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(CHECKPOINT_KEY, {}).get("target_name")
        if saved is not None and saved != self.target.name:
            raise ValueError(
                f"checkpoint was trained against target {saved!r} but this module holds target {self.target.name!r}; "
                "load the matching target"
            )

    @staticmethod
    def drafter_from_checkpoint(path, target: TargetModel, *, map_location: Any = "cpu") -> BlockDrafter:
        """Rebuild the trained drafter from a Lightning checkpoint alone (config + ``drafter.*`` weights).

        Loads with ``weights_only=True`` (:func:`exittrain.safe_io.load_checkpoint`); the drafter is
        attached to ``target`` (pairing checked). Checkpoints written under ``trainer=fsdp`` are
        single files with the full weights too; a folder (a sharded checkpoint) raises ValueError,
        and so does a missing, corrupt or truncated file or one holding objects the safe load
        refuses (the message names the file and never suggests an unsafe load).
        """
        if Path(path).is_dir():
            raise ValueError(
                f"{path} is a folder (a sharded checkpoint, ModelParallelStrategy(save_distributed_checkpoint=True)); "
                "drafters are rebuilt from single-file checkpoints: train with trainer=fsdp, which writes those"
            )
        ckpt = load_checkpoint(
            path,
            what="checkpoint",
            fix="pass another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt of an earlier "
            "run), or re-run the stage",
            map_location=map_location,
        )
        if CHECKPOINT_KEY not in ckpt:
            raise ValueError(f"{path} holds no '{CHECKPOINT_KEY}' entry: not an ExitTrainModule checkpoint")
        config = DrafterConfig.from_dict(ckpt[CHECKPOINT_KEY]["drafter_config"])
        drafter = BlockDrafter(config).attach_target(target)
        prefix = "drafter."
        state = {k[len(prefix) :]: v for k, v in ckpt["state_dict"].items() if k.startswith(prefix)}
        drafter.load_state_dict(state, strict=True)
        return drafter.to(target.device)

    # -- fit ------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Refuse Lightning's ``FSDPStrategy`` (FSDP1): the callbacks and ``fit`` gather FSDP2 shards only.

        With ``feature_cache``, fill the cache with the features the regeneration kept when the
        trainer's datamodule offers them (``captured_features``, :class:`~exittrain.data.ExitTrainDataModule`);
        with ``soft_label_weight > 0``, likewise the top log-probabilities (``captured_top_logprobs``)
        when the datamodule kept ``soft_label_top_k`` of them.
        """
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError(
                f"trainer.strategy={type(self.trainer.strategy).__name__} (FSDP1) is not supported: decoding, export "
                "and checkpoints of the drafter gather FSDP2 shards; use trainer=fsdp "
                "(exittrain.lit.DrafterFSDPStrategy) or trainer=ddp"
            )
        datamodule = getattr(self._trainer, "datamodule", None)
        if self.hparams.feature_cache and hasattr(datamodule, "captured_features"):
            self.preload_features(datamodule.captured_features(self.drafter.config.target_layer_ids))
        if self.hparams.soft_label_weight > 0 and hasattr(datamodule, "captured_top_logprobs"):
            if getattr(datamodule, "top_logprobs", None) == self.hparams.soft_label_top_k:
                self.preload_top_logprobs(datamodule.captured_top_logprobs())

    def configure_model(self) -> None:
        """Shard the drafter (FSDP2) over the strategy's data-parallel mesh; a no-op without a mesh.

        Only ``ModelParallelStrategy`` (``trainer=fsdp``: :class:`~exittrain.lit.sharding.DrafterFSDPStrategy`)
        gives a mesh; single-device and DDP runs leave the drafter as it is. Idempotent: a drafter
        already sharded (an earlier stage of the same run) is kept as it is. The target is never
        sharded. A mesh with a ``tensor_parallel`` dimension larger than 1 raises ValueError: the
        drafter has no tensor-parallel plan.
        """
        mesh = self.device_mesh
        if mesh is None:
            return
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"trainer.strategy.tensor_parallel_size={mesh['tensor_parallel'].size()}: ExitTrainModule only "
                "shards the drafter over data_parallel (FSDP); use trainer=fsdp (exittrain.lit.DrafterFSDPStrategy, "
                "tensor_parallel_size=1) instead of a bare ModelParallelStrategy"
            )
        shard_drafter(self.drafter, mesh["data_parallel"] if "data_parallel" in names else mesh)

    def on_fit_start(self) -> None:
        if self.target.device != self.device:
            raise ValueError(
                f"target is on {self.target.device} but the trainer put the drafter on {self.device}; "
                "load the target on the trainer's device (load_target(..., device=...))"
            )
        # A drafter from load_drafter (from_pretrained) comes in eval mode, and Lightning trains
        # modules in the mode it finds them; the stages train the drafter, dropout included.
        self.drafter.train()

    def configure_optimizers(self):
        """AdamW over the drafter's parameters; warmup + cosine, stepped every optimizer step."""
        hp = self.hparams
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": hp.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr
        )
        total = self.trainer.estimated_stepping_batches
        if not math.isfinite(total):
            raise ValueError("the LR schedule needs a finite run: set trainer max_steps or max_epochs")
        total = max(1, int(total))
        schedule = WarmupCosine(total, round(hp.warmup_ratio * total), hp.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}

    # -- the step -------------------------------------------------------------------------------

    @staticmethod
    def _lengths(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        lengths = batch.get("lengths")
        if lengths is None and batch.get("attention_mask") is not None:
            lengths = batch["attention_mask"].sum(1)
        return lengths

    def _row_layout(self, batch: Mapping[str, torch.Tensor]) -> tuple[list[int | None], list[int]]:
        """Per batch row: its ``row_id`` (None without the entry) and its real length (T without lengths)."""
        L, T = batch["input_ids"].shape
        lengths = self._lengths(batch)
        lens = [T] * L if lengths is None else [int(n) for n in lengths.tolist()]
        row_id = batch.get("row_id")
        ids = [int(r) for r in row_id.tolist()] if row_id is not None else [None] * L
        if len(ids) != L:
            raise ValueError(f"row_id has {len(ids)} entries for a batch of {L} rows")
        return ids, lens

    def _anchors(self, batch: Mapping[str, torch.Tensor], generator: torch.Generator):
        lengths = self._lengths(batch)
        return sample_anchors(batch["loss_mask"], lengths, self.hparams.anchors_per_seq, self.horizon, generator)

    @torch.no_grad()
    def target_features(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Features (L, T, F) fp32 of the drafter's target layers for ``batch``, on the target's device.

        Without ``feature_cache``: one ``sequence_features`` call on the whole batch. With it: the
        rows of ``batch["row_id"]`` not yet cached are computed in one call on that sub-batch (cut
        to its longest row) and cached as bf16 ``[0, length)``; the batch is then rebuilt from the
        cache, zeros at the padding (no anchor sees it). A cached row whose tokens differ from the
        batch's raises ValueError (row ids must be stable and unique).
        """
        input_ids = batch["input_ids"]  # (L, T)
        layers = self.drafter.config.target_layer_ids
        if not self.hparams.feature_cache:
            self._feature_rows_computed = int(input_ids.shape[0])
            return self.target.sequence_features(input_ids, layers).float()
        if batch.get("row_id") is None:
            raise ValueError(
                "feature_cache=True needs a 'row_id' (L,) entry in every batch (exittrain.data.collate.Collator "
                "gives it from the rows' prompt_index); add one or set feature_cache=False"
            )
        L, T = input_ids.shape
        ids, lens = self._row_layout(batch)
        tokens = input_ids.detach().to("cpu", torch.int32)
        cache = self._feature_cache
        missing: dict[int, int] = {}  # row_id -> first batch row holding it
        for i, r in enumerate(ids):
            if r in cache:
                cached_ids = cache[r][0]
                if cached_ids.numel() != lens[i] or not torch.equal(cached_ids, tokens[i, : lens[i]]):
                    raise ValueError(
                        f"row_id {r} was cached with other tokens; row ids must be stable and unique across the "
                        "train and validation data (or call clear_feature_cache() when the data change)"
                    )
            elif r not in missing:
                missing[r] = i
        if missing:
            rows = list(missing.values())
            width = max(lens[i] for i in rows)
            fresh = self.target.sequence_features(input_ids[rows, :width], layers)  # (m, width, F)
            fresh = fresh.to("cpu", torch.bfloat16)
            for j, (r, i) in enumerate(missing.items()):
                cache[r] = (tokens[i, : lens[i]].clone(), fresh[j, : lens[i]].clone())
        self._feature_rows_computed = len(missing)
        F = next(iter(cache.values()))[1].shape[-1]
        out = torch.zeros(L, T, F, dtype=torch.bfloat16)
        for i, r in enumerate(ids):
            out[i, : lens[i]] = cache[r][1]
        return out.to(self.target.device).float()

    @torch.no_grad()
    def top_logprobs(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-S tokens and log-probabilities (L, T, S) at every position of ``batch``, on its device.

        Entry (l, t) describes token t given the tokens before it (``-inf`` where unknown: padding,
        and the prompt of a row the regeneration kept them for). Rows kept by ``row_id`` come from the per-row
        store; the others take one target forward each (:meth:`TargetModel.token_top_logprobs`)
        and are kept when the batch has ``row_id``. A kept row whose length differs from the
        batch's raises ValueError.
        """
        input_ids = batch["input_ids"]  # (L, T)
        L, T = input_ids.shape
        k = self.hparams.soft_label_top_k
        ids, lens = self._row_layout(batch)
        missing = [i for i, r in enumerate(ids) if r not in self._top_cache]
        fresh: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if missing:
            if not self._warned_top_forward:
                log.warning(
                    "soft labels: the target runs a forward over %d rows that the regeneration kept no top-%d "
                    "log-probabilities for (an entry cached without them); delete the cache entry to regenerate "
                    "it with them, or set soft_label_weight=0",
                    len(missing),
                    k,
                )
                self._warned_top_forward = True
            width = max(lens[i] for i in missing)
            top_ids, top_logp = self.target.token_top_logprobs(input_ids[missing, :width], k)
            for j, i in enumerate(missing):
                fresh[i] = (0, top_ids[j, : lens[i]].clone(), top_logp[j, : lens[i]].clone())
                if ids[i] is not None:
                    self._top_cache[ids[i]] = fresh[i]
        out_ids = torch.zeros(L, T, k, dtype=torch.int32)
        out_logp = torch.full((L, T, k), -torch.inf)
        for i, r in enumerate(ids):
            start, row_ids, row_logp = fresh[i] if i in fresh else self._top_cache[r]
            end = start + row_ids.shape[0]
            if end != lens[i]:
                raise ValueError(
                    f"row_id {r}: its kept top log-probabilities end at token {end} of a row of {lens[i]} tokens; "
                    "row ids must be stable and unique across the train and validation data"
                )
            out_ids[i, start:end], out_logp[i, start:end] = row_ids, row_logp
        device = input_ids.device
        return out_ids.to(device, torch.long), out_logp.to(device)

    def compute_losses(
        self,
        batch: Mapping[str, torch.Tensor],
        generator: torch.Generator,
        *,
        exit_loss: bool,
        metrics: bool,
        vocab_sample: int | None = None,
        soft_labels: bool = False,
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Losses and metrics of one batch; returns ``(values, times_ms)``.

        ``values`` holds ``loss``, ``loss_tok``, ``anchors`` (valid count), ``acc_d{k}`` and, with
        ``exit_loss``, ``loss_exit``; with ``exit_loss`` or ``metrics`` (and at least one valid
        anchor) also the :func:`tree_metrics` of the raw law. Gradients flow into ``loss`` from the
        drafter logits only. ``vocab_sample`` m (ignored with ``exit_loss``): the block CE over the
        labels plus m random negatives; the full logits are then computed (without gradients)
        only when ``metrics`` asks, and ``acc_d{k}`` is reported only then. ``soft_labels``: the
        block CE takes the soft labels of ``soft_label_weight`` (when it is > 0; accuracies and tree
        metrics keep the answer tokens).
        """
        hp = self.hparams
        timer = _StageTimer(self.device, ("features", "draft", "tree", "score", "exit"))
        input_ids = batch["input_ids"]  # (L, T)
        K = self.horizon
        features = self.target_features(batch)  # (L, T, F) fp32, no grad
        timer.lap("features")

        anchors_LA, valid_LA = self._anchors(batch, generator)
        L, A = anchors_LA.shape
        sampled = vocab_sample is not None and not exit_loss
        # (N, K, V) logits (the copy-mixed log-probabilities with the copy branch), or (N, K, H)
        # pre-head states when sampled; copy: the branch's (copy ids, gate logits), or None
        out, copy = self.drafter.forward_anchors(
            features,
            input_ids,
            anchors_LA,
            context_window=hp.context_window,
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
        if soft_labels and hp.soft_label_weight > 0:
            top_ids_LTS, top_logp_LTS = self.top_logprobs(batch)
            S = top_ids_LTS.shape[-1]
            at = label_pos.reshape(L, A * K, 1).expand(-1, -1, S)
            top_ids = top_ids_LTS.gather(1, at).reshape(L * A, K, S)
            top_logp = top_logp_LTS.gather(1, at).reshape(L * A, K, S)
            loss_labels, label_probs = mix_soft_labels(labels, top_ids, top_logp, hp.soft_label_weight)
        if sampled:
            head = self.target.lm_head
            loss_tok = sampled_block_cross_entropy(
                out,
                head.weight,
                loss_labels,
                vocab_sample,
                generator,
                gamma=hp.gamma,
                label_mask=label_mask,
                lm_head_bias=getattr(head, "bias", None),
                label_probs=label_probs,
                copy_ids=None if copy is None else copy[0],
                copy_gate_logits=None if copy is None else copy[1],
            )
            logits = None
            if metrics:
                with torch.no_grad():
                    logits = self.drafter.head(out.detach(), None if copy is None else (copy[0], copy[1].detach()))
        else:
            logits = out
            loss_tok = block_cross_entropy(
                logits, loss_labels, gamma=hp.gamma, label_mask=label_mask, label_probs=label_probs
            )
        values: dict[str, torch.Tensor] = {"loss_tok": loss_tok}
        index = valid_N.nonzero().squeeze(1)  # (n,)
        n_valid = int(index.numel())
        values["anchors"] = torch.tensor(float(n_valid))
        with torch.no_grad():
            if n_valid and logits is not None:
                hit = (logits[index].argmax(-1) == labels[index]).float().mean(0)  # (K,)
                values.update({f"acc_d{k + 1}": hit[k] for k in range(K)})
        timer.lap("draft")

        loss = hp.lambda_tok * loss_tok
        if (exit_loss or metrics) and n_valid:
            with torch.no_grad():
                trees = build_tree(torch.log_softmax(logits.detach().float(), dim=-1), hp.budget, validate=False)
                timer.lap("tree")
                scores = self.target.score_trees(
                    input_ids, anchors_LA, trees, mode=hp.scoring, window=hp.window, chunk_size=hp.score_chunk_size
                )
                probs = torch.softmax(scores.logits[index].float(), dim=-1)  # (n, B+1, V)
                timer.lap("score")
                trees_v = select_trees(trees, index)
                law_raw = exit_law(trees_v, probs, 0.0, validate=False)
                values.update(tree_metrics(trees_v, law_raw))
                values["greedy_block_length"] = 1.0 + followed_depth(trees_v, labels[index]).float().mean()
            if exit_loss:
                law_probs, law_w = probs, law_raw
                alpha = hp.alpha if hp.weight_type != "missing" else 0.0
                warped = hp.law_temperature != 1.0
                with torch.no_grad():
                    if warped:
                        law_probs = warp_probs(scores.logits[index], hp.law_temperature)
                    if alpha > 0 or warped:
                        law_w = exit_law(trees_v, law_probs, alpha, validate=False)
                loss_exit = exit_node_loss(logits[index], trees_v, law_w, hp.weight_type, law_probs)
                values["loss_exit"] = loss_exit
                loss = loss + hp.lambda_exit * loss_exit
            timer.lap("exit")
        elif exit_loss:
            values["loss_exit"] = out.sum() * 0.0  # no valid anchor: a zero that keeps the graph
        values["loss"] = loss
        return values, timer.ms

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One step of the stage's loss (see the module docstring); logs the step's metrics.

        ``batch``: ``input_ids`` (L, T) long, ``loss_mask`` (L, T) bool, and ``lengths`` (L,) or
        ``attention_mask`` (L, T) (right padding). Raises RuntimeError naming the global step and
        the batch index if the loss is not finite, before anything is logged or updated.
        """
        hp = self.hparams
        if self._t_step is None:
            self._t_step = self._now()
        step = self.global_step
        generator = anchor_generator(hp.seed, step, self._rank(), stream=0)
        want_metrics = hp.analytic_every > 0 and step % hp.analytic_every == 0
        values, times = self.compute_losses(
            batch,
            generator,
            exit_loss=hp.stage == "exittrain",
            metrics=want_metrics or hp.stage == "exittrain",
            vocab_sample=hp.vocab_sample,
            soft_labels=True,
        )
        loss = values["loss"]
        if not bool(torch.isfinite(loss)):
            parts = ", ".join(f"{k}={float(values[k].detach()):.4g}" for k in ("loss_tok", "loss_exit") if k in values)
            raise RuntimeError(
                f"non-finite training loss {float(loss.detach())} at global step {step}, batch index {batch_idx} "
                f"({parts}); refusing to train on it: check this batch's data, the learning rate and the target outputs"
            )
        self._step_anchors += int(values["anchors"])
        L = batch["input_ids"].shape[0]
        logged = {f"train/{k}": v.detach() for k, v in values.items() if k != "anchors"}
        logged["train/anchors"] = values["anchors"]
        logged.update({f"train/time_{k}_ms": torch.tensor(v) for k, v in times.items()})
        if hp.feature_cache:
            logged["train/feature_cache_rows"] = torch.tensor(float(self.feature_cache_rows))
            logged["train/feature_rows_computed"] = torch.tensor(float(self._feature_rows_computed))
        if self._trainer is not None and self.trainer.optimizers:
            logged["lr"] = torch.tensor(self.trainer.optimizers[0].param_groups[0]["lr"])
        prog = {"train/loss", "train/analytic_block_length"}
        self.log_dict({k: v for k, v in logged.items() if k not in prog}, on_step=True, on_epoch=False, batch_size=L)
        self.log_dict(
            {k: v for k, v in logged.items() if k in prog}, on_step=True, on_epoch=False, batch_size=L, prog_bar=True
        )
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val/loss_tok``, ``val/analytic_block_length``, ``val/greedy_block_length`` and
        ``val/coverage`` per epoch (anchor-weighted)."""
        generator = anchor_generator(self.hparams.seed, batch_idx, self._rank(), stream=1)  # same anchors every epoch
        values, _ = self.compute_losses(batch, generator, exit_loss=False, metrics=True)
        n = int(values["anchors"])
        if n == 0:
            return
        keys = ("loss_tok", "analytic_block_length", "greedy_block_length", "coverage")
        self.log_dict(
            {f"val/{k}": values[k].detach() for k in keys if k in values},
            on_step=False,
            on_epoch=True,
            batch_size=n,
            sync_dist=True,
            prog_bar=True,
        )

    # -- step timing (backward and whole step) --------------------------------------------------

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._t_backward = self._now()

    def on_after_backward(self) -> None:
        if self._t_backward is None:
            return
        ms = (self._now() - self._t_backward) * 1e3
        self._t_backward = None
        self.log("train/time_backward_ms", ms, on_step=True, on_epoch=False)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The default step, timed: ``train/time_step_ms`` runs from the first ``training_step`` since
        the previous update to the end of this one (forward, backward and update of every accumulated
        batch; not the data loading), and ``train/anchors_per_s`` divides their valid anchors by it."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._t_step is None:
            return
        seconds = self._now() - self._t_step
        self.log("train/time_step_ms", seconds * 1e3, on_step=True, on_epoch=False)
        self.log("train/anchors_per_s", self._step_anchors / max(seconds, 1e-9), on_step=True, on_epoch=False)
        self._t_step, self._step_anchors = None, 0
