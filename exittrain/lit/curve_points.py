"""A callback that hands the drafter to a measurement at chosen optimizer steps, with the training tokens so far.

:class:`CurvePointsCallback` is the Lightning side of ``bench curve`` (:mod:`exittrain.bench.curve`):
it counts the real tokens of every training batch (the collator's ``lengths``) and, the first time the
global step reaches one of ``at_steps``, calls ``on_point(step, tokens, drafter)``. What a point
measures, and that its time stays off the curve's clock, is the caller's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

__all__ = ["CurvePointsCallback"]


class CurvePointsCallback(Callback):
    """Call ``on_point(step_offset + global_step, tokens, drafter)`` at each of ``at_steps`` (this trainer's
    optimizer steps, 1-based), once each.

    ``tokens``: ``tokens_before`` plus the real tokens of every training batch this trainer has run
    (``batch["lengths"]`` summed: prompt and answer after truncation, padding left out), this rank only.
    With gradient accumulation a step's point follows the batch that completed it. ValueError for a
    batch without ``lengths`` (not the collator's: the count would be wrong)."""

    def __init__(self, at_steps: Iterable[int], on_point: Callable[[int, int, torch.nn.Module], None], *,
                 step_offset: int = 0, tokens_before: int = 0) -> None:
        self.at_steps = sorted(set(int(s) for s in at_steps))
        if any(s < 1 for s in self.at_steps):
            raise ValueError(f"at_steps {self.at_steps}: optimizer steps are counted from 1")
        self.on_point, self.step_offset, self.tokens = on_point, step_offset, int(tokens_before)
        self.done: set[int] = set()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch,
                           batch_idx: int) -> None:
        lengths = batch.get("lengths") if isinstance(batch, dict) else None
        if not torch.is_tensor(lengths):
            raise ValueError("CurvePointsCallback: a training batch without 'lengths' (the collator's real tokens "
                             "per row); train on exittrain.data's batches")
        self.tokens += int(lengths.sum())
        step = int(trainer.global_step)
        if step in self.at_steps and step not in self.done:
            self.done.add(step)
            self.on_point(self.step_offset + step, self.tokens, pl_module.drafter)
