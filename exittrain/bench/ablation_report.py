"""The ablation's summary, report table and plots, from the result ``bench ablation`` writes.

:func:`summary` reduces the per-domain results to mean ratios against the control;
:func:`to_markdown` and :func:`make_plots` render the result JSON (see
:mod:`exittrain.bench.ablation` for what is measured).
"""

from __future__ import annotations

import statistics
from pathlib import Path

__all__ = ["make_plots", "summary", "to_markdown"]


def summary(domains: list[dict], settings) -> dict:
    """Mean ratio to the control over domains, per arm and (B, T), and overall; the best weight type."""
    per: dict[str, dict[str, list[float]]] = {}
    analytic: dict[str, list[float]] = {}
    for d in domains:
        for arm, a in d["arms"].items():
            for r in a["table"]:
                per.setdefault(arm, {}).setdefault(f"B={r['budget']} T={r['temperature']:g}", []).append(
                    r["tau_vs_control"]
                )
            control = d["arms"]["control"]["analytic"]
            analytic.setdefault(arm, []).extend(v["tau"] / control[b]["tau"] for b, v in a["analytic"].items())
    mean_ratio = {arm: {k: statistics.fmean(v) for k, v in cells.items()} for arm, cells in per.items()}
    overall = {arm: statistics.fmean(cells.values()) for arm, cells in mean_ratio.items()}
    exit_arms = [f"exittrain-{w}" for w in settings.weight_types]
    best = max(exit_arms, key=lambda a: overall[a])  # the headline is decoded tau (docs/algorithm.md section 9)
    return {"mean_tau_vs_control": mean_ratio, "overall_tau_vs_control": overall,
            "analytic_vs_control": {arm: statistics.fmean(v) for arm, v in analytic.items()},
            "best_weight_type": best, "goal_met": overall[best] >= 1.13}


def to_markdown(result: dict) -> str:
    from exittrain.heldout.decode_eval import optional_cell

    s = result["settings"]
    lines = [
        f"Embedded SmolLM2-135M-Instruct target, CPU ({result['threads']} threads), seed {s['seed']}. Warm start "
        + (f"reused from {s['warm_start_root']}" if s.get("warm_start_root") else f"{s['warm_steps']} block-CE steps")
        + f"; each arm {s['arm_steps']} more steps ({s['arm_anchors']} anchors/seq). "
        f"Fit overrides: {', '.join(s['overrides']) or 'none'}. "
        f"Decoded: {s['eval_prompts']} held-out prompts x {s['new_tokens']} new tokens per domain, TEV. "
        f"Total {result['seconds'] / 60:.1f} min.",
        "",
    ]
    for d in result["domains"]:
        lines += [
            f"### {d['domain']} ({d['train_rows']} train rows, {d['held_out_rows']} held-out rows for analytic tau)",
            "",
            "| arm | B | T | tau | 95% CI | vs control | analytic tau | analytic vs control | tau_oracle | "
            "tau/oracle | tok/s | speedup |",
            "|---" * 12 + "|",
        ]
        for arm, a in d["arms"].items():
            for r in a["table"]:
                def f(key, fmt="{:.2f}", r=r):
                    return optional_cell(r, key, fmt)

                lines.append(
                    f"| {arm} | {r['budget']} | {r['temperature']:g} | {r['tau']:.2f} | "
                    f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f} | {r['tau_vs_control']:.3f} | {r['analytic_tau']:.3f} | "
                    f"{r['analytic_vs_control']:.3f} | {f('tau_oracle')} | {f('efficiency')} | "
                    f"{r['tokens_per_s']:.1f} | {f('speedup')}x |"
                )
        lines.append("")
    sm = result["summary"]
    cells = list(next(iter(sm["mean_tau_vs_control"].values())))
    lines += [
        "### Decoded tau relative to the control, averaged over domains",
        "",
        "| arm | " + " | ".join(cells) + " | mean | analytic tau vs control (mean over domains and B) |",
        "|---" * (len(cells) + 3) + "|",
    ]
    for arm, row in sm["mean_tau_vs_control"].items():
        lines.append(f"| {arm} | " + " | ".join(f"{row[c]:.3f}" for c in cells)
                     + f" | {sm['overall_tau_vs_control'][arm]:.3f} | {sm['analytic_vs_control'][arm]:.3f} |")
    lines += ["", f"Best weight type: **{sm['best_weight_type']}** (goal 1.13x the control: "
                  f"{'met' if sm['goal_met'] else 'not met'}).", ""]
    if result.get("verifiers"):
        lines += [
            f"### Verifier stage inside real rounds ({result['verifier_domain']}, exittrain-flow drafter)",
            "",
            "| B | T | verifier | rounds | tau | verify ms/round (mean) | (median) | vs sequential | "
            "same block lengths |",
            "|---" * 9 + "|",
        ]
        for r in result["verifiers"]:
            same = (str(r["same_lengths_as_sequential"]) if "same_lengths_as_sequential" in r
                    else f"p = {r['p_same_mean_as_sequential']:.2f} (permutation, mean)")
            lines.append(
                f"| {r['budget']} | {r['temperature']:g} | {r['verifier']} | {r['rounds']} | {r['tau']:.2f} | "
                f"{r['verify_ms_mean']:.2f} | {r['verify_ms_median']:.2f} | {r['verify_vs_sequential']:.2f}x | {same} |"
            )
        lines.append("")
    return "\n".join(lines)


def make_plots(result: dict, out: Path, trees: dict) -> list[str]:
    """The PNGs of the ablation; returns their paths."""
    from exittrain.report.plots import (
        plot_block_length_histogram,
        plot_draft_tree,
        plot_exit_mass_by_depth,
        plot_grouped_bars,
        plot_tau_vs_budget,
    )

    made = []
    top_b = max(result["settings"]["budgets"])
    for d in result["domains"]:
        name = d["domain"]
        rows = [{**r, "arm": arm} for arm, a in d["arms"].items() for r in a["table"]]
        made.append(plot_tau_vs_budget(rows, out / f"{name}_tau_vs_budget.png",
                                       title=f"{name}: decoded tau vs tree budget (dashed: oracle bound)"))
        greedy = f"{top_b}/0"
        made.append(plot_block_length_histogram(
            {arm: a["block_lengths"][greedy] for arm, a in d["arms"].items() if greedy in a["block_lengths"]},
            out / f"{name}_block_lengths.png", title=f"{name}: block length per round, B={top_b}, T=0"))
        made.append(plot_exit_mass_by_depth(
            {arm: a["analytic"][str(top_b)]["exit_mass"] for arm, a in d["arms"].items()},
            out / f"{name}_exit_mass.png", title=f"{name}: exit mass by depth on held-out anchors, B={top_b}"))
        if name in trees:
            made.append(plot_draft_tree(trees[name], out / f"{name}_draft_tree.png"))
    ratio = {d["domain"]: {arm: statistics.fmean(r["tau_vs_control"] for r in a["table"])
                           for arm, a in d["arms"].items()} for d in result["domains"]}
    made.append(plot_grouped_bars(ratio, out / "tau_vs_control.png", title="Decoded tau / control (mean over B, T)",
                                  ylabel="tau relative to the control arm", reference=1.13,
                                  reference_label="goal 1.13x"))
    if result.get("verifiers"):
        ms = {}
        for r in result["verifiers"]:
            ms.setdefault(f"B={r['budget']} T={r['temperature']:g}", {})[r["verifier"]] = r["verify_ms_mean"]
        made.append(plot_grouped_bars(ms, out / "verifier_ms.png", title="Verify-decision time per round",
                                      ylabel="ms per round (mean)"))
        top = [r for r in result["verifiers"] if r["budget"] == top_b and r["temperature"] == max(
            result["settings"]["temperatures"])]
        made.append(plot_block_length_histogram({r["verifier"]: r["block_lengths"] for r in top},
                                                out / "verifier_block_lengths.png",
                                                title=f"Block lengths per verifier, B={top_b}"))
    return [str(p) for p in made]
