"""The prompt bootstrap of a pooled ratio against its slow twin, and its edges."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import resampled_ratios, resampled_ratios_reference


def test_the_fast_bootstrap_equals_its_twin_draw_for_draw():
    gen = torch.Generator().manual_seed(1)
    numerator = (torch.rand(7, generator=gen) * 40).tolist()
    denominator = torch.randint(0, 6, (7,), generator=gen).tolist()  # some units without rounds
    fast = resampled_ratios(numerator, denominator, draws=500, seed=3)
    slow = resampled_ratios_reference(numerator, denominator, draws=500, seed=3)
    assert fast.shape == (500,) and torch.allclose(fast, slow, rtol=1e-12, atol=0)


def test_alike_units_leave_nothing_to_resample_and_the_seed_fixes_the_draws():
    assert torch.equal(resampled_ratios([6.0] * 4, [2.0] * 4, draws=50), torch.full((50,), 3.0, dtype=torch.float64))
    a = resampled_ratios([1.0, 5.0, 9.0], [1.0, 2.0, 3.0], seed=7)
    assert torch.equal(a, resampled_ratios([1.0, 5.0, 9.0], [1.0, 2.0, 3.0], seed=7))
    assert not torch.equal(a, resampled_ratios([1.0, 5.0, 9.0], [1.0, 2.0, 3.0], seed=8))
    # every draw lies between the smallest and the largest unit's own ratio; the median is the pooled one
    assert a.min() >= 1.0 and a.max() <= 3.0
    assert a.median().item() == pytest.approx(15.0 / 6.0, abs=0.05)


def test_a_draw_of_units_without_rounds_is_zero_and_bad_input_is_named():
    assert resampled_ratios([0.0], [0.0], draws=3).tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="at least one unit"):
        resampled_ratios([], [])
    with pytest.raises(ValueError, match="one value per unit"):
        resampled_ratios([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="draws must be >= 1"):
        resampled_ratios([1.0], [1.0], draws=0)


def test_paired_pooled_difference_matches_its_twin_and_pools_rounds():
    """The fast paired bootstrap equals its loop twin draw for draw, and its delta is the difference of
    pooled taus (tokens / rounds), not of per-prompt means: prompt 0's many short rounds weigh more."""
    from exittrain.core import paired_pooled_difference, paired_pooled_difference_reference, pooled

    a = [[1, 1, 1, 1, 1, 1], [5, 5], [2, 3, 1]]
    b = [[1, 2, 1, 1, 1, 1], [3, 3, 2], [2, 2, 2]]
    fast = paired_pooled_difference(a, b, draws=500, seed=3)
    slow = paired_pooled_difference_reference(a, b, draws=500, seed=3)
    assert fast["ci95"] == pytest.approx(slow["ci95"], abs=1e-12)
    assert fast["delta"] == pytest.approx(pooled(a) - pooled(b))
    assert pooled(a) == pytest.approx(22 / 11)
    per_prompt_mean = sum(sum(p) / len(p) for p in a) / len(a)
    assert abs(pooled(a) - per_prompt_mean) > 0.5  # the two statistics differ here, so the test can fail
    assert fast["ci95"][0] <= fast["delta"] <= fast["ci95"][1]
    assert fast["prompts"] == 3


def test_paired_pooled_difference_of_a_drafter_with_itself_is_zero_and_bad_pairs_are_refused():
    from exittrain.core import paired_pooled_difference

    a = [[1, 2], [3], [1, 1, 4]]
    same = paired_pooled_difference(a, a, draws=200)
    assert same["delta"] == 0.0 and same["ci95"] == [0.0, 0.0]
    with pytest.raises(ValueError, match="same prompts"):
        paired_pooled_difference(a, a[:2])
