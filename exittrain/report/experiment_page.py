"""The ``experiment`` kind of result JSON: ``bench exittrain``'s verdict on RESULTS.md.

A result of kind ``experiment`` (schema ``exittrain.result/1``, see :mod:`exittrain.report.results_page`)
adds ``summary``: ``domain``, ``steps``, ``warm_start``, ``prompts``, ``analytic_anchors``, ``rows``
(``bench exittrain``'s rows: ``drafter``, ``budget``, ``temperature``, ``tau``, ``ci95``,
``vs_control`` and ``vs_warm_start`` (``{"delta", "ci95"}`` or null), and ``tau_oracle`` at T > 0),
optionally ``budget_anchors`` (anchors per answer by budget) and ``oracle_prompts``,
and ``verdict`` (its lines: the settings whose paired interval against the matched control
excludes 0 at T > 0; empty when none does).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exittrain.tables import paired_cell

_SUMMARY_KEYS = ("domain", "steps", "warm_start", "prompts", "analytic_anchors", "rows", "verdict")
_OPTIONAL_KEYS = ("budget_anchors", "oracle_prompts")
_ROW_KEYS = ("drafter", "budget", "temperature", "tau", "ci95", "vs_control", "vs_warm_start")


def check_experiment(res: dict, where: str, need) -> None:
    """Raise ``ValueError`` (through ``need``, the page's key check) where an experiment result breaks the schema."""
    summary = need(res, "summary", where, dict)
    for key in _SUMMARY_KEYS:
        need(summary, key, f"{where} summary")
    if not summary["rows"]:
        raise ValueError(f"{where}: summary 'rows' is empty; an experiment result needs its table")
    for i, row in enumerate(summary["rows"]):
        for key in _ROW_KEYS:
            need(row, key, f"{where} summary rows[{i}]")


def summarize_experiment(data: dict) -> dict:
    """The ``summary`` block of an experiment result from ``bench exittrain``'s ``exittrain.json``."""
    return {key: data[key] for key in (*_SUMMARY_KEYS, *_OPTIONAL_KEYS) if key in data}


def experiment_lines(res: dict, json_link: str, cmd_link: str) -> list[str]:
    """Markdown of one experiment: the verdict, then per budget a drafter x temperature table."""
    sm = res["summary"]
    temps = sorted({r["temperature"] for r in sm["rows"]})
    budgets = sorted({r["budget"] for r in sm["rows"]})
    per_budget = sm.get("budget_anchors")
    anchors = (", ".join(f"{n} at B = {b}" for b, n in per_budget.items()) if per_budget
               else str(sm["analytic_anchors"]))
    found = sm["verdict"] or ["no ExitTrain setting's paired interval against its matched control excludes 0 at T > 0."]
    lines = [
        f"{res['date']}, {json_link} ({cmd_link}): {sm['domain']}, {sm['steps']} steps per arm from one warm start, "
        f"measured on {sm['prompts']} held-out prompts. T = 0: greedy block length at every answer position; "
        f"T > 0: the analytic (expected TEV) block length at seeded positions of the target's samples at T "
        f"({anchors} per answer), "
        f"the oracle bound on the first {sm.get('oracle_prompts', sm['prompts'])} prompts; paired against the "
        "arm's matched block-CE control and against the warm start (95% intervals, bootstrapping prompts).",
        "",
        *(f"- {note}" for note in res.get("notes", [])),
        *([""] if res.get("notes") else []),
        "Verdict:",
        "",
        *(f"- {line}" for line in found),
        "",
    ]
    for budget in budgets:
        rows = [r for r in sm["rows"] if r["budget"] == budget]
        head = ["drafter"] + [f"T = {t:g}: tau, vs control, vs warm start" for t in temps]
        lines += [f"B = {budget}:", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
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
    return lines


def read_experiment(path: str | Path, read) -> dict:
    """``bench exittrain``'s JSON, read with the page's reader (which names the file on error)."""
    data: Any = read(Path(path))
    missing = [k for k in _SUMMARY_KEYS if k not in data]
    if missing:
        raise ValueError(f"{path}: not a bench exittrain output (missing {missing}); pass <out>/exittrain.json")
    return data
