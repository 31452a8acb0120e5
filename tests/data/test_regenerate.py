"""Regeneration: loss masks, EOS handling, the cache, and resuming an interrupted run."""

from __future__ import annotations

import os

import pytest

from exittrain.data.regenerate import (
    GenerationConfig,
    cache_path,
    chat_prompt_ids,
    read_meta,
    regenerate,
    split_response,
)
from tests.data.helpers import CountingTarget, tiny_llama

PROMPTS = ["Hi there", "What is 2+2?", "Write a poem about the sea.", "Name three colours.", "Why is the sky blue?"]
GEN = GenerationConfig(max_new_tokens=8, batch_size=2)  # 3 batches: 2 + 2 + 1


def _target(tokenizer, **kwargs):
    # eos_boost=5 with seed 0 ends 3 of the 5 greedy answers with EOS before 8 tokens
    return CountingTarget(tiny_llama(tokenizer, seed=0, eos_boost=5.0), tokenizer, **kwargs)


def _rows(ds):
    return [dict(r) for r in ds]


def test_split_response_stops_after_the_first_eos():
    assert split_response([5, 6, 2, 2, 2], eos_ids=[2]) == ([5, 6, 2], True)
    assert split_response([2, 9], eos_ids=[2, 9]) == ([2], True)
    assert split_response([5, 6, 7], eos_ids=[2]) == ([5, 6, 7], False)


def test_loss_mask_covers_exactly_the_response(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    target = _target(tok)
    ds = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    rows = _rows(ds)
    assert [r["prompt_index"] for r in rows] == list(range(len(PROMPTS)))
    assert {r["finished"] for r in rows} == {True, False}  # both endings are exercised
    for r in rows:
        prompt_ids = chat_prompt_ids(tok, r["prompt"])
        n_p, n_r = r["n_prompt_tokens"], r["n_response_tokens"]
        assert r["prompt"] == PROMPTS[r["prompt_index"]]
        assert r["input_ids"][:n_p] == prompt_ids and n_p == len(prompt_ids)
        assert len(r["input_ids"]) == len(r["loss_mask"]) == n_p + n_r
        assert r["loss_mask"] == [0] * n_p + [1] * n_r
        response = r["input_ids"][n_p:]
        assert 1 <= n_r <= GEN.max_new_tokens
        if r["finished"]:
            assert response[-1] == tok.eos_token_id and tok.eos_token_id not in response[:-1]
        else:
            assert n_r == GEN.max_new_tokens and tok.eos_token_id not in response
        assert r["response"] == tok.decode(response, skip_special_tokens=True)
    # the prompt ends with the assistant header of the chat template
    assert tok.decode(rows[0]["input_ids"][: rows[0]["n_prompt_tokens"]]).endswith("<|im_start|>assistant\n")


def test_second_call_is_a_cache_hit_without_loading_the_target(tmp_path, smollm2_tokenizer):
    target = _target(smollm2_tokenizer)
    first = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    assert (target.provided, target.generate_calls) == (1, 3)
    second = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    assert (target.provided, target.generate_calls) == (1, 3)
    assert _rows(first) == _rows(second)
    path = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    meta = read_meta(path)
    assert meta["rows"] == 5 and meta["pad_token_id"] == smollm2_tokenizer.pad_token_id
    assert sorted(os.listdir(tmp_path)) == [path.name]  # no partial or temporary folders left
    # any change of target, prompts or settings is a different entry
    other = {
        cache_path(tmp_path, "tiny2", "", PROMPTS, GEN),
        cache_path(tmp_path, "tiny", "other-set", PROMPTS, GEN),
        cache_path(tmp_path, "tiny", "", PROMPTS[:-1], GEN),
        cache_path(tmp_path, "tiny", "", PROMPTS, GenerationConfig(max_new_tokens=9, batch_size=2)),
    }
    assert path not in other and len(other) == 4


def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    reference = regenerate(PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path / "a", gen=GEN, progress=False)

    crashing = _target(tok, fail_after=1)
    with pytest.raises(RuntimeError, match="simulated interruption"):
        regenerate(PROMPTS, crashing, target_name="tiny", cache_dir=tmp_path / "b", gen=GEN, progress=False)
    final = cache_path(tmp_path / "b", "tiny", "", PROMPTS, GEN)
    assert not final.exists()  # nothing half-written looks complete
    partial = final.with_name(final.name + ".partial")
    assert sorted(os.listdir(partial)) == ["shard_00000"]

    resumed_target = _target(tok)
    resumed = regenerate(PROMPTS, resumed_target, target_name="tiny", cache_dir=tmp_path / "b", gen=GEN, progress=False)
    assert resumed_target.generate_calls == 2  # only the two missing batches
    assert _rows(resumed) == _rows(reference)
    assert not partial.exists()


def test_too_long_prompts_are_counted_not_answered(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = ["short", "word " * 100]
    limit = len(chat_prompt_ids(tok, "short")) + 5
    gen = GenerationConfig(max_new_tokens=2, batch_size=4, max_prompt_tokens=limit)
    ds = regenerate(prompts, _target(tok), target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False)
    assert ds["prompt_index"] == [0]
    assert read_meta(cache_path(tmp_path, "tiny", "", prompts, gen))["rejected_too_long"] == 1


def test_generation_config_validates_and_coerces():
    assert GenerationConfig.coerce({"max_new_tokens": 4}).max_new_tokens == 4
    with pytest.raises(ValueError, match="unknown generation settings \\['max_tokens'\\]"):
        GenerationConfig.coerce({"max_tokens": 4})
    with pytest.raises(ValueError, match="batch_size=0 must be positive"):
        GenerationConfig(batch_size=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        GenerationConfig(do_sample=True, temperature=0.0)
