"""The prompt bootstrap: a ratio of sums over units (prompts) resampled with replacement.

Every figure of a decode that is pooled over prompts is such a ratio: tau is tokens over rounds,
a speedup is tokens times a greedy step over the rounds' cost. The prompts are the unit that
varies (one prompt restates its question, the next does not), so they are what is resampled,
with their rounds kept together. Seeded: the same inputs give the same draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "bootstrap_ci", "paired_pooled_difference", "paired_pooled_difference_reference", "pooled", "resampled_ratios",
    "resampled_ratios_reference",
]


def _picks(units: int, draws: int, seed: int) -> torch.Tensor:
    """(N, P) unit indices, each draw ``units`` picks with replacement."""
    if units < 1:
        raise ValueError("the bootstrap needs at least one unit (prompt) to resample")
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws!r}")
    return torch.randint(units, (draws, units), generator=torch.Generator().manual_seed(seed))


def resampled_ratios(numerator: Sequence[float], denominator: Sequence[float], *, draws: int = 2000,
                     seed: int = 0) -> torch.Tensor:
    """(N,) float64: ``sum numerator / sum denominator`` over ``draws`` resamples of the units.

    ``numerator[p]`` and ``denominator[p]`` are unit p's totals (for tau: its tokens and its
    rounds). A draw whose denominator sums to 0 gives 0 (no rounds: nothing decoded).
    """
    if len(numerator) != len(denominator):
        raise ValueError(f"numerator and denominator need one value per unit, got {len(numerator)} and "
                         f"{len(denominator)}")
    pick_NP = _picks(len(numerator), draws, seed)
    num_N = torch.tensor(numerator, dtype=torch.float64)[pick_NP].sum(1)
    den_N = torch.tensor(denominator, dtype=torch.float64)[pick_NP].sum(1)
    return torch.where(den_N != 0, num_N / den_N.where(den_N != 0, torch.ones_like(den_N)), torch.zeros_like(num_N))


def resampled_ratios_reference(numerator: Sequence[float], denominator: Sequence[float], *, draws: int = 2000,
                               seed: int = 0) -> torch.Tensor:
    """The slow twin of :func:`resampled_ratios`: the same draws, summed one pick at a time."""
    out = []
    for picks in _picks(len(numerator), draws, seed).tolist():
        num = sum(float(numerator[p]) for p in picks)
        den = sum(float(denominator[p]) for p in picks)
        out.append(num / den if den else 0.0)
    return torch.tensor(out, dtype=torch.float64)


def bootstrap_ci(per_prompt: Sequence[Sequence[float]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled mean of ``per_prompt``'s values (for tau, each prompt's block
    lengths: the per-round mean over all prompts), resampling the prompts with replacement."""
    stats = sorted(resampled_ratios([sum(p) for p in per_prompt], [len(p) for p in per_prompt], draws=resamples,
                                    seed=seed).tolist())
    return stats[int(0.025 * resamples)], stats[min(resamples - 1, int(0.975 * resamples))]


def pooled(per_prompt: Sequence[Sequence[float]]) -> float:
    """The pooled mean of ``per_prompt``'s values: for tau, total tokens / total rounds, as a decode
    counts it (each prompt's block lengths; 0.0 when no prompt has a round)."""
    rounds = sum(len(p) for p in per_prompt)
    return sum(map(sum, per_prompt)) / rounds if rounds else 0.0


def _paired_totals(first, second) -> tuple[list[float], list[float], list[float], list[float]]:
    if len(first) != len(second):
        raise ValueError(f"a paired difference needs both drafters' rows on the same prompts, got {len(first)} and "
                         f"{len(second)} prompts")
    return ([sum(p) for p in first], [len(p) for p in first], [sum(p) for p in second], [len(p) for p in second])


def paired_pooled_difference(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]], *,
                             draws: int = 2000, seed: int = 0) -> dict:
    """``pooled(first) - pooled(second)`` and its 95% interval, the prompts resampled jointly.

    ``first[p]`` and ``second[p]`` are two drafters' block lengths on prompt p (the same answer
    walked, or the same seed decoded): each draw picks prompts with replacement and takes the
    difference of the two pooled taus over the picks, so what the prompts share cancels. Returns
    ``{"delta", "ci95": [low, high], "prompts"}``. ValueError when the prompt counts differ or there
    is no prompt.
    """
    num_a, den_a, num_b, den_b = _paired_totals(first, second)
    pick_NP = _picks(len(num_a), draws, seed)

    def ratio(num, den):
        n_N = torch.tensor(num, dtype=torch.float64)[pick_NP].sum(1)
        d_N = torch.tensor(den, dtype=torch.float64)[pick_NP].sum(1)
        return torch.where(d_N != 0, n_N / d_N.where(d_N != 0, torch.ones_like(d_N)), torch.zeros_like(n_N))

    stats = (ratio(num_a, den_a) - ratio(num_b, den_b)).sort().values.tolist()
    return {"delta": pooled(first) - pooled(second),
            "ci95": [stats[int(0.025 * draws)], stats[min(draws - 1, int(0.975 * draws))]], "prompts": len(num_a)}


def paired_pooled_difference_reference(first: Sequence[Sequence[float]], second: Sequence[Sequence[float]], *,
                                       draws: int = 2000, seed: int = 0) -> dict:
    """The slow twin of :func:`paired_pooled_difference`: the same draws, one pick at a time."""
    num_a, den_a, num_b, den_b = _paired_totals(first, second)
    stats = []
    for picks in _picks(len(num_a), draws, seed).tolist():
        a = sum(den_a[p] for p in picks)
        b = sum(den_b[p] for p in picks)
        first_tau = sum(num_a[p] for p in picks) / a if a else 0.0
        stats.append(first_tau - (sum(num_b[p] for p in picks) / b if b else 0.0))
    stats.sort()
    return {"delta": pooled(first) - pooled(second),
            "ci95": [stats[int(0.025 * draws)], stats[min(draws - 1, int(0.975 * draws))]], "prompts": len(num_a)}
