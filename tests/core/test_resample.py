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
