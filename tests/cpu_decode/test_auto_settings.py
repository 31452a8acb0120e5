"""decode: auto. The candidates, the tau estimate against real decoding (its reference twin), the
choice from scripted timings (no wall-clock assertion anywhere), the decoder built at the choice,
and evaluate_prompts' auto rows."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import resampled_ratios
from exittrain.cpu_decode import auto_settings as auto
from exittrain.cpu_decode import decode_settings, probe_tau
from exittrain.cpu_decode.auto_settings import auto_decoder
from exittrain.cpu_decode.decode_settings import GREEDY, PROMPT_LOOKUP_TOKENS, DecodeSetting, candidate_settings
from exittrain.cpu_decode.draft_vocab import count_answer_tokens, draft_vocabulary, save_token_counts
from exittrain.cpu_decode.round_policy import RoundPolicyDecoder
from exittrain.decoding import GreedyDecoder, autoregressive_generate
from exittrain.heldout.decode_eval import evaluate_prompts
from exittrain.heldout.evaluator import HeldOutEvaluator, format_report
from exittrain.models import load_drafter, new_drafter
from tests.models.helpers import tiny_target

# a prompt that repeats itself, so the copy chain and the copy tail have something to copy
REPEATING = [5, 17, 33, 2, 40, 41, 9, 12, 5, 17, 33, 2, 40, 41, 9, 5, 17]
PROMPTS = [REPEATING, [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8], [20, 21, 22, 23, 20, 21, 22, 24, 20, 21]]
COUNTS = {"ids": list(range(63, -1, -1))}  # a draft_vocab.json record: every token, high ids most frequent

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread, no spinning on a shared box


@pytest.fixture(scope="module")
def target():
    t = tiny_target("llama", seed=3)
    t.eos_token_ids = []  # random tiny models emit EOS early: decode the full length
    return t


@pytest.fixture(scope="module")
def drafter(target):
    return new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, copy_ngrams=[2, 1]).eval()


def test_candidates_are_capped_by_the_recipe_budget_and_need_token_counts_for_a_vocabulary():
    got = candidate_settings(8, 64, has_token_counts=False, budgets=(2, 4, 16), copy_tails=(0, 10),
                                  copy_leads=(0,), miss_steps=(0,))
    assert got == [DecodeSetting(b, 0, t) for b in (2, 4, 8) for t in (0, 10)]  # 16 dropped, the recipe's 8 added
    got = candidate_settings(4, 64, has_token_counts=True, budgets=(2, 4), vocab_sizes=(0, 3, 16, 64),
                                  copy_tails=(0,), miss_steps=())  # no tail: no copy lead either; steps 0 always
    # 64 is the whole vocabulary (no saving), 3 is smaller than budget 4
    assert got == [DecodeSetting(2, 0), DecodeSetting(2, 3), DecodeSetting(2, 16), DecodeSetting(4, 0),
                   DecodeSetting(4, 16)]
    assert DecodeSetting(4, 4096, 10).label == "B=4, draft vocab 4096, copy tail 10"
    assert DecodeSetting(16).label == "B=16"
    assert DecodeSetting(2, 0, 10, 4).label == "B=2, copy tail 10, copy lead 4"
    assert GREEDY.label == "greedy, no drafter"
    # a copy lead only beside a tail, and always with its drafting twin
    got = candidate_settings(2, 64, has_token_counts=False, budgets=(2,), copy_tails=(0, 10), copy_leads=(4,),
                                  miss_steps=(0,))
    assert got == [DecodeSetting(2), DecodeSetting(2, 0, 10), DecodeSetting(2, 0, 10, 4)]
    # miss steps: every value with every setting; each variant's rounds are its setting without steps
    got = candidate_settings(2, 64, has_token_counts=False, budgets=(2,), copy_tails=(0,), miss_steps=(3, 1))
    assert got == [DecodeSetting(2), DecodeSetting(2, 0, 0, 0, 1), DecodeSetting(2, 0, 0, 0, 3)]
    assert {s.rounds for s in got} == {DecodeSetting(2)}
    assert DecodeSetting(2, 4096, 10, 0, 2).label == "B=2, draft vocab 4096, copy tail 10, miss steps 2"
    with pytest.raises(ValueError, match="miss_steps"):
        candidate_settings(4, 64, has_token_counts=False, miss_steps=(-1,))
    with pytest.raises(ValueError, match="max_budget"):
        candidate_settings(0, 64, has_token_counts=False)
    with pytest.raises(ValueError, match="copy_tails"):
        candidate_settings(4, 64, has_token_counts=False, copy_tails=(-1,))


def test_the_prompt_lookup_length_is_a_copy_tail_candidate():
    """Prompt lookup copies 10 tokens; the tail appends after the tree's own copy, so 10 reaches at
    least as far."""
    assert PROMPT_LOOKUP_TOKENS == 10 and PROMPT_LOOKUP_TOKENS in decode_settings.DEFAULT_COPY_TAILS


@pytest.mark.parametrize(("setting", "earliest"), [(DecodeSetting(4), False), (DecodeSetting(3, 0, 5), False),
                                                   (DecodeSetting(4, 16, 5), False), (DecodeSetting(2, 0, 3, 2), False),
                                                   (DecodeSetting(3, 0, 5), True),
                                                   (DecodeSetting(1, 0, 0, 0, 2), False),
                                                   (DecodeSetting(1, 0, 3, 2, 3), False)],
                         ids=["plain", "copy-tail", "vocab+tail", "copy-lead", "two-chains", "miss-steps",
                              "miss-steps+copy-lead"])
def test_the_block_length_estimate_equals_each_round_of_a_real_decode(target, drafter, setting, earliest):
    """The reference twin: a greedy decode at the setting visits some anchors of the greedy answer;
    the estimate from one drafter pass over the whole answer must give, at each of them, the
    round's block length (the last round is left out: the answer ends there)."""
    vocab = None if setting.draft_vocab == 0 else draft_vocabulary(COUNTS, setting.draft_vocab, target.vocab_size)
    answer = autoregressive_generate(target, REPEATING, 30).tokens
    row = (torch.tensor(REPEATING + answer), len(REPEATING))
    lengths, nodes, kinds = probe_tau.candidate_block_lengths(target, drafter, [row], [setting],
                                                         {setting.draft_vocab: vocab},
                                                         copy_earliest=earliest)[setting]
    assert len(lengths) == len(answer) and len(nodes) == len(answer) and len(kinds) == len(answer)
    decoder = RoundPolicyDecoder(target, drafter, budget=setting.budget, verifier="greedy",
                                 copy_tail=setting.copy_tail, copy_lead=setting.copy_lead, draft_vocab=vocab,
                                 copy_earliest=earliest, miss_steps=setting.miss_steps)
    result = decoder.generate(REPEATING, 30)
    assert result.tokens == answer
    anchor = 0  # index into the anchors: position len(REPEATING) - 1 + anchor
    for r in result.rounds[:-1]:
        if r.kind == "step":  # the root alone: one token, no node
            assert (r.block_length, r.tree_nodes) == (1, 0)
        else:
            assert (r.block_length, r.tree_nodes, r.kind) == (lengths[anchor], nodes[anchor], kinds[anchor])
        anchor += r.block_length
    # the probe's tau walks the same rounds: its blocks are the decoding's, round for round
    walked, walked_nodes, walked_kinds = probe_tau.along_the_rounds([(lengths, nodes, kinds)], setting.miss_steps)
    n = len(result.rounds) - 1
    assert walked[:n] == [r.block_length for r in result.rounds[:-1]] and len(walked) >= n
    assert walked_nodes[:n] == [r.tree_nodes for r in result.rounds[:-1]]
    assert walked_kinds[:n] == [r.kind for r in result.rounds[:-1]]
    if setting.miss_steps:  # steps were taken, so the walk's step rule was compared
        assert "step" in walked_kinds[:n]
    if setting.copy_tail and not setting.copy_lead:
        assert max(nodes) > setting.budget  # the graft happened somewhere, so the tail was exercised
    if earliest:  # the second chain was grafted somewhere: more copy nodes than one chain holds
        assert max(nodes) > setting.budget + setting.copy_tail
    if setting.copy_lead:  # both kinds of round occurred, so both paths were compared
        assert not all(r.drafted for r in result.rounds) and any(r.drafted for r in result.rounds)


def test_round_starts_walk_one_block_at_a_time():
    assert probe_tau.round_starts([3, 1, 1, 2, 1, 1, 4]) == [0, 3, 5, 6]
    assert probe_tau.round_starts([]) == []
    assert probe_tau.along_the_rounds([([2, 9, 1], [4, 4, 5]), ([1, 1], [3, 3])]) == ([2, 1, 1, 1], [4, 5, 3, 3])


def scripted_timer(round_ms: dict, greedy_ms: float):
    calls = []

    def timer(setting):
        calls.append(setting)
        return greedy_ms if setting is None else round_ms(setting)

    return timer, calls


def test_the_choice_maximises_tau_per_round_cost_from_scripted_timings(target, drafter):
    # rounds cost 10 ms + 1 ms a node, the draft vocabulary saves 4 ms, the tail costs 2 ms
    def cost(s: DecodeSetting) -> float:
        return 10.0 + s.budget - (4.0 if s.draft_vocab else 0.0) + (2.0 if s.copy_tail else 0.0)

    timer, calls = scripted_timer(cost, greedy_ms=9.0)
    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=8, token_counts=COUNTS,
                                        vocab_sizes=(0, 16), copy_tails=(0, 5), miss_steps=(0,), answer_tokens=16,
                                        timer=timer)
    # every candidate, greedy, the finalists again, greedy again
    assert calls[-1] is None and len(calls) == len(choice.candidates) + auto.FINALISTS + 2
    assert calls[len(choice.candidates)] is None
    assert {c.setting for c in choice.candidates if c.first_round_ms is not None} == set(
        calls[len(choice.candidates) + 1 : -1])
    best = max(choice.candidates, key=lambda c: c.tau / cost(c.setting))
    assert choice.setting == best.setting
    for c in choice.candidates:
        assert c.round_ms == cost(c.setting) and c.speedup == pytest.approx(c.tau * 9.0 / cost(c.setting))
    assert choice.reference.setting == DecodeSetting(8)
    assert choice.reason.startswith(f"decode auto -> {best.setting.label} (round {cost(best.setting):.0f} ms")
    assert (f"expected {best.speedup:.2f}x greedy, {best.speedup_low:.2f}x at the 10% bound for other prompts "
            "(greedy step 9 ms)") in choice.reason
    assert best.speedup_low >= 1.0
    if best.setting != DecodeSetting(8):
        assert f"B=8: {cost(DecodeSetting(8)):.0f} ms, {choice.reference.tau:.2f}" in choice.reason
    assert choice.decoder_kwargs()["budget"] == best.setting.budget
    assert (choice.vocab_ids is None) == (best.setting.draft_vocab == 0)
    assert choice.to_dict()["chosen"]["setting"] == best.setting.label
    # the same timings give the same choice
    again = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=8, token_counts=COUNTS,
                                       vocab_sizes=(0, 16), copy_tails=(0, 5), miss_steps=(0,), answer_tokens=16,
                                       timer=scripted_timer(cost, 9.0)[0])
    def figures(c):
        return {k: v for k, v in c.to_dict().items() if k != "probe_seconds"}  # the probe's own wall time varies

    assert figures(again) == figures(choice) and choice.seconds > 0


def test_when_no_setting_beats_greedy_auto_decodes_greedily_and_says_why(target, drafter):
    timer, _ = scripted_timer(lambda s: 100.0 + s.budget, greedy_ms=5.0)
    choice = auto.probe_decode_settings(target, drafter, PROMPTS[:1], max_budget=4, answer_tokens=8, timer=timer,
                                        copy_tails=(0,))
    assert choice.setting == GREEDY and not choice.beats_greedy and choice.chosen.speedup == 1.0
    best = max((c for c in choice.candidates if c.setting != GREEDY), key=lambda c: c.speedup)
    assert best.speedup < 1 and choice.candidates[-1] is choice.chosen
    assert choice.reason.startswith("decode auto -> greedy, no drafter: no setting is expected to beat greedy on "
                                    "this host by the 1.05x that timing noise allows")
    assert f"the best, {best.setting.label}, expected {best.speedup:.2f}x" in choice.reason
    assert f"{best.round_ms:.0f} ms for {best.tau:.2f} tokens" in choice.reason
    assert "against 5 ms a greedy step" in choice.reason
    # the decoder auto builds then has no drafter, and decodes what greedy decoding does
    decoder, chosen = auto_decoder(target, drafter, PROMPTS[:1], max_budget=4, answer_tokens=8, copy_tails=(0,),
                                   timer=scripted_timer(lambda s: 100.0 + s.budget, greedy_ms=5.0)[0])
    assert isinstance(decoder, GreedyDecoder) and chosen.setting == GREEDY
    assert decoder.generate(REPEATING, 12).tokens == autoregressive_generate(target, REPEATING, 12).tokens
    # without the fallback, the least slow candidate is chosen and the reason says it is slower
    kept = auto.probe_decode_settings(target, drafter, PROMPTS[:1], max_budget=4, answer_tokens=8, copy_tails=(0,),
                                      timer=scripted_timer(lambda s: 100.0 + s.budget, greedy_ms=5.0)[0],
                                      greedy_fallback=False)
    assert kept.setting == best.setting and not kept.beats_greedy
    assert "no setting beats greedy on this host" in kept.reason
    assert f"{kept.chosen.round_ms:.0f} ms for {kept.chosen.tau:.2f} tokens" in kept.reason


def test_an_expected_gain_within_timing_noise_decodes_greedily(target, drafter):
    """1.02x expected is under CLEAR_GAIN: auto falls back to greedy decoding; 1.08x is not."""
    def probe(greedy_ms):
        return auto.probe_decode_settings(target, drafter, PROMPTS[:1], max_budget=4, answer_tokens=8,
                                          copy_tails=(0,), miss_steps=(0,),
                                          timer=scripted_timer(lambda s: 100.0, greedy_ms)[0])

    best_tau = max(c.tau for c in probe(50.0).candidates)  # every round costs 100 ms: the best has the top tau
    assert probe(1.02 * 100.0 / best_tau).setting == GREEDY
    clear = probe(1.08 * 100.0 / best_tau)
    assert clear.setting != GREEDY and clear.chosen.speedup == pytest.approx(1.08)


def test_the_fastest_first_timing_is_timed_again_and_a_flattering_one_loses(target, drafter):
    """The winner's curse: one lucky first timing (B=2 at 1 ms, 60 ms when timed again) makes B=2
    a finalist; timed again it is slow, and the choice goes to the finalist fastest on its second
    timing.
    The greedy step is the mean of its two timings."""
    seen = []

    def timer(setting):
        if setting is None:
            seen.append(None)
            return 29.0 if seen.count(None) == 1 else 31.0
        lucky = setting == DecodeSetting(2) and setting not in seen
        seen.append(setting)
        return 1.0 if lucky else (60.0 if setting == DecodeSetting(2) else 10.0 + setting.budget)

    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=8, copy_tails=(0, 5), answer_tokens=16,
                                        miss_steps=(0,), timer=timer)
    assert len(choice.candidates) > auto.FINALISTS
    flattered = next(c for c in choice.candidates if c.setting == DecodeSetting(2))
    assert flattered.first_round_ms == 1.0 and flattered.round_ms == 60.0  # its figures are the second timing's
    assert choice.greedy_ms == 30.0
    assert choice.setting != DecodeSetting(2)
    finals = [c for c in choice.candidates if c.first_round_ms is not None]
    assert len(finals) == auto.FINALISTS
    assert choice.chosen == max(finals, key=lambda c: c.speedup)
    assert choice.to_dict()["candidates"][0]["first_round_ms"] == flattered.first_round_ms


def test_a_finalist_is_priced_at_the_slower_of_its_two_timings(target, drafter):
    """A fast second timing flatters as a fast first one does: B=2 timed at 12 ms, then at 2 ms,
    is priced at 12 and its speedup is the 12 ms one; each round kind takes its own slower timing."""
    seen = []

    def timer(setting):
        if setting is None:
            return 30.0
        second = setting in seen
        seen.append(setting)
        return 2.0 if second and setting == DecodeSetting(2) else 10.0 + setting.budget

    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=8, copy_tails=(0,), answer_tokens=16,
                                        miss_steps=(0,), timer=timer)
    finals = [c for c in choice.candidates if c.first_round_ms is not None]
    assert {c.setting for c in finals} == {DecodeSetting(2), DecodeSetting(4), DecodeSetting(8)}
    for c in finals:
        assert c.round_ms == c.first_round_ms == 10.0 + c.setting.budget
        assert c.speedup == pytest.approx(c.tau * 30.0 / c.round_ms)
    assert choice.chosen == max(finals, key=lambda c: c.speedup)
    assert auto.slower((12.0, 5.0), (9.0, 7.0)) == (12.0, 7.0)


def test_a_finalists_first_timing_prices_its_steps_at_the_same_greedy_step_as_its_final_round(target, drafter):
    """Greedy timed at 20 ms, then 40: the final figures price a step at the mean, 30 ms. A finalist
    timed the same twice then has the same round at both timings, its steps included (they were
    priced at the first greedy timing, 20 ms, before)."""
    greedy_timings = []

    def timer(setting):
        if setting is None:
            greedy_timings.append(None)
            return 20.0 if len(greedy_timings) == 1 else 40.0
        return 10.0 + setting.budget

    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=8, copy_tails=(0,), answer_tokens=16,
                                        miss_steps=(0, 2), timer=timer)
    assert choice.greedy_ms == 30.0
    finals = [c for c in choice.candidates if c.first_round_ms is not None]
    assert any(c.steps > 0 for c in finals)  # the case the repricing is about
    for c in finals:
        assert c.first_round_ms == pytest.approx(c.round_ms)


def test_the_speedup_bound_is_the_point_estimate_on_alike_prompts_and_widened_for_other_prompts():
    """speedup_bound on (tokens, drafted rounds, copy-led rounds, steps) per prompt (a step costs the
    greedy step): alike prompts leave
    nothing to resample; otherwise the bound is the point estimate minus sqrt(2) times the
    bootstrap quantile's distance below it (the prompts decoded next are another sample): at a tiny
    quantile the bootstrap's own tail is the worst prompt's speed (a draw of it alone, 3 prompts: 1
    in 27 of the draws), so the bound lies below even that prompt; seeded, so the same rows give
    the same bound."""
    alike = [(12, 4, 0, 1)] * 5
    assert auto.speedup_bound(alike, 10.0, 20.0, 5.0) == pytest.approx(12 * 10.0 / (4 * 20.0 + 10.0))
    rows = [(8, 4, 0, 0), (12, 4, 2, 0), (30, 2, 6, 0)]  # the last one restates its prompt: copy-led rounds
    speeds = [t * 10.0 / (d * 20.0 + n * 5.0) for t, d, n, _ in rows]
    point = sum(t for t, *_ in rows) * 10.0 / sum(d * 20.0 + n * 5.0 for _, d, n, _ in rows)
    tiny = auto.speedup_bound(rows, 10.0, 20.0, 5.0, quantile=1e-4, draws=20000)
    assert tiny == pytest.approx(point - 2 ** 0.5 * (point - min(speeds)))
    assert tiny < min(speeds)
    low = auto.speedup_bound(rows, 10.0, 20.0, 5.0)
    q10 = float(torch.quantile(resampled_ratios([t * 10.0 for t, *_ in rows],
                                                [d * 20.0 + n * 5.0 for _, d, n, _ in rows], draws=2000, seed=0), 0.1))
    assert min(speeds) < q10 < point
    assert low == pytest.approx(point - 2 ** 0.5 * (point - q10)) and low == auto.speedup_bound(rows, 10.0, 20.0, 5.0)
    for bad in ({"quantile": 0.0}, {"quantile": 1.0}):
        with pytest.raises(ValueError, match="quantile"):
            auto.speedup_bound(rows, 10.0, 20.0, 5.0, **bad)
    with pytest.raises(ValueError, match="at least one unit"):
        auto.speedup_bound([], 10.0, 20.0, 5.0)


def test_a_setting_fast_on_few_prompts_is_passed_over_and_without_another_auto_decodes_greedily(
        target, drafter, monkeypatch):
    """The choice needs the bound >= 1 as well as the point estimate's clear gain: the fastest
    setting by the point estimate is passed over when its bound is under 1 (scripted here through
    speedup_bound, keyed on each setting's own round cost), and with no setting left the probe
    falls back to greedy decoding, naming the bound."""
    def cost(s: DecodeSetting) -> float:  # distinct round costs, so the scripted bound knows the setting
        return 10.0 + s.budget + (0.5 if s.copy_tail else 0.0)

    def probe():
        return auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=4, copy_tails=(0, 5), answer_tokens=16,
                                          miss_steps=(0,), timer=scripted_timer(cost, 30.0)[0])

    free = probe()
    best = free.chosen
    assert best.speedup >= auto.CLEAR_GAIN and best.speedup_low >= 1.0  # 30 ms greedy steps: every setting is clear
    real_bound = auto.speedup_bound
    monkeypatch.setattr(auto, "speedup_bound", lambda rows, g, d, l: 0.9 if d == best.round_ms
                        else real_bound(rows, g, d, l))
    passed = probe()
    runner_up = max((c for c in free.candidates if c.setting != best.setting), key=lambda c: c.speedup)
    assert passed.setting == runner_up.setting
    assert (f"passed over: {best.setting.label}, expected {best.speedup:.2f}x but 0.90x at the 10% bound"
            in passed.reason)
    monkeypatch.setattr(auto, "speedup_bound", lambda rows, g, d, l: 0.9)
    none_left = probe()
    assert none_left.setting == GREEDY and not none_left.beats_greedy
    assert none_left.reason.startswith("decode auto -> greedy, no drafter: no setting is expected to beat greedy on "
                                       f"most prompts: the best, {best.setting.label}, expected {best.speedup:.2f}x, "
                                       "0.90x at the 10% bound for other prompts")


def test_copy_led_rounds_weigh_their_own_cost(target, drafter):
    """A copy-led setting's round cost is its drafted and copy-led rounds' costs, weighed by how
    often the probe's walk met each; a kind the timed decodes missed costs what the twin's round does."""
    lead = DecodeSetting(2, 0, 3, 2)

    def timer(setting):
        if setting is None:
            return 9.0
        return (40.0, 10.0) if setting.copy_lead else 30.0

    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=2, budgets=(2,), copy_tails=(0, 3),
                                        copy_leads=(2,), miss_steps=(0,), answer_tokens=16, timer=timer)
    led = next(c for c in choice.candidates if c.setting == lead)
    assert 0 < led.copy_led < 1  # the repeating prompts give both kinds of round
    assert led.round_ms == pytest.approx((1 - led.copy_led) * 40.0 + led.copy_led * 10.0)
    assert led.speedup == pytest.approx(led.tau * 9.0 / led.round_ms)
    assert all(c.copy_led == 0 and c.round_ms == 30.0 for c in choice.candidates
               if not c.setting.copy_lead and c.setting != GREEDY)

    def no_led_round(setting):
        return 9.0 if setting is None else ((None, None) if setting.copy_lead else 30.0)

    again = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=2, budgets=(2,), copy_tails=(0, 3),
                                       copy_leads=(2,), miss_steps=(0,), answer_tokens=16, timer=no_led_round)
    assert next(c for c in again.candidates if c.setting == lead).round_ms == pytest.approx(30.0)


def test_steps_after_a_miss_share_their_settings_timing_and_cost_a_greedy_step(target, drafter):
    """A miss-steps variant is walked, not timed: the timer sees settings without steps only, and
    the variant's round cost weighs its drafted rounds at their timing and its steps at the greedy
    step's; its tau is the walk's over the same anchors."""
    timer, calls = scripted_timer(lambda s: 40.0, greedy_ms=10.0)
    choice = auto.probe_decode_settings(target, drafter, PROMPTS, max_budget=1, budgets=(1,), copy_tails=(0,),
                                        miss_steps=(0, 3), answer_tokens=16, timer=timer)
    assert all(c is None or c.miss_steps == 0 for c in calls)
    plain = next(c for c in choice.candidates if c.setting == DecodeSetting(1))
    stepping = next(c for c in choice.candidates if c.setting == DecodeSetting(1, 0, 0, 0, 3))
    assert plain.steps == 0 and 0 < stepping.steps < 1  # the tiny drafter misses: steps were walked
    assert stepping.round_ms == pytest.approx((1 - stepping.steps) * 40.0 + stepping.steps * 10.0)
    assert stepping.speedup == pytest.approx(stepping.tau * 10.0 / stepping.round_ms)
    assert stepping.tau < plain.tau  # a step yields one token
    assert choice.to_dict()["candidates"][1]["miss_steps"] in (0, 3)
    if choice.setting.miss_steps:
        assert "steps" in choice.reason and choice.decoder_kwargs()["miss_steps"] == choice.setting.miss_steps


def test_a_gain_within_timing_noise_says_so():
    """An expected 1.02x is no promise: the reason says the decoded speed can land either side of greedy's."""
    slim = auto.CandidateResult(DecodeSetting(2, copy_tail=5), tau=2.04, nodes_per_round=3.0, round_ms=100.0,
                                speedup=1.02)
    clear = auto.CandidateResult(DecodeSetting(4), tau=3.0, nodes_per_round=5.0, round_ms=100.0, speedup=1.5)
    assert "timing noise can put the decoded speed either side" in auto._reason(slim, clear, 50.0)
    assert "49 ms a token against 50 ms a greedy step" in auto._reason(slim, clear, 50.0)
    assert auto._reason(clear, clear, 50.0).endswith("expected 1.50x greedy (greedy step 50 ms)")


def test_the_auto_decoder_decodes_at_the_choice_and_stays_greedy(target, drafter):
    def cost(s: DecodeSetting) -> float:  # only B=2 with the tail is cheap
        return 1.0 if (s.budget, s.copy_tail) == (2, 5) else 50.0

    decoder, chosen = auto_decoder(target, drafter, PROMPTS, max_budget=4, token_counts=COUNTS,
                                   vocab_sizes=(0, 16), copy_tails=(0, 5), answer_tokens=8,
                                   timer=scripted_timer(cost, 10.0)[0])
    assert (decoder.budget, decoder.copy_tail) == (2, 5)
    assert chosen.setting.budget == 2
    assert decoder.generate(REPEATING, 20).tokens == autoregressive_generate(target, REPEATING, 20).tokens


def test_the_real_timer_runs_and_the_choice_is_one_of_the_candidates(target, drafter):
    """Unscripted: the host timer times real rounds; no assertion on how fast they were."""
    choice = auto.probe_decode_settings(target, drafter, PROMPTS[:2], max_budget=4, copy_tails=(0, 5),
                                        answer_tokens=8, timed_tokens=8)
    assert choice.setting in {c.setting for c in choice.candidates} and choice.greedy_ms > 0
    assert all(c.round_ms > 0 and c.tau >= 1 for c in choice.candidates)


def test_the_drafter_folder_gives_its_token_counts(tmp_path, target, drafter):
    assert auto.drafter_token_counts(drafter) is None  # a fresh drafter has no folder
    drafter.save_pretrained(tmp_path)
    loaded = load_drafter(tmp_path, target)
    assert auto.drafter_token_counts(loaded) is None  # a folder without draft_vocab.json
    save_token_counts(tmp_path, count_answer_tokens([([3, 3, 4], [1, 1, 1])]), source="rows")
    assert auto.drafter_token_counts(loaded)["ids"] == [3, 4]


def test_evaluate_prompts_auto_rows_carry_the_quality_and_the_speed_setting(target, drafter):
    rows = evaluate_prompts(target, drafter, PROMPTS[:2], budgets=[4], max_new_tokens=12, progress=False,
                            auto=auto.auto_probe(target), label="x")
    fixed = evaluate_prompts(target, drafter, PROMPTS[:2], budgets=[4], max_new_tokens=12, progress=False)
    for row, plain in zip(rows, fixed):
        assert row["decode"] == "auto" and plain["decode"] == "fixed" and "auto_setting" not in plain
        assert row["tau"] == plain["tau"] and row["block_lengths"] == plain["block_lengths"]  # quality at B=4
        setting = DecodeSetting(row["auto_budget"], row["auto_draft_vocab"], row["auto_copy_tail"],
                                row["auto_copy_lead"], row["auto_miss_steps"])
        assert row["auto_setting"] == setting.label and row["auto_budget"] <= 4  # 0: greedy, no drafter
        assert row["auto_tau"] == sum(row["auto_block_lengths"]) / len(row["auto_block_lengths"])
        assert row["matches_target"] is True and row["new_tokens"] == row["fixed_new_tokens"] == 12
        assert row["speedup"] == pytest.approx(row["tokens_per_s"] / row["ar_tokens_per_s"])
        assert row["fixed_speedup"] == pytest.approx(row["fixed_tokens_per_s"] / row["ar_tokens_per_s"])
        assert row["auto_reason"].startswith("decode auto -> ")
    settings = dict(budgets=[4], temperatures=[0.0], max_new_tokens=12, verifier="tev", baseline=True, oracle=False,
                    seed=0, decode="auto", drafter_temperature=1.0)
    with pytest.raises(ValueError, match="eval.decode=auto needs the CPU decode probe"):
        HeldOutEvaluator(target, PROMPTS[:1], settings)


def test_the_evaluator_shows_speed_on_a_cpu_only_at_decode_auto(target, drafter):
    """The plain decoder's speed on a CPU is no figure a user can act on: its rows carry no tokens/s
    and the report says why; with the probe the speed columns are there."""
    settings = dict(budgets=[4], temperatures=[0.0], max_new_tokens=8, verifier="tev", baseline=True, oracle=False,
                    seed=0, decode="fixed", drafter_temperature=1.0)
    plain, _, _ = HeldOutEvaluator(target, PROMPTS[:1], settings, chain=False).measure(drafter, "x")
    assert "tokens_per_s" not in plain[0] and "speedup" not in plain[0] and plain[0]["lossless"] is True
    assert "tok/s" not in format_report(plain) and "Speed: not measured" in format_report(plain)
    fast, _, _ = HeldOutEvaluator(target, PROMPTS[:1], {**settings, "decode": "auto"},
                                  auto=auto.auto_probe(target), chain=False).measure(drafter, "x")
    assert fast[0]["speedup"] > 0 and "tok/s" in format_report(fast)
    assert "Speed: not measured" not in format_report(fast)
