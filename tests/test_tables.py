"""exittrain.tables: the one markdown table builder."""

import pytest

from exittrain.tables import cell, markdown_table


def test_markdown_table_lines():
    lines = markdown_table(["B", "tau"], [[8, cell(1.234)], [16, cell(None)]])
    assert lines == ["| B | tau |", "|---|---|", "| 8 | 1.23 |", "| 16 | - |"]


def test_a_row_of_the_wrong_width_names_the_row():
    with pytest.raises(ValueError, match=r"table row 1 has 3 cells for 2 columns"):
        markdown_table(["a", "b"], [[1, 2], [1, 2, 3]])
    with pytest.raises(ValueError, match="at least one column"):
        markdown_table([], [])


def test_cells():
    assert cell(2.0, "{:.2f}x") == "2.00x" and cell(0.0) == "0.00" and cell(None, missing="n/a") == "n/a"
