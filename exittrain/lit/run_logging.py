"""The run's rank, seed and stage loggers: the Lightning pieces that ``fit`` and ``eval`` need.

Kept here, in Lightning's home, so that :mod:`exittrain.fit`, :mod:`exittrain.build` and
:mod:`exittrain.evaluate` reach Lightning only through ``exittrain.lit`` (tests/test_architecture.py).
"""

from __future__ import annotations

import importlib.util
import logging
import os

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

__all__ = ["global_rank", "seed_everything", "build_logger", "make_logger", "close_logger", "log_table"]

log = logging.getLogger(__name__)


def global_rank() -> int:
    """This process's global rank, as Lightning's ``rank_zero_only`` (and so every logger) sees it.

    Lightning reads it from the launcher's environment at import (``RANK`` under torchrun,
    ``LOCAL_RANK`` in the processes its own launcher starts on one node, ``SLURM_PROCID`` under
    srun; 0 in a plain process) and sets it to the strategy's global rank when a Trainer is
    built. It is therefore right before the first Trainer exists too, where ``fit`` needs it
    (the logger, the data, a given warm start's evaluation).
    """
    from lightning.pytorch.utilities import rank_zero_only

    return rank_zero_only.rank


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch, and the data loader workers (Lightning's ``seed_everything``)."""
    import lightning as L

    L.seed_everything(seed, workers=True)


def build_logger(cfg: DictConfig, run_name: str):
    """The configured logger (``cfg.logger``) for one stage, or None, built but not started (no W&B run yet).

    wandb is an optional extra (``pip install 'exittrain[wandb]'``): where ``logger=wandb`` is asked for
    and wandb is not installed, the run logs to CSV in the same folder instead and says so once per stage."""
    if cfg.get("logger") is None:
        return None
    if "WandbLogger" not in str(cfg.logger.get("_target_", "")):
        return instantiate(cfg.logger)
    if importlib.util.find_spec("wandb") is None:
        from lightning.pytorch.loggers import CSVLogger

        save_dir = cfg.logger.get("save_dir", ".")
        log.warning("logger=wandb, but wandb is not installed: logging to CSV under %s/csv instead "
                    "(pip install 'exittrain[wandb]' for W&B, or pass logger=csv to silence this)", save_dir)
        return CSVLogger(save_dir=save_dir, name="csv")
    os.environ.setdefault("WANDB_SILENT", "true")
    return instantiate(cfg.logger, name=run_name)


def make_logger(cfg: DictConfig, run_name: str):
    """:func:`build_logger`, and on a W&B run max/last summaries for block length and the run's config."""
    logger = build_logger(cfg, run_name)
    # The W&B run exists on global rank 0 only: on the other ranks `experiment` is Lightning's
    # dummy, whose `config` is a method, so `config.update` would raise AttributeError there.
    if "WandbLogger" in type(logger).__name__ and global_rank() == 0:
        exp = logger.experiment
        exp.define_metric("val/block_length", summary="max")
        exp.define_metric("val/analytic_block_length", summary="max")
        exp.define_metric("val/greedy_block_length", summary="max")
        exp.define_metric("train/analytic_block_length", summary="last")
        exp.config.update(OmegaConf.to_container(cfg, resolve=True), allow_val_change=True)
    return logger


def close_logger(logger) -> None:
    """Finish a W&B run (sequential runs in one process would share it otherwise); other loggers need nothing."""
    if logger is not None and "WandbLogger" in type(logger).__name__:
        import wandb

        wandb.finish()


def log_table(logger, name: str, table: list[dict]) -> None:
    """Log the summary rows of one held-out evaluation as ``<name>/B<budget>_T<temperature>/<metric>``."""
    if logger is None:
        return
    flat = {}
    for row in table:
        key = f"{name}/B{row['budget']}_T{row['temperature']:g}"
        for extra in ("tau", "tau_oracle", "speedup", "tokens_per_s", "chain_tau"):
            if extra in row:
                flat[f"{key}/{extra}"] = row[extra]
        if "vllm" in row:  # the serving track: vLLM's acceptance and whether speculation kept its outputs
            flat[f"{key}/vllm_tau"] = row["vllm"]["vllm_tau"]
            flat[f"{key}/vllm_matches_plain"] = float(row["vllm"]["vllm_matches_plain"])
        for column in ("tau", "chain_tau"):  # the paired gains over the reference drafter, on the same answers
            for pair_key, pair in row.items():
                if pair_key.startswith(f"{column}_vs_") and pair is not None:
                    flat[f"{key}/{pair_key}"] = pair["delta"]
    logger.log_metrics(flat)
