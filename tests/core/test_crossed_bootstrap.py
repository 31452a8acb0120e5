"""The crossed bootstrap over training seeds and prompts against its slow twin, its reductions, its
coverage on simulated experiments, and its errors."""

from __future__ import annotations

import random

import pytest
import torch

from exittrain.core import (
    crossed_paired_difference,
    crossed_paired_difference_reference,
    paired_pooled_difference,
    prompt_totals,
)


def _random_side(gen: torch.Generator, seeds: int, prompts: int) -> dict[int, list[tuple[float, float]]]:
    """Per seed, each prompt's (tokens, rounds): fractional tokens so that summation order shows."""
    return {s: [(float(torch.rand(1, generator=gen)) * 40 + 1, int(torch.randint(1, 9, (1,), generator=gen)))
                for _ in range(prompts)] for s in (10, 3, 7)[:seeds]}


@pytest.mark.parametrize("endpoint", ["difference", "log_ratio"])
def test_the_fast_path_equals_its_twin_draw_for_draw(endpoint):
    gen = torch.Generator().manual_seed(4)
    arm, control = _random_side(gen, 3, 23), _random_side(gen, 3, 23)
    fast = crossed_paired_difference(arm, control, endpoint=endpoint, draws=600, seed=9)
    slow = crossed_paired_difference_reference(arm, control, endpoint=endpoint, draws=600, seed=9)
    assert fast["seeds"] == slow["seeds"] == [3, 7, 10] and fast["prompts"] == 23 and fast["draws"] == 600
    assert fast["estimate"] == pytest.approx(slow["estimate"], rel=1e-12, abs=1e-12)
    assert fast["per_seed"] == pytest.approx(slow["per_seed"], rel=1e-12, abs=1e-12)
    assert fast["ci95"] == pytest.approx(slow["ci95"], rel=1e-12, abs=1e-12)
    # the estimate is the mean of the seeds' own pooled statistics over every prompt
    own = [sum(t for t, _ in arm[s]) / sum(r for _, r in arm[s]) - sum(t for t, _ in control[s]) /
           sum(r for _, r in control[s]) for s in (3, 7, 10)]
    if endpoint == "difference":
        assert fast["per_seed"] == pytest.approx(own, rel=1e-12)
    # another generator seed moves the interval (the draws are the seed's)
    assert crossed_paired_difference(arm, control, endpoint=endpoint, draws=600, seed=10)["ci95"] != fast["ci95"]


def test_one_seed_is_the_paired_prompt_bootstrap_draw_for_draw():
    # the prompt picks come first from the same generator as _picks: with one seed (every seed pick is
    # that seed) the draws, and so the interval, are paired_pooled_difference's exactly
    rng = random.Random(1)
    first = [[rng.randint(1, 6) for _ in range(rng.randint(1, 10))] for _ in range(30)]
    second = [[rng.randint(1, 6) for _ in range(rng.randint(1, 10))] for _ in range(30)]
    crossed = crossed_paired_difference({0: prompt_totals(first)}, {0: prompt_totals(second)}, draws=2000, seed=5)
    paired = paired_pooled_difference(first, second, draws=2000, seed=5)
    assert crossed["estimate"] == paired["delta"] and crossed["ci95"] == paired["ci95"]
    assert crossed["per_seed"] == [paired["delta"]]


def test_identical_sides_give_zero_and_a_zero_interval_and_a_shift_moves_both():
    gen = torch.Generator().manual_seed(2)
    side = _random_side(gen, 3, 15)
    same = crossed_paired_difference(side, side, draws=500)
    assert same["estimate"] == 0.0 and same["ci95"] == [0.0, 0.0] and same["per_seed"] == [0.0] * 3
    assert crossed_paired_difference(side, side, endpoint="log_ratio", draws=500)["ci95"] == [0.0, 0.0]
    # every prompt of the arm gains exactly 0.25 tokens a round: every draw is 0.25
    shifted = {s: [(t + 0.25 * r, r) for t, r in rows] for s, rows in side.items()}
    moved = crossed_paired_difference(shifted, side, draws=500)
    assert moved["estimate"] == pytest.approx(0.25) and moved["ci95"] == pytest.approx([0.25, 0.25])


def _experiment(gen: torch.Generator, seeds: int, prompts: int, true_gain: float) -> tuple[dict, dict]:
    """One simulated replicated experiment whose true pooled difference is ``true_gain``: each prompt gains
    ``true_gain`` plus its own prompt effect (sd 0.3, what differs between prompts), each (seed, prompt) cell
    adds training noise (sd 0.1); rounds are drawn independently of tau, so pooled = mean."""
    rounds = torch.randint(5, 30, (prompts,), generator=gen).double()
    base = 3.0 + 0.5 * torch.randn(prompts, generator=gen, dtype=torch.float64)
    gain = true_gain + 0.3 * torch.randn(prompts, generator=gen, dtype=torch.float64)
    arm, control = {}, {}
    for s in range(seeds):
        tau_arm = base + gain + 0.1 * torch.randn(prompts, generator=gen, dtype=torch.float64)
        tau_control = base + 0.1 * torch.randn(prompts, generator=gen, dtype=torch.float64)
        arm[s] = list(zip((tau_arm * rounds).tolist(), rounds.tolist()))
        control[s] = list(zip((tau_control * rounds).tolist(), rounds.tolist()))
    return arm, control


def test_the_interval_covers_a_known_pooled_difference_about_95_percent_of_the_time():
    gen = torch.Generator().manual_seed(11)
    covered = biased = 0
    for i in range(200):
        arm, control = _experiment(gen, seeds=3, prompts=60, true_gain=0.1)
        low, high = crossed_paired_difference(arm, control, draws=500, seed=i)["ci95"]
        covered += low <= 0.1 <= high
        biased += low <= 0.2 <= high  # negative control: a wrong truth, 0.1 off, is covered far less often
    assert 0.90 <= covered / 200 <= 0.99
    assert biased / 200 < 0.6


def test_bad_input_is_named_with_its_fix():
    side = {0: [(4.0, 2), (6.0, 3)], 1: [(5.0, 2), (3.0, 1)]}
    with pytest.raises(ValueError, match="training seeds"):
        crossed_paired_difference(side, {0: side[0], 2: side[1]})
    with pytest.raises(ValueError, match="prompt counts differ"):
        crossed_paired_difference(side, {0: side[0], 1: side[1][:1]})
    with pytest.raises(ValueError, match="prompt counts differ"):
        uneven = {0: side[0], 1: side[1] + [(2.0, 1)]}  # seed 1 measured on one prompt more than seed 0
        crossed_paired_difference(uneven, uneven)
    with pytest.raises(ValueError, match="no round on any prompt"):
        crossed_paired_difference(side, {0: side[0], 1: [(0.0, 0), (0.0, 0)]})
    with pytest.raises(ValueError, match="no training seed"):
        crossed_paired_difference({}, {})
    with pytest.raises(ValueError, match="no prompt"):
        crossed_paired_difference({0: []}, {0: []})
    with pytest.raises(ValueError, match="not a \\(tokens, rounds\\) pair"):
        crossed_paired_difference({0: [(4.0, -1)]}, {0: [(4.0, 1)]})
    with pytest.raises(ValueError, match="endpoint"):
        crossed_paired_difference(side, side, endpoint="ratio")
    # a prompt without a round is fine, until a draw picks only such prompts for a seed: then it is named
    sparse = {0: [(3.0, 2)] + [(0.0, 0)] * 3}
    for fn in (crossed_paired_difference, crossed_paired_difference_reference):
        with pytest.raises(ValueError, match="bootstrap draws picked prompts without a round"):
            fn(sparse, sparse, draws=200)
