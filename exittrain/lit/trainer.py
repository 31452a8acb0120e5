"""The Lightning Trainer of a ``trainer`` config group, with ``precision: auto`` decided here."""

from __future__ import annotations

from typing import Any

from exittrain.lit.sharding import is_model_parallel
from exittrain.precision import trainer_precision


def build_trainer(trainer_cfg: Any, **kwargs: Any):
    """``instantiate(trainer_cfg)(**kwargs)`` with ``precision`` resolved from the hardware and the strategy.

    ``trainer_cfg`` is a ``trainer`` group node (``_partial_: true``); its ``precision: auto`` is
    replaced by what :func:`exittrain.precision.trainer_precision` picks for its ``accelerator``
    and its strategy (Lightning itself has no ``auto`` precision; under ``trainer=fsdp``, whose
    ``ModelParallelStrategy`` refuses ``16-mixed``, a GPU without bf16 gets ``32-true``). An explicit
    precision that strategy refuses raises a ValueError naming ``trainer.precision`` before the
    Trainer is built. ``kwargs`` are the run-time arguments (``max_steps``, callbacks, logger, ...);
    a ``precision`` or ``strategy`` among them wins over the config.
    """
    from hydra.utils import instantiate

    make = instantiate(trainer_cfg)  # a partial of the Trainer, its strategy node already built
    precision = kwargs.pop("precision", trainer_cfg.get("precision"))
    strategy = kwargs.get("strategy", make.keywords.get("strategy"))
    resolved = trainer_precision(precision, trainer_cfg.get("accelerator"), sharded=is_model_parallel(strategy))
    return make(precision=resolved, **kwargs)
