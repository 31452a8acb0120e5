"""The registered decision rule of a replicated experiment: node-loss arms against a block-CE control.

The protocol (the experiment's issue) fixes, before any measurement, the contrasts it reads: each an arm
against its control at one setting (shape, budget, temperature), with a margin ``delta`` in tokens per
round, grouped in sequences (a primary, then secondaries in a fixed order). This module reads them off
the per-prompt measurements of every drafter replicate (``ARM@seedS``,
:func:`exittrain.bench.exittrain_grid.replicate`); it measures nothing itself.

**The statistic.** tau pooled over prompts (total tokens / total rounds). For one contrast, each
training seed's paired pooled difference (the arm minus the control of the same seed, on the same
prompts, the same answers walked); the estimate is their mean, and the 95% interval resamples seeds
and prompts at once (:func:`exittrain.core.crossed_paired_difference`).

**The verdict** (:func:`verdict`): confirmed when every seed's own difference is above 0, the
interval's lower bound is above 0 and the estimate is at least ``delta``; refuted when the upper bound
is below ``delta``; otherwise inconclusive.

**The fixed sequence.** A contrast's verdict is read (``reading``) only while the primary and every
secondary before it in its sequence were confirmed; otherwise its reading is ``descriptive``. A
contrast whose arm or control (or the setting) was not measured reads ``not measured`` and ends its
sequence. Each sequence (one per primary) runs on its own.

**Registered robustness rows** (reported, never gating): the log ratio ``log(pooled arm / pooled
control)`` under the same crossed bootstrap (estimate and interval), and the estimate without the
top 5% of prompts (ranked by their seed-averaged per-prompt difference, the top ``ceil(5% of P)``
dropped; the same bootstrap and the same verdict on the rest).

**Input** (:func:`registered_readings`): ``{drafter name: {setting: {prompt index: (tokens,
rounds)}}}``, from either source through an adapter:

- the held-out evaluator (``bench exittrain``): :func:`evaluator_totals` of each drafter's
  ``prompt_rows`` (block lengths per prompt: tokens = their sum, rounds = their count);
- vLLM (``--vllm``): :func:`vllm_totals` of vLLM's per-prompt counters (``{"drafts",
  "accepted_tokens"}``, :func:`exittrain.serve.compare.per_prompt_counts`): rounds = drafts, tokens
  = drafts + accepted tokens (each draft commits its accepted tokens plus the target's own), so
  that tokens / rounds is vLLM's acceptance length ``1 + accepted / drafts``. A prompt answered by the
  prefill alone has 0 drafts: it adds nothing to either sum.

Limits: the rule reads replicates only (names with ``@seed``); a drafter trained without
``--train-seeds`` reads ``not measured``, with the reason. With three seeds the seed direction of the
interval rests on three values (see :func:`~exittrain.core.crossed_paired_difference`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exittrain.bench.exittrain_grid import split_replicate
from exittrain.core import CROSSED_DRAWS, crossed_paired_difference, prompt_totals
from exittrain.tables import cell, markdown_table

__all__ = ["Contrast", "TRIM_PERCENT", "evaluator_totals", "registered_readings", "to_markdown", "trimmed_prompts",
           "verdict", "vllm_totals"]

TRIM_PERCENT = 5  # the robustness row drops the top ceil(5% of the prompts)

Setting = tuple[str, "int | None", float]  # (shape, budget, temperature), as prompt_rows keys them
Totals = Mapping[str, Mapping[Setting, Mapping[int, tuple[float, float]]]]


@dataclass(frozen=True)
class Contrast:
    """One registered contrast: ``arm`` against ``control`` (arm base names, without ``@seed``) at
    ``setting`` (shape, budget, temperature), with the margin ``delta`` (tokens per round) the estimate must
    reach to be confirmed, and a ``label`` for the report."""

    arm: str
    control: str
    setting: Setting
    delta: float
    label: str

    def __post_init__(self) -> None:
        if len(self.setting) != 3:
            raise ValueError(f"Contrast {self.label!r}: setting={self.setting!r}; pass (shape, budget, temperature)")
        if not (0 < self.delta < math.inf):
            raise ValueError(f"Contrast {self.label!r}: delta={self.delta!r}; the margin is a positive number of "
                             "tokens per round (the protocol's, per setting)")
        if self.arm == self.control:
            raise ValueError(f"Contrast {self.label!r}: the arm and the control are both {self.arm!r}; name two arms")


def verdict(estimate: float, low: float, high: float, per_seed: Sequence[float], delta: float) -> str:
    """``confirmed`` when every seed's own difference is above 0, ``low`` is above 0 and ``estimate`` is at
    least ``delta``; else ``refuted`` when ``high`` is below ``delta``; else ``inconclusive``. The tests
    run in the protocol's order: an estimate above its own interval (a skewed bootstrap) that met both
    would read confirmed."""
    if not per_seed:
        raise ValueError("verdict needs each seed's paired difference; per_seed is empty")
    if min(per_seed) > 0 and low > 0 and estimate >= delta:
        return "confirmed"
    if high < delta:
        return "refuted"
    return "inconclusive"


def evaluator_totals(rows_by_setting: Mapping[Setting, Mapping[int, dict]]) -> dict[Setting, dict[int, tuple]]:
    """One drafter's ``{setting: {prompt index: (tokens, rounds)}}`` from the held-out evaluator's per-prompt
    rows (:func:`exittrain.bench.exittrain_arms.prompt_rows` of its measurement): tokens = the sum of the
    prompt's ``block_lengths``, rounds = their count."""
    return {setting: dict(zip(rows, prompt_totals([r["block_lengths"] for r in rows.values()])))
            for setting, rows in rows_by_setting.items()}


def vllm_totals(per_prompt: Sequence[Mapping[str, int]]) -> dict[int, tuple[float, float]]:
    """``{prompt index: (tokens, rounds)}`` of vLLM's per-prompt counters (``{"drafts", "accepted_tokens"}``
    in prompt order): rounds = drafts, tokens = drafts + accepted tokens. Put it under a setting key of the
    caller's choice (for example ``("vllm", K, 0.0)``) beside the evaluator's settings of the same drafter."""
    out = {}
    for i, c in enumerate(per_prompt):
        if not {"drafts", "accepted_tokens"} <= set(c):
            raise ValueError(f"vLLM prompt {i}: {c!r} lacks 'drafts' or 'accepted_tokens'; pass the per_prompt "
                             "counts of exittrain.serve.compare.per_prompt_counts")
        out[i] = (float(c["drafts"] + c["accepted_tokens"]), float(c["drafts"]))
    return out


def _replicates(totals: Totals, base: str, setting: Setting) -> dict[int, Mapping[int, tuple]]:
    """``{training seed: {prompt index: (tokens, rounds)}}`` of ``base``'s replicates measured at ``setting``."""
    out = {}
    for name, by_setting in totals.items():
        arm, seed = split_replicate(name)
        if arm == base and seed is not None and setting in by_setting:
            out[seed] = by_setting[setting]
    return out


def _aligned(side: dict[int, Mapping[int, tuple]], order: list[int], what: str) -> dict[int, list[tuple]]:
    for seed, rows in side.items():
        if set(rows) != set(order):
            raise ValueError(f"{what} seed {seed} was measured on prompts {sorted(set(rows) ^ set(order))[:10]} "
                             "that another replicate lacks (or the other way round): measure every replicate of "
                             "both drafters on the same held-out prompts")
    return {seed: [rows[p] for p in order] for seed, rows in side.items()}


def trimmed_prompts(arm: Mapping[int, Sequence[tuple]], control: Mapping[int, Sequence[tuple]],
                    percent: int = TRIM_PERCENT) -> list[int]:
    """The positions of the prompts the trimmed row drops: prompts ranked by their per-prompt paired difference
    (the arm's tokens / rounds minus the control's on that prompt, 0 for a side without a round) averaged over
    the seeds, the top ``ceil(percent% of P)`` (largest first; a tie goes to the earlier position)."""
    seeds = sorted(arm)
    prompts = len(arm[seeds[0]])

    def tau(row):
        return row[0] / row[1] if row[1] else 0.0

    gain = [sum(tau(arm[s][p]) - tau(control[s][p]) for s in seeds) / len(seeds) for p in range(prompts)]
    drop = -(-prompts * percent // 100)  # ceil in integers: 0.05 * 60 is 3.0000000000000004 in floats
    return sorted(sorted(range(prompts), key=lambda p: (-gain[p], p))[:drop])


def _measured(contrast: Contrast, totals: Totals, draws: int, seed: int) -> dict:
    arm = _replicates(totals, contrast.arm, contrast.setting)
    control = _replicates(totals, contrast.control, contrast.setting)
    missing = [what for what, side in (("arm", arm), ("control", control)) if not side]
    if missing:
        return {"why": f"no replicate (ARM@seedS) of the {' or the '.join(missing)} measured at this setting"}
    order = sorted(next(iter(arm.values())))
    try:
        arm_rows, control_rows = _aligned(arm, order, contrast.arm), _aligned(control, order, contrast.control)
        main = crossed_paired_difference(arm_rows, control_rows, draws=draws, seed=seed)
        log_ratio = crossed_paired_difference(arm_rows, control_rows, endpoint="log_ratio", draws=draws, seed=seed)
    except ValueError as e:
        raise ValueError(f"contrast {contrast.label!r} ({contrast.arm} vs {contrast.control} at "
                         f"{contrast.setting}): {e}") from e
    dropped = trimmed_prompts(arm_rows, control_rows)
    kept = [p for p in range(len(order)) if p not in set(dropped)]
    trimmed = {"dropped": [order[p] for p in dropped], "prompts": len(kept)}
    if kept:
        rest = crossed_paired_difference({s: [r[p] for p in kept] for s, r in arm_rows.items()},
                                         {s: [r[p] for p in kept] for s, r in control_rows.items()},
                                         draws=draws, seed=seed)
        trimmed.update(estimate=rest["estimate"], ci95=rest["ci95"], per_seed=rest["per_seed"],
                       verdict=verdict(rest["estimate"], *rest["ci95"], rest["per_seed"], contrast.delta))
    else:
        trimmed.update(estimate=None, ci95=None, per_seed=None, verdict=None)
    return {"estimate": main["estimate"], "ci95": main["ci95"], "per_seed": main["per_seed"], "seeds": main["seeds"],
            "prompts": main["prompts"], "draws": draws,
            "verdict": verdict(main["estimate"], *main["ci95"], main["per_seed"], contrast.delta),
            "log_ratio": {"estimate": log_ratio["estimate"], "ci95": log_ratio["ci95"]}, "trimmed": trimmed}


def registered_readings(totals: Totals, sequences: Sequence[Sequence[Contrast]], *, draws: int = CROSSED_DRAWS,
                        seed: int = 0) -> list[dict]:
    """One JSON-ready dict per registered contrast, sequence by sequence, in the order given.

    ``totals``: ``{drafter name: {setting: {prompt index: (tokens, rounds)}}}`` (:func:`evaluator_totals`,
    :func:`vllm_totals`); the replicates ``ARM@seedS`` of a contrast's arm and control must share their seeds
    and their prompts (ValueError otherwise). ``sequences``: the protocol's, each a primary then its
    secondaries in their fixed order.

    Each dict: ``label``, ``arm``, ``control``, ``setting`` (``{"shape", "budget", "temperature"}``),
    ``delta``, ``sequence`` (its index), ``role`` (``primary`` or ``secondary k``), ``reading``; and where
    measured ``estimate``, ``ci95``, ``per_seed``, ``seeds``, ``prompts``, ``draws``, ``verdict``,
    ``log_ratio`` (``{"estimate", "ci95"}``) and ``trimmed`` (``{"dropped": prompt indices, "prompts",
    "estimate", "ci95", "per_seed", "verdict"}``, under the same delta; estimate None when no prompt is
    left), or else ``why`` (with ``verdict`` None and ``reading`` ``not measured``).
    """
    out = []
    for index, sequence in enumerate(sequences):
        if not sequence:
            raise ValueError(f"sequence {index} is empty; each sequence starts with its primary contrast")
        open_ = True  # tested while every contrast before was confirmed
        for k, contrast in enumerate(sequence):
            shape, budget, temperature = contrast.setting
            entry = {"label": contrast.label, "arm": contrast.arm, "control": contrast.control,
                     "setting": {"shape": shape, "budget": budget, "temperature": temperature},
                     "delta": contrast.delta, "sequence": index, "role": "primary" if k == 0 else f"secondary {k}",
                     **_measured(contrast, totals, draws, seed)}
            if "why" in entry:
                entry.update(verdict=None, reading="not measured")
            else:
                entry["reading"] = entry["verdict"] if open_ else "descriptive"
            open_ = open_ and entry["verdict"] == "confirmed"
            out.append(entry)
    return out


def _setting_cell(s: dict) -> str:
    where = "chain" if s["shape"] == "chain" else f"{s['shape']} B={s['budget']}"
    return f"{where}, T={s['temperature']:g}"


def _interval_cell(estimate, ci95, fmt: str = "{:+.3f}") -> str:
    if estimate is None:
        return "-"
    return f"{fmt.format(estimate)} [{fmt.format(ci95[0])}, {fmt.format(ci95[1])}]"


def to_markdown(readings: Sequence[dict]) -> str:
    """The contrasts in order (contrast, setting, estimate [95% interval], per seed, delta, verdict,
    reading), then the registered robustness rows (log ratio; without the top prompts)."""
    main = markdown_table(
        ["contrast", "role", "setting", "estimate [95% CI]", "per seed", "delta", "verdict", "reading"],
        ([r["label"], r["role"], _setting_cell(r["setting"]), _interval_cell(r.get("estimate"), r.get("ci95")),
          " ".join(f"{d:+.3f}" for d in r["per_seed"]) if r.get("per_seed") else "-", f"{r['delta']:+.2f}",
          r["verdict"] or "-", r["reading"] + (f" ({r['why']})" if "why" in r else "")]
         for r in readings))
    robust = markdown_table(
        ["contrast", "setting", "log ratio [95% CI]", f"without the top {TRIM_PERCENT}%: dropped", "estimate [95% CI]",
         "verdict"],
        ([r["label"], _setting_cell(r["setting"]),
          _interval_cell(r["log_ratio"]["estimate"], r["log_ratio"]["ci95"], "{:+.4f}") if "log_ratio" in r else "-",
          cell(len(r["trimmed"]["dropped"]) if "trimmed" in r else None, "{} prompts"),
          _interval_cell(r["trimmed"]["estimate"], r["trimmed"]["ci95"]) if "trimmed" in r else "-",
          (r["trimmed"]["verdict"] or "-") if "trimmed" in r else "-"]
         for r in readings))
    return "\n".join([
        "Registered rule: each seed's paired pooled difference (arm minus the control of the same training seed, "
        "on the same prompts), their mean, and a 95% interval resampling seeds and prompts at once (crossed "
        "bootstrap). Confirmed: every seed above 0, the lower bound above 0 and the estimate at least delta; "
        "refuted: the upper bound below delta; otherwise inconclusive. A contrast is read only while the primary "
        "and every contrast before it in its sequence were confirmed; otherwise descriptive.", "", *main, "",
        f"Registered robustness rows (reported, not gating): the log ratio log(pooled arm / pooled control) under "
        f"the same bootstrap, and the estimate without the top {TRIM_PERCENT}% of prompts (ranked by their "
        "seed-averaged per-prompt difference), with the verdict under the same delta.", "", *robust, ""])
