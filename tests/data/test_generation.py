"""How the target answers, without a model: response extraction, settings, the shared prefix."""

from __future__ import annotations

import pytest

from exittrain.data.generation import GenerationConfig, shared_prefix_length, split_response


def test_split_response_stops_after_the_first_eos():
    assert split_response([5, 6, 2, 2, 2], eos_ids=[2]) == ([5, 6, 2], True)
    assert split_response([2, 9], eos_ids=[2, 9]) == ([2], True)
    assert split_response([5, 6, 7], eos_ids=[2]) == ([5, 6, 7], False)


def test_generation_config_validates_and_coerces():
    assert GenerationConfig.coerce({"max_new_tokens": 4}).max_new_tokens == 4
    with pytest.raises(ValueError, match="unknown generation settings \\['max_tokens'\\]"):
        GenerationConfig.coerce({"max_tokens": 4})
    with pytest.raises(ValueError, match="batch_size=0 must be positive"):
        GenerationConfig(batch_size=0)
    with pytest.raises(ValueError, match="temperature > 0"):
        GenerationConfig(do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="dtype='bf16'.*bfloat16.*data.generation.dtype"):
        GenerationConfig(dtype="bf16")


def test_the_shared_prefix_stops_at_the_first_difference_and_leaves_each_prompt_a_token():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter keeps its last token
    assert shared_prefix_length([[7, 8], [9, 8]]) == 0
