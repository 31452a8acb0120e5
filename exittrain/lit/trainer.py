"""The Lightning Trainer of a ``trainer`` config group, with ``precision: auto`` decided here."""

from __future__ import annotations

from typing import Any

from exittrain.host_choices import HostChoice
from exittrain.lit.sharding import is_model_parallel
from exittrain.precision import trainer_precision_choice


def precision_choice(trainer_cfg: Any, precision: Any = None, strategy: Any = None) -> HostChoice:
    """The precision a Trainer of ``trainer_cfg`` trains in, and how it was chosen
    (:func:`exittrain.precision.trainer_precision_choice`: ``auto`` on a CPU is this host type's
    recorded choice). ``precision`` / ``strategy``: run-time values that win over the config's."""
    if strategy is None and trainer_cfg.get("strategy") is not None:
        from hydra.utils import instantiate

        strategy = instantiate(trainer_cfg).keywords.get("strategy")
    value = trainer_cfg.get("precision") if precision is None else precision
    return trainer_precision_choice(value, trainer_cfg.get("accelerator"), sharded=is_model_parallel(strategy))


def build_trainer(trainer_cfg: Any, **kwargs: Any):
    """``instantiate(trainer_cfg)(**kwargs)`` with ``precision`` resolved from the hardware and the strategy.

    ``trainer_cfg`` is a ``trainer`` group node (``_partial_: true``); its ``precision: auto`` is
    replaced by what :func:`precision_choice` picks for its ``accelerator`` and its strategy
    (Lightning itself has no ``auto`` precision; under ``trainer=fsdp``, whose
    ``ModelParallelStrategy`` refuses ``16-mixed``, a GPU without bf16 gets ``32-true``). An explicit
    precision that strategy refuses raises a ValueError naming ``trainer.precision`` before the
    Trainer is built. ``kwargs`` are the run-time arguments (``max_steps``, callbacks, logger, ...);
    a ``precision`` or ``strategy`` among them wins over the config.
    """
    from hydra.utils import instantiate

    make = instantiate(trainer_cfg)  # a partial of the Trainer, its strategy node already built
    precision = kwargs.pop("precision", trainer_cfg.get("precision"))
    strategy = kwargs.get("strategy", make.keywords.get("strategy"))
    resolved = precision_choice(trainer_cfg, precision, strategy).value
    return make(precision=resolved, **kwargs)
