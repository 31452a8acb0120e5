"""Which prompts a run trains and evaluates on, and which regeneration cache entry holds the answers.

Lightning-free: :class:`~exittrain.data.datamodule.ExitTrainDataModule` delegates to it, and a
command that only prepares the data can call it with the DataModule's own arguments::

    plan = PromptPlan.from_data_args(cfg_data, target_name=target.name, device=str(target.device))
    plan.train                     # the chosen training prompts: what the regeneration answers
    plan.eval_ids(tokenizer, n)    # the first n evaluation prompts, chat-templated
    plan.cache_path                # the cache entry of the answers (regen_cache.cache_path)
    plan.regenerate(provider)      # fill it unless it is there (regenerate.regenerate)

The training prompts (:func:`choose_train_prompts`): the domain's sources, cleaned, without any
prompt equal to an evaluation prompt (:func:`exittrain.data.sources.load_domain`); then, with
``exclude_seed``, without every task of the ``max_train_prompts`` sample that seed draws
(:func:`~exittrain.data.prompt_selection.unseen_tasks`); then a ``max_train_prompts`` sample under
``seed`` (:func:`~exittrain.data.prompt_selection.seeded_sample`).

The cache key hashes the target name, the prompt-set description (:func:`prompt_set_description`),
the training prompts and the generation settings (:func:`exittrain.data.regen_cache.cache_key`):
spelling any of them differently orphans every cache entry written before.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from exittrain.data.generation import GenerationConfig, chat_prompt_ids
from exittrain.data.prompt_selection import seeded_sample, unseen_tasks
from exittrain.data.regen_cache import cache_key, cache_path
from exittrain.data.regenerate import TargetProvider, regenerate
from exittrain.data.sources import DEFAULT_MAX_CHARS, DomainPrompts, PromptSource, load_domain
from exittrain.models.target_loading import EMBEDDED_TARGET_NAME

__all__ = [
    "LOADER_ARGS",
    "PromptPlan",
    "SourceSpecs",
    "check_sample_settings",
    "choose_train_prompts",
    "prompt_set_description",
]

logger = logging.getLogger(__name__)

SourceSpecs = Sequence[str | PromptSource | Mapping[str, Any]]

LOADER_ARGS = frozenset(
    {
        "target",
        "tokenizer",
        "max_length",
        "batch_size",
        "num_workers",
        "val_fraction",
        "progress",
        "feature_layers",
        "top_logprobs",
        "feature_store",
    }
)
"""The DataModule's arguments that choose neither the prompts nor the cache entry (its loaders', split's, store's)."""

_HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


def check_sample_settings(max_train_prompts: int | None, seed: int, exclude_seed: int | None) -> None:
    """Raise ValueError, naming the setting, for a ``max_train_prompts`` below 1 or an ``exclude_seed``
    without ``max_train_prompts`` or equal to ``seed``."""
    if max_train_prompts is not None and max_train_prompts < 1:
        raise ValueError(f"max_train_prompts={max_train_prompts} must be positive or None")
    if exclude_seed is not None and (max_train_prompts is None or exclude_seed == seed):
        raise ValueError(
            f"exclude_seed={exclude_seed}: leaves out the max_train_prompts sample of another seed; set "
            f"max_train_prompts and a seed other than {exclude_seed} (seed={seed})"
        )


def choose_train_prompts(
    dp: DomainPrompts, *, max_train_prompts: int | None, seed: int, exclude_seed: int | None = None
) -> list[str]:
    """The training prompts of ``dp`` a run uses: without the tasks of ``exclude_seed``'s sample (when
    set), then a sample of at most ``max_train_prompts`` under ``seed``; in ``dp.train``'s order."""
    check_sample_settings(max_train_prompts, seed, exclude_seed)
    train = list(dp.train)
    if exclude_seed is not None:
        unseen = unseen_tasks(train, dp.train_tasks(), max_train_prompts, exclude_seed)
        logger.info(
            "left out %d training prompts: the tasks of seed %d's sample (exclude_seed)",
            len(train) - len(unseen),
            exclude_seed,
        )
        train = unseen
    if max_train_prompts is not None and len(train) > max_train_prompts:
        keep = seeded_sample(len(train), max_train_prompts, seed)
        logger.info("using %d of %d training prompts (max_train_prompts)", len(keep), len(train))
        train = [train[i] for i in keep]
    return train


def prompt_set_description(
    dp: DomainPrompts,
    *,
    max_prompt_chars: int | None,
    max_train_prompts: int | None,
    seed: int,
    exclude_seed: int | None = None,
) -> str:
    """Where the training prompts came from and how they were chosen: part of the regeneration cache key.

    Its spelling is frozen: a change orphans every cache entry. ``exclude_seed`` appears only when
    set, so the entries of runs without it keep their keys."""
    return ";".join(
        [
            f"domain={dp.domain}",
            "train=" + "+".join(s.source for s in dp.train_stats),
            "eval=" + "+".join(s.source for s in dp.eval_stats),
            f"max_chars={max_prompt_chars}",
            f"max_train={max_train_prompts}",
            f"seed={seed}",
            *([f"exclude_seed={exclude_seed}"] if exclude_seed is not None else []),
        ]
    )


class PromptPlan:
    """The prompts of one data configuration and the cache entry of their answers.

    The sources are read on first use (:meth:`prompts`), once. The arguments are the DataModule's of
    the same names (:class:`~exittrain.data.datamodule.ExitTrainDataModule`):

    Args:
        domain: ``"dialogue"``, ``"code"`` or ``"math"`` (default sources in
            :data:`exittrain.data.sources.DOMAIN_SOURCES`); only a label when both source lists are given.
        train_sources, eval_sources: prompt source specs overriding the domain defaults.
        target_name: the target's hub id or path, or None for the embedded SmolLM2 target
            (:data:`~exittrain.models.target_loading.EMBEDDED_TARGET_NAME`); it keys the cache.
        cache_dir: folder of regenerated datasets.
        generation: :class:`~exittrain.data.regenerate.GenerationConfig` or a mapping of its fields.
        max_train_prompts: keep a seeded random sample of at most this many training prompts.
        seed: seed of the prompt sample.
        exclude_seed: leave out every task of the sample that ``max_train_prompts`` draws under this
            seed, before this run's own sample (both prompt forms of a CodeI/O task go together):
            data a warm start of seed ``exclude_seed`` never saw (``bench exittrain``'s fresh rows).
            None (the default) leaves nothing out.
        max_prompt_chars: prompts longer than this are rejected (counted) when sources are read.
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
        cache_dir: str | os.PathLike = "data/cache/regen",
        generation: GenerationConfig | Mapping[str, Any] | None = None,
        max_train_prompts: int | None = None,
        seed: int = 0,
        exclude_seed: int | None = None,
        max_prompt_chars: int | None = DEFAULT_MAX_CHARS,
        device: str | None = None,
    ) -> None:
        check_sample_settings(max_train_prompts, seed, exclude_seed)
        self.domain = domain
        self.train_sources = list(train_sources) if train_sources is not None else None
        self.eval_sources = list(eval_sources) if eval_sources is not None else None
        self.target_name = target_name or EMBEDDED_TARGET_NAME
        self.cache_dir = Path(cache_dir)
        self.device = device or "cpu"
        self.generation = GenerationConfig.coerce(generation).resolved(self.device)
        self.max_train_prompts = max_train_prompts
        self.seed = seed
        self.exclude_seed = exclude_seed
        self.max_prompt_chars = max_prompt_chars
        self._prompts: DomainPrompts | None = None

    @classmethod
    def from_data_args(cls, data: Mapping[str, Any], **overrides: Any) -> PromptPlan:
        """The plan of the DataModule arguments ``data`` (a fit config's ``cfg.data``, as a mapping), with
        ``overrides`` on top (``target_name``, ``device``). Hydra's keys (``_target_``...) and the
        loader-only arguments (:data:`LOADER_ARGS`) are ignored; an unknown name raises ValueError naming it."""
        args = {k: v for k, v in {**dict(data), **overrides}.items() if k not in _HYDRA_KEYS and k not in LOADER_ARGS}
        known = set(inspect.signature(cls).parameters)
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown data settings {unknown}; known: {sorted(known | LOADER_ARGS)}")
        return cls(**args)

    def prompts(self) -> DomainPrompts:
        """Train and eval prompts after cleaning, overlap removal, ``exclude_seed`` and ``max_train_prompts``."""
        if self._prompts is None:
            dp = load_domain(
                self.domain, train=self.train_sources, eval=self.eval_sources, max_chars=self.max_prompt_chars
            )
            dp.train = choose_train_prompts(
                dp, max_train_prompts=self.max_train_prompts, seed=self.seed, exclude_seed=self.exclude_seed
            )
            self._prompts = dp
        return self._prompts

    @property
    def train(self) -> list[str]:
        """The training prompts: what the regeneration answers, in the order of their ``prompt_index``."""
        return self.prompts().train

    def eval_texts(self, n: int | None = None) -> list[str]:
        """The first ``n`` evaluation prompts (all when None), never seen in training."""
        return self.prompts().eval[:n]

    def eval_ids(self, tokenizer: Any, n: int | None = None) -> list[list[int]]:
        """The first ``n`` evaluation prompts as chat-templated token ids ending with the assistant header,
        templated exactly like the training prompts (same ``generation.system_prompt``)."""
        return [chat_prompt_ids(tokenizer, p, self.generation.system_prompt) for p in self.eval_texts(n)]

    @property
    def prompt_set(self) -> str:
        """The prompt-set description of the cache key (:func:`prompt_set_description`)."""
        return prompt_set_description(
            self.prompts(),
            max_prompt_chars=self.max_prompt_chars,
            max_train_prompts=self.max_train_prompts,
            seed=self.seed,
            exclude_seed=self.exclude_seed,
        )

    @property
    def cache_key(self) -> str:
        """The hex key of the cache entry (:func:`exittrain.data.regen_cache.cache_key`)."""
        return cache_key(self.target_name, self.prompt_set, self.train, self.generation)

    @property
    def cache_path(self) -> Path:
        """Folder of the regenerated answers (it exists once the regeneration has run)."""
        return cache_path(self.cache_dir, self.target_name, self.prompt_set, self.train, self.generation)

    def regenerate(self, target: TargetProvider, **kwargs: Any) -> Any:
        """Fill :attr:`cache_path` with the target's answers to :attr:`train` unless it holds them already
        (:func:`exittrain.data.regenerate.regenerate`; ``target`` is called only then). ``kwargs``:
        ``progress``, ``feature_layers``, ``top_logprobs``. Returns the entry's dataset."""
        return regenerate(
            self.train,
            target,
            target_name=self.target_name,
            cache_dir=self.cache_dir,
            gen=self.generation,
            prompt_set=self.prompt_set,
            device=self.device,
            **kwargs,
        )
