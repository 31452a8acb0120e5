"""Corpus rows beside the target's own answers: existing text, labelled by one target pass, no generation.

A run's training rows can come from two cache entries at once: the target's answers to the plan's
prompts (:class:`~exittrain.data.prompts.prompt_plan.PromptPlan`, the regenerated entry) and
``data.corpus_sources``, answered rows read from elsewhere (``corpus:NAME``: text an installed package
ships with its reference answer, or ``chat-json:`` / ``chat-hf:`` conversations;
:mod:`exittrain.data.prompts.source_spec`). The corpus rows get a brought entry of their own
(:func:`exittrain.data.brought.write_brought_entry`): rendered with the chat template, then one
teacher-forced target pass keeps the same top-k soft labels and features a regenerated entry keeps,
in the same layout. Labelling a row costs one prefill; answering a prompt costs one target forward per
generated token.

**Which corpus rows** (:class:`CorpusPlan`): the sources' rows (cleaned and counted,
:func:`~exittrain.data.conversations.load_conversation_set`), without

- every row with a user turn equal (normalized text) to an evaluation prompt of the plan;
- every row of a task the plan holds out (:meth:`PromptPlan.held_out_tasks`): the tasks ``exclude_seed``
  leaves out of the regenerated prompts and the tasks of the evaluation prompts, in any form (a
  CodeI/O row is keyed ``codeio:<line>`` as a prompt and as a corpus row), so a held-out task is
  held out of the corpus rows too;

then a sample of at most ``max_corpus_rows`` under the plan's ``seed``
(:func:`~exittrain.data.prompts.selection.seeded_sample`). Every count is in the entry's metadata
(``removed``). The entry's key hashes the target, the description (sources, sample size, seed), the
chosen rows' turns, the pass's dtype and the run's ``max_length``, to which rows are cut before the
pass (:func:`~exittrain.data.brought.brought_cache_key`): another held-out set chooses other rows and
so another entry.

**Which rows train** (:func:`exittrain.data.split.corpus_train_rows`): every corpus row is a training
row, except a row whose task is one of the regenerated entry's validation tasks (dropped, counted),
so the validation loss stays on tasks no training row poses. The corpus rows join the regenerated
training rows with row ids shifted past every regenerated row (by the plan's prompt count:
:func:`shift_row_ids`), and :class:`JoinedStore` serves both entries' features and soft labels under those ids.

Limits: like every brought entry, the pass is neither split across ranks nor resumable (each rank that
misses the entry writes it whole; the first rename wins). ``exclude_seed`` leaves out the tasks of the
regenerated sample of that seed; a warm start that was itself trained on corpus rows saw corpus tasks
beyond those, which this does not track.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from exittrain.data.brought import brought_cache_path, write_brought_entry
from exittrain.data.conversations import Conversation, load_conversation_set
from exittrain.data.feature_store import FeatureStore
from exittrain.data.prompts.prompt_plan import PromptPlan, SourceSpecs
from exittrain.data.prompts.prompt_sets import LoadStats, normalize_prompt
from exittrain.data.prompts.selection import seeded_sample
from exittrain.data.prompts.source_spec import PromptSource

__all__ = ["CorpusPlan", "JoinedStore", "check_corpus_settings", "shift_row_ids"]

logger = logging.getLogger(__name__)


def check_corpus_settings(corpus_sources: SourceSpecs | None, max_corpus_rows: int | None) -> None:
    """ValueError naming the key unless every spec of ``corpus_sources`` is an answered source and
    ``max_corpus_rows`` is None or a positive integer (nothing is read)."""
    if max_corpus_rows is not None and (
        isinstance(max_corpus_rows, bool) or not isinstance(max_corpus_rows, int) or max_corpus_rows < 1
    ):
        raise ValueError(f"max_corpus_rows={max_corpus_rows!r} must be a positive integer or null (every row)")
    for spec in corpus_sources or ():
        src = PromptSource.parse(spec)
        if not src.answered:
            raise ValueError(
                f"corpus_sources: {src} is a prompt source; corpus rows carry their answer: use corpus:NAME "
                "(corpus:codeio, corpus:codeio_stub, corpus:gsm_symbolic), chat-json:PATH or chat-hf:REPO:SPLIT, "
                "and put prompts for the target to answer in train_sources"
            )
    if max_corpus_rows is not None and not corpus_sources:
        raise ValueError(f"max_corpus_rows={max_corpus_rows} without corpus_sources; list the corpus sources too")


class CorpusPlan:
    """The corpus rows a run trains on beside the answers of ``plan`` (module docstring), and their entry.

    Args:
        plan: the run's plan of regenerated prompts: its evaluation prompts, held-out tasks, seed,
            target, cache folder and generation dtype apply to the corpus rows too.
        sources: answered source specs (``corpus:NAME``, ``chat-json:``, ``chat-hf:``).
        max_rows: keep a seeded sample of at most this many rows (None: every row left).
        max_tokens: cut every row to this many tokens before it is labelled (the run's ``max_length``:
            training reads no further; :func:`~exittrain.data.brought.write_brought_entry`); None: whole rows.
    """

    def __init__(
        self, plan: PromptPlan, sources: SourceSpecs, max_rows: int | None = None, max_tokens: int | None = None
    ) -> None:
        if not sources:
            raise ValueError("corpus_sources is empty: give at least one corpus:NAME, chat-json: or chat-hf: spec")
        check_corpus_settings(sources, max_rows)
        self.plan, self.sources, self.max_rows, self.max_tokens = plan, list(sources), max_rows, max_tokens
        self._chosen: tuple[list[Conversation], list[str], list[LoadStats], dict[str, int]] | None = None

    def _choose(self) -> tuple[list[Conversation], list[str], list[LoadStats], dict[str, int]]:
        if self._chosen is None:
            conversations, stats, repeats = load_conversation_set(self.sources)
            keys = {p: k for s in stats for p, k in s.task_keys.items()}
            tasks = [keys.get(c.prompt, c.prompt) for c in conversations]
            eval_texts = {normalize_prompt(p) for p in self.plan.prompts().eval}
            held = self.plan.held_out_tasks()
            keep = [i for i, c in enumerate(conversations) if not c.asks_any(eval_texts)]
            overlap = len(conversations) - len(keep)
            kept = [i for i in keep if tasks[i] not in held]
            held_out = len(keep) - len(kept)
            if not kept:
                raise ValueError(
                    f"corpus_sources {self.sources}: every row asks an evaluation prompt or a held-out task "
                    f"({overlap} and {held_out}); use other corpus sources or hold out fewer tasks"
                )
            sample = [kept[j] for j in seeded_sample(len(kept), self.max_rows, self.plan.seed)]
            removed = {"overlap_removed": overlap, "held_out_tasks": held_out, "cross_source_duplicates": repeats,
                       "left_out_by_sample": len(kept) - len(sample)}
            for name, n in removed.items():
                if n and name != "left_out_by_sample":
                    logger.info("corpus rows: %d left out (%s)", n, name)
            self._chosen = [conversations[i] for i in sample], [tasks[i] for i in sample], stats, removed
        return self._chosen

    def conversations(self) -> list[Conversation]:
        """The chosen corpus rows: row ``prompt_index`` i of the entry is the i-th."""
        return self._choose()[0]

    def tasks(self) -> list[str]:
        """The task key of every chosen row (a task set's ``"codeio:<line>"``, else the row's prompt)."""
        return self._choose()[1]

    @property
    def description(self) -> str:
        """Where the corpus rows came from and how they were chosen: part of the entry's key."""
        return ";".join(
            [
                "corpus",
                "sources=" + "+".join(str(PromptSource.parse(s)) for s in self.sources),
                f"max_rows={self.max_rows}",
                f"seed={self.plan.seed}",
                "beside=" + self.plan.prompt_set,
            ]
        )

    @property
    def cache_path(self) -> Path:
        """Folder of the corpus rows' entry (exists once :meth:`write` has run)."""
        plan = self.plan
        return brought_cache_path(
            plan.cache_dir, plan.target_name, self.description, self.conversations(), plan.generation.dtype,
            self.max_tokens,
        )

    def write(self, target: Any, **kwargs: Any) -> datasets.Dataset:
        """The corpus rows' entry, from the cache or written now by one teacher-forced pass of ``target`` (a
        callable returning ``(model, tokenizer)``, called only when the entry is missing). ``kwargs``:
        ``progress``, ``feature_layers``, ``top_logprobs``, ``report_to`` (:func:`write_brought_entry`)."""
        conversations, _, stats, removed = self._choose()
        plan = self.plan
        return write_brought_entry(
            conversations, target, target_name=plan.target_name, cache_dir=plan.cache_dir,
            description=self.description, gen=plan.generation, source_stats=stats, removed=removed,
            device=plan.device, max_tokens=self.max_tokens, **kwargs,
        )


def shift_row_ids(rows: datasets.Dataset, shift: int) -> datasets.Dataset:
    """``rows`` with ``shift`` added to every ``prompt_index`` (the collator's row ids), in memory."""
    shifted = [int(i) + shift for i in rows["prompt_index"]]
    return rows.remove_columns("prompt_index").add_column("prompt_index", shifted)


class JoinedStore:
    """The stores of the regenerated entry and of the corpus entry as one, for the
    :class:`~exittrain.data.collate.Collator`: a row id below ``shift`` is the first entry's, any other
    the corpus entry's row ``id - shift``. Both must serve the same things (features of the same layers,
    soft labels of the same width); ValueError naming the entry otherwise. Picklable like its stores."""

    def __init__(self, answers: FeatureStore, corpus: FeatureStore, shift: int) -> None:
        if (answers.feature_layers, answers.top_k) != (corpus.feature_layers, corpus.top_k):
            raise ValueError(
                f"the corpus entry {corpus.path} keeps features of layers {corpus.feature_layers} and top-"
                f"{corpus.top_k} log-probabilities, the answers' entry {answers.path} layers "
                f"{answers.feature_layers} and top-{answers.top_k}; delete the entry that lacks them to write it again"
            )
        self.answers, self.corpus, self.shift = answers, corpus, shift
        self.feature_layers, self.top_k, self.mode = answers.feature_layers, answers.top_k, answers.mode

    @property
    def has_features(self) -> bool:
        return self.answers.has_features

    @property
    def has_top_logprobs(self) -> bool:
        return self.answers.has_top_logprobs

    def __len__(self) -> int:
        return len(self.answers) + len(self.corpus)

    def summary(self) -> dict[str, Any]:
        return {**self.answers.summary(), "corpus_rows": len(self.corpus)}

    def _of(self, row_id: int) -> tuple[FeatureStore, int]:
        row_id = int(row_id)
        return (self.answers, row_id) if row_id < self.shift else (self.corpus, row_id - self.shift)

    def check_tokens(self, row_id: int, ids: Sequence[int]) -> None:
        store, r = self._of(row_id)
        store.check_tokens(r, ids)

    def features(self, row_id: int) -> torch.Tensor:
        store, r = self._of(row_id)
        return store.features(r)

    def top_logprobs(self, row_id: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        store, r = self._of(row_id)
        return store.top_logprobs(r)
