"""`python -m exittrain report RUN_DIR [RUN_DIR ...] [--out DIR] [--wandb]`: tables and plots from run directories.

Works offline from the files alone (no model is loaded). Each RUN_DIR is a run directory or any
folder above some (a Hydra multirun sweep): every folder below it that holds one of the files
below is read as one run (hidden folders, checkpoints, drafters, wandb and lightning_logs folders
and the output folder are not searched).

Files read: those of :mod:`exittrain.run_dir` (its docstring gives their one layout each):
``metrics.json`` (a ``fit`` run's summary), ``metrics_<stage>.json`` (the training callbacks'
metrics per stage), ``eval_<label>.json`` (per-prompt rows), ``results.json`` (an ``eval`` run)
and ``tree_example.json``. A ``metrics.json`` that is not a fit summary is an error naming the file.

The recipe of a run is ``metrics.json["recipe"]``, else ``recipe_name`` in ``.hydra/config.yaml``,
else the label of its eval rows, else the folder name. Summary rows come from the files'
summaries, else from :func:`~exittrain.heldout.decode_eval.summarize` of the per-prompt rows
(:mod:`exittrain.report.run_loading` finds and reads the runs).

Written to ``--out`` (default ``RUN_DIR/report`` for one RUN_DIR, ``./report`` for several):

- ``report.md`` and ``report.json``: per recipe, one row per run / label / budget / temperature
  with tau, its 95% CI, the expected tau, the serving track (chain tau at K, vLLM's acceptance length,
  ``MISMATCH`` when vLLM's outputs changed under speculation), tau_oracle, tau/oracle, tok/s, AR tok/s and
  speedup; a training table
  (analytic tau, coverage, mean exit depth, final and best ``val/block_length`` per stage).
- ``tau_vs_budget_<recipe>.png``, ``block_lengths_<recipe>.png`` (at the lowest temperature and
  the largest budget of the recipe's rows), ``exit_mass_<recipe>.png``,
  ``training_curves_<recipe>.png`` (the decode check's tau, and the frequent cheap held-out
  measures ``heldout/chain_block_length`` and ``heldout/tree_block_length`` per stage), ``tree_<run>.png``.

A plot whose data is missing is skipped with a warning (logged, and listed under ``skipped`` in
report.json). With ``--wandb``, or when ``WANDB_MODE`` is set (and not ``disabled``), the PNGs
and the table are also logged to a wandb run (mode ``$WANDB_MODE``, default ``offline``; project
``$WANDB_PROJECT``, default ``exittrain``) in the output folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
from pathlib import Path

from exittrain.report import plots
from exittrain.report.run_loading import Run, discover_runs, load_run
from exittrain.run_dir import STAGE_LABELS
from exittrain.tables import cell, markdown_table

__all__ = ["main", "build_report", "format_markdown", "table_rows", "training_rows", "log_to_wandb"]

log = logging.getLogger(__name__)

_ORDER = {"pretrain": 0, "warm_start": 0, "exittrain": 1}


def _order(name: str) -> tuple[int, str]:
    """Sort key that puts the warm start before ExitTrain, then other labels alphabetically."""
    return _ORDER.get(name, 2), name
TRAINING_KEYS = (
    ("train/analytic_block_length", "train analytic tau"),
    ("val/analytic_block_length", "val analytic tau"),
    ("val/greedy_block_length", "val greedy tau"),
    ("train/coverage", "coverage"),
    ("train/mean_exit_depth", "mean exit depth"),
    ("val/block_length", "val tau (final)"),
)

# the HeldOutBlockLengthCallback's measures the training-curve plot draws: (history key, series name)
HELDOUT_CURVES = (
    ("heldout/chain_block_length", "greedy chain (fixed val rows)"),
    ("heldout/tree_block_length", "greedy tree (fixed val rows)"),
)


# ----------------------------------------------------------------------------------------------
# tables


def _num(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def table_rows(runs: list[Run]) -> list[dict]:
    """One flat row per run summary row: recipe, run, label, budget, temperature and the metrics."""
    out = []
    for run in runs:
        summary = sorted(run.summary, key=lambda r: (_order(str(r.get("label") or "")),
                                                     float(r.get("temperature") or 0.0), r.get("budget") or 0))
        for r in summary:
            ci = r.get("ci95")
            out.append({
                "recipe": run.recipe,
                "run": run.name,
                "label": r.get("label") or "-",
                "budget": r.get("budget"),
                "temperature": r.get("temperature"),
                "prompts": r.get("prompts"),
                "tau": _num(r, "tau"),
                "ci95": list(ci) if isinstance(ci, (list, tuple)) and len(ci) == 2 else None,
                "tau_oracle": _num(r, "tau_oracle"),
                "efficiency": _num(r, "efficiency"),
                "tokens_per_s": _num(r, "tokens_per_s"),
                "ar_tokens_per_s": _num(r, "ar_tokens_per_s"),
                "speedup": _num(r, "speedup"),
                "lossless": r.get("lossless"),
                "expected_tau": {t: c["tau"] for t, c in (r.get("analytic") or {}).items()},
                "chain_tau": _num(r, "chain_tau"),
                "chain_K": r.get("chain_K"),
                "vllm_tau": (r.get("vllm") or {}).get("vllm_tau"),
                "vllm_matches_plain": (r.get("vllm") or {}).get("vllm_matches_plain"),
            })
    return out


def training_rows(runs: list[Run]) -> list[dict]:
    """One row per run and stage with the final training metrics and the best decoded tau."""
    out = []
    for run in runs:
        stages: dict[str, dict] = {}
        for stage, data in run.stage_metrics.items():
            stages[stage] = dict(data.get("final") or {})
        for key, value in (run.fit or {}).items():  # fit's "<stage>_metrics" fill what the callback files lack
            if key.endswith("_metrics") and isinstance(value, dict):
                stage = key.removesuffix("_metrics")
                stages[stage] = {**value, **stages.get(stage, {})}
        for stage, final in sorted(stages.items(), key=lambda kv: _order(kv[0])):
            row = {"recipe": run.recipe, "run": run.name, "stage": stage}
            for key, _ in TRAINING_KEYS:
                row[key] = _num(final, key)
            best = ((run.stage_metrics.get(stage) or {}).get("decode_eval") or {}).get("best") or {}
            row["best val/block_length"] = _num(best, "block_length")
            row["global_step"] = (run.stage_metrics.get(stage) or {}).get("global_step")
            out.append(row)
    return out


# what a serving engine runs first (the chain), then the tree; every tau pooled as a decode counts it. The
# per-anchor expected tau only older runs' tables hold (before fit's tables were pooled) keeps its own column
DECODING_HEADER = ["run", "label", "B", "T", "prompts", "chain tau (K)", "tree tau", "95% CI", "vLLM tau",
                   "tau_oracle", "tau/oracle", "tok/s", "AR tok/s", "speedup", "older runs: per-anchor E[tau] at T"]


def _decoding_cells(r: dict) -> list:
    ci = f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}" if r["ci95"] else "-"
    temp = cell(None if r["temperature"] is None else float(r["temperature"]), "{:g}")
    # older runs only: the per-anchor expected TEV tau at their eval.analytic_temperatures (not a pooled tau)
    expected = ", ".join(f"{t}: {v:.2f}" for t, v in (r.get("expected_tau") or {}).items()) or "-"
    # the serving track (fit): the greedy chain of K a serving engine verifies, and vLLM's own acceptance
    chain = "-" if r.get("chain_tau") is None else f"{r['chain_tau']:.2f} ({r.get('chain_K', '-')})"
    vllm = "-" if r.get("vllm_tau") is None else f"{r['vllm_tau']:.2f}" + (
        "" if r.get("vllm_matches_plain", True) else " MISMATCH")
    return [r["run"], r["label"], r["budget"], temp, r["prompts"] or "-", chain, cell(r["tau"]), ci, vllm,
            cell(r["tau_oracle"]),
            cell(r["efficiency"]), cell(r["tokens_per_s"], "{:.1f}"), cell(r["ar_tokens_per_s"], "{:.1f}"),
            cell(r["speedup"], "{:.2f}x"), expected]


def format_markdown(rows: list[dict], train: list[dict], plots_by_recipe: dict[str, list[str]]) -> str:
    """The report as markdown: one section per recipe with the decoding and training tables and the plots."""
    recipes = list(dict.fromkeys([r["recipe"] for r in rows] + [t["recipe"] for t in train] + list(plots_by_recipe)))
    lines = ["# exittrain report", "",
             "tau = tokens per round (accepted + bonus), pooled as a decode counts it (total tokens / total rounds); "
             "chain tau = the greedy chain of K a serving engine verifies; tau/oracle = tau / tau_oracle; "
             "speedup = tok/s over autoregressive tok/s.", ""]
    for recipe in recipes:
        lines += [f"## recipe: {recipe}", ""]
        mine = [r for r in rows if r["recipe"] == recipe]
        if mine:
            lines += markdown_table(DECODING_HEADER, (_decoding_cells(r) for r in mine)) + [""]
        mine = [t for t in train if t["recipe"] == recipe]
        if mine:
            header = ["run", "stage", "step", *(n for _, n in TRAINING_KEYS), "best val tau"]
            cells = (
                [t["run"], t["stage"], cell(t["global_step"], "{}"), *(cell(t[k], "{:.3f}") for k, _ in TRAINING_KEYS),
                 cell(t["best val/block_length"])]
                for t in mine
            )
            lines += ["Training (last logged values):", "", *markdown_table(header, cells), ""]
        for png in plots_by_recipe.get(recipe, []):
            lines += [f"![{Path(png).stem}]({png})", ""]
    return "\n".join(lines).rstrip() + "\n"


# ----------------------------------------------------------------------------------------------
# plots


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(text)).strip("_") or "run"


def _series_prefix(runs: list[Run], run: Run) -> str:
    return f"{run.name}:" if len(runs) > 1 else ""


class _Plotter:
    def __init__(self, out: Path):
        self.out = out
        self.written: list[Path] = []
        self.skipped: list[str] = []
        self.by_recipe: dict[str, list[str]] = {}

    def skip(self, what: str, why: str) -> None:
        msg = f"skipped {what}: {why}"
        log.warning(msg)
        self.skipped.append(msg)

    def done(self, recipe: str, path: Path) -> None:
        self.written.append(path)
        self.by_recipe.setdefault(recipe, []).append(path.name)

    def tau_vs_budget(self, recipe: str, runs: list[Run]) -> None:
        what = f"tau_vs_budget_{_slug(recipe)}.png"
        rows = []
        for run in runs:
            for r in sorted(run.summary, key=lambda r: _order(str(r.get("label") or ""))):
                if "budget" in r and "tau" in r:
                    rows.append({**r, "series": _series_prefix(runs, run) + str(r.get("label") or "-")})
        if not rows:
            return self.skip(what, f"recipe {recipe!r} has no summary rows (no metrics.json tables, results.json "
                                   "or eval_*.json)")
        title = f"{recipe}: mean block length tau vs tree budget"
        self.done(recipe, plots.plot_tau_vs_budget(rows, self.out / what, title=title))

    def block_lengths(self, recipe: str, runs: list[Run]) -> None:
        what = f"block_lengths_{_slug(recipe)}.png"
        rows = [(run, r) for run in runs for r in sorted(run.rows, key=lambda r: _order(str(r.get("label") or "")))
                if r.get("block_lengths")]
        if not rows:
            return self.skip(what, f"recipe {recipe!r} has no per-prompt rows with block_lengths "
                                   "(eval_*.json or results.json rows)")
        temp = min(float(r.get("temperature", 0.0)) for _, r in rows)
        rows = [(run, r) for run, r in rows if float(r.get("temperature", 0.0)) == temp]
        budget = max(r.get("budget", 0) for _, r in rows)
        series: dict[str, list[int]] = {}
        oracle: dict[str, list[int]] = {}
        for run, r in rows:
            if r.get("budget", 0) != budget:
                continue
            name = _series_prefix(runs, run) + str(r.get("label") or "-")
            series.setdefault(name, []).extend(r["block_lengths"])
            if r.get("oracle_block_lengths"):
                oracle.setdefault(name, []).extend(r["oracle_block_lengths"])
        distinct: dict[tuple, str] = {}  # the oracle does not depend on the drafter: show each distinct one once
        for name, lengths in oracle.items():
            distinct.setdefault(tuple(lengths), name)
        for lengths, name in distinct.items():
            series[f"{name}: oracle trees" if len(distinct) > 1 else "oracle trees"] = list(lengths)
        title = f"{recipe}: block length per round (B={budget}, T={temp:g})"
        self.done(recipe, plots.plot_block_length_histogram(series, self.out / what, title=title))

    def exit_mass(self, recipe: str, runs: list[Run]) -> None:
        what = f"exit_mass_{_slug(recipe)}.png"
        series = {}
        for run in runs:
            sources = {stage: data.get("final") or {} for stage, data in run.stage_metrics.items()}
            for key, value in (run.fit or {}).items():
                if key.endswith("_metrics") and isinstance(value, dict):
                    sources.setdefault(key.removesuffix("_metrics"), value)
            for stage, final in sorted(sources.items(), key=lambda kv: _order(kv[0])):
                depths = sorted(int(m.group(1)) for k in final if (m := re.fullmatch(r"train/exit_mass_d(\d+)", k)))
                if depths:
                    label = _series_prefix(runs, run) + STAGE_LABELS.get(stage, stage)
                    series[label] = [float(final.get(f"train/exit_mass_d{d}") or 0.0) for d in range(depths[-1] + 1)]
        if not series:
            return self.skip(what, f"recipe {recipe!r}: no train/exit_mass_d* in metrics_<stage>.json 'final' or "
                                   "metrics.json '<stage>_metrics'")
        title = f"{recipe}: exit mass by depth (training trees, last logged step)"
        self.done(recipe, plots.plot_exit_mass_by_depth(series, self.out / what, title=title))

    def training_curves(self, recipe: str, runs: list[Run]) -> None:
        what = f"training_curves_{_slug(recipe)}.png"
        history, starts = {}, {}
        for run in runs:
            offset = 0.0
            order = sorted(run.stage_metrics, key=_order)  # pretrain first
            for stage in order:
                data = run.stage_metrics[stage]
                prefix = _series_prefix(runs, run) + STAGE_LABELS.get(stage, stage)
                hist = ((data.get("decode_eval") or {}).get("history")) or []
                if hist:
                    history[prefix] = [{**h, "step": float(h["step"]) + offset} for h in hist if "step" in h]
                    starts[prefix] = offset
                # the cheap held-out measures, logged far more often than the decode check
                cheap = ((data.get("heldout_block_length") or {}).get("history")) or []
                for key, name in HELDOUT_CURVES:
                    points = [{"step": float(h["step"]) + offset, "value": h[key]} for h in cheap
                              if "step" in h and h.get(key) is not None]
                    if points:
                        history[f"{prefix} {name}"] = points
                offset += float(data.get("global_step") or 0)
        if not history:
            return self.skip(what, f"recipe {recipe!r}: no decode_eval or heldout_block_length history in "
                                   "metrics_<stage>.json")
        title = f"{recipe}: held-out tau during training (stages run back to back)"
        self.done(recipe, plots.plot_training_curves(history, self.out / what, title=title, stage_starts=starts))

    def tree(self, recipe: str, run: Run) -> None:
        what = f"tree_{_slug(run.name)}.png"
        if run.tree_example is None:
            return self.skip(what, f"run {run.name} has no tree_example.json")
        self.done(recipe, plots.plot_draft_tree(run.tree_example, self.out / what))


# ----------------------------------------------------------------------------------------------
# entry points


def build_report(run_dirs: list[str | os.PathLike], out: str | os.PathLike | None = None) -> dict:
    """Read the runs, write report.md, report.json and the PNGs into ``out``; returns report.json's content.

    ``out`` defaults to ``run_dirs[0]/report`` for one run directory, ``./report`` for several.
    Raises ValueError for a missing directory or one without run files.
    """
    if not run_dirs:
        raise ValueError("no run directories given: python -m exittrain report RUN_DIR [RUN_DIR ...]")
    out = Path(out) if out is not None else (Path(run_dirs[0]) / "report" if len(run_dirs) == 1 else Path("report"))
    runs: list[Run] = []
    names: set[str] = set()
    for root in map(Path, run_dirs):
        for path in discover_runs(root, exclude=out):
            resolved, top = path.resolve(), root.resolve()
            name = str(resolved.relative_to(top.parent)) if top.parent != top else resolved.name
            base, k = name, 2
            while name in names:
                name, k = f"{base}#{k}", k + 1
            names.add(name)
            runs.append(load_run(path, name))
    out.mkdir(parents=True, exist_ok=True)

    plotter = _Plotter(out)
    recipes: dict[str, list[Run]] = {}
    for run in runs:
        recipes.setdefault(run.recipe, []).append(run)
    for recipe, mine in recipes.items():
        plotter.tau_vs_budget(recipe, mine)
        plotter.block_lengths(recipe, mine)
        plotter.exit_mass(recipe, mine)
        plotter.training_curves(recipe, mine)
        for run in mine:
            if run.tree_example is not None:
                plotter.tree(recipe, run)
        if not any(r.tree_example for r in mine):
            plotter.skip(f"draft tree plot for recipe {recipe!r}", "no tree_example.json in its runs")

    rows, train = table_rows(runs), training_rows(runs)
    markdown = format_markdown(rows, train, plotter.by_recipe)
    (out / "report.md").write_text(markdown, encoding="utf-8")
    report = {
        "runs": [{"name": r.name, "path": str(r.path), "recipe": r.recipe, "kind": r.kind, "files": r.files}
                 for r in runs],
        "rows": rows,
        "training": train,
        "plots": [p.name for p in plotter.written],
        "skipped": plotter.skipped,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    report["markdown"] = markdown
    report["out"] = str(out)
    report["files"] = [str(out / "report.md"), str(out / "report.json"), *map(str, plotter.written)]
    return report


def _wandb_mode(flag: bool) -> str | None:
    env = os.environ.get("WANDB_MODE")
    if env == "disabled":
        return None
    if flag or env:
        return env or "offline"
    return None


def log_to_wandb(report: dict, mode: str) -> None:
    """Log the report's PNGs (``wandb.Image``) and table to a wandb run in ``mode``; warns if wandb is missing."""
    try:
        import wandb
    except ImportError:
        log.warning("wandb is not installed; the report is not logged to wandb")
        return
    out = Path(report["out"])
    run = wandb.init(project=os.environ.get("WANDB_PROJECT", "exittrain"), job_type="report", dir=str(out), mode=mode)
    try:
        images = {f"report/{Path(p).stem}": wandb.Image(str(out / p)) for p in report["plots"]}
        columns = ["recipe", "run", "label", "budget", "temperature", "tau", "tau_oracle", "efficiency",
                   "tokens_per_s", "speedup"]
        table = wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in report["rows"]])
        run.log({**images, "report/table": table})
    finally:
        wandb.finish()


def main(argv: list[str] | None = None) -> dict:
    """CLI entry (``python -m exittrain report``): build the report, print the tables and the files written."""
    if argv is not None and "--results" in argv:  # RESULTS.md from results/ (exittrain.report.results_page)
        from exittrain.report.results_page import main as results_main

        return results_main([a for a in argv if a != "--results"])
    parser = argparse.ArgumentParser(prog="python -m exittrain report", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", help="fit/eval run directories or sweep folders above them")
    parser.add_argument("--out", default=None, help="output folder (default RUN_DIR/report, or ./report for several)")
    parser.add_argument("--wandb", action="store_true", help="also log the plots to wandb (offline unless WANDB_MODE)")
    args = parser.parse_args(argv)
    report = build_report(args.run_dirs, args.out)
    print(report["markdown"])
    mode = _wandb_mode(args.wandb)
    if mode is not None:
        log_to_wandb(report, mode)
    print("Files written:")
    for f in report["files"]:
        print(f"  {f}")
    return report
