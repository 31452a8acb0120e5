"""The training and validation rows of one regenerated cache entry, and their statistics.

:func:`split_entry` opens the entry, drops the rows whose prompt alone fills ``max_length``,
shuffles the rest under ``seed`` and holds out ``val_fraction`` of them for a validation loss, whole
tasks at a time (:func:`~exittrain.data.prompts.selection.split_by_task`: both prompt forms of one
CodeI/O task land on the same side). Everything is counted in :attr:`EntrySplit.stats`.
:func:`corpus_train_rows` gives the training rows of a corpus entry trained beside them, without the
validation tasks.
Lightning-free; the DataModule's ``setup`` calls it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from exittrain.data.collate import TruncationStats, truncation_stats
from exittrain.data.prompts.prompt_sets import DomainPrompts
from exittrain.data.prompts.selection import split_by_task
from exittrain.data.regen_cache import read_meta

__all__ = ["COLUMNS", "EntrySplit", "check_loader_settings", "corpus_train_rows", "split_entry", "split_rows"]

logger = logging.getLogger(__name__)

COLUMNS = ("input_ids", "loss_mask", "n_prompt_tokens", "prompt_index")


def check_loader_settings(max_length: int, batch_size: int, val_fraction: float) -> None:
    """ValueError naming the argument unless the rows can be cut and batched as asked."""
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise ValueError(f"max_length={max_length!r} must be an integer >= 2 (tokens per training row)")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} must be a positive integer")
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) or not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
"""The columns a split keeps: what the collator reads (``prompt_index`` becomes ``row_id``)."""


def split_rows(train_set: datasets.Dataset | None, val_set: datasets.Dataset | None, *columns: str) -> Iterator[tuple]:
    """The zipped ``columns`` of every training row, then of every validation row."""
    for split in (train_set, val_set):
        if split is not None:
            yield from zip(*(split[c] for c in columns))


@dataclass
class EntrySplit:
    """The rows of one cache entry: ``train_set``, ``val_set`` (None without validation rows), the
    entry's ``pad_token_id`` and the counts of :func:`split_entry` (``stats``)."""

    train_set: datasets.Dataset
    val_set: datasets.Dataset | None
    pad_token_id: int
    stats: dict[str, Any] = field(default_factory=dict)

    def rows(self, *columns: str) -> Iterator[tuple]:
        """The zipped ``columns`` of every training row, then of every validation row."""
        return split_rows(self.train_set, self.val_set, *columns)


def _usable_rows(ds: datasets.Dataset, path: Path, max_length: int) -> tuple[list[int], TruncationStats]:
    """The rows of ``ds`` whose prompt leaves a response token under ``max_length``, and the truncation counts
    (logged); ValueError when no row is left."""
    n_prompt = ds["n_prompt_tokens"]
    n_total = [p + r for p, r in zip(n_prompt, ds["n_response_tokens"])]
    trunc = truncation_stats(n_prompt, n_total, max_length)
    usable = [i for i, p in enumerate(n_prompt) if p < max_length]
    if not usable:
        raise ValueError(f"every prompt in {path} is at least max_length={max_length} tokens; raise max_length")
    if trunc.truncated or trunc.no_response:
        logger.warning(
            "max_length=%d truncates %d of %d rows of %s; %d of them keep no response token and are dropped",
            max_length,
            trunc.truncated,
            trunc.rows,
            path.name,
            trunc.no_response,
        )
    return usable, trunc


def corpus_train_rows(
    path: Path, tasks: Sequence[str], *, max_length: int, held_out: Collection[str]
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """The training rows of the corpus entry at ``path`` (:mod:`exittrain.data.corpus`) and their counts.

    ``tasks[i]`` is the task key of the row with ``prompt_index`` i; a row whose task is in ``held_out``
    (the validation tasks of the answers it trains beside) is dropped, as is a row whose prompt alone
    fills ``max_length``. Every other row trains: the corpus entry holds out no validation rows of its
    own. ValueError when no row is left."""
    ds = datasets.load_from_disk(str(path))
    usable, trunc = _usable_rows(ds, path, max_length)
    index = ds["prompt_index"]
    rows = [i for i in usable if tasks[index[i]] not in held_out]
    if not rows:
        raise ValueError(
            f"every usable row of the corpus entry {path} poses a validation task of the answers it trains beside; "
            "add corpus rows, or lower data.val_fraction"
        )
    stats = {
        "rows": len(ds),
        "train_rows": len(rows),
        "validation_tasks_removed": len(usable) - len(rows),
        "truncation": {"rows": trunc.rows, "truncated": trunc.truncated, "dropped_no_response": trunc.no_response},
        "cache_path": str(path),
    }
    return ds.select_columns(list(COLUMNS)).select(rows, keep_in_memory=True), stats


def split_entry(path: Path, prompts: DomainPrompts, *, max_length: int, val_fraction: float, seed: int) -> EntrySplit:
    """The training and validation rows of the complete cache entry at ``path`` (see the module docstring).

    ``prompts`` are the prompts the entry answered (their ``train_tasks`` are indexed by the rows'
    ``prompt_index``). Raises ValueError when no row is shorter than ``max_length`` or when the
    validation rows would leave no training row.
    """
    ds = datasets.load_from_disk(str(path))
    meta = read_meta(path)
    usable, trunc = _usable_rows(ds, path, max_length)
    order = list(usable)
    random.Random(seed).shuffle(order)
    val_rows, train_rows = [], order
    if val_fraction > 0:
        asked = max(1, round(val_fraction * len(order)))
        tasks = prompts.train_tasks()  # indexed by prompt_index; only the split needs them
        val_rows, train_rows = split_by_task(order, [tasks[i] for i in ds["prompt_index"]], asked)
        if not train_rows:
            raise ValueError(
                f"{len(order)} usable rows cannot give {asked} validation rows and some training rows; "
                "lower val_fraction or add prompts"
            )
    ds = ds.select_columns(list(COLUMNS))
    val_set = ds.select(sorted(val_rows), keep_in_memory=True) if val_rows else None
    train_set = ds.select(sorted(train_rows), keep_in_memory=True)
    stats = {
        "prompts": prompts.to_dict(),
        "regeneration": {k: meta[k] for k in ("rows", "rejected_too_long", "unfinished", "n_prompts")},
        "truncation": {"rows": trunc.rows, "truncated": trunc.truncated, "dropped_no_response": trunc.no_response},
        "train_rows": len(train_set),
        "val_rows": len(val_rows),
        "eval_prompts": len(prompts.eval),
        "cache_path": str(path),
    }
    return EntrySplit(train_set, val_set, int(meta["pad_token_id"]), stats)
