"""The Lightning DataModule of drafter training: prompts -> the target's own answers -> batches.

Lifecycle (Lightning calls these; see ``lightning.pytorch.core.datamodule``):

- ``prepare_data`` (one process per node): loads the prompt sources and regenerates the target's
  answers into the Arrow cache (:func:`exittrain.data.regenerate.regenerate`). The target is built
  by the ``target`` callable only when the cache entry is missing.
- ``setup`` (every process): reloads the prompt lists (deterministic, cheap), opens the cached
  dataset, drops rows whose prompt alone fills ``max_length`` and holds out ``val_fraction`` of the
  training rows for a validation loss, whole tasks at a time
  (:func:`~exittrain.data.prompt_selection.split_by_task`). Everything is counted in :attr:`ExitTrainDataModule.stats`.
- ``train_dataloader`` / ``val_dataloader``: right-padded batches from :class:`~exittrain.data.collate.Collator`
  (input_ids (L, T) long, loss_mask (L, T) bool, attention_mask (L, T) long, n_prompt_tokens (L,),
  lengths (L,), row_id (L,) = the row's ``prompt_index``: stable across epochs, unique across both splits).
  The training order of epoch e is a function of ``seed`` and e only, and a fit resumed from a
  checkpoint continues it where the checkpoint left off (``state_dict`` / ``load_state_dict``,
  :class:`~exittrain.data.sampler.ResumableSampler`).
- :attr:`ExitTrainDataModule.store`: what the regeneration kept beside the answers (target
  features; the target's top-k next-token log-probabilities, the soft labels), keyed by row id
  (:class:`~exittrain.data.feature_store.FeatureStore`, in host memory or read per batch from the
  cache entry, ``feature_store``); the collator puts them in every batch.
- :meth:`ExitTrainDataModule.eval_prompts`: the held-out evaluation prompts, chat-templated, for
  decoding benchmarks. They never overlap the training prompts (:func:`exittrain.data.sources.load_domain`).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from exittrain.data.collate import Collator, truncation_stats
from exittrain.data.feature_store import STORE_MODES, FeatureStore, RowLayout, token_fingerprint
from exittrain.data.prompt_selection import seeded_sample, split_by_task, unseen_tasks
from exittrain.data.regenerate import (
    GenerationConfig,
    TargetProvider,
    cache_path,
    chat_prompt_ids,
    read_meta,
    regenerate,
)
from exittrain.data.sampler import ResumableSampler
from exittrain.data.sources import DEFAULT_MAX_CHARS, DomainPrompts, PromptSource, load_domain

logger = logging.getLogger(__name__)

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct-Q4_1"
"""Cache-key name of the embedded default target: ``load_target(None).name`` in exittrain.models.target."""


def default_target_provider(target_name: str | None) -> TargetProvider:
    """A provider that builds the target with ``exittrain.models.target.load_target`` when called."""

    def provide() -> tuple[Any, Any]:
        from exittrain.models.target import load_target

        target = load_target(target_name)
        return target.model, target.tokenizer

    return provide


SourceSpecs = Sequence[str | PromptSource | Mapping[str, Any]]


class ExitTrainDataModule(pl.LightningDataModule):
    """Self-distilled training data of one domain.

    Args:
        domain: ``"dialogue"``, ``"code"`` or ``"math"`` (default sources in
            :data:`exittrain.data.sources.DOMAIN_SOURCES`); only a label when both source lists are given.
        train_sources, eval_sources: prompt source specs overriding the domain defaults.
        target_name: the target's hub id or path, or None for the embedded SmolLM2 target; it keys
            the cache and is what the default provider loads.
        target: callable returning ``(model, tokenizer)``, called only when regeneration is needed
            (or for :meth:`eval_prompts` without ``tokenizer``). Default: ``load_target(target_name)``.
        tokenizer: the target's tokenizer, or a callable returning it; lets :meth:`eval_prompts`
            work without building the model.
        cache_dir: folder of regenerated datasets.
        max_length: training sequences (prompt + response) are truncated to this many tokens.
        batch_size, num_workers: DataLoader settings.
        generation: :class:`~exittrain.data.regenerate.GenerationConfig` or a mapping of its fields.
        max_train_prompts: keep a seeded random sample of at most this many training prompts.
        val_fraction: fraction of the regenerated training rows held out for validation loss
            (0 disables validation; otherwise at least one row), whole tasks at a time: both
            prompt forms of one CodeI/O task land on the same side
            (:func:`~exittrain.data.prompt_selection.split_by_task`).
        seed: seed of the prompt sample, the validation split and the shuffling.
        exclude_seed: leave out every task of the sample that ``max_train_prompts`` draws under this
            seed, before this run's own sample (both prompt forms of a CodeI/O task go together):
            data a warm start of seed ``exclude_seed`` never saw (``bench exittrain``'s fresh rows).
            None (the default) leaves nothing out.
        max_prompt_chars: prompts longer than this are rejected (counted) when sources are read.
        progress: show the regeneration progress bar.
        feature_layers: target layer ids whose outputs regeneration keeps beside the answers
            (:func:`~exittrain.data.regenerate.regenerate`); the :attr:`store` serves them in every
            batch, and training then never runs the target over a row. Not part of the cache key:
            an entry already cached without them is used as it is (training computes them).
        top_logprobs: S > 0 keeps the answering model's top-S next-token log-probabilities at every
            response position during regeneration; the :attr:`store` serves them in every batch as
            the soft labels of the block cross-entropy. Not part of the cache key either.
        feature_store: ``"memory"`` reads every row's features and soft labels into host memory at
            setup (each process holds all of them); ``"disk"`` reads each batch's rows from the cache
            entry's files (:mod:`exittrain.data.feature_store`), for data sets larger than host memory.
        device: the device the target answers on (default the CPU); it decides
            ``generation.dtype="auto"`` (:meth:`GenerationConfig.resolved`).
    """

    def __init__(
        self,
        domain: str | None = "code",
        *,
        train_sources: SourceSpecs | None = None,
        eval_sources: SourceSpecs | None = None,
        target_name: str | None = None,
        target: TargetProvider | None = None,
        tokenizer: Any = None,
        cache_dir: str | os.PathLike = "data/cache/regen",
        max_length: int = 512,
        batch_size: int = 8,
        num_workers: int = 0,
        generation: GenerationConfig | Mapping[str, Any] | None = None,
        max_train_prompts: int | None = None,
        val_fraction: float = 0.05,
        seed: int = 0,
        exclude_seed: int | None = None,
        max_prompt_chars: int | None = DEFAULT_MAX_CHARS,
        progress: bool = True,
        feature_layers: Sequence[int] | None = None,
        top_logprobs: int = 0,
        feature_store: str = "memory",
        device: str | None = None,
    ) -> None:
        super().__init__()
        if max_length < 2:
            raise ValueError(f"max_length={max_length} must be at least 2")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must be in [0, 1)")
        if max_train_prompts is not None and max_train_prompts < 1:
            raise ValueError(f"max_train_prompts={max_train_prompts} must be positive or None")
        if exclude_seed is not None and (max_train_prompts is None or exclude_seed == seed):
            raise ValueError(
                f"exclude_seed={exclude_seed}: leaves out the max_train_prompts sample of another seed; set "
                f"max_train_prompts and a seed other than {exclude_seed} (seed={seed})"
            )
        self.domain = domain
        self.train_sources = list(train_sources) if train_sources is not None else None
        self.eval_sources = list(eval_sources) if eval_sources is not None else None
        self.target_name = target_name or EMBEDDED_TARGET_NAME
        self._target = target if target is not None else default_target_provider(target_name)
        self._tokenizer_arg = tokenizer
        self._tokenizer_obj: Any = None
        self.cache_dir = Path(cache_dir)
        self.max_length = max_length
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.device = device or "cpu"
        self.generation = GenerationConfig.coerce(generation).resolved(self.device)
        self.max_train_prompts = max_train_prompts
        self.val_fraction = val_fraction
        self.seed = seed
        self.exclude_seed = exclude_seed
        self.max_prompt_chars = max_prompt_chars
        self.progress = progress
        self.feature_layers = list(feature_layers) if feature_layers is not None else None
        if not isinstance(top_logprobs, int) or top_logprobs < 0:
            raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
        self.top_logprobs = top_logprobs
        if feature_store not in STORE_MODES:
            raise ValueError(
                f"feature_store={feature_store!r}: must be one of {STORE_MODES} (host memory, or read per batch "
                "from the cache entry)"
            )
        self.feature_store = feature_store
        self.store: FeatureStore | None = None  # after setup, when feature_layers or top_logprobs ask for one

        self._prompts: DomainPrompts | None = None
        self.train_set: datasets.Dataset | None = None
        self.val_set: datasets.Dataset | None = None
        self.pad_token_id: int | None = None
        self.stats: dict[str, Any] = {}
        self._resume_order: tuple[int, int] | None = None  # (epoch, batches done) from a checkpoint

    # -- prompts ---------------------------------------------------------------------------------

    def prompts(self) -> DomainPrompts:
        """Train and eval prompts after cleaning, overlap removal and ``max_train_prompts``."""
        if self._prompts is None:
            dp = load_domain(
                self.domain, train=self.train_sources, eval=self.eval_sources, max_chars=self.max_prompt_chars
            )
            if self.exclude_seed is not None:
                unseen = unseen_tasks(dp.train, dp.train_tasks(), self.max_train_prompts, self.exclude_seed)
                logger.info(
                    "left out %d training prompts: the tasks of seed %d's sample (exclude_seed)",
                    len(dp.train) - len(unseen), self.exclude_seed,
                )
                dp.train = unseen
            if self.max_train_prompts is not None and len(dp.train) > self.max_train_prompts:
                keep = seeded_sample(len(dp.train), self.max_train_prompts, self.seed)
                logger.info("using %d of %d training prompts (max_train_prompts)", len(keep), len(dp.train))
                dp.train = [dp.train[i] for i in keep]
            self._prompts = dp
        return self._prompts

    def _prompt_set_description(self) -> str:
        """Where the training prompts came from; part of the regeneration cache key."""
        dp = self.prompts()
        return ";".join(
            [
                f"domain={dp.domain}",
                "train=" + "+".join(s.source for s in dp.train_stats),
                "eval=" + "+".join(s.source for s in dp.eval_stats),
                f"max_chars={self.max_prompt_chars}",
                f"max_train={self.max_train_prompts}",
                f"seed={self.seed}",
                # only when set: the caches of runs without it keep their keys
                *([f"exclude_seed={self.exclude_seed}"] if self.exclude_seed is not None else []),
            ]
        )

    @property
    def cache_path(self) -> Path:
        """Folder of this configuration's regenerated dataset (exists after ``prepare_data``)."""
        return cache_path(
            self.cache_dir, self.target_name, self._prompt_set_description(), self.prompts().train, self.generation
        )

    # -- Lightning hooks -------------------------------------------------------------------------

    def prepare_data(self) -> None:
        """Regenerate the target's answers unless they are cached; loads the target only then."""
        regenerate(
            self.prompts().train,
            self._provide_target,
            target_name=self.target_name,
            cache_dir=self.cache_dir,
            gen=self.generation,
            prompt_set=self._prompt_set_description(),
            progress=self.progress,
            feature_layers=self.feature_layers,
            top_logprobs=self.top_logprobs,
            device=self.device,
        )

    def setup(self, stage: str | None = None) -> None:
        """Open the cached dataset and split off the validation rows (every process)."""
        if self.train_set is not None:
            return
        path = self.cache_path
        if not path.is_dir():
            raise ValueError(
                f"no regenerated data at {path}; call prepare_data() first (Trainer.fit does), with the same "
                "sources, target_name, generation settings, max_train_prompts and seed"
            )
        ds = datasets.load_from_disk(str(path))
        meta = read_meta(path)
        self.pad_token_id = int(meta["pad_token_id"])
        n_prompt = ds["n_prompt_tokens"]
        n_total = [p + r for p, r in zip(n_prompt, ds["n_response_tokens"])]
        trunc = truncation_stats(n_prompt, n_total, self.max_length)
        usable = [i for i, p in enumerate(n_prompt) if p < self.max_length]
        if not usable:
            raise ValueError(
                f"every prompt in {path} is at least max_length={self.max_length} tokens; raise max_length"
            )
        if trunc.truncated or trunc.no_response:
            logger.warning(
                "max_length=%d truncates %d of %d rows; %d of them keep no response token and are dropped",
                self.max_length,
                trunc.truncated,
                trunc.rows,
                trunc.no_response,
            )
        order = list(usable)
        random.Random(self.seed).shuffle(order)
        dp = self.prompts()
        val_rows, train_rows = [], order
        if self.val_fraction > 0:
            asked = max(1, round(self.val_fraction * len(order)))
            tasks = dp.train_tasks()  # indexed by prompt_index; only the split needs them
            val_rows, train_rows = split_by_task(order, [tasks[i] for i in ds["prompt_index"]], asked)
            if not train_rows:
                raise ValueError(
                    f"{len(order)} usable rows cannot give {asked} validation rows and some training rows; "
                    "lower val_fraction or add prompts"
                )
        n_val = len(val_rows)
        columns = ["input_ids", "loss_mask", "n_prompt_tokens", "prompt_index"]  # prompt_index -> row_id
        ds = ds.select_columns(columns)
        self.val_set = ds.select(sorted(val_rows), keep_in_memory=True) if n_val else None
        self.train_set = ds.select(sorted(train_rows), keep_in_memory=True)
        self.stats = {
            "prompts": dp.to_dict(),
            "regeneration": {k: meta[k] for k in ("rows", "rejected_too_long", "unfinished", "n_prompts")},
            "truncation": {"rows": trunc.rows, "truncated": trunc.truncated, "dropped_no_response": trunc.no_response},
            "train_rows": len(self.train_set),
            "val_rows": n_val,
            "eval_prompts": len(dp.eval),
            "cache_path": str(path),
        }
        self.store = self._open_store(path)
        if self.store is not None:
            self.stats["feature_store"] = {
                "mode": self.store.mode,
                "feature_layers": self.store.feature_layers,
                "top_logprobs": self.store.top_k,
            }
        logger.info(
            "data: %d train rows, %d val rows, %d eval prompts (%s)", len(self.train_set), n_val, len(dp.eval), path
        )

    def _split_rows(self, *columns: str):
        """The zipped ``columns`` of every training row, then of every validation row."""
        for split in (self.train_set, self.val_set):
            if split is not None:
                yield from zip(*(split[c] for c in columns))

    def answer_token_rows(self):
        """``(input_ids, loss_mask)`` of every training and validation row (after :meth:`setup`):
        what the draft vocabulary counts (exittrain/decoding/draft_vocab.py)."""
        self.setup("fit")
        return self._split_rows("input_ids", "loss_mask")

    def _open_store(self, path: Path) -> FeatureStore | None:
        """The :class:`FeatureStore` of the entry at ``path`` for every train and val row; None when
        neither ``feature_layers`` nor ``top_logprobs`` asks for one. Warns about what the entry lacks."""
        if not self.feature_layers and not self.top_logprobs:
            return None
        rows = {
            int(r): RowLayout(len(ids), int(p), min(len(ids), self.max_length), token_fingerprint(ids))
            for r, ids, p in self._split_rows("prompt_index", "input_ids", "n_prompt_tokens")
        }
        store = FeatureStore.open(
            path, rows, feature_layers=self.feature_layers, top_k=self.top_logprobs, mode=self.feature_store
        )
        if self.feature_layers and not store.has_features:
            logger.warning(
                "the cache entry %s keeps no target features of layers %s (written without them): training computes "
                "them every step; delete the entry to regenerate it with them",
                path,
                self.feature_layers,
            )
        if self.top_logprobs and not store.has_top_logprobs:
            logger.warning(
                "the cache entry %s keeps no top-%d log-probabilities: training asks the target for the soft labels "
                "every step; delete the entry to regenerate it with them",
                path,
                self.top_logprobs,
            )
        logger.info(
            "feature store (%s): %d rows, features of layers %s, top-%d log-probabilities (%s)",
            store.mode,
            len(store),
            store.feature_layers,
            store.top_k,
            path,
        )
        return store

    def _collator(self) -> Collator:
        if self.pad_token_id is None:
            raise ValueError("the DataModule is not set up; call setup() first")
        return Collator(pad_token_id=self.pad_token_id, max_length=self.max_length, store=self.store)

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches; epoch e's order depends only on ``seed`` and e (:class:`ResumableSampler`).

        After ``load_state_dict`` (a resumed fit) the first pass continues the checkpoint's epoch
        right after the batches it had trained: a resumed run sees the same batches, in the same
        order, as a run that was never interrupted.
        """
        if self.train_set is None:
            raise ValueError("the DataModule is not set up; call setup('fit') first")
        # Bug fixed here: a RandomSampler with a generator seeded once per DataLoader replayed epoch 0's
        # order after every resume, from the start of the epoch (Lightning does not skip the batches a
        # plain DataLoader already gave before the checkpoint). See exittrain/data/sampler.py.
        world, rank = self._world()
        trainer = self.trainer
        epoch_fn = (lambda: trainer.current_epoch) if trainer is not None else None
        sampler = ResumableSampler(self.train_set, seed=self.seed, num_replicas=world, rank=rank, epoch_fn=epoch_fn)
        if self._resume_order is not None:
            epoch, batches_done = self._resume_order
            sampler.resume(epoch, batches_done * self.batch_size)
            self._resume_order = None  # once: a later fit of the same DataModule starts afresh
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=sampler,
            # its own generator, only for the workers' base seed: iterating never draws from torch's global RNG
            generator=torch.Generator().manual_seed(self.seed),
            collate_fn=self._collator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def _world(self) -> tuple[int, int]:
        """(world size, global rank) of the attached trainer; (1, 0) without one."""
        trainer = self.trainer
        return (int(trainer.world_size), int(trainer.global_rank)) if trainer is not None else (1, 0)

    def state_dict(self) -> dict[str, Any]:
        """Where training stands in the data, saved in every checkpoint of a fit (Lightning hook).

        ``train_order``: the epoch and how many batches of it this rank has trained, read from
        Lightning's own counters at the moment the checkpoint is written (after the batch's update),
        plus the settings that fix the order (seed, batch size, world size).
        """
        trainer = self.trainer
        if trainer is None or self.train_set is None:
            return {}
        world, _ = self._world()
        return {
            "train_order": {
                "epoch": int(trainer.current_epoch),
                "batches_done": int(trainer.fit_loop.epoch_loop.batch_progress.current.processed),
                "seed": int(self.seed),
                "batch_size": int(self.batch_size),
                "world_size": world,
            }
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the data order of a checkpoint (Lightning calls it before ``train_dataloader``).

        With another seed, batch size or world size the order cannot continue: the resumed run
        starts the checkpoint's epoch afresh (with a warning).
        """
        order = state_dict.get("train_order")
        if not order:
            return
        world, _ = self._world()
        now = {"seed": int(self.seed), "batch_size": int(self.batch_size), "world_size": world}
        saved = {k: order.get(k) for k in now}
        if saved != now:
            logger.warning(
                "the checkpoint's data order (%s) differs from this run's (%s): epoch %d restarts from its first batch",
                saved,
                now,
                order["epoch"],
            )
            self._resume_order = (int(order["epoch"]), 0)
        else:
            self._resume_order = (int(order["epoch"]), int(order["batches_done"]))

    def val_dataloader(self) -> DataLoader | list:
        """Validation-loss batches over held-out training prompts; ``[]`` when ``val_fraction == 0``."""
        if self.val_set is None:
            return []
        return DataLoader(
            self.val_set,
            batch_size=self.batch_size,
            shuffle=False,
            collate_fn=self._collator(),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    # -- evaluation prompts ------------------------------------------------------------------------

    def tokenizer(self) -> Any:
        """The target's tokenizer: the ``tokenizer`` argument, else the target provider's (cached)."""
        if self._tokenizer_obj is None:
            arg = self._tokenizer_arg
            if arg is None:
                self._tokenizer_obj = self._provide_target()[1]
            else:
                self._tokenizer_obj = arg() if callable(arg) and not hasattr(arg, "apply_chat_template") else arg
        return self._tokenizer_obj

    def eval_prompt_texts(self, n: int | None = None) -> list[str]:
        """The first ``n`` evaluation prompts (all when None), never seen in training."""
        return self.prompts().eval[:n]

    def eval_prompts(self, n: int | None = None) -> list[list[int]]:
        """The first ``n`` evaluation prompts as chat-templated token ids ending with the assistant header.

        Templated exactly like the training prompts (same ``generation.system_prompt``).
        """
        tok = self.tokenizer()
        return [chat_prompt_ids(tok, p, self.generation.system_prompt) for p in self.eval_prompt_texts(n)]

    def _provide_target(self) -> tuple[Any, Any]:
        model, tokenizer = self._target()
        if self._tokenizer_obj is None and self._tokenizer_arg is None:
            self._tokenizer_obj = tokenizer
        return model, tokenizer
