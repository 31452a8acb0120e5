"""The Lightning Trainer of a ``trainer`` config group, with ``precision: auto`` decided here."""

from __future__ import annotations

from typing import Any

from exittrain.precision import trainer_precision


def build_trainer(trainer_cfg: Any, **kwargs: Any):
    """``instantiate(trainer_cfg)(**kwargs)`` with ``precision`` resolved from the hardware.

    ``trainer_cfg`` is a ``trainer`` group node (``_partial_: true``); its ``precision: auto`` is
    replaced by what :func:`exittrain.precision.trainer_precision` picks for its ``accelerator``
    (Lightning itself has no ``auto`` precision). ``kwargs`` are the run-time arguments
    (``max_steps``, callbacks, logger, ...); a ``precision`` among them wins over the config.
    """
    from hydra.utils import instantiate

    precision = kwargs.pop("precision", trainer_cfg.get("precision"))
    resolved = trainer_precision(precision, trainer_cfg.get("accelerator"))
    return instantiate(trainer_cfg)(precision=resolved, **kwargs)
