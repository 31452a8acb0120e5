"""Train a module for a few steps under a bare Lightning Trainer and keep each step's logged timings.

What ``bench train`` measures with: the Lightning part lives here so the benchmark itself stays
free of Lightning (tests/test_architecture.py).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from exittrain.lit.train_steps import train_steps


class _CollectStepMetrics(Callback):
    """After every training batch, the logged ``train/time_<part>_ms`` (and ``train/anchors``)."""

    def __init__(self, parts: tuple[str, ...]):
        self.parts, self.rows = parts, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        times = {k: float(m[f"train/time_{k}_ms"]) for k in self.parts if f"train/time_{k}_ms" in m}
        self.rows.append(times | {"anchors": float(m.get("train/anchors", 0))})


def timed_training_steps(module, datamodule, *, steps: int, precision: str, parts: tuple[str, ...]) -> list[dict]:
    """Fit ``module`` on ``datamodule`` for ``steps`` CPU steps (no logger, checkpoints or validation).

    Returns one dict per step: ``{part: ms}`` for each of ``parts`` the module logged as
    ``train/time_<part>_ms``, and ``anchors``."""
    collect = _CollectStepMetrics(parts)
    train_steps(
        module, datamodule, steps=steps, accelerator="cpu", precision=precision, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[collect],
        limit_val_batches=0, num_sanity_val_steps=0,
    )
    return collect.rows
