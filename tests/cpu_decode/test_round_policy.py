"""Rounds that skip the drafter (copy-led rounds, steps after a miss) keep decoding lossless:
greedy equality with Hugging Face generate, and the sampling law; with both off the decoder is the
plain one, round for round."""

import pytest

from exittrain.cpu_decode.round_policy import RoundPolicyDecoder, steps_due
from exittrain.decoding import RoundStats, SpeculativeDecoder
from tests.decoding import test_speculative as plain_decoder_tests
from tests.decoding.test_speculative import PROMPT, REPEATING, hf_greedy
from tests.decoding.test_speculative import test_sampling_law_over_three_tokens as sampling_law_over_three_tokens

# the plain decoder's fixtures: the tiny target, its drafters (plain and with the copy branch), no EOS
target, drafter, no_eos = plain_decoder_tests.target, plain_decoder_tests.drafter, plain_decoder_tests.no_eos


@pytest.mark.parametrize("verifier", ["tev", "greedy"])
def test_copy_led_rounds_output_equals_target_greedy(no_eos, target, drafter, verifier):
    """Rounds where the root's last 2 tokens occurred before verify the copy alone (no drafter);
    the others draft. Both kinds occur, and the tokens are greedy's."""
    expected = hf_greedy(target, REPEATING, 30)
    decoder = RoundPolicyDecoder(target, drafter, budget=3, verifier=verifier, copy_tail=2, copy_lead=2)
    result = decoder.generate(REPEATING, max_new_tokens=30, seed=0)
    assert result.tokens == expected
    led = [r for r in result.rounds if not r.drafted]
    assert led and len(led) < len(result.rounds), "one kind of round never ran: the test proves nothing"
    K = drafter.config.num_draft_tokens
    assert all(1 <= r.tree_nodes <= K + 2 for r in led)
    assert all(3 <= r.tree_nodes <= 3 + 2 for r in result.rounds if r.drafted)  # the tree, and the tail's graft
    # the first round's root closes (5, 17), seen before: copy-led, and the copy is K + tail long
    assert not result.rounds[0].drafted and result.rounds[0].tree_nodes == K + 2


@pytest.mark.parametrize("verifier", ["tev", "predraw", "sequential", "greedy"])
def test_steps_after_a_miss_output_equals_target_greedy(no_eos, target, drafter, verifier):
    """After a drafted round that accepted nothing, up to 2 steps verify the root alone (no drafter,
    one token each); both kinds occur, a step follows only a miss, and the tokens are greedy's."""
    expected = hf_greedy(target, PROMPT, 30)
    decoder = RoundPolicyDecoder(target, drafter, budget=2, verifier=verifier, miss_steps=2)
    result = decoder.generate(PROMPT, max_new_tokens=30, seed=0)
    assert result.tokens == expected
    kinds = [r.kind for r in result.rounds]
    assert "step" in kinds and "drafted" in kinds, "one kind of round never ran: the test proves nothing"
    for before, r in zip(result.rounds, result.rounds[1:]):
        if r.kind == "step":
            assert (r.block_length, r.tree_nodes) == (1, 0)
            assert before.kind == "step" or (before.kind == "drafted" and before.accept_length == 0)
        elif before.kind == "drafted" and before.accept_length == 0:
            raise AssertionError("a miss was not followed by a step")
    runs = "".join("s" if k == "step" else "d" for k in kinds)
    assert "sss" not in runs  # at most miss_steps = 2 in a row


def test_steps_after_a_miss_keep_the_sampling_law(no_eos, target, drafter):
    """At T > 0 a step samples the root's warped distribution through the verifier: the 3-token law holds."""
    sampling_law_over_three_tokens(no_eos, target, drafter, 400, PROMPT, {"miss_steps": 2},
                                   decoder_class=RoundPolicyDecoder)


def test_copy_led_rounds_keep_the_sampling_law(no_eos, target, drafter):
    """At T > 0 a copy-led round is verified as any tree: the 3-token law holds (chi-square)."""
    sampling_law_over_three_tokens(no_eos, target, drafter, 400, REPEATING, {"copy_lead": 2},
                                   decoder_class=RoundPolicyDecoder)


def test_with_both_off_it_is_the_plain_decoder_round_for_round(no_eos, target, drafter):
    plain = SpeculativeDecoder(target, drafter, budget=3, copy_tail=2).generate(REPEATING, 30)
    policy = RoundPolicyDecoder(target, drafter, budget=3, copy_tail=2).generate(REPEATING, 30)
    assert policy.tokens == plain.tokens
    assert [(r.block_length, r.tree_nodes, r.kind) for r in policy.rounds] == \
        [(r.block_length, r.tree_nodes, r.kind) for r in plain.rounds]


def test_the_step_rule_reads_the_past_rounds_only():
    def rounds(spec):  # d: drafted round that accepted 1, m: drafted miss, s: step, c: copy-led round
        kind = {"d": "drafted", "m": "drafted", "s": "step", "c": "copy-led"}
        return [RoundStats(1 if k in "ms" else 2, 0 if k in "ms" else 1, {}, 0, kind[k]) for k in spec]

    assert not steps_due([], 2)
    assert steps_due(rounds("dm"), 2) and steps_due(rounds("dms"), 2) and not steps_due(rounds("dmss"), 2)
    assert not steps_due(rounds("md"), 2) and not steps_due(rounds("mc"), 2)
    assert not steps_due(rounds("m"), 0)


def test_bad_arguments(target, drafter):
    with pytest.raises(ValueError, match="copy_lead"):
        RoundPolicyDecoder(target, drafter, copy_lead=-2)
    with pytest.raises(ValueError, match="miss_steps"):
        RoundPolicyDecoder(target, drafter, miss_steps=-1)
    with pytest.raises(ValueError, match="budget"):  # the plain decoder's checks still run
        RoundPolicyDecoder(target, drafter, budget=0, copy_lead=2)
    with pytest.raises(TypeError, match="copy_lead"):  # the plain decoder drafts every round
        SpeculativeDecoder(target, drafter, copy_lead=2)
