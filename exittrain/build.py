"""The objects a run is made of, built from a composed ``fit`` config: what ``fit`` and the benchmarks share.

Each config group mirrors one constructor (``hydra.utils.instantiate``); the runtime objects (the
target, the drafter, the prompts) are passed at the call site. The settings are checked before
any of this runs (:mod:`exittrain.settings`).

- :func:`build_target`, :func:`build_drafter`: the frozen target and the drafter to train;
- :func:`build_datamodule`, :func:`prepare_data`: the DataModule, and its data step across ranks;
- :func:`build_module`, :func:`build_callbacks`: a stage's LightningModule and callbacks.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from exittrain import progress
from exittrain.data.generation import GenerationConfig
from exittrain.lit import ExportDrafterCallback, MetricsFileCallback, ProgressLogCallback, stage_progress_bar
from exittrain.lit.run_logging import global_rank
from exittrain.lit.trainer import precision_choice
from exittrain.models import load_drafter
from exittrain.run_dir import DRAFTER_DIRS
from exittrain.settings import module_overrides, stage_module_args

__all__ = [
    "TargetArg",
    "build_target",
    "build_drafter",
    "build_datamodule",
    "prepare_data",
    "build_module",
    "build_callbacks",
    "run_choices",
]

log = logging.getLogger("exittrain")

TargetArg = Any  # a TargetModel, a function returning one, or None (build cfg.target)


def build_target(cfg: DictConfig, target: TargetArg = None):
    """``target`` when given (a built target, or a function that builds one), else ``cfg.target`` built."""
    if target is None:
        return instantiate(cfg.target)
    return target() if callable(target) else target


def build_drafter(cfg: DictConfig, target):
    """The drafter to train: ``warm_start`` loaded, else a fresh one from ``cfg.drafter``.

    Built before the data, so bad ``drafter.*`` settings or a warm start saved for another target
    fail in seconds, not after the regeneration."""
    if cfg.warm_start is not None:
        return load_drafter(cfg.warm_start, target)
    return instantiate(cfg.drafter)(target)


def build_datamodule(cfg: DictConfig, target, drafter_layers: list[int], stages: list[str]):
    """The run's DataModule (``cfg.data``), asking the regeneration to keep what training reads.

    With the feature cache on, the regeneration keeps the target features of ``drafter_layers``
    as it answers (no training row then needs a target forward of its own); when one of
    ``stages`` trains on soft labels, also the target's top-k next-token log-probabilities. The
    DataModule's store holds them in host memory with the feature cache on, and reads them per
    batch from the cache entry with it off (the setting for data larger than host memory).
    """
    args = [stage_module_args(cfg, stage) for stage in stages]
    top_k = max((a.get("soft_label_top_k", 0) for a in args if a.get("soft_label_weight", 0) > 0), default=0)
    return instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer),
        tokenizer=target.tokenizer,
        target_name=target.name,
        feature_layers=list(drafter_layers) if cfg.objective.feature_cache else None,
        top_logprobs=top_k,
        feature_store="memory" if cfg.objective.feature_cache else "disk",
        device=str(target.device),
        vocab_size=target.vocab_size,
    )


def prepare_data(datamodule, *, wait_s: float, poll_s: float = 10.0) -> None:
    """Every rank answers its shard of the regeneration, then waits for the complete cache entry.

    ``datamodule.prepare_data()`` answers this process's shard of the entry's batches: the one
    ``data.generation.shard`` names, else the launcher's global rank of its world size (torchrun's
    ``RANK``/``WORLD_SIZE``, srun's ``SLURM_PROCID``/``SLURM_NTASKS``), else every batch
    (:func:`exittrain.data.answerers.process_shard`). The process that completes the last batch
    merges the entry; the others poll for the folder with the entry's final name, which exists only
    once complete, for up to ``wait_s`` seconds (``data_wait_s``). Under Lightning's own launcher
    rank 0 is alone here (no launcher variables yet: every batch) and the ranks it starts later find
    the entry at once. ``data.cache_dir`` must be on a file system every process sees, like
    ``hydra.run.dir``.
    """
    rank = global_rank()
    datamodule.prepare_data()  # this rank's shard (cached batches are skipped), with its progress bar
    path = datamodule.cache_path
    deadline = time.monotonic() + wait_s
    if not path.is_dir():
        log.info("rank %d: shard answered; waiting up to %g s for the other shards of %s", rank, wait_s, path)
    while not path.is_dir():
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: no regenerated data at {path} after data_wait_s={wait_s:g} s; every rank answers its "
                "shard and the one that completes the last batch merges the entry. Look for a rank that failed or "
                "ran with other data.* or target settings, fill the cache first (python -m exittrain prepare with the "
                "same overrides; docs/multi_gpu.md, Launching), or raise data_wait_s; with several nodes, "
                "data.cache_dir must be on a shared file system"
            )
        time.sleep(poll_s)


def build_module(cfg: DictConfig, stage: str, drafter, target, overrides: dict | None = None):
    """The stage's LightningModule: ``cfg.objective`` with ``overrides`` (default: ``stages.<stage>``'s,
    as ``fit`` trains it; a benchmark arm passes its own)."""
    overrides = module_overrides(cfg, stage) if overrides is None else overrides
    return instantiate(cfg.objective)(drafter=drafter, target=target, stage=stage, **overrides)


def build_callbacks(
    cfg: DictConfig, stage: str, eval_prompts: list[list[int]], out: Path, eval_every: int | None = None
) -> list:
    """The stage's callbacks; ``eval_every`` (``stages.<stage>.eval_every``), when set, replaces the
    decode check's ``every_n_steps`` and the checkpoint's ``every_n_train_steps`` for this stage.

    Progress (unless ``trainer.enable_progress_bar`` is false): the stage's bar on a terminal, else
    progress lines in the log (:class:`~exittrain.lit.ProgressLogCallback`; no bar draws into a file),
    and then the stage's trainer switches Lightning's own bar off."""
    callbacks = []
    for name, node in cfg.callbacks.items():
        if node is None:
            continue
        if name == "decode_eval":
            node = OmegaConf.to_container(node, resolve=True)
            n = node.pop("num_prompts")
            if eval_every is not None:
                node["every_n_steps"] = eval_every
            callbacks.append(instantiate(node)(prompts=eval_prompts[:n]))
        elif name == "checkpoint":
            extra = {} if eval_every is None else {"every_n_train_steps": eval_every}
            callbacks.append(instantiate(node, dirpath=str(out / "checkpoints" / stage), **extra))
        else:
            callbacks.append(instantiate(node))
    callbacks.append(ExportDrafterCallback(out, name=DRAFTER_DIRS[stage]))
    callbacks.append(MetricsFileCallback(out, stage))
    if cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar when it is switched off
        callbacks.append(stage_progress_bar(stage) if progress.interactive() else ProgressLogCallback(stage))
    return callbacks


def run_choices(cfg: DictConfig, datamodule) -> dict[str, dict]:
    """``metrics.json``'s ``choices``: per config key the value the run used, its setting and why
    (:class:`~exittrain.host_choices.HostChoice`), for the settings a host can decide: the answers'
    dtype (as the data module decided it, in its cache folder) and the trainer's precision."""
    generation = GenerationConfig.coerce(dict(cfg.data.get("generation") or {}))
    dtype = generation.dtype_choice(datamodule.device, remember_in=cfg.data.cache_dir)
    if dtype.value != datamodule.generation.dtype:  # a record deleted or rewritten while this run started
        raise RuntimeError(f"data.generation.dtype: the data module answers in {datamodule.generation.dtype!r} but the "
                           f"record now says {dtype.value!r} ({', '.join(dtype.records)}); run again")
    return {c.key: c.as_dict() for c in (dtype, precision_choice(cfg.trainer))}
