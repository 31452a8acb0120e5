"""Cheap held-out measures, logged often: a learning curve with more than two points per stage.

:class:`HeldOutBlockLengthCallback` logs ``heldout/chain_block_length`` and
``heldout/tree_block_length`` every few optimizer steps: one drafter pass over a fixed few
validation rows, no decoding, no target forward when the batches carry the target features.
The chain's per-anchor block lengths come from the held-out layer
(:func:`~exittrain.heldout.round_walk.chain_block_lengths`), where the walks' acceptance lives.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from exittrain.core import anchor_generator, build_tree, followed_depth, sample_anchors
from exittrain.heldout.round_walk import chain_block_lengths
from exittrain.lit.sharding import drafter_and_target

log = logging.getLogger(__name__)

__all__ = ["HeldOutBlockLengthCallback"]


class HeldOutBlockLengthCallback(Callback):
    """Every ``every_n_steps`` optimizer steps, the greedy block lengths of the drafter on fixed validation rows.

    The rows are the first ``num_rows`` of the validation loader (the target's own greedy answers
    to held-out training prompts), taken once, with ``anchors_per_row`` anchors each drawn once from
    ``seed``: every measurement reads the same anchors, so the curve moves with the drafter only.
    One teacher-forced drafter pass (:meth:`~exittrain.models.BlockDrafter.forward_anchors`, the
    target features as the batch carries them or as the target computes them,
    :func:`~exittrain.objective.batch_features`), then per anchor with the row's next K tokens:

    - ``heldout/chain_block_length``: 1 + how many of them the drafter's greedy chain matches in a
      row, the block a T = 0 verifier accepts on the chain a serving engine verifies, averaged over
      the anchors (:func:`~exittrain.heldout.round_walk.chain_block_lengths`). A training curve: a
      mean over anchors is not a decode's pooled tau, which counts only where rounds start and is
      lower where blocks are long (docs/metrics.md); the final table's chain tau is the pooled one;
    - ``heldout/tree_block_length``: 1 + how deep DDTree's tree of ``budget`` nodes holds them
      (:func:`~exittrain.core.followed_depth`); ``budget=None`` leaves it out.

    Written from ``on_train_batch_end`` to the loggers at the optimizer step (global rank 0) and
    into ``trainer.callback_metrics`` (every rank computes the same values; under FSDP every rank
    must run the sharded drafter's forward). :attr:`history` keeps ``{"step", the metrics, "anchors"}``
    (``metrics_<stage>.json``, the report's training curves). Nothing is decoded: ``val/block_length``
    (:class:`DecodeEvalCallback`) keeps its own cadence. A loader without rows logs nothing (warned).
    """

    CHAIN = "heldout/chain_block_length"
    TREE = "heldout/tree_block_length"

    def __init__(self, every_n_steps: int = 25, num_rows: int = 8, anchors_per_row: int = 16,
                 budget: int | None = 16, seed: int = 0) -> None:
        for key, value, low in (("every_n_steps", every_n_steps, 1), ("num_rows", num_rows, 1),
                                ("anchors_per_row", anchors_per_row, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{key}={value!r}: need an int >= {low}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget={budget!r}: need an int >= 1 (tree nodes) or null (no tree measure)")
        self.every_n_steps, self.num_rows, self.anchors_per_row = every_n_steps, num_rows, anchors_per_row
        self.budget, self.seed = budget, int(seed)
        self._rows: list[tuple[dict, torch.Tensor]] | None = None  # (batch on CPU, anchors (L, A) with -1 = none)
        self._last_step = -1
        self.history: list[dict[str, float]] = []

    @staticmethod
    def _validation_batches(trainer):
        """The DataModule's validation loader; else the loader given to ``fit`` (which Lightning sets up
        only when a validation runs, so it is read from the validation loop's source)."""
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is not None:
            return datamodule.val_dataloader()
        if trainer.val_dataloaders is not None:
            return trainer.val_dataloaders
        source = getattr(trainer.fit_loop.epoch_loop.val_loop, "_data_source", None)
        return (source.dataloader() if getattr(source, "instance", None) is not None else None) or []

    def _fixed_rows(self, trainer, K: int) -> list[tuple[dict, torch.Tensor]]:
        if self._rows is not None:
            return self._rows
        rows, taken = [], 0
        generator = anchor_generator(self.seed, 0, 0, stream=2)  # stream 2: neither training nor validation's
        for batch in self._validation_batches(trainer):
            keep = min(self.num_rows - taken, batch["input_ids"].shape[0])
            part = {k: (v[:keep] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == batch["input_ids"].shape[0]
                        else v) for k, v in batch.items()}
            lengths = part.get("lengths")
            if lengths is None and part.get("attention_mask") is not None:
                lengths = part["attention_mask"].sum(1)
            anchors_LA, valid_LA = sample_anchors(part["loss_mask"], lengths, self.anchors_per_row, K, generator)
            rows.append((part, anchors_LA.masked_fill(~valid_LA, -1)))
            taken += keep
            if taken >= self.num_rows:
                break
        if not rows:
            log.warning("HeldOutBlockLengthCallback: the validation loader has no rows; no heldout/* measures")
        else:
            self._rows = rows  # fixed from here on
        return rows

    @torch.no_grad()
    def measure(self, trainer, pl_module) -> dict[str, float]:
        """``{CHAIN: mean, TREE: mean, "anchors": n}`` over the fixed rows' valid anchors ({} without any)."""
        from exittrain.objective import batch_features

        drafter, target = drafter_and_target(pl_module)
        K = drafter.config.num_draft_tokens
        chain, tree, was_training = [], [], drafter.training
        drafter.eval()
        try:
            for batch, anchors_LA in self._fixed_rows(trainer, K):
                device = target.device
                on_device = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
                features = batch_features(drafter, target, on_device, pl_module.objective)[0]
                input_ids = on_device["input_ids"]
                anchors = anchors_LA.to(device)
                valid_N = (anchors >= 0).reshape(-1)
                logits_NKV = drafter.forward_anchors(features, input_ids, anchors.clamp_min(0),
                                                     context_window=pl_module.objective.context_window)
                positions_LAK = (anchors.clamp_min(0).unsqueeze(-1) + torch.arange(1, K + 1, device=device))
                L, A = anchors.shape
                labels_NK = input_ids.gather(1, positions_LAK.clamp_max(input_ids.shape[1] - 1).reshape(L, A * K))
                labels_NK = labels_NK.reshape(L * A, K)[valid_N]
                logits_NKV = logits_NKV[valid_N].float()
                chain.append(chain_block_lengths(logits_NKV, labels_NK))
                if self.budget is not None:
                    trees = build_tree(torch.log_softmax(logits_NKV, -1), self.budget, validate=False)
                    tree.append(1.0 + followed_depth(trees, labels_NK).float())
        finally:
            drafter.train(was_training)
        chain_N = torch.cat(chain) if chain else torch.zeros(0)
        if chain_N.numel() == 0:
            return {}
        out = {self.CHAIN: float(chain_N.mean()), "anchors": int(chain_N.numel())}
        if tree:
            out[self.TREE] = float(torch.cat(tree).mean())
        return out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every_n_steps or step == self._last_step:  # once per optimizer step
            return
        self._last_step = step
        measured = self.measure(trainer, pl_module)
        if not measured:
            return
        self.history.append({"step": step, **measured})
        metrics = {k: v for k, v in measured.items() if k.startswith("heldout/")}
        # straight to the loggers at the optimizer step: a value given to pl_module.log in this hook is
        # logged again at every later step of the epoch (Lightning keeps on_step results until it ends)
        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"history": [dict(h) for h in self.history]}  # a resumed stage keeps its curve

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.history = [dict(h) for h in state_dict.get("history", [])]
        self._last_step = int(self.history[-1]["step"]) if self.history else -1
