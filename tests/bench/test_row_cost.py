"""bench rows: a target forward timed per row count, each over the same cached context."""

from __future__ import annotations

import pytest
import torch

from exittrain.bench import row_cost
from exittrain.bench.row_cost import check_counts, context_ids, forward_ms, run, to_markdown


def test_counts_are_sorted_distinct_and_checked():
    assert check_counts([4, 1, 4, 2], "--rows") == [1, 2, 4]
    for bad in ([], [0, 2], [1.5]):
        with pytest.raises(ValueError, match="--rows"):
            check_counts(bad, "--rows")


def test_context_joins_the_prompts_and_names_the_fix():
    assert context_ids([[1, 2], [3, 4, 5]], 4) == [1, 2, 3, 4]
    with pytest.raises(ValueError, match="--contexts 9"):
        context_ids([[1, 2], [3]], 9)


def test_every_forward_sees_the_same_context(tiny_llama_target, one_thread):
    target = tiny_llama_target
    ids = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    seen = []

    def record(module, args, kwargs):  # the decoder stack, which the step and the tree forward both run
        cache = next(v for v in kwargs.values() if hasattr(v, "get_seq_length"))
        seen.append((cache.get_seq_length(), kwargs["input_ids"].shape[1]))

    handle = target.model.model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        ms = forward_ms(target, ids, [1, 3, 5], repeats=2)
    finally:
        handle.remove()
    assert set(ms) == {"1", "3 on", "5 on"} and all(v > 0 for v in ms.values())
    # the prefill, then one warm-up pass and two timed ones, the counts interleaved; each forward
    # sees the 11 ids before the root, and scores its rows
    assert seen == [(0, 11)] + [(11, 1), (11, 3), (11, 5)] * 3


def test_table_gives_each_count_against_one_row():
    result = {"host": {"cpu_model": "X", "cpu_units": "none", "cpu_capability": "AVX2", "threads": 2,
                       "torch": "2"}, "set": "code", "repeats": 3, "rows": [1, 2],
              "contexts": [{"context": 300, "ms": {"1": 50.0, "2 on": 80.0}}]}
    table = to_markdown(result)
    assert "| 300 | 50.0 ms | 80.0 ms (1.60x) |" in table and "capability AVX2" in table


def test_packed_and_unpacked_trees_stand_side_by_side_with_the_buckets_below():
    result = {"host": {"cpu_model": "X", "cpu_units": "none", "cpu_capability": "AVX2", "threads": 2,
                       "torch": "2"}, "set": "code", "repeats": 3, "rows": [1, 4], "packed": ["on", "off"],
              "contexts": [{"context": 100, "ms": {"1": 50.0, "4 on": 60.0, "4 off": 90.0}}],
              "packed_buckets": [{"rows": 4, "timed_rows": 3, "linears": 7, "packed": True, "linear_ms": 9.0,
                                  "packed_ms": 5.5}]}
    table = to_markdown(result)
    assert "| context | 1 row | 4 rows, on | 4 rows, off |" in table
    assert "| 100 | 50.0 ms | 60.0 ms (1.20x) | 90.0 ms (1.80x) |" in table
    assert "| 4 | 3 | 9.0 | 5.5 | yes |" in table


def test_each_packing_mode_is_timed_for_every_tree(tiny_llama_target, one_thread):
    target = tiny_llama_target
    ids = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    ms = forward_ms(target, ids, [1, 4], repeats=1, packed=("on", "off"))
    assert set(ms) == {"1", "4 on", "4 off"}


def test_bad_arguments_fail_before_the_target_loads(monkeypatch):
    monkeypatch.setattr("exittrain.models.load_target", lambda *a, **k: pytest.fail("loaded the target"))
    with pytest.raises(ValueError, match="--repeats"):
        run([1, 2], [100], 0, "code", None)
    with pytest.raises(ValueError, match="--sets"):
        run([1, 2], [100], 3, "poetry", None)
    with pytest.raises(ValueError, match="--contexts"):
        run([1], [0], 3, "code", None)
    assert row_cost.DEFAULT_ROWS[0] == 1  # the greedy step is the table's yardstick


def test_attention_modes_cross_the_packing_modes_and_keep_the_old_keys(tiny_llama_target, one_thread):
    target = tiny_llama_target
    ids = torch.randint(0, target.vocab_size, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    ms = forward_ms(target, ids, [1, 3], repeats=1, packed=("on", "off"), attention=("grouped", "repeated"))
    assert set(ms) == {"1", "3 on", "3 off", "3 on repeated", "3 off repeated"}
    result = {"host": {"cpu_model": "X", "cpu_units": "none", "cpu_capability": "AVX2", "threads": 2,
                       "torch": "2"}, "set": "code", "repeats": 1, "rows": [1, 3], "packed": ["on"],
              "attention": ["grouped", "repeated"],
              "contexts": [{"context": 100, "ms": {"1": 50.0, "3 on": 55.0, "3 on repeated": 65.0}}]}
    table = to_markdown(result)
    assert "| context | 1 row | 3 rows, grouped | 3 rows, repeated |" in table
    assert "| 100 | 50.0 ms | 55.0 ms (1.10x) | 65.0 ms (1.30x) |" in table and "attention: grouped, repeated" in table
