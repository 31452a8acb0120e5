"""CodeI/O tasks as function stubs to complete (the ``pkg:codeio_stub`` prompt set).

A CodeI/O row (``reasoning_gym``'s ``codeio.jsonl.gz``) holds a task description, an input/output
spec and a code sample defining ``main_solution``. :func:`codeio_stub` turns it into the layout of
a HumanEval prompt: the sample's imports, then the signature with the task as its docstring.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from exittrain.data.source_fields import MissingField, as_text, lookup

__all__ = ["codeio_stub", "with_stubs"]


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
