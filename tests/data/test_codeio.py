"""CodeI/O tasks as function stubs: the layout of a HumanEval prompt, and rows without a main_solution."""

from __future__ import annotations

import gzip
import json

import pytest

from exittrain.data.prompts import source_reading
from exittrain.data.prompts.prompt_sets import (
    load_prompts,
)
from exittrain.data.prompts.source_reading import MissingField, codeio_stub


def test_codeio_stubs_are_the_tasks_as_functions_to_complete():
    stubs, stats = load_prompts("pkg:codeio_stub")
    tasks, _ = load_prompts("pkg:codeio")
    assert stats.kept == len(tasks) == 3000
    humaneval, _ = load_prompts("pkg:humaneval")
    header = "Complete the following Python function.\n\n```python\n"
    assert humaneval[0].startswith(header)  # the layout of the evaluation prompts
    for stub in stubs[:50]:
        assert stub.startswith(header) and stub.endswith('    """\n```')
        assert "\ndef main_solution(" in stub and "Input:" in stub and "Output:" in stub
        compile(stub.removeprefix(header).removesuffix("```"), "<stub>", "exec")  # a valid Python stub


def test_codeio_stub_keeps_imports_signature_and_the_task_as_docstring():
    row = {
        "task_description": "Add two numbers.",
        "input_output_spec": "Input:\n  `a` (int): first\n\nOutput:\n  `return` (int): the sum",
        "code_sample": "# packages\nimport math\nfrom typing import List\n\nclass Helper:\n    import os\n\n"
        "def main_solution(a,\n                  b=2) -> int:\n    return a + b\n",
    }
    assert codeio_stub(row) == (
        "import math\nfrom typing import List\n\n\n"
        "def main_solution(a,\n                  b=2) -> int:\n"
        '    """ Add two numbers.\n\n    Input:\n      `a` (int): first\n\n    Output:\n      `return` (int): the sum\n'
        '    """\n'
    )
    no_main = {**row, "code_sample": "def solve(a):\n    return a\n"}
    with pytest.raises(MissingField, match="main_solution"):
        codeio_stub(no_main)


def test_codeio_rows_without_a_main_solution_are_counted_as_missing_the_field(tmp_path, monkeypatch):

    rows = [
        {"task_description": "t", "input_output_spec": "s", "code_sample": "def main_solution(x):\n    pass\n"},
        {"task_description": "u", "input_output_spec": "s", "code_sample": "def other(x):\n    pass\n"},
    ]
    path = tmp_path / "codeio.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(source_reading, "builtin_path", lambda name: path)
    prompts, stats = load_prompts("pkg:codeio_stub")
    assert len(prompts) == 1 and stats.rejected["missing_field"] == 1 and stats.example_rows["missing_field"] == [2]
