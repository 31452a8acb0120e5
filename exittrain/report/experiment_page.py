"""The ``experiment`` kind of result JSON: ``bench exittrain``'s verdict on RESULTS.md.

A result of kind ``experiment`` (schema ``exittrain.result/1``, see :mod:`exittrain.report.results_page`)
adds ``summary``: ``domain``, ``steps``, ``warm_start``, ``prompts``, ``rows``
(``bench exittrain``'s rows: ``drafter``, ``budget``, ``temperature``, ``tau``, ``ci95``,
``vs_control`` and ``vs_warm_start`` (``{"delta", "ci95"}`` or null), ``tau_oracle`` at T > 0,
and ``shape``: ``chain`` for a row of the drafter's greedy chain of K = ``budget`` nodes, else the
DDTree tree of ``budget`` nodes),
optionally ``budget_anchors`` (anchors per answer by budget), ``oracle_prompts`` and ``vllm``
(vLLM's measured acceptance length of each drafter's DFlash export: ``prompts``, ``max_new_tokens``,
``vllm_version`` and ``drafters``: name -> ``tau``, ``ci95``, ``vs_control``, ``vs_warm_start``,
``lossless``). A run with training seeds adds ``train_seeds``, ``noise_floor``, ``replicates`` (each
ExitTrain arm's per-seed differences, the pre-registered rule's word and the reading under the
protocol's fixed sequence, :func:`exittrain.bench.exittrain_report.replicate_verdicts`) and
``per_prompt`` (every drafter's per-prompt rows). A result measured through the one evaluator adds
``statistic`` (how its tau is counted: pooled, total tokens / total rounds); a result without it is
from before (``analytic_anchors`` and its per-position and per-anchor means), and the page labels it so.

The page shows the replicates' readings first. Then come the intervals that exclude 0, each pair read
alone and labelled as uncorrected (:func:`uncorrected`, computed from the rows when the page is drawn;
a ``verdict`` key older results stored is not read).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exittrain.tables import paired_cell

_SUMMARY_KEYS = ("domain", "steps", "warm_start", "prompts", "rows")
NEGLIGIBLE = 0.005  # tokens per round (~0.2% of tau here): an interval can exclude 0 and still mean nothing
_OPTIONAL_KEYS = ("statistic", "analytic_anchors", "budget_anchors", "oracle_prompts", "vllm", "train_seeds",
                  "noise_floor", "replicates", "per_prompt")
_ROW_KEYS = ("drafter", "budget", "temperature", "tau", "ci95", "vs_control", "vs_warm_start")


def check_experiment(res: dict, where: str, need) -> None:
    """Raise ``ValueError`` (through ``need``, the page's key check) where an experiment result breaks the schema."""
    summary = need(res, "summary", where, dict)
    for key in _SUMMARY_KEYS:
        need(summary, key, f"{where} summary")
    if not summary["rows"]:
        raise ValueError(f"{where}: summary 'rows' is empty; an experiment result needs its table")
    for i, row in enumerate(summary["rows"]):
        for key in _ROW_KEYS + (("control",) if row.get("vs_control") is not None else ()):
            need(row, key, f"{where} summary rows[{i}]")


def _setting(r: dict) -> str:
    """Where a row was measured, in words: ``at B = 16, T = 0.6`` or ``on the chain of K = 7 at T = 0.6``."""
    if r.get("shape", "ddtree") == "chain":  # rows of results from before the chain have no shape
        return f"on the chain of K = {r['budget']} at T = {r['temperature']:g}"
    return f"at B = {r['budget']}, T = {r['temperature']:g}"


def separation(pair: dict | None) -> str | None:
    """``beats`` or ``loses to`` where a paired difference's 95% interval (``pair["ci95"]``) excludes 0;
    None where it covers 0 or there is no pair. Each pair is read alone: no correction."""
    if pair is None:
        return None
    low, high = pair["ci95"]
    return "beats" if low > 0 else "loses to" if high < 0 else None


def uncorrected(rows: list[dict]) -> list[str]:
    """The settings whose paired interval against their matched control excludes 0, each pair read alone
    (no correction for the comparisons made), at every temperature, T = 0 included, for both shapes; a
    difference under :data:`NEGLIGIBLE` says so (a tiny lambda moves few trees, by little, consistently).

    Computed from the rows whenever a page is drawn: the lines a result stored when it was written (its
    ``verdict`` key, from a rule since changed) are not read."""
    lines = []
    for r in rows:
        pair = r.get("vs_control")
        if (word := separation(pair)) is None:
            continue
        low, high = pair["ci95"]
        size = f" (under {NEGLIGIBLE} tokens per round: negligible)" if abs(pair["delta"]) < NEGLIGIBLE else ""
        lines.append(f"{r['drafter']} {word} {r['control']} {_setting(r)}: "
                     f"{pair['delta']:+.4f} ({low:+.4f} to {high:+.4f}){size}")  # 4 places: some are tiny
    return lines


def summarize_experiment(data: dict) -> dict:
    """The ``summary`` block of an experiment result from ``bench exittrain``'s ``exittrain.json``."""
    return {key: data[key] for key in (*_SUMMARY_KEYS, *_OPTIONAL_KEYS) if key in data}


def experiment_lines(res: dict, json_link: str, cmd_link: str) -> list[str]:
    """Markdown of one experiment: the verdict, then per budget a drafter x temperature table."""
    sm = res["summary"]
    temps = sorted({r["temperature"] for r in sm["rows"]})
    # the trees by budget, then the chain (what a serving engine verifies)
    groups = sorted({(r.get("shape", "ddtree") == "chain", r["budget"]) for r in sm["rows"]})
    pairs = sum(r.get("vs_control") is not None for r in sm["rows"])
    found = uncorrected(sm["rows"]) or ["none: no ExitTrain setting's paired interval against its matched control "
                                        "excludes 0."]
    if "statistic" in sm:  # measured through the one evaluator: every tau pooled as a decode counts it
        measured = (f"every tau pooled as a decode counts it ({sm['statistic']}); paired against the arm's matched "
                    "block-CE control and against the warm start on the same answers (95% intervals, "
                    "resampling prompts).")
    else:  # from before the pooled evaluator
        per_budget = sm.get("budget_anchors")
        anchors = (", ".join(f"{n} at B = {b}" for b, n in per_budget.items()) if per_budget
                   else str(sm.get("analytic_anchors", "-")))
        measured = ("per-position and per-anchor means, on drafters with the n-gram copy branch (not a decode's "
                    "pooled tau): T = 0: greedy block length at every answer position; T > 0: the analytic (expected "
                    f"TEV) block length at seeded positions of the target's samples at T ({anchors} per answer), the "
                    f"oracle bound on the first {sm.get('oracle_prompts', sm['prompts'])} prompts; paired against "
                    "the arm's matched block-CE control and against the warm start (95% intervals, bootstrapping "
                    "prompts).")
    lines = [
        f"{res['date']}, {json_link} ({cmd_link}): {sm['domain']}, {sm['steps']} steps per arm from one warm start, "
        f"measured on {sm['prompts']} held-out prompts: {measured}",
        "",
        *(f"- {note}" for note in res.get("notes", [])),
        *([""] if res.get("notes") else []),
    ]
    if sm.get("replicates"):
        lines += [f"Replicates (training seeds {sm['train_seeds']}) under the pre-registered rule: each seed's "
                  "difference from its matched control of the same seed, their mean, the noise floor (the largest "
                  "control-against-control difference between seeds), the rule's word, and the reading under the "
                  "protocol's fixed sequence (the primary first; a secondary is tested only while every one before "
                  "it was confirmed; the rest are descriptive, and no claim is drawn from them):", "",
                  "| arm | B | T | in the sequence | per seed | mean | noise floor | rule | reading |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for v in sm["replicates"]:
            size = f"chain K={v['budget']}" if v["shape"] == "chain" else v["budget"]
            floor = "-" if v["noise_floor"] is None else f"{v['noise_floor']:.4f}"
            seeds = " ".join(f"{d:+.3f}" for d in v["deltas"])
            lines.append(f"| {v['drafter']} | {size} | {v['temperature']:g} | {v.get('role') or '-'} | {seeds} "
                         f"| {v['mean']:+.4f} | {floor} | {v['verdict']} | {v.get('reading', v['verdict'])} |")
        lines += ["", f"Exploratory: the per-seed intervals that exclude 0, each pair read alone, with no correction "
                  f"for the {pairs} comparisons made:"]
    else:
        lines.append(f"Exploratory: one training seed, so the intervals cover the choice of prompts and not training; "
                     f"each pair read alone, with no correction for the {pairs} comparisons made. The intervals "
                     "that exclude 0:")
    lines += ["", *(f"- {line}" for line in found), ""]
    for chain, budget in groups:
        rows = [r for r in sm["rows"] if r["budget"] == budget and (r.get("shape", "ddtree") == "chain") == chain]
        head = ["drafter"] + [f"T = {t:g}: tau, vs control, vs warm start" for t in temps]
        title = f"The greedy chain of K = {budget} (what vLLM and SGLang verify):" if chain else f"B = {budget}:"
        lines += [title, "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        for name in dict.fromkeys(r["drafter"] for r in rows):
            cells = []
            for t in temps:
                r = next((r for r in rows if r["drafter"] == name and r["temperature"] == t), None)
                cells.append("-" if r is None else
                             f"{r['tau']:.3f}; {paired_cell(r['vs_control'])}; {paired_cell(r['vs_warm_start'])}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        oracle = {r["temperature"]: r["tau_oracle"] for r in rows if "tau_oracle" in r}
        if oracle:
            lines.append("| oracle bound (same budget and law) | "
                         + " | ".join(f"{oracle[t]:.3f}" if t in oracle else "-" for t in temps) + " |")
        lines.append("")
    if sm.get("vllm"):
        lines += vllm_lines(sm["vllm"])
    return lines


def vllm_lines(vllm: dict) -> list[str]:
    """vLLM's measured acceptance length of every drafter's DFlash export, paired against the arm's
    control and the warm start on the same prompts."""
    lines = [f"vLLM {vllm['vllm_version']}'s own acceptance length of each drafter's DFlash export (greedy, "
             f"{vllm['prompts']} held-out prompts x up to {vllm['max_new_tokens']} tokens, 95% intervals "
             "bootstrapping prompts):", "",
             "| drafter | vLLM acceptance length | 95% CI | vs control | vs warm start | lossless |",
             "|---|---|---|---|---|---|"]
    for name, r in vllm["drafters"].items():
        lines.append(f"| {name} | {r['tau']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} | "
                     f"{paired_cell(r.get('vs_control'))} | {paired_cell(r.get('vs_warm_start'))} | "
                     f"{'yes' if r['lossless'] else 'NO'} |")
    return [*lines, ""]


def read_experiment(path: str | Path, read) -> dict:
    """``bench exittrain``'s JSON, read with the page's reader (which names the file on error)."""
    data: Any = read(Path(path))
    missing = [k for k in _SUMMARY_KEYS if k not in data]
    if missing:
        raise ValueError(f"{path}: not a bench exittrain output (missing {missing}); pass <out>/exittrain.json")
    return data
