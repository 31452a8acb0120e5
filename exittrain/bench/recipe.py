"""What a benchmark takes from ``fit``: the recipe's config, its held-out prompts, a stage's training.

- :func:`compose_fit_config`: the fit config of ``+recipe=<domain>`` as ``python -m exittrain fit``
  composes it (conf/ and recipes/, plus overrides), with its paths set for a benchmark;
- :func:`heldout_prompts`: the recipe's held-out evaluation prompts as ``fit`` and ``eval`` read
  them (the datamodule of ``cfg.data``, :meth:`~exittrain.data.ExitTrainDataModule.eval_prompts`),
  from an offset, so that a benchmark can leave out the first ones ``fit`` decodes;
- :func:`train_drafter`: a given number of steps of one stage, with exactly the module arguments
  the caller states (a benchmark arm sets its own).

Nothing here measures a drafter: the held-out measures are
:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

__all__ = ["compose_fit_config", "heldout_prompts", "train_drafter"]


def compose_fit_config(domain: str, out: Path, overrides: Sequence[str] = ()):
    """The fit config of ``+recipe=<domain>`` as ``fit`` would compose it, with ``overrides`` (Hydra
    override strings) applied after the bench's paths: ``paths.output_dir=out`` and the data cache of
    ``$EXITTRAIN_CACHE`` (default ``./data/cache``, the one ``fit`` fills)."""
    from hydra import compose, initialize_config_dir

    from exittrain.configs import CONF_DIR, register_recipes

    cache = os.environ.get("EXITTRAIN_CACHE", str(Path.cwd() / "data" / "cache"))
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "fit",
            overrides=[f"+recipe={domain}", "logger=csv", f"paths.output_dir={out}", f"paths.cache_dir={cache}",
                       *overrides],
        )


def heldout_prompts(cfg, target, prompts: int, *, skip: int = 0) -> list[list[int]]:
    """The held-out evaluation prompts ``skip .. skip + prompts`` of ``cfg.data``, chat-templated, as
    ``fit`` and ``eval`` read them: the recipe's datamodule (an override of ``data.eval_sources``
    included; their equals are left out of every training sample) and its ``eval_prompts``.

    ``fit`` and ``eval`` decode the first ``eval.num_prompts``; a benchmark that must not measure on
    those passes ``skip``. ValueError when the evaluation set holds fewer than ``skip + prompts``
    prompts, naming the sources and their count."""
    from hydra.utils import instantiate

    datamodule = instantiate(cfg.data)(target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer,
                                       target_name=target.name)
    held = datamodule.eval_prompts(skip + prompts)[skip:]
    if len(held) < prompts:
        loaded = datamodule.plan.prompts()
        raise ValueError(f"--skip {skip} --prompts {prompts}: the {cfg.data.domain} evaluation prompts "
                         f"({', '.join(s.source for s in loaded.eval_stats)}) are {len(loaded.eval)}; lower --skip "
                         "or --prompts, or name others with --override 'data.eval_sources=[...]'")
    return held


def train_drafter(cfg, drafter, target, datamodule, stage: str, steps: int, **overrides) -> dict[str, float]:
    """Fit ``drafter`` for ``steps`` of ``stage`` on ``datamodule`` with ``cfg.objective`` and
    exactly ``overrides`` (no ``stages.*``: an arm states its own); returns the last scalar metrics.

    Seeded by ``cfg.seed`` (the data order, the anchors and dropout), and every arm reads the same
    target features and soft labels from the DataModule's store."""
    from exittrain import progress
    from exittrain.build import build_module
    from exittrain.lit import ProgressLogCallback, stage_progress_bar
    from exittrain.lit.run_logging import seed_everything
    from exittrain.lit.train_steps import scalar_metrics, train_steps

    seed_everything(cfg.seed)  # the same data order and anchors for every arm
    module = build_module(cfg, stage, drafter, target, overrides)
    # as fit shows its stages: a bar on a terminal, else a progress line every 10 steps
    bar = progress.interactive()
    shown = stage_progress_bar(stage) if bar else ProgressLogCallback(stage, every_n_steps=10)
    trainer = train_steps(module, datamodule, steps=steps, trainer_cfg=cfg.trainer, logger=False,
                          enable_checkpointing=False, callbacks=[shown], limit_val_batches=0,
                          **({} if bar else {"enable_progress_bar": False}))
    return scalar_metrics(trainer)
