"""Prompt sets: the clean prompts of each source, counted, and each domain's training and evaluation sets.

A prompt source is named by a :class:`PromptSource` (or its spec string: the grammar is in
:mod:`exittrain.data.prompts.source_spec`) and read into a list of clean prompt strings by
:func:`load_prompts`. Every row that is read either becomes a prompt or is counted under a
rejection reason in :class:`LoadStats`; nothing disappears silently. The readers, the field paths
and templates, and the CodeI/O stubs are in :mod:`exittrain.data.prompts.source_reading`, and each
domain's default sources in :mod:`exittrain.data.prompts.domain_sources`. Import each name from the
module that defines it.

Rejection reasons (:data:`REJECT_REASONS`): ``blank_line`` (whitespace-only line in a JSON Lines
file), ``non_utf8`` (bytes that are not UTF-8), ``malformed`` (not valid JSON, or a row that is not an
object), ``missing_field``, ``not_string``, ``empty`` (blank text), ``too_long`` (more than
``max_chars`` characters or ``max_tokens`` tokens), ``duplicate`` (same normalized text as an earlier
row). A source that yields no prompt at all is an error, not an empty set.

Sources of answered conversations (``chat-json:``, ``chat-hf:``) and corpus rows (``corpus:``) are read
by :mod:`exittrain.data.conversations`; :func:`load_prompts` refuses them.

Training prompts never overlap evaluation prompts: :func:`remove_overlap` drops every training
prompt whose normalized text (:func:`normalize_prompt`) equals an evaluation prompt's, and
:func:`load_domain` applies it, drops every training prompt of a task an evaluation prompt poses in
another form (the task keys of :attr:`LoadStats.task_keys`: CodeI/O's description and stub), and
reports the count.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES
from exittrain.data.prompts.source_reading import read_texts, source_rows
from exittrain.data.prompts.source_spec import BUILTIN_SOURCES, PromptSource

__all__ = [
    "DEFAULT_MAX_CHARS",
    "REJECT_REASONS",
    "DomainPrompts",
    "LoadStats",
    "find_overlap",
    "load_domain",
    "load_prompt_set",
    "load_prompts",
    "normalize_prompt",
    "poses_eval_task",
    "remove_overlap",
]

logger = logging.getLogger(__name__)

REJECT_REASONS = (
    "blank_line",
    "non_utf8",
    "malformed",
    "missing_field",
    "not_string",
    "empty",
    "too_long",
    "duplicate",
)
DEFAULT_MAX_CHARS = 6000
_MAX_EXAMPLE_ROWS = 5


# ----------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    """What happened to every row of one source.

    ``rows`` counts rows read; ``kept + sum(rejected.values()) == rows``. ``dropped_by_limit`` counts
    clean prompts left out by ``limit`` (not a rejection). ``example_rows`` holds the first few row
    numbers (1-based lines for JSON Lines, 0-based indices otherwise) of each rejection reason.
    ``skipped`` is set when an optional source was not available. ``task_keys`` maps each kept
    prompt of a source whose rows are tasks posed in several forms (``BuiltinSource.task_set``)
    to ``"<task set>:<row>"``, so that every form of one task can stay on one side of a split;
    it is not part of :meth:`to_dict`.
    """

    source: str
    rows: int = 0
    kept: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECT_REASONS, 0))
    example_rows: dict[str, list[int]] = field(default_factory=dict)
    dropped_by_limit: int = 0
    skipped: str | None = None
    task_keys: dict[str, str] = field(default_factory=dict, repr=False)

    def reject(self, reason: str, row: int) -> None:
        assert reason in self.rejected, reason
        self.rejected[reason] += 1
        examples = self.example_rows.setdefault(reason, [])
        if len(examples) < _MAX_EXAMPLE_ROWS:
            examples.append(row)

    def mapping_rows(self, rows: Iterable[tuple[int, Any]]) -> Iterator[tuple[int, Mapping]]:
        """The ``(row number, row)`` pairs of a reader that are rows (mappings), each counted in
        :attr:`rows`; a reader's rejection reason (a string) or a non-mapping row is counted as rejected."""
        for row_no, row in rows:
            self.rows += 1
            if isinstance(row, str):  # a reader's rejection reason
                self.reject(row, row_no)
            elif not isinstance(row, Mapping):
                self.reject("malformed", row_no)
            else:
                yield row_no, row

    @property
    def n_rejected(self) -> int:
        return sum(self.rejected.values())

    def summary(self) -> str:
        if self.skipped:
            return f"{self.source}: skipped ({self.skipped})"
        bad = ", ".join(
            f"{reason}={n} (rows {self.example_rows.get(reason, [])})" for reason, n in self.rejected.items() if n
        )
        limit = f", {self.dropped_by_limit} left out by limit" if self.dropped_by_limit else ""
        return f"{self.source}: {self.rows} rows, kept {self.kept}{limit}; rejected {bad or 'none'}"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["task_keys"]
        return out


@dataclass
class DomainPrompts:
    """Training and evaluation prompts of a domain, disjoint by normalized text.

    ``overlap_removed`` training prompts were dropped because an evaluation prompt had the same
    normalized text; ``cross_source_duplicates`` prompts repeated one from an earlier source of the
    same side.
    """

    domain: str
    train: list[str]
    eval: list[str]
    train_stats: list[LoadStats]
    eval_stats: list[LoadStats]
    overlap_removed: int = 0
    cross_source_duplicates: dict[str, int] = field(default_factory=lambda: {"train": 0, "eval": 0})

    def train_tasks(self) -> list[str]:
        """One key per training prompt: prompts that pose the same task share it (the description
        and the stub of one CodeI/O row); any other prompt is its own task (its text)."""
        keys: dict[str, str] = {}
        for stats in self.train_stats:
            for prompt, key in stats.task_keys.items():
                keys.setdefault(prompt, key)
        return [keys.get(p, p) for p in self.train]

    def eval_tasks(self) -> set[str]:
        """The task keys of the evaluation prompts that pose a task of a task set (``"codeio:<row>"``): no
        training prompt or corpus row of one of these tasks is trained on, in any form."""
        return {key for stats in self.eval_stats for key in stats.task_keys.values()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "n_train": len(self.train),
            "n_eval": len(self.eval),
            "overlap_removed": self.overlap_removed,
            "cross_source_duplicates": dict(self.cross_source_duplicates),
            "train_stats": [s.to_dict() for s in self.train_stats],
            "eval_stats": [s.to_dict() for s in self.eval_stats],
        }


# ----------------------------------------------------------------------------------------------
# Normalized text
# ----------------------------------------------------------------------------------------------

_WS = re.compile(r"\s+")


def normalize_prompt(text: str) -> str:
    """The key two prompts are compared by: NFKC, case-folded, whitespace collapsed and stripped."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text)).strip().casefold()


def remove_overlap(train: Sequence[str], eval_prompts: Sequence[str]) -> tuple[list[str], int]:
    """Drop every training prompt whose normalized text equals an evaluation prompt's.

    Returns the kept training prompts (order preserved) and how many were dropped.
    """
    held_out = {normalize_prompt(p) for p in eval_prompts}
    kept = [p for p in train if normalize_prompt(p) not in held_out]
    return kept, len(train) - len(kept)


def poses_eval_task(train_stats: Sequence[LoadStats], eval_stats: Sequence[LoadStats]) -> Callable[[str], bool]:
    """A test of a training prompt (or a conversation's first user turn) read with ``train_stats``: True when it
    poses a task an evaluation prompt read with ``eval_stats`` poses, in any form (their
    :attr:`LoadStats.task_keys` agree: a CodeI/O stub against its description). Text overlap is
    :func:`remove_overlap`'s."""
    eval_tasks = {key for stats in eval_stats for key in stats.task_keys.values()}
    keys = {prompt: key for stats in train_stats for prompt, key in stats.task_keys.items()}
    return lambda prompt: bool(eval_tasks) and keys.get(prompt) in eval_tasks


def find_overlap(train: Iterable[str], eval_prompts: Iterable[str]) -> set[str]:
    """Normalized texts present on both sides (empty when the sets are disjoint)."""
    return {normalize_prompt(p) for p in train} & {normalize_prompt(p) for p in eval_prompts}


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def load_prompts(
    source: str | PromptSource | Mapping[str, Any],
    *,
    max_chars: int | None = DEFAULT_MAX_CHARS,
    max_tokens: int | None = None,
    tokenizer: Any = None,
) -> tuple[list[str], LoadStats]:
    """Read one source into clean prompts.

    Rows are validated in file order; a row is rejected and counted (see :class:`LoadStats`) when
    it cannot be decoded or parsed, is not an object, lacks the field, holds a non-string, holds only
    whitespace, is longer than ``max_chars`` characters or ``max_tokens`` tokens of ``tokenizer``
    (raw text, no chat template), or repeats an earlier prompt. Then ``limit`` keeps a seeded
    random sample, in file order.

    Returns:
        ``(prompts, stats)``; prompts are stripped, non-empty and distinct after normalization.

    Raises:
        ValueError: bad spec, missing file, unreadable JSON array, missing column, or no row left
            (the message names the source, the counts and the fix).
        ModuleNotFoundError: a ``pkg:`` source whose package is not installed (unless ``optional``).
    """
    src = PromptSource.parse(source)
    if src.answered:
        raise ValueError(
            f"{src} is a source of answered rows, not of prompts: it can only be one of data.train_sources, "
            "all of which must then be answered (exittrain.data.conversations), or of data.corpus_sources "
            "(exittrain.data.corpus); evaluation prompts come from prompt sources (json:, hf:, parquet:, pkg:)"
        )
    stats = LoadStats(source=str(src))
    if max_tokens is not None and tokenizer is None:
        raise ValueError(f"{src}: max_tokens={max_tokens} needs a tokenizer; pass tokenizer= or max_tokens=None")
    try:
        rows, fld = source_rows(src)
        first = list(_take(rows, 1))  # surfaces a missing package or file here
    except ModuleNotFoundError as e:
        if not src.optional:
            raise
        stats.skipped = str(e)
        logger.warning("prompt source %s skipped: %s", src, e)
        return [], stats

    prompts: list[str] = []
    seen: set[str] = set()
    task_set = BUILTIN_SOURCES[src.path].task_set if src.kind == "pkg" else None
    for row_no, row in stats.mapping_rows(_chain(first, rows)):
        got = read_texts(row, (fld,))
        if isinstance(got, str):  # a rejection reason
            stats.reject(got, row_no)
            continue
        (text,) = got
        if max_chars is not None and len(text) > max_chars:
            stats.reject("too_long", row_no)
            continue
        if max_tokens is not None and len(tokenizer(text, add_special_tokens=False)["input_ids"]) > max_tokens:
            stats.reject("too_long", row_no)
            continue
        key = normalize_prompt(text)
        if key in seen:
            stats.reject("duplicate", row_no)
            continue
        seen.add(key)
        prompts.append(text)
        if task_set is not None:
            stats.task_keys[text] = f"{task_set}:{row_no}"

    if not prompts:
        if stats.rows and stats.rejected["missing_field"] == stats.rows:
            first_row = next((r for _, r in first if isinstance(r, Mapping)), None)
            keys = list(first_row) if first_row is not None else []
            raise ValueError(
                f"prompt source {src}: field {fld!r} is missing from every row (first row's keys: {keys}); "
                "fix the FIELD part of the spec"
            )
        raise ValueError(
            f"prompt source {src} yielded no usable prompt: {stats.summary()}; fix the file or the limits "
            f"(max_chars={max_chars}, max_tokens={max_tokens})"
        )
    if src.limit is not None and len(prompts) > src.limit and not (src.kind == "pkg" and src.path == "gsm_symbolic"):
        keep = sorted(random.Random(src.seed).sample(range(len(prompts)), src.limit))
        stats.dropped_by_limit = len(prompts) - src.limit
        prompts = [prompts[i] for i in keep]
        stats.task_keys = {p: stats.task_keys[p] for p in prompts if p in stats.task_keys}
    stats.kept = len(prompts)
    log = logger.warning if stats.n_rejected - stats.rejected["duplicate"] else logger.info
    log("prompt source %s", stats.summary())
    return prompts, stats


def _take(it: Iterator[Any], n: int) -> Iterator[Any]:
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def _chain(first: list[Any], rest: Iterator[Any]) -> Iterator[Any]:
    yield from first
    yield from rest


def load_prompt_set(
    sources: Sequence[str | PromptSource | Mapping[str, Any]],
    **kwargs: Any,
) -> tuple[list[str], list[LoadStats], int]:
    """Load several sources and concatenate them in order.

    Keyword arguments go to :func:`load_prompts`. Returns ``(prompts, per-source stats, number of
    prompts dropped because an earlier source had the same normalized text)``.
    """
    if not sources:
        raise ValueError(
            "empty list of prompt sources; give at least one spec (see exittrain.data.prompts.prompt_sets)"
        )
    prompts: list[str] = []
    all_stats: list[LoadStats] = []
    seen: set[str] = set()
    repeats = 0
    for source in sources:
        got, stats = load_prompts(source, **kwargs)
        all_stats.append(stats)
        for p in got:
            key = normalize_prompt(p)
            if key in seen:
                repeats += 1
                continue
            seen.add(key)
            prompts.append(p)
    if repeats:
        logger.info("%d prompts repeated an earlier source and were dropped", repeats)
    return prompts, all_stats, repeats


def load_domain(
    domain: str | None = None,
    *,
    train: Sequence[str | PromptSource | Mapping[str, Any]] | None = None,
    eval: Sequence[str | PromptSource | Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> DomainPrompts:
    """Training and evaluation prompts of a domain, with overlaps removed from the training side.

    ``train`` / ``eval`` override the domain's defaults (:data:`DOMAIN_SOURCES`, the lists of its data
    config); with both given, ``domain`` is only a label. Keyword
    arguments go to :func:`load_prompts`.
    """
    train_specs, eval_specs = train, eval
    if train is None or eval is None:
        if domain is None:
            raise ValueError("load_domain needs a domain or both train= and eval= sources")
        if domain not in DOMAIN_SOURCES:
            raise ValueError(f"unknown domain {domain!r}; use one of {sorted(DOMAIN_SOURCES)} or give train= and eval=")
        defaults = DOMAIN_SOURCES[domain]
        train_specs = train if train is not None else defaults.train
        eval_specs = eval if eval is not None else defaults.eval
    eval_prompts, eval_stats, eval_rep = load_prompt_set(eval_specs, **kwargs)
    train_prompts, train_stats, train_rep = load_prompt_set(train_specs, **kwargs)
    train_prompts, removed = remove_overlap(train_prompts, eval_prompts)
    poses = poses_eval_task(train_stats, eval_stats)
    kept = [p for p in train_prompts if not poses(p)]
    removed += len(train_prompts) - len(kept)
    train_prompts = kept
    if removed:
        logger.warning("%s: dropped %d training prompts that equal evaluation prompts", domain, removed)
    if not train_prompts:
        raise ValueError(f"domain {domain}: every training prompt is also an evaluation prompt; use other sources")
    assert not find_overlap(train_prompts, eval_prompts)
    return DomainPrompts(
        domain=domain or "custom",
        train=train_prompts,
        eval=eval_prompts,
        train_stats=train_stats,
        eval_stats=eval_stats,
        overlap_removed=removed,
        cross_source_duplicates={"train": train_rep, "eval": eval_rep},
    )
