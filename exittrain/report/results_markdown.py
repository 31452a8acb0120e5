"""The Markdown of RESULTS.md: a pure function of the checked results and the page text.

:func:`render_page` takes the result JSONs as :func:`exittrain.report.results_page.load_results`
returns them (checked, sorted by date and name) and ``page.json`` as
:func:`~exittrain.report.results_page.load_page` returns it (free text without figures); the
schema of both is in :mod:`exittrain.report.results_page`. It reads no file, clock or host, so the
same results give the same page byte for byte. The header names the newest result's commit and
date; it opens with the findings (the question, its answer so far, what the default recipe's served
drafter yields at the newest pooled fit, and what is not measured yet); then come the hosts, one
section per recipe (its decoded table with the serving-track
columns once a result has them, and its wall time by stage), the ablation, the experiments
(:func:`exittrain.report.experiment_page.experiment_lines`), the learning curve (``page["curve"]``:
``bench curve``'s ``results/curve/curve.json``, its plot and table, or "not measured yet"), the known
negatives, the notebook and every result's exact command. Every figure's row links to its JSON and to its command.
"""

from __future__ import annotations

from pathlib import Path

from exittrain.report.experiment_page import experiment_lines

__all__ = ["curve_table", "render_page"]

CURVE_DIR = "results/curve"  # where bench curve's default --out writes, relative to the checkout


_LABELS = {"warm_start": "warm start (block CE)", "exittrain": "after ExitTrain", "served": "DFlash export"}
_FIT_LEGEND = (
    "tau: tokens per decoding round on the held-out evaluation prompts, with its bootstrap interval over "
    "prompts. Held-out tau: the warm start on the validation rows at every anchor, greedy (the block a "
    "T = 0 verifier accepts, `val/greedy_block_length`) and analytic (the expected block length under the "
    "target's law, `val/analytic_block_length`). Speedup: tokens/s over the target decoding alone."
)
_POOLED_LEGEND = (
    "Measured by the pooled evaluator: every tau is tokens / rounds over every round of every prompt, as a "
    "decode and vLLM count it, walked along the target's own answers (greedy at T = 0, its samples at T > 0), "
    "on the drafter an engine serves (docs/metrics.md)."
)
_EARLIER_LEGEND = (
    "Earlier results, kept with their figures: their tree and chain tau are T = 0 rounds pooled over the prompts "
    "as above, but their drafters had the n-gram copy branch, which no engine runs (except runs trained as "
    "`+serve=dflash`, and the DFlash export rows), and their held-out greedy / analytic taus are per-anchor means, "
    "which overstate a decode's pooled tau."
)
_EXPERIMENT_LEGEND = (
    "The experiments below without a named statistic were measured before the pooled evaluator: greedy tau was a "
    "mean over every answer position and the tau at T > 0 an expected block length per anchor, both on drafters "
    "with the n-gram copy branch. A decode pools tokens over rounds, which weights a position by about one over "
    "its block, so these means overstate a decode's tau, the more the sharper the drafter (docs/metrics.md)."
)
_SERVING_LEGEND = (
    "Chain tau (K): the same prompts decoded with the drafter's greedy chain of K tokens, the draft vLLM and "
    "SGLang verify. vLLM tau: vLLM's mean acceptance length of the DFlash export on those prompts (MISMATCH: "
    "vLLM's greedy outputs with speculation differed from those without)."
)
# the stages of a fit run's wall time, in the order they run (metrics.json "timings")
_STAGES = (
    ("regeneration_and_setup_s", "regeneration + setup"),
    ("pretrain_s", "pretrain"),
    ("eval_warm_start_s", "eval of the warm start"),
    ("exittrain_s", "ExitTrain"),
    ("eval_exittrain_s", "eval after ExitTrain"),
)


def _f(x: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def _json_link(res: dict) -> str:
    return f"[{res['name']}](results/{res['name']}.json)"


def _cmd_link(res: dict) -> str:
    return f"[command](#{res['name']})"


def _host_text(host: dict) -> str:
    where = host["gpu"] or f"{host['cpu_model']}, `{host['cpu_capability']}`"
    if host.get("emulation"):
        where += f" (emulated: {host['emulation']})"
    return where + (", shared machine" if host["shared"] else "")


def _serving_cells(row: dict) -> str:
    """The serving track's cells of a fit row: the greedy chain's tau at K, and vLLM's acceptance length
    of the DFlash export (``MISMATCH`` when speculation changed vLLM's greedy outputs)."""
    chain = f"{row['chain_tau']:.2f} ({row.get('chain_K', '-')})" if row.get("chain_tau") is not None else "-"
    vllm = "-"
    if row.get("vllm_tau") is not None:
        ci = row.get("vllm_ci95")
        vllm = f"{row['vllm_tau']:.2f}" + ("" if ci is None else f" ({ci[0]:.2f}-{ci[1]:.2f})")
        vllm += "" if row.get("vllm_matches_plain", True) else " MISMATCH"
    return f" {chain} | {vllm} |"


def _fit_rows(results: list[dict]) -> list[str]:
    # the serving-track columns appear once a result has them (results written before them stay as they were)
    serving = any("chain_tau" in row for res in results for row in res["tables"])
    lines = [
        "| result | host | drafter | B | T | prompts x tokens | tau (95% CI) | "
        + ("chain tau (K) | vLLM tau | " if serving else "")
        + "held-out tau: greedy / analytic | tokens/s (target alone) | speedup | run wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if serving else ""),
    ]
    for res in results:
        held = res["heldout"]
        for row in res["tables"]:
            heldout = "-"
            if held is not None and row["label"] == "warm_start":
                heldout = f"{_f(held.get('greedy_tau'))} / {_f(held.get('analytic_tau'))}"
            # a row of the serving track alone has no tree tau; a CPU fit at eval.decode=fixed measures no speed
            tau = f"{row['tau']:.2f} ({row['ci95'][0]:.2f}-{row['ci95'][1]:.2f})" if "tau" in row else "-"
            speed = (f"{row['tokens_per_s']:.1f} ({row['ar_tokens_per_s']:.1f}) | {row['speedup']:.2f}x"
                     if "speedup" in row else "- | -")
            lines.append(
                f"| {_json_link(res)} ({_cmd_link(res)}) | {_host_text(res['host'])} "
                f"| {_LABELS.get(row['label'], row['label'])} | {row['budget']} | {row['temperature']:g} "
                f"| {row['prompts']} x {row.get('new_tokens') or '-'} | {tau} |"
                + (_serving_cells(row) if serving else "")
                + f" {heldout} | {speed} | {res['wall_s']['total_s'] / 60:.1f} min |"
            )
    return lines


def _wall_rows(results: list[dict]) -> list[str]:
    head = " | ".join(name for _, name in _STAGES)
    lines = [f"| result | {head} | total | peak RSS |", "|---|" + "---|" * (len(_STAGES) + 2)]
    for res in results:
        cells = " | ".join(_f(res["wall_s"].get(key), "{:.0f} s") for key, _ in _STAGES)
        rss = _f(res.get("peak_rss_gb"), "{:.1f} GB")
        lines.append(f"| {_json_link(res)} ({_cmd_link(res)}) | {cells} | {res['wall_s']['total_s'] / 60:.1f} min "
                     f"| {rss} |")
    return lines


def _see(ref: str, names: set[str]) -> str:
    return f"[{ref}](results/{ref}.json)" if ref in names else f"[{Path(ref).name}]({ref})"


def _ablation_lines(results: list[dict], page: dict) -> list[str]:
    abl = [r for r in results if r["kind"] == "ablation"]
    spec = page["ablation"]
    if not abl:
        return [f"{spec['verdict']} History: [{Path(spec['notebook']).name}]({spec['notebook']}).", "",
                f"Command: `{spec['command']}`"]
    lines = []
    for res in abl:
        sm = res["summary"]
        best = sm["best_weight_type"]
        ratio = sm["overall_tau_vs_control"][best]
        met = "met" if sm["goal_met"] else "not met"
        lines += [
            f"- {res['date']}, {_json_link(res)} ({_cmd_link(res)}): best ExitTrain arm **{best}**, decoded tau "
            f"{ratio:.3f}x the block-CE control (mean over domains, budgets and temperatures); goal "
            f"{res['goal']:.2f}x: **{met}**.",
        ]
    return lines


def _served_text(res: dict) -> str:
    """What an engine gets of a pooled fit result: its served rows' chain tau at K and tree tau at B, per T."""
    label = res["served"]["label"]
    who = ("the drafter itself (its DFlash export drops nothing)" if not res["served"]["dropped"]
           else f"its DFlash export (dropping {', '.join(res['served']['dropped'])})")
    parts = []
    for row in (r for r in res["tables"] if r["label"] == label):
        T = f"{row['temperature']:g}"
        if row.get("chain_tau") is not None:
            ci = row.get("chain_ci95")
            parts.append(f"chain tau at K = {row.get('chain_K', '-')}, T = {T}: **{row['chain_tau']:.2f}**"
                         + ("" if ci is None else f" ({ci[0]:.2f}-{ci[1]:.2f})"))
        if "tau" in row:
            parts.append(f"tree tau at B = {row['budget']}, T = {T}: {row['tau']:.2f} "
                         f"({row['ci95'][0]:.2f}-{row['ci95'][1]:.2f})")
        if row.get("vllm_tau") is not None and row["temperature"] == 0:
            parts.append(f"vLLM's acceptance at T = 0: {row['vllm_tau']:.2f}")
    return f"{who}; " + "; ".join(parts)


def _findings(results: list[dict], page: dict) -> list[str]:
    """The page's opening block: the question and its answer, what the default recipe's served drafter
    yields (its newest pooled fit), and what is not measured yet."""
    spec = page["findings"]
    recipe = spec["default_recipe"]
    pooled = [r for r in results if r["kind"] == "fit" and r["recipe"] == recipe and r.get("statistic") == "pooled"]
    lines = ["## Findings", "", f"- **The question.** {spec['question']}", f"- **The answer so far.** {spec['answer']}"]
    if pooled:
        res = pooled[-1]
        lines.append(f"- **What a user of the default recipe (`{recipe}`) serves**, {_json_link(res)} "
                     f"({_host_text(res['host'])}): {_served_text(res)}; pooled, on held-out prompts.")
    else:
        lines.append(f"- **What a user of the default recipe (`{recipe}`) serves:** not measured with the pooled "
                     "evaluator yet (no such result in `results/`).")
    missing = ["the GPU path: no result here ran on a GPU" if not any(r["host"]["gpu"] for r in results) else None,
               *(f"the `{r}` recipe at the current defaults" for r in page["recipes"]
                 if not any(x["kind"] == "fit" and x["recipe"] == r and x.get("statistic") == "pooled"
                            for x in results))]
    lines.append("- **Not measured yet:** " + "; ".join(m for m in missing if m) + ".")
    lines.append("- Every earlier result below keeps its figures, labelled with the statistic and the drafter it was "
                 "measured with.")
    return lines + [""]


def _ci(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]"


def curve_table(curve: dict) -> list[str]:
    """``bench curve``'s table (its ``curve.md`` and RESULTS.md's learning curve): a line saying what was
    measured, then one row per point, recipe by recipe."""
    from exittrain.tables import markdown_table

    points = curve["points"]
    K = points[0]["chain_K"] if points else "K"
    rows = ([p["recipe"], p["step"], p["stage"] or "start", f"{p['cpu_s']:.0f}", f"{p['wall_s']:.0f}",
             p["train_tokens"], f"{p['chain_tau']:.3f} {_ci(p['chain_ci95'])}",
             f"{p['tree_tau']:.3f} {_ci(p['tree_ci95'])}"] for p in points)
    data = ", ".join(f"{r['name']} {r['data']['cpu_s']:.0f}" for r in curve["recipes"])
    return [f"Served tau against training cost, {curve['domain']} recipe, {curve['prompts']} held-out prompts, "
            f"T = {curve['temperature']:g}, pooled, 95% intervals over prompts. CPU s and wall s include the data "
            f"step (CPU s: {data}); evaluation is not counted.", "",
            *markdown_table(["recipe", "step", "stage", "CPU s", "wall s", "train tokens", f"chain tau K={K}",
                             f"tree tau B={curve['budget']}"], rows)]


def _curve_lines(curve: dict | None) -> list[str]:
    """RESULTS.md's learning curve: ``results/curve/``'s plot and table, or a plain "not measured yet"."""
    lines = ["## Learning curve: the served tau against training cost", ""]
    if curve is None:
        return lines + ["Not measured yet: no `results/curve/curve.json`. `python -m exittrain bench curve` "
                        "(`make bench-curve`) writes it, with its plot and table, into `results/curve/`.", ""]
    host = curve["host"]
    return lines + [f"[curve.json]({CURVE_DIR}/curve.json), on {host['cpu_model']} (`{host['cpu_capability']}`):",
                    "", "```bash", curve["command"], "```", "",
                    f"![served tau against training CPU-seconds and training tokens]({CURVE_DIR}/curve.png)", "",
                    *curve_table(curve), ""]


def render_page(results: list[dict], page: dict) -> str:
    """The Markdown of RESULTS.md: a pure function of the results and the page text."""
    names = {r["name"] for r in results}
    lines = ["# Results", "",
             "Generated by `python -m exittrain report --results` from the JSON files in [results/](results/); "
             "do not edit it by hand. Each figure's row links to its JSON and to its exact command. The "
             "history of every measurement, including those no JSON was kept for, is the "
             "[notebook](docs/notebook/README.md).", ""]
    lines += _findings(results, page)
    if results:
        newest = results[-1]
        torches = sorted({r["host"]["torch"] for r in results})
        lines += ["| | |", "|---|---|",
                  f"| commit | `{newest['commit']}` (newest result: {_json_link(newest)}) |",
                  f"| date | {newest['date']} |",
                  f"| hosts | {'; '.join(sorted({_host_text(r['host']) for r in results}))} |",
                  f"| torch | {', '.join(torches)} |", ""]
        lines += ["## Hosts", "", "| result | CPU | `get_cpu_capability()` | GPU | torch | shared machine |",
                  "|---|---|---|---|---|---|"]
        for res in results:
            h = res["host"]
            cap = f"`{h['cpu_capability']}`" + (" (emulated)" if h.get("emulation") else "")
            lines.append(f"| {_json_link(res)} | {h['cpu_model']} | {cap} | {h['gpu'] or '-'} "
                         f"| {h['torch']} | {'yes' if h['shared'] else 'no'} |")
        lines.append("")
    fits = [r for r in results if r["kind"] == "fit"]
    recipes = list(page["recipes"]) + sorted({r["recipe"] for r in fits} - set(page["recipes"]))
    for recipe in recipes:
        mine = [r for r in fits if r["recipe"] == recipe]
        lines += [f"## Recipe `{recipe}`", ""]
        if not mine:
            note = page["not_measured"].get(recipe)
            lines += ["Not measured at the current defaults: no result in `results/`."
                      + (f" Earlier runs: [{Path(note).name}]({note})." if note else ""), ""]
            continue
        current = [r for r in mine if r.get("statistic") == "pooled"]
        earlier = [r for r in mine if r.get("statistic") != "pooled"]
        for group, legend in ((current, _POOLED_LEGEND), (earlier, _EARLIER_LEGEND)):
            if not group:
                continue
            serving = any("chain_tau" in row for res in group for row in res["tables"])
            lines += ([legend, ""] + _fit_rows(group)
                      + ["", _FIT_LEGEND + (" " + _SERVING_LEGEND if serving else ""), ""])
        lines += ["Wall time by stage:", ""] + _wall_rows(mine) + [""]
        for res in mine:
            for note in res.get("notes", []):
                lines.append(f"- {_json_link(res)}: {note}")
        lines.append("")
    lines += ["## The ablation: ExitTrain against the block-CE control", ""] + _ablation_lines(results, page) + [""]
    experiments = [r for r in results if r["kind"] == "experiment"]
    if experiments:
        lines += ["## Does exit-guided training help? ExitTrain arms against matched controls", ""]
        if any("statistic" not in r["summary"] for r in experiments):  # some from before the pooled evaluator
            lines += [_EXPERIMENT_LEGEND, ""]
        for res in experiments:
            lines += experiment_lines(res, _json_link(res), _cmd_link(res))
    lines += _curve_lines(page.get("curve"))
    lines += ["## Known negatives", ""]
    for neg in page["negatives"]:
        refs = ", ".join(_see(ref, names) for ref in neg["see"])
        lines.append(f"- {neg['text']}" + (f" ({refs})" if refs else ""))
    lines += ["", "## Notebook", ""]
    lines += [f"- [{e['title']}]({e['path']})" for e in page["notebook"]]
    lines += ["", "## Commands", ""]
    for res in results:
        lines += [f"### {res['name']}", "", f"{res['date']}, commit `{res['commit']}`:", "", "```bash",
                  res["command"], "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"
