"""The prompt bootstrap: a ratio of sums over units (prompts) resampled with replacement.

Every figure of a decode that is pooled over prompts is such a ratio: tau is tokens over rounds,
a speedup is tokens times a greedy step over the rounds' cost. The prompts are the unit that
varies (one prompt restates its question, the next does not), so they are what is resampled,
with their rounds kept together. Seeded: the same inputs give the same draws.

With replicates (drafters trained under several seeds), :func:`crossed_paired_difference` resamples
the training seeds and the prompts at once: both vary, and a verdict should carry both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

__all__ = [
    "CROSSED_DRAWS", "CROSSED_ENDPOINTS", "bootstrap_ci", "crossed_paired_difference",
    "crossed_paired_difference_reference", "paired_pooled_difference", "paired_pooled_difference_reference", "pooled",
    "prompt_totals", "resampled_ratios", "resampled_ratios_reference",
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


def _interval95(stats: Sequence[float]) -> list[float]:
    """The 95% percentile interval of sorted bootstrap draws: ``[stats[int(0.025 N)], stats[min(N - 1,
    int(0.975 N))]]``, the one convention every interval here uses."""
    n = len(stats)
    return [stats[int(0.025 * n)], stats[min(n - 1, int(0.975 * n))]]


def bootstrap_ci(per_prompt: Sequence[Sequence[float]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled mean of ``per_prompt``'s values (for tau, each prompt's block
    lengths: the per-round mean over all prompts), resampling the prompts with replacement."""
    stats = sorted(resampled_ratios([sum(p) for p in per_prompt], [len(p) for p in per_prompt], draws=resamples,
                                    seed=seed).tolist())
    low, high = _interval95(stats)
    return low, high


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
            "ci95": _interval95(stats), "prompts": len(num_a)}


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
            "ci95": _interval95(stats), "prompts": len(num_a)}


# --- The crossed bootstrap: training seeds and prompts resampled at once -------------------------------
#
# Legend: S training seeds (drafter replicates), P prompts, N bootstrap draws.

CROSSED_ENDPOINTS = ("difference", "log_ratio")


def prompt_totals(block_lengths_per_prompt: Sequence[Sequence[float]]) -> list[tuple[float, int]]:
    """Each prompt's ``(tokens, rounds)``: the sum and the count of its block lengths, what a pooled tau
    adds up (:func:`crossed_paired_difference` takes these)."""
    return [(float(sum(p)), len(p)) for p in block_lengths_per_prompt]


def _crossed_totals(arm: Mapping[int, Sequence[tuple[float, float]]],
                    control: Mapping[int, Sequence[tuple[float, float]]],
                    endpoint: str) -> tuple[list[int], list[list[list[float]]]]:
    """``(seeds, [arm tokens, arm rounds, control tokens, control rounds])``, each an S x P list, the seeds
    sorted; ValueError naming what is wrong and the fix."""
    if endpoint not in CROSSED_ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r}: pass one of {CROSSED_ENDPOINTS}")
    if set(arm) != set(control):
        raise ValueError(f"the arm's training seeds {sorted(arm)} differ from the control's {sorted(control)}: pair "
                         "each arm replicate with the control of the same seed, and pass the same seeds on both sides")
    if not arm:
        raise ValueError("no training seed: pass at least one seed's per-prompt (tokens, rounds) on each side")
    seeds = sorted(arm)
    prompts = {f"{side} seed {s}": len(rows[s]) for side, rows in (("arm", arm), ("control", control)) for s in seeds}
    if len(set(prompts.values())) != 1:
        raise ValueError(f"prompt counts differ between seeds or sides ({prompts}): measure every replicate of both "
                         "drafters on the same prompts, in the same order")
    if next(iter(prompts.values())) == 0:
        raise ValueError("no prompt: the crossed bootstrap needs at least one prompt per seed")
    tables: list[list[list[float]]] = [[], [], [], []]
    for side, rows, tok, rnd in (("arm", arm, tables[0], tables[1]), ("control", control, tables[2], tables[3])):
        for s in seeds:
            for p, row in enumerate(rows[s]):
                if len(row) != 2 or not (0 <= float(row[0]) < math.inf and 0 <= float(row[1]) < math.inf):
                    raise ValueError(f"{side} seed {s} prompt {p}: {row!r} is not a (tokens, rounds) pair of finite "
                                     "non-negative numbers; pass prompt_totals(block lengths) per prompt")
            tok.append([float(t) for t, _ in rows[s]])
            rnd.append([float(r) for _, r in rows[s]])
            if not sum(rnd[-1]):
                raise ValueError(f"{side} seed {s} has no round on any prompt: its pooled tau is undefined; check "
                                 "that replicate's measurement")
            if endpoint == "log_ratio" and not sum(tok[-1]):
                raise ValueError(f"{side} seed {s} has no token: its log ratio is undefined; check that replicate's "
                                 "measurement")
    return seeds, tables


def _crossed_picks(seeds: int, prompts: int, draws: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(pick_NP, seed_pick_NS)``: each draw's prompts and training seeds, with replacement. The prompt picks
    come first from the generator, so they are :func:`_picks`' own: with one seed the crossed bootstrap
    makes :func:`paired_pooled_difference`'s draws."""
    if prompts < 1 or seeds < 1:
        raise ValueError("the crossed bootstrap needs at least one seed and one prompt")
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws!r}")
    gen = torch.Generator().manual_seed(seed)
    pick_NP = torch.randint(prompts, (draws, prompts), generator=gen)
    return pick_NP, torch.randint(seeds, (draws, seeds), generator=gen)


def _seed_statistic(arm_tau: float, control_tau: float, endpoint: str) -> float:
    return arm_tau - control_tau if endpoint == "difference" else math.log(arm_tau / control_tau)


def _undefined_draws(count: int, draws: int) -> ValueError:
    return ValueError(f"{count} of {draws} bootstrap draws picked prompts without a round (or, for the log ratio, "
                      "without a token) on one side for one seed, where the pooled ratio is undefined: pass more "
                      "prompts, or leave out prompts that have no round on either side (say so in the report)")


def _crossed_result(seeds: list[int], tables, stats: list[float], endpoint: str, draws: int) -> dict:
    per_seed = [_seed_statistic(sum(tables[0][i]) / sum(tables[1][i]), sum(tables[2][i]) / sum(tables[3][i]),
                                endpoint) for i in range(len(seeds))]
    stats = sorted(stats)
    return {"endpoint": endpoint, "estimate": sum(per_seed) / len(per_seed),
            "ci95": _interval95(stats),
            "per_seed": per_seed, "seeds": seeds, "prompts": len(tables[0][0]), "draws": draws}


# 4000 draws, twice paired_pooled_difference's 2000: a verdict reads the interval's bounds against 0 and
# delta, and each bound is an order statistic of the draws (the 100th of 4000), whose Monte Carlo
# error shrinks with the square root of the draws; the fast path draws 4000 in milliseconds.
CROSSED_DRAWS = 4000


def crossed_paired_difference(arm: Mapping[int, Sequence[tuple[float, float]]],
                              control: Mapping[int, Sequence[tuple[float, float]]], *,
                              endpoint: str = "difference", draws: int = CROSSED_DRAWS, seed: int = 0) -> dict:
    """The arm's pooled tau against the control's, training seeds and prompts resampled at once (crossed).

    ``arm[s][p]`` and ``control[s][p]`` are prompt p's ``(tokens, rounds)`` (:func:`prompt_totals`) for
    the replicate of training seed s, every replicate on the same P prompts in the same order (the same
    answers walked). For each seed, the paired pooled statistic over a set of prompts is

    - ``endpoint="difference"``: ``pooled(arm) - pooled(control)``, pooled = sum of tokens / sum of rounds;
    - ``endpoint="log_ratio"``: ``log(pooled(arm) / pooled(control))``.

    **Estimate**: the mean over the S seeds of each seed's statistic over all P prompts (``per_seed``).
    **One draw**: S seeds picked with replacement from the S seeds and, independently, P prompts picked
    with replacement from the P prompts, the same prompt picks for every seed of the draw (the prompts
    are shared by the seeds); the draw is the mean over the picked seeds of each one's statistic over the
    picked prompts (a prompt picked twice counts twice, a seed picked twice counts twice). **Interval**:
    the draws sorted, ``[stats[int(0.025 N)], stats[min(N - 1, int(0.975 N))]]``, as
    :func:`bootstrap_ci`. Seeded: the same inputs give the same draws; with one seed the prompt picks
    are :func:`paired_pooled_difference`'s for the same ``draws`` and ``seed``.

    Returns ``{"endpoint", "estimate", "ci95": [low, high], "per_seed", "seeds", "prompts", "draws"}``.

    Limits: with S seeds the seed resampling sees at most the S seeds measured; with S = 3 it cannot
    show training noise larger than their spread (the interval is then too narrow in the seed
    direction). ValueError, naming the fix: different seed sets on the two sides, different prompt
    counts between sides or seeds, a row that is not a (tokens, rounds) pair, a seed without a round
    (or, for the log ratio, without a token), or a draw whose picked prompts hold no round for a
    picked seed (the pooled ratio undefined there).
    """
    seeds, tables = _crossed_totals(arm, control, endpoint)
    tok_a_SP, rnd_a_SP, tok_c_SP, rnd_c_SP = (torch.tensor(t, dtype=torch.float64) for t in tables)
    pick_NP, seed_pick_NS = _crossed_picks(len(seeds), tok_a_SP.shape[1], draws, seed)
    count_NP = torch.zeros(pick_NP.shape, dtype=torch.float64).scatter_add_(
        1, pick_NP, torch.ones(pick_NP.shape, dtype=torch.float64))  # how often each prompt is picked

    def picked(total_SP):  # (S, N): each seed's total over each draw's picked prompts
        return total_SP @ count_NP.T

    tok_a_SN, rnd_a_SN, tok_c_SN, rnd_c_SN = map(picked, (tok_a_SP, rnd_a_SP, tok_c_SP, rnd_c_SP))
    undefined_SN = (rnd_a_SN == 0) | (rnd_c_SN == 0)
    if endpoint == "log_ratio":
        undefined_SN |= (tok_a_SN == 0) | (tok_c_SN == 0)
    undefined_N = undefined_SN.T.gather(1, seed_pick_NS).any(1)
    if undefined_N.any():
        raise _undefined_draws(int(undefined_N.sum()), draws)
    one = torch.ones_like(rnd_a_SN)
    tau_a_SN = tok_a_SN / rnd_a_SN.where(~undefined_SN, one)
    tau_c_SN = tok_c_SN / rnd_c_SN.where(~undefined_SN, one)
    if endpoint == "difference":
        stat_SN = tau_a_SN - tau_c_SN
    else:
        stat_SN = torch.log(tau_a_SN.where(~undefined_SN, one) / tau_c_SN.where(~undefined_SN, one))
    stat_N = stat_SN.T.gather(1, seed_pick_NS).mean(1)
    return _crossed_result(seeds, tables, stat_N.tolist(), endpoint, draws)


def crossed_paired_difference_reference(arm: Mapping[int, Sequence[tuple[float, float]]],
                                        control: Mapping[int, Sequence[tuple[float, float]]], *,
                                        endpoint: str = "difference", draws: int = CROSSED_DRAWS,
                                        seed: int = 0) -> dict:
    """The slow twin of :func:`crossed_paired_difference`: the same draws, one picked seed and one
    picked prompt at a time."""
    seeds, (tok_a, rnd_a, tok_c, rnd_c) = _crossed_totals(arm, control, endpoint)
    pick_NP, seed_pick_NS = _crossed_picks(len(seeds), len(tok_a[0]), draws, seed)
    stats, undefined = [], 0
    for prompts, picked_seeds in zip(pick_NP.tolist(), seed_pick_NS.tolist()):
        values = []
        for s in picked_seeds:
            ta = sum(tok_a[s][p] for p in prompts)
            ra = sum(rnd_a[s][p] for p in prompts)
            tc = sum(tok_c[s][p] for p in prompts)
            rc = sum(rnd_c[s][p] for p in prompts)
            if ra == 0 or rc == 0 or (endpoint == "log_ratio" and (ta == 0 or tc == 0)):
                values = None
                break
            values.append(_seed_statistic(ta / ra, tc / rc, endpoint))
        if values is None:
            undefined += 1
        else:
            stats.append(sum(values) / len(values))
    if undefined:
        raise _undefined_draws(undefined, draws)
    return _crossed_result(seeds, tables=[tok_a, rnd_a, tok_c, rnd_c], stats=stats, endpoint=endpoint, draws=draws)
