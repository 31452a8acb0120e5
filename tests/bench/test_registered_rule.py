"""The registered decision rule on constructed replicates: the verdicts, the fixed sequence, the
robustness rows, the adapters of both sources and the report."""

from __future__ import annotations

import math

import pytest
import torch

from exittrain.bench.registered_rule import (
    Contrast,
    evaluator_totals,
    registered_readings,
    to_markdown,
    trimmed_prompts,
    verdict,
    vllm_totals,
)
from exittrain.serve.compare import acceptance_interval

T06 = ("ddtree", 16, 0.6)
T0 = ("ddtree", 16, 0.0)
CHAIN = ("chain", 7, 0.6)
PROMPTS = 40


def _rows(tau_P: torch.Tensor, first_prompt: int = 0) -> dict[int, tuple[float, float]]:
    """``{prompt index: (tokens, rounds)}`` with per-prompt tau ``tau_P`` and 5-11 rounds per prompt."""
    return {first_prompt + p: (float(t) * (5 + p % 7), float(5 + p % 7)) for p, t in enumerate(tau_P.tolist())}


def _replicates(gains: dict[str, dict[tuple, list[float]]], seeds=(0, 1, 2), noise: float = 0.02,
                seed: int = 0) -> dict:
    """Totals of a control ``C`` (tau 3 + prompt effect + noise) and arms whose seed s gains
    ``gains[arm][setting][s]`` tokens a round on every prompt (plus the same kind of noise)."""
    gen = torch.Generator().manual_seed(seed)
    settings = sorted({setting for per in gains.values() for setting in per})
    base = {setting: 3.0 + 0.5 * torch.randn(PROMPTS, generator=gen, dtype=torch.float64) for setting in settings}
    totals: dict[str, dict] = {}
    for s in seeds:
        totals[f"C@seed{s}"] = {st: _rows(base[st] + noise * torch.randn(PROMPTS, generator=gen, dtype=torch.float64))
                                for st in settings}
        for arm, per in gains.items():
            totals[f"{arm}@seed{s}"] = {st: _rows(base[st] + g[s] + noise * torch.randn(PROMPTS, generator=gen,
                                                                                         dtype=torch.float64))
                                        for st, g in per.items()}
    return totals


def test_the_verdict_follows_the_registered_words():
    assert verdict(0.2, 0.05, 0.3, [0.1, 0.2, 0.3], delta=0.1) == "confirmed"
    assert verdict(0.2, 0.05, 0.3, [0.1, -0.01, 0.3], delta=0.1) == "inconclusive"  # a seed below 0
    assert verdict(0.08, 0.05, 0.3, [0.1, 0.1, 0.04], delta=0.1) == "inconclusive"  # the estimate short of delta
    assert verdict(0.2, -0.01, 0.3, [0.1, 0.2, 0.3], delta=0.1) == "inconclusive"  # the interval touches 0
    assert verdict(0.02, -0.01, 0.09, [0.02] * 3, delta=0.1) == "refuted"
    assert verdict(0.02, -0.01, 0.1, [0.02] * 3, delta=0.1) == "inconclusive"  # the upper bound reaches delta
    with pytest.raises(ValueError, match="per_seed is empty"):
        verdict(0.1, 0.0, 0.2, [], delta=0.1)


def test_confirmed_refuted_and_inconclusive_on_constructed_replicates():
    totals = _replicates({"N": {T06: [0.3, 0.32, 0.28]}, "E": {T06: [0.0, 0.0, 0.0]},
                          "W": {T06: [0.06, -0.05, 0.02]}})
    readings = registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N - C")],
                                            [Contrast("E", "C", T06, 0.05, "E - C")],
                                            [Contrast("W", "C", T06, 0.05, "W - C")]], draws=400)
    n, e, w = readings
    assert (n["verdict"], n["reading"], n["role"]) == ("confirmed", "confirmed", "primary")
    assert n["seeds"] == [0, 1, 2] and n["prompts"] == PROMPTS and n["estimate"] == pytest.approx(0.3, abs=0.02)
    assert len(n["per_seed"]) == 3 and n["ci95"][0] > 0.2
    assert e["verdict"] == "refuted" and e["ci95"][1] < 0.05
    assert w["verdict"] == "inconclusive"
    # the log ratio: the same direction, about log(1 + 0.3 / 3) for N
    assert n["log_ratio"]["estimate"] == pytest.approx(math.log(1.1), abs=0.02) and n["log_ratio"]["ci95"][0] > 0
    assert e["log_ratio"]["ci95"][0] < 0 < e["log_ratio"]["ci95"][1]


def test_an_interval_above_zero_with_one_seed_below_it_is_not_confirmed():
    # five seeds, so that the draws picking mostly the one losing seed stay under 2.5%: the interval clears 0
    gains = [0.4, 0.35, 0.45, 0.4, -0.03]
    totals = _replicates({"N": {T06: gains}}, seeds=range(5), noise=0.005)
    (n,) = registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N - C")]], draws=1000)
    assert n["ci95"][0] > 0 and n["estimate"] >= 0.05 and min(n["per_seed"]) < 0
    assert n["verdict"] == "inconclusive"
    # negative control: the same seeds without the losing one are confirmed
    gains[-1] = 0.03
    (m,) = registered_readings(_replicates({"N": {T06: gains}}, seeds=range(5), noise=0.005),
                               [[Contrast("N", "C", T06, 0.05, "N - C")]], draws=1000)
    assert m["verdict"] == "confirmed"


def test_the_fixed_sequence_reads_a_contrast_only_after_every_one_before_was_confirmed():
    good = [0.3, 0.3, 0.3]
    totals = _replicates({"N": {T06: [0.0] * 3, T0: good, CHAIN: good},  # the primary fails
                          "E": {T06: good, T0: [0.02, 0.0, 0.01], CHAIN: good}})  # the first secondary fails
    sequences = [[Contrast("N", "C", T06, 0.05, "N T=0.6"), Contrast("N", "C", T0, 0.10, "N T=0"),
                  Contrast("N", "C", CHAIN, 0.05, "N chain")],
                 [Contrast("E", "C", T06, 0.05, "E T=0.6"), Contrast("E", "C", T0, 0.10, "E T=0"),
                  Contrast("E", "C", CHAIN, 0.05, "E chain")]]
    readings = registered_readings(totals, sequences, draws=400)
    assert [r["label"] for r in readings] == ["N T=0.6", "N T=0", "N chain", "E T=0.6", "E T=0", "E chain"]
    assert [r["role"] for r in readings[:3]] == ["primary", "secondary 1", "secondary 2"]
    assert [r["sequence"] for r in readings] == [0, 0, 0, 1, 1, 1]
    assert [r["verdict"] for r in readings] == ["refuted", "confirmed", "confirmed", "confirmed", "refuted",
                                                "confirmed"]
    # each sequence on its own: N's failed primary leaves its secondaries descriptive, E's primary is read
    assert [r["reading"] for r in readings] == ["refuted", "descriptive", "descriptive", "confirmed", "refuted",
                                                "descriptive"]


def test_a_missing_arm_is_not_measured_and_ends_its_sequence():
    good = [0.3, 0.3, 0.3]
    totals = _replicates({"N": {T06: good, CHAIN: good}})  # N never measured at T = 0; no E at all
    readings = registered_readings(totals, [
        [Contrast("N", "C", T06, 0.05, "N T=0.6"), Contrast("N", "C", T0, 0.10, "N T=0"),
         Contrast("N", "C", CHAIN, 0.05, "N chain")],
        [Contrast("E", "C", T06, 0.05, "E T=0.6")]], draws=500)
    assert [r["reading"] for r in readings] == ["confirmed", "not measured", "descriptive", "not measured"]
    assert readings[2]["verdict"] == "confirmed"  # still computed, only not read
    assert "arm" in readings[3]["why"] and readings[3]["verdict"] is None and "estimate" not in readings[3]
    # an arm trained without --train-seeds (no @seed) is no replicate: not measured either
    plain = {name.removesuffix("@seed0"): v for name, v in totals.items() if name.startswith("N@seed0")}
    (r,) = registered_readings({**{k: v for k, v in totals.items() if not k.startswith("N@")}, **plain},
                               [[Contrast("N", "C", T06, 0.05, "N")]], draws=200)
    assert r["reading"] == "not measured"


def test_the_trimmed_row_drops_the_prompts_that_gain_most():
    gen = torch.Generator().manual_seed(3)
    base = 3.0 + 0.5 * torch.randn(PROMPTS, generator=gen, dtype=torch.float64)
    gain = torch.full((PROMPTS,), 0.05, dtype=torch.float64)
    gain[[3, 17]] = torch.tensor([2.0, 1.5], dtype=torch.float64)  # two prompts carry most of the gain
    gain[25] = 1.2  # the third largest on average, but not in the top ceil(5% of 40) = 2
    totals = {}
    for s in range(3):
        totals[f"C@seed{s}"] = {T06: _rows(base, first_prompt=100)}
        totals[f"N@seed{s}"] = {T06: _rows(base + gain + 0.01 * s, first_prompt=100)}
    (n,) = registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N")]], draws=500)
    assert n["trimmed"]["dropped"] == [103, 117]  # prompt indices, not positions
    assert n["trimmed"]["prompts"] == PROMPTS - 2
    assert n["trimmed"]["estimate"] < n["estimate"] - 0.05
    # what is left: seed 0 gains each kept prompt's gain, pooled over its rounds (5 + p % 7)
    kept = [p for p in range(PROMPTS) if p not in (3, 17)]
    expected = sum(gain[p].item() * (5 + p % 7) for p in kept) / sum(5 + p % 7 for p in kept)
    assert n["trimmed"]["per_seed"][0] == pytest.approx(expected, rel=1e-9)
    assert n["trimmed"]["verdict"] in ("confirmed", "inconclusive", "refuted")
    # ceil in integers: 5% of 60 prompts is 3 (floats would make it 4), of 61 is 4, of 20 is 1
    for prompts, dropped in ((60, 3), (61, 4), (20, 1)):
        side = {0: [(float(p), 1.0) for p in range(prompts)]}
        flat = {0: [(0.0, 1.0)] * prompts}
        assert trimmed_prompts(side, flat) == list(range(prompts - dropped, prompts))


def test_mismatched_prompts_or_seeds_are_named():
    totals = _replicates({"N": {T06: [0.3, 0.3, 0.3]}})
    del totals["N@seed1"][T06][7]
    with pytest.raises(ValueError, match="contrast 'N - C'.*seed 1 was measured on prompts \\[7\\]"):
        registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N - C")]], draws=100)
    totals = _replicates({"N": {T06: [0.3, 0.3, 0.3]}})
    del totals["C@seed2"]
    with pytest.raises(ValueError, match="training seeds \\[0, 1, 2\\] differ from the control's \\[0, 1\\]"):
        registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N - C")]], draws=100)
    with pytest.raises(ValueError, match="delta"):
        Contrast("N", "C", T06, 0.0, "N - C")
    with pytest.raises(ValueError, match="setting"):
        Contrast("N", "C", ("ddtree", 16), 0.05, "N - C")


def test_the_adapters_give_each_source_its_own_pooled_tau():
    # vLLM: tokens / rounds is its acceptance length 1 + accepted / drafts, pooled as it pools
    counts = [{"drafts": 4, "accepted_tokens": 6}, {"drafts": 0, "accepted_tokens": 0},
              {"drafts": 7, "accepted_tokens": 3}]
    rows = vllm_totals(counts)
    assert rows == {0: (10.0, 4.0), 1: (0.0, 0.0), 2: (10.0, 7.0)}
    pooled = sum(t for t, _ in rows.values()) / sum(r for _, r in rows.values())
    assert pooled == pytest.approx(acceptance_interval(counts)["mean"])
    with pytest.raises(ValueError, match="vLLM prompt 0"):
        vllm_totals([{"drafts": 3}])
    # the evaluator: its per-prompt rows' block lengths, summed and counted
    by_setting = {T06: {0: {"block_lengths": [3, 1, 2]}, 5: {"block_lengths": [4]}}}
    assert evaluator_totals(by_setting) == {T06: {0: (6.0, 3), 5: (4.0, 1)}}


def test_the_report_lists_every_contrast_in_order_with_its_robustness_rows():
    totals = _replicates({"N": {T06: [0.3, 0.3, 0.3]}})
    readings = registered_readings(totals, [[Contrast("N", "C", T06, 0.05, "N - C"),
                                             Contrast("N", "C", T0, 0.10, "N - C at T=0")]], draws=200)
    text = to_markdown(readings)
    main = [line for line in text.splitlines() if line.startswith("| N - C")]
    assert len(main) == 4  # two contrasts in each table
    assert "ddtree B=16, T=0.6" in main[0] and "confirmed | confirmed" in main[0]
    assert "not measured (no replicate" in main[1]
    assert "2 prompts" in main[2] and main[3].endswith("| - | - | - | - |")
