"""The prompt text of a row: a dotted field path, or a template of ``{dotted.path}`` placeholders.

``FIELD`` of a prompt source (:mod:`exittrain.data.source_spec`) is a dotted path into a row, where
integers index lists (``conversations.0.value``), or a template with ``{dotted.path}`` placeholders
that builds the prompt from several fields (``"[{tag}] {q.turns.0}"``). A missing key raises
:class:`MissingField`, a value that is not text ``TypeError``, bytes that are not UTF-8
``UnicodeDecodeError``: :func:`exittrain.data.sources.load_prompts` counts each under its own
rejection reason.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

__all__ = ["MissingField", "as_text", "extract", "field_roots", "lookup"]


class MissingField(Exception):
    """A row lacks a field the prompt needs."""


def lookup(row: Any, path: str) -> Any:
    value = row
    for part in path.split("."):
        if isinstance(value, Mapping) and part in value:
            value = value[part]
        elif isinstance(value, list | tuple) and part.lstrip("-").isdigit() and -len(value) <= int(part) < len(value):
            value = value[int(part)]
        else:
            raise MissingField(path)
    return value


def as_text(value: Any) -> str:
    """A field value as text; raises TypeError (not a string) or UnicodeDecodeError (bad bytes)."""
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if not isinstance(value, str):
        raise TypeError(type(value).__name__)
    return value


def extract(row: Mapping[str, Any], fld: str) -> str:
    """The prompt text of a row: a dotted path, or a template of ``{dotted.path}`` placeholders."""
    if "{" not in fld:
        return as_text(lookup(row, fld))
    pieces = []
    for literal, name, _spec, _conv in string.Formatter().parse(fld):
        pieces.append(literal)
        if name is not None:
            pieces.append(as_text(lookup(row, name)))
    return "".join(pieces)


def field_roots(fld: str) -> list[str]:
    """Top-level keys a field path or template reads (for column checks)."""
    if "{" not in fld:
        return [fld.split(".")[0]]
    return [name.split(".")[0] for _, name, _, _ in string.Formatter().parse(fld) if name]
