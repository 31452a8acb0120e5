"""answer_sets: the target's answers at several temperatures from one prefill a batch. Greedy rows
against the one-prompt autoregressive decode (their slow reference twin), sampled rows against the
warped law they are drawn from, the seed, EOS and bad input."""

from __future__ import annotations

import pytest
import torch

from exittrain.decoding import autoregressive_generate
from exittrain.heldout.answers import answer_sets

NEW_TOKENS = 24


def test_greedy_rows_are_the_one_prompt_decode_alone_or_beside_sampled_sets(one_thread, target, prompts):
    """Padded batches of 3, greedy alone and as one of three sets: the autoregressive decode's tokens."""
    alone = answer_sets(target, prompts, [0.0], NEW_TOKENS, batch=3)[0.0]
    beside = answer_sets(target, prompts, [0.6, 0.0, 1.0], NEW_TOKENS, batch=3)
    for i, prompt in enumerate(prompts):
        expected = autoregressive_generate(target, prompt, NEW_TOKENS).tokens
        for ids, n_prompt, features in (alone[i], beside[0.0][i]):
            assert n_prompt == len(prompt) and ids[:n_prompt].tolist() == prompt and features is None
            assert ids[n_prompt:].tolist() == expected, f"prompt {i}"
    assert any(ids[-1] == 1 and ids.shape[0] - n < NEW_TOKENS for ids, n, _ in alone)  # one ended at EOS
    for T in (0.6, 1.0):  # sampled rows: the prompt, then at most NEW_TOKENS tokens, cut after the first EOS
        for (ids, n_prompt, _), prompt in zip(beside[T], prompts, strict=True):
            answer = ids[n_prompt:].tolist()
            assert ids[:n_prompt].tolist() == prompt and 1 <= len(answer) <= NEW_TOKENS
            assert 1 not in answer[:-1]


def test_the_seed_repeats_a_set_beside_any_other_and_the_global_rng_is_untouched(one_thread, target, prompts):
    state = torch.random.get_rng_state()
    first = answer_sets(target, prompts, [1.0], NEW_TOKENS, seed=3)[1.0]
    assert torch.equal(torch.random.get_rng_state(), state)
    again = answer_sets(target, prompts, [1.0], NEW_TOKENS, seed=3)[1.0]
    other = answer_sets(target, prompts, [1.0], NEW_TOKENS, seed=4)[1.0]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
    beside = answer_sets(target, prompts, [0.6, 0.0, 1.0], NEW_TOKENS, seed=3)[1.0]  # its own generator
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, beside, strict=True))
    assert any(not torch.equal(a[0], b[0]) for a, b in zip(first, other, strict=True))


def test_each_set_draws_from_the_target_law_at_its_own_temperature(one_thread, target, prompts):
    """First tokens of 4000 copies of one prompt at T = 0.5 and 2, drawn in the same batches: each set's
    frequencies are softmax(logits / T) of its own T (total variation under 0.04, seed fixed; the two
    laws are over 0.2 apart, so swapped rows would fail)."""
    prompt, n = prompts[2], 4000
    sets = answer_sets(target, [prompt] * n, [0.5, 2.0], 1, seed=0, batch=500)
    logits = target.model(torch.tensor([prompt])).logits[0, -1].detach().float()
    laws = {T: torch.softmax(logits / T, dim=-1) for T in (0.5, 2.0)}
    assert 0.5 * (laws[0.5] - laws[2.0]).abs().sum() > 0.2
    for T, rows in sets.items():
        first = torch.tensor([ids[len(prompt)].item() for ids, _, _ in rows])
        freq = torch.bincount(first, minlength=target.vocab_size).float() / n
        assert 0.5 * (freq - laws[T]).abs().sum() < 0.04, T


@pytest.mark.parametrize(
    "temperatures, max_new_tokens, match",
    [
        ([0.6, 0.6], 4, "distinct temperatures"),
        ([], 4, "distinct temperatures"),
        ([-1.0], 4, "temperature must be a number >= 0"),
        ([0.0], 0, "max_new_tokens=0"),
    ],
)
def test_bad_input_names_the_argument(target, prompts, temperatures, max_new_tokens, match):
    with pytest.raises(ValueError, match=match):
        answer_sets(target, prompts, temperatures, max_new_tokens)
