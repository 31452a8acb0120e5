"""Progress of drafter training: one bar over a stage's steps on a terminal, log lines elsewhere.

- :func:`stage_progress_bar` is Lightning's default progress bar with one training bar over the stage's
  steps (``pretrain step 120/600``), for a terminal.
- :class:`ProgressLogCallback` logs progress lines instead, for a redirected stdout (a log file, SLURM,
  CI), where no bar draws.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, RichProgressBar, TQDMProgressBar

from exittrain import progress
from exittrain.lit.callbacks import scalar_float
from exittrain.progress import Ticker

__all__ = ["ProgressLogCallback", "StageRichProgressBar", "StageTQDMProgressBar", "stage_progress_bar"]


def _step_description(stage: str, trainer: pl.Trainer) -> str:
    """``<stage> step <global step>/<max_steps>``; the step is right-aligned to the total's width (a
    steady width, no flicker), and there is no total when ``max_steps`` is unset (-1)."""
    max_steps = trainer.max_steps
    if max_steps is None or max_steps <= 0:
        return f"{stage} step {trainer.global_step}"
    return f"{stage} step {trainer.global_step:>{len(str(max_steps))}}/{max_steps}"


def _step_total(trainer: pl.Trainer) -> float:
    return trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else math.inf


class StageRichProgressBar(RichProgressBar):
    """Lightning's Rich bar whose training bar spans the whole stage: ``<stage> step g/max_steps``,
    total ``max_steps``, at the global step.

    Why: the stages run by ``max_steps`` over many epochs of a small dataset, which leaves
    ``max_epochs`` at -1; Lightning 2.6 restarts the bar at every epoch (``on_train_epoch_start``
    resets it to the epoch's batches, ``on_train_batch_end`` sets it to ``batch_idx + 1``) and
    printed ``Epoch 6/-2``. Here the task is made once, with the steps already done (a resumed
    run starts part way), and every batch sets it to ``trainer.global_step``. Validation bars are
    Lightning's.
    """

    def __init__(self, stage: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage

    def _styled(self, text: str) -> str:
        return f"[{self.theme.description}]{text}" if self.theme.description else text  # as RichProgressBar._add_task

    def _get_train_description(self, current_epoch: int) -> str:
        text = _step_description(self.stage, self.trainer)
        return f"{text:{len(self.validation_description)}}"  # at least as wide as the validation label

    def _initialize_train_progress_bar_id(self) -> None:
        assert self.progress is not None
        trainer = self.trainer
        self.train_progress_bar_id = self.progress.add_task(
            self._styled(self._get_train_description(trainer.current_epoch)),
            total=_step_total(trainer),
            completed=trainer.global_step,
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.is_disabled or self.progress is None:
            return
        if self.train_progress_bar_id is None:  # not reset per epoch: one bar for the stage
            self._initialize_train_progress_bar_id()
        self.refresh()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.is_enabled and self.progress is not None:
            if self.train_progress_bar_id is None:
                self._initialize_train_progress_bar_id()
            self.progress.update(
                self.train_progress_bar_id,
                completed=trainer.global_step,
                description=self._styled(self._get_train_description(trainer.current_epoch)),
            )
        self._update_metrics(trainer, pl_module)
        self.refresh()


class StageTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm bar (used without Rich) with the training bar over the stage's steps, like
    :class:`StageRichProgressBar`: description ``<stage> step g/max_steps``, total ``max_steps``,
    position the global step, never reset per epoch."""

    def __init__(self, stage: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stage = stage

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        bar, total = self.train_progress_bar, _step_total(trainer)
        bar.reset(total=None if math.isinf(total) else total)
        bar.initial = bar.n = trainer.global_step  # a resumed run starts part way; tqdm's rate counts from here
        bar.set_description(_step_description(self.stage, trainer))

    def on_train_epoch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        pass  # Lightning resets the bar to the epoch's batches here; this bar spans the stage

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, n = self.train_progress_bar, trainer.global_step
        if bar.disable or not self._should_update(n, bar.total):
            return
        bar.n = n
        bar.set_description(_step_description(self.stage, trainer), refresh=False)
        bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes the bar


def stage_progress_bar(stage: str) -> Callback:
    """The progress bar Lightning would pick (Rich when installed, else tqdm), with one training bar
    over the stage's steps reading ``<stage> step <global step>/<max_steps>``
    (:class:`StageRichProgressBar`, :class:`StageTQDMProgressBar`). For a terminal: under a
    redirected stdout use :class:`ProgressLogCallback`."""
    from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

    return StageRichProgressBar(stage) if _RICH_AVAILABLE else StageTQDMProgressBar(stage)


def _batch_rows_tokens(batch: Any) -> tuple[int, Any]:
    """Rows and real (unpadded) tokens of a collated batch; the token count may be a device tensor,
    left unsynchronised until it is printed. (0, 0) for a batch without ``input_ids``."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not torch.is_tensor(ids) or ids.dim() == 0:
        return 0, 0
    for key in ("lengths", "attention_mask"):
        if torch.is_tensor(batch.get(key)):
            return ids.shape[0], batch[key].sum()
    return ids.shape[0], ids.numel()


class ProgressLogCallback(Callback):
    """A progress line on the ``exittrain`` logger (INFO) every ``every_n_steps`` optimizer steps or
    ``every_s`` seconds of training, for runs whose stdout is not a terminal (no bar draws there).

    Line: ``<stage> step <global step>/<max_steps> (p%) loss=... loss_tok=... rows_s=... tok_s=...
    elapsed=H:MM:SS eta=H:MM:SS`` (:class:`exittrain.progress.Ticker`: the first and the last step
    are always logged). The losses are the step's values of ``metrics`` in
    ``trainer.callback_metrics`` (what :class:`~exittrain.lit.ExitTrainModule` logs), named without
    their ``train/`` prefix; ``loss`` falls back to ``outputs["loss"]``. ``rows_s`` and ``tok_s``
    are mean rates since this fit started: rows and real tokens (``lengths`` or ``attention_mask``)
    of the training batches times the world size (every rank is assumed to get batches of the same
    size). The ETA is the remaining steps at the mean step rate since the fit started (a resumed
    fit counts from its first step).

    Logs on global rank 0 only, and nothing when stdout is a terminal at train start
    (:func:`exittrain.progress.interactive`), where :func:`stage_progress_bar` shows the progress.
    Not a Lightning ``ProgressBar``: it works with ``enable_progress_bar=False``.
    """

    def __init__(
        self,
        stage: str,
        every_n_steps: int = 50,
        every_s: float = 30.0,
        *,
        metrics: Sequence[str] = ("train/loss", "train/loss_tok"),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        Ticker(stage, every=every_n_steps, every_s=every_s)  # validates the intervals now, not at train start
        self.stage = stage
        self.every_n_steps = every_n_steps
        self.every_s = every_s
        self.metrics = tuple(metrics)
        self.clock = clock
        self._ticker: Ticker | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ticker = None
        if progress.interactive() or not trainer.is_global_zero:
            return
        total = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps > 0 else None
        self._ticker = Ticker(
            self.stage,
            total,
            every=self.every_n_steps,
            every_s=self.every_s,
            start=trainer.global_step,
            clock=self.clock,
        )
        self._rows, self._tokens = 0, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ticker = self._ticker
        if ticker is None:
            return
        rows, tokens = _batch_rows_tokens(batch)
        self._rows, self._tokens = self._rows + rows, self._tokens + tokens
        step = trainer.global_step
        if step == ticker.n or not ticker.due(step):  # step == n: accumulating gradients, no update yet
            ticker.n = step
            return
        ticker.update(step, **self._postfix(trainer, outputs, ticker.elapsed))

    def _postfix(self, trainer: pl.Trainer, outputs: Any, elapsed: float) -> dict[str, float | None]:
        found = trainer.callback_metrics
        out = {key.rsplit("/", 1)[-1]: scalar_float(found[key]) for key in self.metrics if key in found}
        if "loss" not in out and isinstance(outputs, Mapping) and "loss" in outputs:
            out["loss"] = scalar_float(outputs["loss"])
        if self._rows and elapsed > 0:
            scale = trainer.world_size / elapsed
            out["rows_s"] = self._rows * scale
            out["tok_s"] = float(self._tokens) * scale
        return out
