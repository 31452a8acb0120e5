"""The serving check's arithmetic: vLLM counters, output agreement, our counters, the table."""

from __future__ import annotations

import pytest

from exittrain.serve.compare import acceptance_from_metrics, compare_outputs, our_acceptance, to_markdown


def _counter(name, value, engine="0"):
    return {"name": name, "kind": "Counter", "labels": {"engine": engine}, "value": value}


def test_acceptance_sums_engines_and_reads_total_suffix():
    metrics = [
        _counter("vllm:spec_decode_num_drafts", 10),
        _counter("vllm:spec_decode_num_drafts_total", 6, engine="1"),
        _counter("vllm:spec_decode_num_accepted_tokens", 20),
        _counter("vllm:spec_decode_num_accepted_tokens", 4, engine="1"),
        _counter("vllm:spec_decode_num_draft_tokens", 112),
        {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "kind": "Vector", "labels": {}, "values": [9, 5]},
        {"name": "vllm:spec_decode_num_accepted_tokens_per_pos", "kind": "Vector", "labels": {}, "values": [3, 2, 1]},
        _counter("vllm:prompt_tokens", 999),  # unrelated counters are ignored
    ]
    acc = acceptance_from_metrics(metrics)
    assert acc["drafts"] == 16 and acc["accepted_tokens"] == 24 and acc["draft_tokens"] == 112
    assert acc["accepted_per_position"] == [12, 7, 1]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 24 / 16)


def test_acceptance_without_drafts_names_the_fix():
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        acceptance_from_metrics([_counter("vllm:prompt_tokens", 5)])
    with pytest.raises(ValueError, match="drafted nothing"):
        acceptance_from_metrics([_counter("vllm:spec_decode_num_drafts", 0)])
    with pytest.raises(ValueError, match="no numeric value"):
        acceptance_from_metrics([{"name": "vllm:spec_decode_num_drafts", "labels": {}}])
    with pytest.raises(ValueError, match="record 0"):
        acceptance_from_metrics([["vllm:spec_decode_num_drafts", 3]])


def test_compare_outputs_finds_first_mismatch_and_length_differences():
    ref = [[1, 2, 3], [4, 5, 6, 7], [8]]
    same = compare_outputs(ref, [list(r) for r in ref])
    assert same["equal"] and same["prompts_equal"] == 3 and same["tokens_agreeing"] == same["tokens"] == 8
    diff = compare_outputs(ref, [[1, 2, 3], [4, 9, 6, 7], [8, 0]])
    assert not diff["equal"]
    assert diff["first_mismatch"] == [None, 1, 1]  # a longer candidate mismatches where the reference ends
    assert diff["prompts_equal"] == 1 and diff["tokens_agreeing"] == 3 + 1 + 1
    with pytest.raises(ValueError, match="same prompt list"):
        compare_outputs(ref, ref[:2])


def test_our_acceptance_counts_like_vllm():
    acc = our_acceptance([[0, 3, 7], [1]], num_draft_tokens=7)
    assert acc["drafts"] == 4 and acc["accepted_tokens"] == 11 and acc["draft_tokens"] == 28
    # position k counts the rounds that accepted more than k draft tokens
    assert acc["accepted_per_position"] == [3, 2, 2, 1, 1, 1, 1]
    assert acc["mean_acceptance_length"] == pytest.approx(1 + 11 / 4)
    with pytest.raises(ValueError, match="outside"):
        our_acceptance([[8]], num_draft_tokens=7)
    with pytest.raises(ValueError, match="no decoding rounds"):
        our_acceptance([[], []], num_draft_tokens=7)


def test_markdown_shows_both_acceptance_lengths():
    agree = compare_outputs([[1, 2]], [[1, 2]])
    vllm_acc = acceptance_from_metrics([_counter("vllm:spec_decode_num_drafts", 4),
                                        _counter("vllm:spec_decode_num_accepted_tokens", 2)])
    result = {
        "vllm_version": "0.32.0", "target": "t", "drafter": "d", "drafter_kind": "given", "domain": "code",
        "max_tokens": 2, "num_speculative_tokens": 7, "host": {"cpu": "cpu", "capability": "AVX2", "threads": 2},
        "agreement": {k: agree for k in ("vllm_dflash_vs_plain", "hf_greedy_vs_vllm_plain",
                                         "ours_exittrain_vs_vllm_plain", "ours_exittrain_vs_hf_greedy")},
        "vllm_acceptance": vllm_acc,
        "ours": {"greedy_seconds": 1.0,
                 "runs": {"exittrain": {"acceptance": our_acceptance([[1, 0, 0, 1]], 7), "seconds": 1.0}}},
        "vllm_plain": {"startup_s": 30.0, "generate_s": 2.0},
        "vllm_dflash": {"startup_s": 40.0, "generate_s": 3.0},
    }
    text = to_markdown(result)
    assert "| vLLM DFlash | 4 | 2 | 1.500 |" in text
    assert "| ours: chain of K, exittrain's drafter | 4 | 2 | 1.500 |" in text
    assert "| vLLM DFlash vs vLLM plain | True | 1/1 | 2/2 |" in text


def _snapshot(drafts, accepted):
    """vLLM's cumulative counters after a prompt, split over two engines as the worker may report them."""
    return [_counter("vllm:spec_decode_num_drafts", drafts - 1), _counter("vllm:spec_decode_num_drafts", 1, "1"),
            _counter("vllm:spec_decode_num_accepted_tokens_total", accepted)]


def test_per_prompt_counts_are_differences_of_cumulative_snapshots():
    from exittrain.serve.compare import per_prompt_counts

    counts = per_prompt_counts([_snapshot(4, 6), _snapshot(4, 6), _snapshot(10, 9)])
    assert counts == [{"drafts": 4, "accepted_tokens": 6}, {"drafts": 0, "accepted_tokens": 0},
                      {"drafts": 6, "accepted_tokens": 3}]
    with pytest.raises(ValueError, match="decrease at prompt 1"):
        per_prompt_counts([_snapshot(4, 6), _snapshot(3, 6)])
    with pytest.raises(ValueError, match="no speculative_config"):
        per_prompt_counts([[_counter("vllm:prompt_tokens", 5)]])


def test_acceptance_interval_pools_prompts_and_pairs_them():
    from exittrain.serve.compare import acceptance_interval, paired_acceptance

    a = [{"drafts": 10, "accepted_tokens": 20}, {"drafts": 5, "accepted_tokens": 0},
         {"drafts": 5, "accepted_tokens": 5}]
    summary = acceptance_interval(a)
    assert summary["mean"] == pytest.approx(1 + 25 / 20) and summary["drafts"] == 20 and summary["prompts"] == 3
    low, high = summary["ci95"]
    assert 1.0 <= low < summary["mean"] < high <= 3.0  # three unequal prompts: a real spread
    same = paired_acceptance(a, a)
    assert same == {"delta": 0.0, "ci95": [0.0, 0.0]}
    # one more accepted token per draft on every prompt: +1 pooled, whatever the resample
    b = [{"drafts": c["drafts"], "accepted_tokens": c["accepted_tokens"] + c["drafts"]} for c in a]
    shifted = paired_acceptance(b, a)
    assert shifted["delta"] == pytest.approx(1.0) and shifted["ci95"] == pytest.approx([1.0, 1.0])
    with pytest.raises(ValueError, match="same prompts"):
        paired_acceptance(a, a[:2])
    with pytest.raises(ValueError, match="per_prompt=True"):
        acceptance_interval([])
