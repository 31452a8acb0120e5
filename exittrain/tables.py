"""Markdown tables: the one builder behind every table exittrain prints or writes.

:func:`markdown_table` takes a header and rows of cells and returns the lines of a GitHub
markdown table; :func:`cell` formats one value, with ``-`` for a missing one. The report, the
held-out tables and every benchmark's ``to_markdown`` build their tables with these two.
:func:`write_results` writes a result and its table as ``<out>.json`` and ``<out>.md`` (every
benchmark and the serving check).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["markdown_table", "cell", "paired_cell", "write_results"]

MISSING = "-"


def cell(value: Any, fmt: str = "{:.2f}", missing: str = MISSING) -> str:
    """``value`` formatted with ``fmt``; ``missing`` for None (a value a row does not have)."""
    return missing if value is None else fmt.format(value)


def paired_cell(pair: dict | None) -> str:
    """A paired difference ``{"delta", "ci95": [low, high]}`` as ``+0.012 (-0.004 to +0.031)``; ``-`` for None."""
    if pair is None:
        return MISSING
    return f"{pair['delta']:+.3f} ({pair['ci95'][0]:+.3f} to {pair['ci95'][1]:+.3f})"


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    """The lines of a markdown table: ``| a | b |``, ``|---|---|``, then one line per row.

    Cells are written with ``str``; format numbers first (:func:`cell`). ValueError when a row has
    another number of cells than the header, naming the row.
    """
    width = len(header)
    if width == 0:
        raise ValueError("a markdown table needs at least one column")
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * width]
    for i, row in enumerate(rows):
        row = list(row)
        if len(row) != width:
            raise ValueError(f"table row {i} has {len(row)} cells for {width} columns: {row!r}")
        lines.append("| " + " | ".join(map(str, row)) + " |")
    return lines


def write_results(out: str, result: dict, markdown: str) -> None:
    """Write ``<out>.json`` and ``<out>.md`` (creating the folder) and print the table."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(result, indent=2))
    path.with_suffix(".md").write_text(markdown)
    print(markdown)
