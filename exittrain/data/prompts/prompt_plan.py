"""Which prompts a run trains and evaluates on, and which regeneration cache entry holds the answers.

Lightning-free: :class:`~exittrain.data.datamodule.ExitTrainDataModule` delegates to it, and a
command that only prepares the data can call it with the DataModule's own arguments::

    plan = PromptPlan.from_data_args(cfg_data, target_name=target.name, device=str(target.device))
    plan.train                     # the chosen training prompts: what the regeneration answers
    plan.eval_ids(tokenizer, n)    # the first n evaluation prompts, chat-templated
    plan.cache_path                # the cache entry of the answers (regen_cache.cache_path)
    plan.regenerate(provider)      # fill it unless it is there (regenerate.regenerate)

The training prompts (:func:`choose_train_prompts`): the domain's sources, cleaned, without any
prompt equal to an evaluation prompt (:func:`exittrain.data.prompts.prompt_sets.load_domain`); then, with
``exclude_seed``, without every task of the sample of ``exclude_size`` (default
``max_train_prompts``) prompts that seed draws (:func:`~exittrain.data.prompts.selection.unseen_tasks`);
then a ``max_train_prompts`` sample under ``seed`` (:func:`~exittrain.data.prompts.selection.seeded_sample`).
:meth:`PromptPlan.held_out_tasks` names every task the plan holds out (``exclude_seed``'s and the
evaluation prompts'): the corpus rows a run trains beside the answers leave them out too
(:mod:`exittrain.data.corpus`).

The cache key hashes the target name, the prompt-set description (:func:`prompt_set_description`),
the training prompts and the generation settings (:func:`exittrain.data.regen_cache.cache_key`):
spelling any of them differently orphans every cache entry written before.

**Answered conversations.** When every training source is one of answered conversations
(``chat-json:`` / ``chat-hf:``, :mod:`exittrain.data.prompts.source_spec`), nothing is generated: the plan
reads the conversations (:func:`exittrain.data.conversations.load_conversation_set`), drops every
conversation with a user turn equal to an evaluation prompt (normalized text), samples them like
prompts (``exclude_seed``, ``max_train_prompts``, ``seed``: :func:`choose_train_indices`), and
:meth:`PromptPlan.regenerate` writes the brought entry (:func:`exittrain.data.brought.write_brought_entry`)
at :attr:`PromptPlan.cache_path` (:func:`~exittrain.data.brought.brought_cache_path`: the key hashes
the target, the description ``"brought;" + prompt_set_description``, the conversations and
``generation.dtype``). :attr:`PromptPlan.train` is then each chosen conversation's first user turn
(its task key for the validation split), and the evaluation prompts still come from the eval
sources (or the domain's). A list that mixes prompt sources and answered conversations is refused
(ValueError): answers the target wrote and answers brought from elsewhere are two entries, two runs.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from exittrain.data.answerers import resolve_backend
from exittrain.data.brought import brought_cache_key, brought_cache_path, write_brought_entry
from exittrain.data.conversations import Conversation, load_conversation_set
from exittrain.data.generation import GenerationConfig, chat_prompt_ids
from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES
from exittrain.data.prompts.prompt_sets import (
    DEFAULT_MAX_CHARS,
    DomainPrompts,
    load_domain,
    load_prompt_set,
    normalize_prompt,
    poses_eval_task,
)
from exittrain.data.prompts.selection import sampled_tasks, seeded_sample
from exittrain.data.prompts.source_spec import PromptSource
from exittrain.data.regen_cache import cache_key, cache_path
from exittrain.data.regenerate import TargetProvider, regenerate
from exittrain.models.target_loading import EMBEDDED_TARGET_NAME

__all__ = [
    "CORPUS_ARGS",
    "LOADER_ARGS",
    "PromptPlan",
    "SourceSpecs",
    "answered_sources",
    "check_sample_settings",
    "choose_train_indices",
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
        "vocab_size",
    }
)
"""The DataModule's arguments that choose neither the prompts nor the cache entry (its loaders', split's, store's)."""

CORPUS_ARGS = frozenset({"corpus_sources", "max_corpus_rows"})
"""The DataModule's arguments that choose the corpus rows trained beside the answers: their own entry
(:class:`exittrain.data.corpus.CorpusPlan`), not this plan's."""

_HYDRA_KEYS = frozenset({"_target_", "_partial_", "_recursive_", "_convert_", "_args_"})


def check_sample_settings(max_train_prompts: int | None, seed: int, exclude_seed: int | None,
                          exclude_size: int | None = None) -> None:
    """Raise ValueError, naming the setting, for a ``max_train_prompts`` below 1, an ``exclude_seed``
    without ``max_train_prompts`` or equal to ``seed``, or an ``exclude_size`` below 1 or without
    ``exclude_seed``."""
    if max_train_prompts is not None and max_train_prompts < 1:
        raise ValueError(f"max_train_prompts={max_train_prompts} must be positive or None")
    if exclude_size is not None and (exclude_seed is None or exclude_size < 1):
        raise ValueError(f"exclude_size={exclude_size}: the size of exclude_seed's sample to leave out needs "
                         f"exclude_seed set (exclude_seed={exclude_seed}) and a count >= 1; null = max_train_prompts")
    if exclude_seed is not None and ((max_train_prompts is None and exclude_size is None) or exclude_seed == seed):
        raise ValueError(
            f"exclude_seed={exclude_seed}: leaves out the max_train_prompts sample of another seed; set "
            f"max_train_prompts and a seed other than {exclude_seed} (seed={seed})"
        )


def answered_sources(specs: SourceSpecs | None) -> bool:
    """True when every spec of ``specs`` names answered conversations, False when none does (and for
    None: the domain's prompt sources). A list mixing both raises ValueError naming them."""
    if not specs:
        return False
    sources = [PromptSource.parse(s) for s in specs]
    if len({src.answered for src in sources}) > 1:
        answered, prompts = [str(s) for s in sources if s.answered], [str(s) for s in sources if not s.answered]
        raise ValueError(
            f"data.train_sources mixes answered conversations {answered} with prompt sources {prompts}; "
            "give either prompts for the target to answer or conversations answered elsewhere, and run the other "
            "set as another fit"
        )
    return sources[0].answered


def choose_train_indices(
    dp: DomainPrompts, *, max_train_prompts: int | None, seed: int, exclude_seed: int | None = None,
    exclude_size: int | None = None,
) -> list[int]:
    """The positions in ``dp.train`` of the training prompts a run uses: without the tasks of
    ``exclude_seed``'s sample of ``exclude_size`` prompts (when set; ``max_train_prompts`` when
    ``exclude_size`` is None; :func:`~exittrain.data.prompts.selection.unseen_tasks` by position),
    then a sample of at most ``max_train_prompts`` under ``seed``; ascending."""
    check_sample_settings(max_train_prompts, seed, exclude_seed, exclude_size)
    keep = list(range(len(dp.train)))
    if exclude_seed is not None:
        tasks = dp.train_tasks()
        size = max_train_prompts if exclude_size is None else exclude_size
        seen = sampled_tasks(tasks, size, exclude_seed)
        unseen = [i for i in keep if tasks[i] not in seen]
        logger.info(
            "left out %d training prompts: the tasks of seed %d's sample of %d (exclude_seed)",
            len(keep) - len(unseen),
            exclude_seed,
            size,
        )
        keep = unseen
    if max_train_prompts is not None and len(keep) > max_train_prompts:
        sample = seeded_sample(len(keep), max_train_prompts, seed)
        logger.info("using %d of %d training prompts (max_train_prompts)", len(sample), len(keep))
        keep = [keep[j] for j in sample]
    return keep


def choose_train_prompts(
    dp: DomainPrompts, *, max_train_prompts: int | None, seed: int, exclude_seed: int | None = None,
    exclude_size: int | None = None,
) -> list[str]:
    """The training prompts of ``dp`` a run uses (:func:`choose_train_indices`), in ``dp.train``'s order."""
    keep = choose_train_indices(dp, max_train_prompts=max_train_prompts, seed=seed, exclude_seed=exclude_seed,
                                exclude_size=exclude_size)
    return [dp.train[i] for i in keep]


def prompt_set_description(
    dp: DomainPrompts,
    *,
    max_prompt_chars: int | None,
    max_train_prompts: int | None,
    seed: int,
    exclude_seed: int | None = None,
    exclude_size: int | None = None,
) -> str:
    """Where the training prompts came from and how they were chosen: part of the regeneration cache key.

    Its spelling is frozen: a change orphans every cache entry. ``exclude_seed`` and ``exclude_size``
    appear only when set, so the entries of runs without them keep their keys."""
    return ";".join(
        [
            f"domain={dp.domain}",
            "train=" + "+".join(s.source for s in dp.train_stats),
            "eval=" + "+".join(s.source for s in dp.eval_stats),
            f"max_chars={max_prompt_chars}",
            f"max_train={max_train_prompts}",
            f"seed={seed}",
            *([f"exclude_seed={exclude_seed}"] if exclude_seed is not None else []),
            *([f"exclude_size={exclude_size}"] if exclude_size is not None else []),
        ]
    )


class PromptPlan:
    """The prompts of one data configuration and the cache entry of their answers.

    The sources are read on first use (:meth:`prompts`), once. The arguments are the DataModule's of
    the same names (:class:`~exittrain.data.datamodule.ExitTrainDataModule`):

    Args:
        domain: ``"dialogue"``, ``"code"`` or ``"math"`` (default sources in
            :data:`exittrain.data.prompts.domain_sources.DOMAIN_SOURCES`); only a label when both source
            lists are given.
        train_sources, eval_sources: prompt source specs overriding the domain defaults.
        target_name: the target's hub id or path, or None for the embedded SmolLM2 target
            (:data:`~exittrain.models.target_loading.EMBEDDED_TARGET_NAME`); it keys the cache.
        cache_dir: folder of regenerated datasets.
        generation: :class:`~exittrain.data.generation.GenerationConfig` or a mapping of its fields.
        max_train_prompts: keep a seeded random sample of at most this many training prompts.
        seed: seed of the prompt sample.
        exclude_seed: leave out every task of the sample that ``max_train_prompts`` draws under this
            seed, before this run's own sample (both prompt forms of a CodeI/O task go together):
            data a warm start of seed ``exclude_seed`` never saw (``bench exittrain``'s fresh rows).
            None (the default) leaves nothing out.
        exclude_size: the size of that sample, when the warm start drew another number of prompts
            than this run (None: ``max_train_prompts``).
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
        exclude_size: int | None = None,
        max_prompt_chars: int | None = DEFAULT_MAX_CHARS,
        device: str | None = None,
    ) -> None:
        check_sample_settings(max_train_prompts, seed, exclude_seed, exclude_size)
        self.domain = domain
        self.train_sources = list(train_sources) if train_sources is not None else None
        self.eval_sources = list(eval_sources) if eval_sources is not None else None
        self.target_name = target_name or EMBEDDED_TARGET_NAME
        self.cache_dir = Path(cache_dir)
        self.device = device or "cpu"
        self.generation = GenerationConfig.coerce(generation).resolved(self.device, remember_in=self.cache_dir)
        self.max_train_prompts = max_train_prompts
        self.seed = seed
        self.exclude_seed, self.exclude_size = exclude_seed, exclude_size
        self.max_prompt_chars = max_prompt_chars
        self.answered = answered_sources(self.train_sources)  # answered conversations: a brought entry
        self._prompts: DomainPrompts | None = None
        self._conversations: list[Conversation] | None = None  # the chosen ones, when answered
        self._left_out_by_sample = 0
        self._excluded_tasks: frozenset[str] = frozenset()  # the tasks exclude_seed leaves out, once prompts() ran
        self._keyed_generation: GenerationConfig | None = None

    @classmethod
    def from_data_args(cls, data: Mapping[str, Any], **overrides: Any) -> PromptPlan:
        """The plan of the DataModule arguments ``data`` (a fit config's ``cfg.data``, as a mapping), with
        ``overrides`` on top (``target_name``, ``device``). Hydra's keys (``_target_``...) and the
        loader-only arguments (:data:`LOADER_ARGS`) are ignored; an unknown name raises ValueError naming it."""
        skip = _HYDRA_KEYS | LOADER_ARGS | CORPUS_ARGS
        args = {k: v for k, v in {**dict(data), **overrides}.items() if k not in skip}
        known = set(inspect.signature(cls).parameters)
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown data settings {unknown}; known: {sorted(known | LOADER_ARGS | CORPUS_ARGS)}")
        return cls(**args)

    def prompts(self) -> DomainPrompts:
        """Train and eval prompts after cleaning, overlap removal, ``exclude_seed`` and ``max_train_prompts``."""
        if self._prompts is None and self.answered:
            self._prompts, self._conversations = self._brought()
        if self._prompts is None:
            dp = load_domain(
                self.domain, train=self.train_sources, eval=self.eval_sources, max_chars=self.max_prompt_chars
            )
            self._excluded_tasks = self._sampled_by_exclude_seed(dp)
            dp.train = choose_train_prompts(
                dp, max_train_prompts=self.max_train_prompts, seed=self.seed, exclude_seed=self.exclude_seed,
                exclude_size=self.exclude_size,
            )
            self._prompts = dp
        return self._prompts

    def _brought(self) -> tuple[DomainPrompts, list[Conversation]]:
        """The answered conversations a run trains on, and the domain's prompts they stand for (module docstring)."""
        eval_specs = self.eval_sources
        if eval_specs is None:
            if self.domain not in DOMAIN_SOURCES:
                raise ValueError(
                    f"domain {self.domain!r} has no default evaluation prompts; give data.eval_sources beside the "
                    f"answered conversations, or a domain of {sorted(DOMAIN_SOURCES)}"
                )
            eval_specs = DOMAIN_SOURCES[self.domain].eval
        eval_prompts, eval_stats, eval_rep = load_prompt_set(eval_specs, max_chars=self.max_prompt_chars)
        conversations, train_stats, train_rep = load_conversation_set(self.train_sources)
        held_out = {normalize_prompt(p) for p in eval_prompts}
        poses = poses_eval_task(train_stats, eval_stats)
        kept = [c for c in conversations if not c.asks_any(held_out) and not poses(c.prompt)]
        if len(kept) < len(conversations):
            logger.warning(
                "%s: dropped %d conversations with a user turn equal to an evaluation prompt or of its task",
                self.domain,
                len(conversations) - len(kept),
            )
        if not kept:
            raise ValueError(f"every conversation of {self.train_sources} asks an evaluation prompt; use other data")
        dp = DomainPrompts(
            domain=self.domain or "custom",
            train=[c.prompt for c in kept],
            eval=eval_prompts,
            train_stats=train_stats,
            eval_stats=eval_stats,
            overlap_removed=len(conversations) - len(kept),
            cross_source_duplicates={"train": train_rep, "eval": eval_rep},
        )
        self._excluded_tasks = self._sampled_by_exclude_seed(dp)
        chosen = choose_train_indices(
            dp, max_train_prompts=self.max_train_prompts, seed=self.seed, exclude_seed=self.exclude_seed,
            exclude_size=self.exclude_size,
        )
        dp.train = [dp.train[i] for i in chosen]
        self._left_out_by_sample = len(kept) - len(chosen)  # exclude_seed and max_train_prompts, for the metadata
        return dp, [kept[i] for i in chosen]

    def _sampled_by_exclude_seed(self, dp: DomainPrompts) -> frozenset[str]:
        """The tasks ``exclude_seed`` leaves out of ``dp.train`` (before the sample): none without it."""
        if self.exclude_seed is None:
            return frozenset()
        size = self.max_train_prompts if self.exclude_size is None else self.exclude_size
        return frozenset(sampled_tasks(dp.train_tasks(), size, self.exclude_seed))

    def held_out_tasks(self) -> frozenset[str]:
        """Every task no training row of this plan may pose, in any form: those ``exclude_seed`` leaves out
        and those of the evaluation prompts (:meth:`DomainPrompts.eval_tasks`); a task is a task set's key
        (``"codeio:<row>"``) or, for any other prompt, its text. Corpus rows trained beside this plan's
        answers leave them out too (:mod:`exittrain.data.corpus`)."""
        dp = self.prompts()
        return self._excluded_tasks | frozenset(dp.eval_tasks())

    def conversations(self) -> list[Conversation]:
        """The chosen answered conversations (row ``prompt_index`` i is the i-th); ValueError for a plan of prompts."""
        if not self.answered:
            raise ValueError("this plan's training sources are prompts, not answered conversations")
        self.prompts()
        assert self._conversations is not None
        return self._conversations

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
        """The prompt-set description of the cache key (:func:`prompt_set_description`; prefixed with
        ``brought;`` for answered conversations)."""
        return ("brought;" if self.answered else "") + prompt_set_description(
            self.prompts(),
            max_prompt_chars=self.max_prompt_chars,
            max_train_prompts=self.max_train_prompts,
            seed=self.seed,
            exclude_seed=self.exclude_seed,
            exclude_size=self.exclude_size,
        )

    @property
    def keyed_generation(self) -> GenerationConfig:
        """:attr:`generation` with the answering engine's version filled in, as the cache key reads it
        (:func:`~exittrain.data.answerers.resolve_backend`: asks ``.venv-vllm`` or the server once,
        for ``backend=vllm`` only)."""
        if self._keyed_generation is None:
            self._keyed_generation = resolve_backend(self.generation)
        return self._keyed_generation

    @property
    def cache_key(self) -> str:
        """The hex key of the cache entry (:func:`exittrain.data.regen_cache.cache_key`, or
        :func:`~exittrain.data.brought.brought_cache_key` for answered conversations)."""
        if self.answered:
            return brought_cache_key(self.target_name, self.prompt_set, self.conversations(), self.generation.dtype)
        return cache_key(self.target_name, self.prompt_set, self.train, self.keyed_generation)

    @property
    def cache_path(self) -> Path:
        """Folder of the regenerated answers, or of the brought conversations (it exists once
        :meth:`regenerate` has run)."""
        if self.answered:
            return brought_cache_path(
                self.cache_dir, self.target_name, self.prompt_set, self.conversations(), self.generation.dtype
            )
        return cache_path(self.cache_dir, self.target_name, self.prompt_set, self.train, self.keyed_generation)

    def regenerate(self, target: TargetProvider, **kwargs: Any) -> Any:
        """Fill :attr:`cache_path` with the target's answers to :attr:`train` unless it holds them already
        (:func:`exittrain.data.regenerate.regenerate`; ``target`` is called only then). ``kwargs``:
        ``progress``, ``feature_layers``, ``top_logprobs``, ``report_to``. Returns the entry's dataset, or None
        when this process answered its shard and the entry waits for the other shards
        (``generation.shard`` or the launcher's rank).

        For answered conversations it writes the brought entry instead
        (:func:`exittrain.data.brought.write_brought_entry`: rows and one teacher-forced target pass)."""
        if self.answered:
            dp = self.prompts()
            return write_brought_entry(
                self.conversations(),
                target,
                target_name=self.target_name,
                cache_dir=self.cache_dir,
                description=self.prompt_set,
                gen=self.generation,
                source_stats=dp.train_stats,
                removed={
                    "overlap_removed": dp.overlap_removed,
                    "cross_source_duplicates": dp.cross_source_duplicates["train"],
                    "left_out_by_sample": self._left_out_by_sample,
                },
                device=self.device,
                **kwargs,
            )
        return regenerate(
            self.train,
            target,
            target_name=self.target_name,
            cache_dir=self.cache_dir,
            gen=self.keyed_generation,
            prompt_set=self.prompt_set,
            device=self.device,
            **kwargs,
        )
