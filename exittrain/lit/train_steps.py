"""Train a module for N steps under a Lightning Trainer: the one loop of `fit`, the benchmarks and step timing."""

from __future__ import annotations

from typing import Any

import lightning as L

from exittrain.lit.trainer import build_trainer

__all__ = ["train_steps", "scalar_metrics"]


def train_steps(module, datamodule, *, steps: int, trainer_cfg: Any = None, ckpt_path: str | None = None,
                **trainer_kwargs: Any) -> L.Trainer:
    """Fit ``module`` on ``datamodule`` for ``steps`` optimizer steps; returns the Trainer.

    ``trainer_cfg``: a ``trainer`` group node (its ``precision: auto`` resolved by
    :func:`~exittrain.lit.trainer.build_trainer`), or None for a bare ``L.Trainer`` of
    ``trainer_kwargs`` alone. ``trainer_kwargs``: the run-time arguments (callbacks, logger,
    plugins, ``limit_val_batches``, ...). ``ckpt_path``: a checkpoint to resume from.
    """
    if trainer_cfg is None:
        trainer = L.Trainer(max_steps=steps, **trainer_kwargs)
    else:
        trainer = build_trainer(trainer_cfg, max_steps=steps, **trainer_kwargs)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    return trainer


def scalar_metrics(trainer: L.Trainer) -> dict[str, float]:
    """The trainer's last logged scalar metrics (``callback_metrics``) as floats."""
    return {k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1}
