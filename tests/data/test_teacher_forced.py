"""The teacher-forced pass: batched equals row by row, and equals what the target kept while it answered."""

from __future__ import annotations

import pytest
import torch

from exittrain.data.generation import GenerationConfig, chat_prompt_ids, eos_token_ids, generate_batch, padding_token_id
from exittrain.data.teacher_forced import teacher_forced, teacher_forced_reference
from tests.data.helpers import tiny_llama

PROMPTS = ["Say hi.", "Write a loop in Python that prints the first ten squares.", "What is 2 + 2?"]


def _answered(tokenizer, model, top_k: int, layers: list[int]):
    """Prompts answered greedily by ``generate_batch``, keeping features and top-k log-probabilities."""
    ids = [chat_prompt_ids(tokenizer, p) for p in PROMPTS]
    gen = GenerationConfig(max_new_tokens=12, batch_size=len(ids), share_prefix=False)
    answers = generate_batch(
        model, tokenizer, ids, gen, padding_token_id(tokenizer), eos_token_ids(model, tokenizer), layers, top_k
    )
    return [(p + a.response, len(p)) for p, a in zip(ids, answers)], answers


def test_batched_pass_equals_the_row_by_row_twin(smollm2_tokenizer):
    model = tiny_llama(smollm2_tokenizer, seed=1)
    rows, _ = _answered(smollm2_tokenizer, model, 0, [])
    rows = [*rows, (rows[0][0][:5], 2)]  # a short row in the same batch: the most padding
    fast = teacher_forced(model, rows, feature_layers=[0, 1], top_logprobs=5, batch_size=3)
    slow = teacher_forced_reference(model, rows, feature_layers=[0, 1], top_logprobs=5)
    assert len(fast) == len(rows)
    for (ids, n_prompt), f, s in zip(rows, fast, slow):
        r = len(ids) - n_prompt
        assert f.features.shape == (len(ids), 2 * 32) and f.features.dtype == torch.bfloat16
        assert f.top_ids.shape == (r, 5) and f.top_ids.dtype == torch.int32
        torch.testing.assert_close(f.features.float(), s.features.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(f.top_logprobs, s.top_logprobs, atol=1e-4, rtol=1e-4)
        assert torch.equal(f.top_ids, s.top_ids)
        assert torch.all(f.top_logprobs[:, :-1] >= f.top_logprobs[:, 1:])  # sorted, most likely first


def test_the_pass_gives_what_the_target_kept_while_answering(smollm2_tokenizer):
    model = tiny_llama(smollm2_tokenizer, seed=2, eos_boost=5.0)
    rows, answers = _answered(smollm2_tokenizer, model, 4, [1])
    forced = teacher_forced(model, rows, feature_layers=[1], top_logprobs=4, batch_size=2)
    for a, f in zip(answers, forced):
        torch.testing.assert_close(f.top_logprobs, a.top_logprobs, atol=1e-4, rtol=1e-4)
        assert torch.equal(f.top_ids, a.top_ids)
        torch.testing.assert_close(f.features.float(), a.features.float(), atol=2e-2, rtol=2e-2)
    # a negative control: the labels of another row differ, so the comparison can fail
    assert not torch.allclose(forced[0].top_logprobs[:1], forced[1].top_logprobs[:1])


def test_bad_rows_and_settings_are_named(smollm2_tokenizer):
    model = tiny_llama(smollm2_tokenizer, seed=0)
    with pytest.raises(ValueError, match="row 1: n_prompt_tokens=0"):
        teacher_forced(model, [([1, 2, 3], 1), ([1, 2], 0)])
    with pytest.raises(ValueError, match="top_logprobs=-1"):
        teacher_forced(model, [([1, 2, 3], 1)], top_logprobs=-1)
    with pytest.raises(ValueError, match="repeats a layer id"):
        teacher_forced(model, [([1, 2, 3], 1)], feature_layers=[0, 0])
