"""The serving check's arithmetic: vLLM's acceptance counters, output agreement, the table.

Standard library only, so it runs (and is tested) without vLLM or a model.

**Acceptance length.** Both sides count a round (vLLM: a draft) as the tokens it commits: the
accepted draft tokens plus the target's own next token. vLLM's mean acceptance length is
``1 + vllm:spec_decode_num_accepted_tokens / vllm:spec_decode_num_drafts`` (its counters; a
Prometheus counter's ``_total`` suffix is accepted too, and samples with different labels, such
as one per engine, are summed). Ours is the mean block length of the chain decoder over the same
prompts. vLLM's first new token comes from the prefill, without a draft; so that both sides
draft from the same roots, our chain decoder starts from the prompt plus the target's first
greedy token (see :mod:`exittrain.serve.check`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

__all__ = [
    "acceptance_from_metrics", "acceptance_interval", "compare_outputs", "our_acceptance", "paired_acceptance",
    "per_prompt_counts", "to_markdown",
]

DRAFTS = "vllm:spec_decode_num_drafts"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def _base_name(name: str) -> str:
    return name.removesuffix("_total")


def _counter_totals(metrics: Sequence[dict]) -> tuple[dict[str, float], list[int]]:
    """The speculative counters of vLLM's metric records, summed over labels: ``(totals by base name,
    accepted per position)``. ``ValueError`` names a malformed record."""
    totals: dict[str, float] = {}
    per_position: list[int] = []
    for i, record in enumerate(metrics):
        if not isinstance(record, dict) or "name" not in record:
            raise ValueError(f"metric record {i} is not an object with a 'name': {record!r}")
        name = _base_name(record["name"])
        if name == PER_POSITION and "values" in record:
            values = [int(v) for v in record["values"]]
            per_position = [a + b for a, b in zip(per_position, values)] + values[len(per_position):]
        elif name in (DRAFTS, ACCEPTED, DRAFT_TOKENS):
            value = record.get("value")
            if not isinstance(value, (int, float)):
                raise ValueError(f"metric {record['name']!r} (record {i}) has no numeric value: {record!r}")
            totals[name] = totals.get(name, 0) + value
    return totals, per_position


def acceptance_from_metrics(metrics: Sequence[dict]) -> dict:
    """vLLM's speculative-decoding counters from the worker's metric records, summed over labels.

    Returns ``drafts``, ``accepted_tokens``, ``draft_tokens``, ``accepted_per_position`` (a list,
    empty when vLLM did not report it) and ``mean_acceptance_length``. Raises ``ValueError``
    when the draft counter is missing (vLLM ran without speculation or with
    ``disable_log_stats=True``) or zero (nothing was drafted).
    """
    totals, per_position = _counter_totals(metrics)
    if DRAFTS not in totals:
        raise ValueError(
            f"vLLM reported no {DRAFTS!r}: the run had no speculative_config, or stats were off "
            "(construct LLM with disable_log_stats=False)"
        )
    drafts = int(totals[DRAFTS])
    if drafts == 0:
        raise ValueError(f"{DRAFTS} is 0: vLLM drafted nothing; check the prompts and max_tokens")
    accepted = int(totals.get(ACCEPTED, 0))
    return {
        "drafts": drafts,
        "accepted_tokens": accepted,
        "draft_tokens": int(totals.get(DRAFT_TOKENS, 0)),
        "accepted_per_position": per_position,
        "mean_acceptance_length": 1.0 + accepted / drafts,
    }


def per_prompt_counts(snapshots: Sequence[Sequence[dict]]) -> list[dict]:
    """Each prompt's ``{"drafts", "accepted_tokens"}`` from the cumulative metric records taken after
    each prompt (the worker's ``metrics_after_prompt``): differences of consecutive snapshots. A
    prompt answered by the prefill alone has 0 drafts. ``ValueError`` when a counter decreases
    (snapshots out of order) or when no snapshot reports drafts (no speculation)."""
    counts, before = [], (0, 0)
    seen_drafts = False
    for i, records in enumerate(snapshots):
        totals, _ = _counter_totals(records)
        seen_drafts |= DRAFTS in totals
        now = (int(totals.get(DRAFTS, 0)), int(totals.get(ACCEPTED, 0)))
        if now[0] < before[0] or now[1] < before[1]:
            raise ValueError(f"vLLM's counters decrease at prompt {i} ({before} -> {now}): pass the snapshots in order")
        counts.append({"drafts": now[0] - before[0], "accepted_tokens": now[1] - before[1]})
        before = now
    if snapshots and not seen_drafts:
        raise ValueError(f"vLLM reported no {DRAFTS!r} after any prompt: the run had no speculative_config")
    return counts


def _pooled(counts: Sequence[dict]) -> float:
    drafts = sum(c["drafts"] for c in counts)
    return 1.0 + sum(c["accepted_tokens"] for c in counts) / drafts if drafts else float("nan")


def _bootstrap(statistic, n: int, resamples: int, seed: int) -> list[float]:
    """``statistic(indices)`` on ``resamples`` resamples of ``range(n)`` with replacement, sorted."""
    rng = random.Random(seed)
    values = [statistic([rng.randrange(n) for _ in range(n)]) for _ in range(resamples)]
    return sorted(v for v in values if not math.isnan(v))


def _interval(values: list[float]) -> list[float]:
    if not values:
        return [float("nan"), float("nan")]
    return [values[int(0.025 * len(values))], values[min(len(values) - 1, int(0.975 * len(values)))]]


def acceptance_interval(counts: Sequence[dict], resamples: int = 2000, seed: int = 0) -> dict:
    """The pooled mean acceptance length ``1 + sum accepted / sum drafts`` of per-prompt ``counts``
    and its 95% interval, resampling prompts with replacement (fixed seed): ``{"mean", "ci95",
    "prompts", "drafts"}``."""
    if not counts:
        raise ValueError("no per-prompt counts: run vLLM with per_prompt=True on at least one prompt")
    stats = _bootstrap(lambda idx: _pooled([counts[i] for i in idx]), len(counts), resamples, seed)
    return {"mean": _pooled(counts), "ci95": _interval(stats), "prompts": len(counts),
            "drafts": sum(c["drafts"] for c in counts)}


def paired_acceptance(counts: Sequence[dict], reference: Sequence[dict], resamples: int = 2000,
                      seed: int = 0) -> dict:
    """``counts``' pooled acceptance length minus ``reference``'s on the same prompts, and its 95%
    interval resampling the prompts jointly (paired): ``{"delta", "ci95"}``. ``ValueError`` when
    the two cover different numbers of prompts."""
    if len(counts) != len(reference) or not counts:
        raise ValueError(f"paired acceptance needs the same prompts on both sides, got {len(counts)} and "
                         f"{len(reference)} prompts")

    def diff(idx: list[int]) -> float:
        return _pooled([counts[i] for i in idx]) - _pooled([reference[i] for i in idx])

    stats = _bootstrap(diff, len(counts), resamples, seed)
    return {"delta": _pooled(counts) - _pooled(reference), "ci95": _interval(stats)}


def compare_outputs(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> dict:
    """Token-for-token agreement of two runs over the same prompts.

    Returns ``equal`` (every prompt identical), ``prompts``, ``prompts_equal``, ``tokens``
    (tokens of the reference), ``tokens_agreeing`` (the common prefix, summed) and per prompt
    ``first_mismatch`` (index of the first differing token, None when equal; a length
    difference counts as a mismatch at the shorter length).
    """
    if len(reference) != len(candidate):
        raise ValueError(f"runs cover {len(reference)} and {len(candidate)} prompts; compare the same prompt list")
    first_mismatch: list[int | None] = []
    agreeing = 0
    for ref, cand in zip(reference, candidate):
        ref, cand = list(ref), list(cand)
        prefix = next((j for j, (a, b) in enumerate(zip(ref, cand)) if a != b), min(len(ref), len(cand)))
        agreeing += prefix
        first_mismatch.append(None if ref == cand else prefix)
    return {
        "equal": all(m is None for m in first_mismatch),
        "prompts": len(reference),
        "prompts_equal": sum(m is None for m in first_mismatch),
        "tokens": sum(len(r) for r in reference),
        "tokens_agreeing": agreeing,
        "first_mismatch": first_mismatch,
    }


def our_acceptance(accept_lengths_per_prompt: Sequence[Sequence[int]], num_draft_tokens: int) -> dict:
    """Our chain decoder's counters in vLLM's terms, from each round's accepted draft tokens.

    ``num_draft_tokens`` is K. Returns ``drafts`` (rounds), ``accepted_tokens``,
    ``draft_tokens`` (K per round), ``accepted_per_position`` (rounds that accepted position k,
    k = 1..K) and ``mean_acceptance_length`` (1 + accepted / drafts, our tau).
    """
    rounds = [int(a) for prompt in accept_lengths_per_prompt for a in prompt]
    if not rounds:
        raise ValueError("no decoding rounds to count; generate at least one round per prompt")
    bad = [a for a in rounds if not 0 <= a <= num_draft_tokens]
    if bad:
        raise ValueError(f"accept lengths {bad[:5]} lie outside [0, K={num_draft_tokens}]")
    return {
        "drafts": len(rounds),
        "accepted_tokens": sum(rounds),
        "draft_tokens": num_draft_tokens * len(rounds),
        "accepted_per_position": [sum(a > k for a in rounds) for k in range(num_draft_tokens)],
        "mean_acceptance_length": 1.0 + sum(rounds) / len(rounds),
    }


_OURS_LABEL = {"exittrain": "exittrain's drafter", "reference": "dflash's module"}


def to_markdown(result: dict) -> str:
    """The report: agreement, then acceptance side by side, then startup and throughput."""
    spec, plain, ours = result["vllm_dflash"], result["vllm_plain"], result["ours"]
    agree = result["agreement"]
    lines = [
        f"# Serving check: vLLM {result['vllm_version']} DFlash vs exittrain's chain decoder",
        "",
        f"Target: {result['target']}. Drafter: {result['drafter']} ({result['drafter_kind']}). "
        f"{agree['vllm_dflash_vs_plain']['prompts']} {result['domain']} prompts x up to {result['max_tokens']} "
        f"new tokens, greedy, K = {result['num_speculative_tokens']}, fp32. Host: {result['host']['cpu']} "
        f"({result['host']['capability']}, {result['host']['threads']} threads).",
        "",
        "| agreement | equal | prompts equal | tokens agreeing |",
        "|---|---|---|---|",
    ]
    rows = [("vllm_dflash_vs_plain", "vLLM DFlash vs vLLM plain"),
            ("hf_greedy_vs_vllm_plain", "our target's greedy vs vLLM plain")]
    for kind in ours["runs"]:
        label = _OURS_LABEL.get(kind, kind)
        rows += [(f"ours_{kind}_vs_vllm_plain", f"our chain decoder ({label}) vs vLLM plain"),
                 (f"ours_{kind}_vs_hf_greedy", f"our chain decoder ({label}) vs our target's greedy")]
    for name, label in rows:
        a = agree[name]
        lines.append(
            f"| {label} | {a['equal']} | {a['prompts_equal']}/{a['prompts']} | {a['tokens_agreeing']}/{a['tokens']} |"
        )
    lines += [
        "",
        "| acceptance | drafts | accepted tokens | mean acceptance length | accepted per position |",
        "|---|---|---|---|---|",
    ]
    sides = [("vLLM DFlash", result["vllm_acceptance"])]
    sides += [(f"ours: chain of K, {_OURS_LABEL.get(k, k)}", r["acceptance"]) for k, r in ours["runs"].items()]
    for label, acc in sides:
        per_pos = " ".join(str(v) for v in acc["accepted_per_position"]) or "-"
        mean = acc["mean_acceptance_length"]
        lines.append(f"| {label} | {acc['drafts']} | {acc['accepted_tokens']} | {mean:.3f} | {per_pos} |")
    lines += [
        "",
        "| run | startup s | generate s |",
        "|---|---|---|",
        f"| vLLM plain | {plain['startup_s']:.1f} | {plain['generate_s']:.1f} |",
        f"| vLLM DFlash | {spec['startup_s']:.1f} | {spec['generate_s']:.1f} |",
        f"| our target's greedy | - | {ours['greedy_seconds']:.1f} |",
    ]
    lines += [f"| ours: chain, {_OURS_LABEL.get(k, k)} | - | {r['seconds']:.1f} |" for k, r in ours["runs"].items()]
    lines += ["", "Timings come from a shared machine; read them as orders of magnitude.", ""]
    return "\n".join(lines)
