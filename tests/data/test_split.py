"""The training and validation rows of a cache entry (exittrain.data.split), on a synthetic entry."""

from __future__ import annotations

import datasets
import pytest

from exittrain.data.prompts.prompt_sets import DomainPrompts, LoadStats
from exittrain.data.regen_cache import FEATURES, save_atomic
from exittrain.data.split import COLUMNS, split_entry, split_rows

# (n_prompt_tokens, n_response_tokens) of each row; prompts 2 and 5 fill max_length=6 alone
SHAPES = [(2, 3), (3, 1), (6, 2), (1, 8), (4, 4), (7, 1), (2, 2), (3, 3)]
TASKS = ["a", "a", "b", "c", "c", "d", "e", "f"]  # rows 0, 1 and rows 3, 4 pose one task each


def _entry(tmp_path):
    rows = []
    for i, (p, r) in enumerate(SHAPES):
        ids = list(range(10 * i, 10 * i + p + r))
        rows.append(
            {
                "prompt_index": i,
                "prompt": f"prompt {i}",
                "response": "",
                "input_ids": ids,
                "loss_mask": [0] * p + [1] * r,
                "n_prompt_tokens": p,
                "n_response_tokens": r,
                "finished": True,
            }
        )
    meta = {"pad_token_id": 0, "rows": len(rows), "rejected_too_long": 1, "unfinished": 0, "n_prompts": len(rows) + 1}
    path = tmp_path / "entry"
    save_atomic(datasets.Dataset.from_list(rows, features=FEATURES), path, meta)
    prompts = [f"prompt {i}" for i in range(len(SHAPES))]
    stats = LoadStats("jsonl:t.jsonl:text", task_keys=dict(zip(prompts, TASKS, strict=True)))
    return path, DomainPrompts("custom", prompts, ["an eval prompt"], [stats], [])


def test_split_entry_drops_full_prompts_keeps_tasks_whole_and_counts(tmp_path):
    path, dp = _entry(tmp_path)
    split = split_entry(path, dp, max_length=6, val_fraction=0.3, seed=0)
    val = list(split.val_set["prompt_index"])
    train = list(split.train_set["prompt_index"])
    assert sorted(val + train) == [0, 1, 3, 4, 6, 7], "rows whose prompt fills max_length are dropped"
    assert val == sorted(val) and train == sorted(train)
    assert not {TASKS[i] for i in val} & {TASKS[i] for i in train}, "a task sits on both sides"
    assert len(val) >= 2  # round(0.3 * 6) rows asked, whole tasks given
    assert split.pad_token_id == 0 and split.train_set.column_names == list(COLUMNS)
    assert split.stats == {
        "prompts": dp.to_dict(),
        "regeneration": {"rows": 8, "rejected_too_long": 1, "unfinished": 0, "n_prompts": 9},
        "truncation": {"rows": 8, "truncated": 4, "dropped_no_response": 2},
        "train_rows": len(train),
        "val_rows": len(val),
        "eval_prompts": 1,
        "cache_path": str(path),
    }
    assert list(split.rows("prompt_index")) == [(i,) for i in train + val]
    assert list(split_rows(split.train_set, None, "prompt_index")) == [(i,) for i in train]
    # the same seed, the same split; no validation rows without val_fraction
    assert list(split_entry(path, dp, max_length=6, val_fraction=0.3, seed=0).val_set["prompt_index"]) == val
    alone = split_entry(path, dp, max_length=6, val_fraction=0.0, seed=0)
    assert alone.val_set is None and alone.stats["val_rows"] == 0 and len(alone.train_set) == 6


def test_split_entry_refuses_rows_it_cannot_train_on(tmp_path):
    path, dp = _entry(tmp_path)
    with pytest.raises(ValueError, match="every prompt in .* is at least max_length=1 tokens; raise max_length"):
        split_entry(path, dp, max_length=1, val_fraction=0.0, seed=0)
    one_task = DomainPrompts("custom", dp.train, [], [LoadStats("s", task_keys=dict.fromkeys(dp.train, "t"))], [])
    with pytest.raises(ValueError, match="cannot give 2 validation rows and some training rows; lower val_fraction"):
        split_entry(path, one_task, max_length=6, val_fraction=0.3, seed=0)
