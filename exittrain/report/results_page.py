"""`python -m exittrain report --results`: RESULTS.md, generated from the result JSONs under ``results/``.

The page is a pure function of the files in ``results/`` (nothing is read from the clock or the
host that renders it; :mod:`exittrain.report.results_markdown` renders it), so a test can
regenerate it and compare byte for byte. Its header takes the commit and the date of the newest
result.

Files read, in ``ROOT/results/`` (``--root``, default the current folder, a checkout):

- ``NAME.json``, one per measured run, with the schema ``exittrain.result/1``:
  ``name`` (the file's stem), ``kind`` (``fit`` or ``ablation``), ``command`` (the exact command,
  environment variables included), ``commit``, ``date`` (``YYYY-MM-DD``), ``host`` (``cpu_model``,
  ``cpu_capability``, ``gpu`` or null, ``torch``, ``shared``: whether other jobs shared the
  machine, and optionally ``emulation``: how an emulated capability was set), optional ``notes`` (a
  list of strings). A ``fit`` result adds ``recipe``, ``tables`` (rows of ``label``, ``budget``,
  ``temperature``, ``prompts``, ``new_tokens``, ``tau``, ``ci95``, ``tokens_per_s``,
  ``ar_tokens_per_s``, ``speedup``, ``lossless``), ``heldout`` (the warm start's
  validation ``greedy_tau`` and ``analytic_tau``, or null), ``wall_s`` (seconds per stage and
  ``total``) and ``peak_rss_gb`` (or null); a fit measured by the pooled evaluator adds ``statistic``
  (``"pooled"``: every tau is total tokens / total rounds, at every temperature of its rows) and
  ``served`` (metrics.json's lead: the label of the drafter an engine serves and what its export
  dropped); a fit without ``statistic`` predates it (its drafter had the n-gram copy branch unless it
  trained as ``+serve=dflash``, and its held-out greedy / analytic taus are per-anchor means), and
  the page says so. An ``ablation`` result adds ``summary``: the
  ``summary`` block of an ``ablation.json`` (``overall_tau_vs_control``, ``analytic_vs_control``,
  ``best_weight_type``, ``goal_met``) and ``goal`` (the ratio asked); the benchmark that wrote those
  files is gone (``bench exittrain`` asks its question), and the page keeps reading them. An
  ``experiment`` result adds the ``summary`` of ``bench exittrain``
  (:mod:`exittrain.report.experiment_page`).
- ``page.json``: the page's text, free of figures: ``recipes`` (the order of the recipe
  sections), ``not_measured`` {recipe: notebook file}, ``ablation`` (``command``: the command of
  the experiment that asks the ablation's question now, ``notebook``, ``verdict``: the line shown
  while no ablation result exists), ``negatives`` [{``text``,
  ``see``: [result names or repository paths]}], ``notebook`` [{``path``, ``title``}] and
  ``findings`` (``question``, ``answer``: the project's question and its current answer, and
  ``default_recipe``: the recipe whose served tau the findings block quotes).
  Free text carrying a digit (dates and link targets aside) is refused: every figure on the page
  must come from a result JSON, linked to it and to its command.
- ``curve/curve.json``, when it exists: ``bench curve``'s learning curve (:func:`load_curve`), shown with
  its ``curve/curve.png`` and table; without it the page says the curve is not measured yet.

Writing a result: ``python -m exittrain report --results --add RUN_DIR --name NAME --command CMD``
summarises a ``fit`` run directory (its ``metrics.json``, and ``cli.log`` for the date and the CPU
capability that ``auto`` logged) into ``results/NAME.json``; ``--add-ablation ABLATION_JSON`` does
the same for an earlier ablation's JSON, ``--add-experiment EXITTRAIN_JSON`` for ``bench exittrain``. Host
fields not in the run's files come from the machine that runs the command (``--cpu-model``,
``--gpu`` override them), so summarise on the host that ran.
``--check`` renders the page and fails if ``RESULTS.md`` differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from exittrain.report.experiment_page import check_experiment, read_experiment, summarize_experiment
from exittrain.report.results_markdown import render_page

__all__ = [
    "SCHEMA", "load_results", "load_page", "write_page", "summarize_fit_run", "summarize_ablation", "host_info", "main",
]

log = logging.getLogger(__name__)

SCHEMA = "exittrain.result/1"
PAGE = "RESULTS.md"
KINDS = ("fit", "ablation", "experiment")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_LOG_DATE = re.compile(r"^\[(\d{4}-\d{2}-\d{2}) ", re.M)
_LOG_CAPABILITY = re.compile(r"CPU capability (\w+)")
_HOST_KEYS = ("cpu_model", "cpu_capability", "gpu", "torch", "shared")
_ROW_KEYS = ("label", "budget", "temperature", "prompts")
# a row's measures where it has them: a serving-track row has no tree tau, a CPU fit at eval.decode=fixed no speed
_OPTIONAL_ROW_KEYS = ("tau", "ci95", "tokens_per_s", "ar_tokens_per_s", "speedup")


# ----------------------------------------------------------------------------------------------
# reading and checking


def _need(d: Any, key: str, where: str, types: type | tuple = object) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise ValueError(f"{where}: missing key '{key}'; see the schema in exittrain/report/results_page.py")
    if not isinstance(d[key], types):
        raise ValueError(f"{where}: '{key}' must be {types}, got {type(d[key]).__name__}")
    return d[key]


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err


def check_result(res: Any, where: str) -> dict:
    """Raise ``ValueError`` naming the file and the key where ``res`` breaks the schema; return it."""
    if _need(res, "schema", where, str) != SCHEMA:
        raise ValueError(f"{where}: schema '{res['schema']}' is not '{SCHEMA}'")
    kind = _need(res, "kind", where, str)
    if kind not in KINDS:
        raise ValueError(f"{where}: kind '{kind}' is not one of {KINDS}")
    for key in ("name", "command", "commit"):
        _need(res, key, where, str)
    if not _DATE.match(_need(res, "date", where, str)):
        raise ValueError(f"{where}: date '{res['date']}' is not YYYY-MM-DD")
    host = _need(res, "host", where, dict)
    for key in _HOST_KEYS:
        _need(host, key, f"{where} host")
    if kind == "fit":
        _need(res, "recipe", where, str)
        rows = _need(res, "tables", where, list)
        if not rows:
            raise ValueError(f"{where}: 'tables' is empty; a fit result needs its decoded table")
        for i, row in enumerate(rows):
            for key in _ROW_KEYS:
                _need(row, key, f"{where} tables[{i}]")
            if "tau" not in row and "chain_tau" not in row:
                raise ValueError(f"{where} tables[{i}]: neither 'tau' nor 'chain_tau'; a row needs a measured tau")
            if "tau" in row:  # a tree tau comes with its interval
                _need(row, "ci95", f"{where} tables[{i}]")
            if "speedup" in row:  # and a speedup with its parts
                for key in ("tokens_per_s", "ar_tokens_per_s"):
                    _need(row, key, f"{where} tables[{i}]")
        _need(_need(res, "wall_s", where, dict), "total_s", f"{where} wall_s", (int, float))
        _need(res, "heldout", where, (dict, type(None)))
        if "statistic" in res:
            if res["statistic"] != "pooled":
                raise ValueError(f"{where}: statistic '{res['statistic']}' is not 'pooled' (omit it for older results)")
            _need(_need(res, "served", where, dict), "label", f"{where} served", str)
    elif kind == "experiment":
        check_experiment(res, where, _need)
    else:
        summary = _need(res, "summary", where, dict)
        for key in ("overall_tau_vs_control", "best_weight_type", "goal_met"):
            _need(summary, key, f"{where} summary")
        _need(res, "goal", where, (int, float))
    return res


def load_results(results_dir: str | Path) -> list[dict]:
    """Every ``results/*.json`` but ``page.json``, checked, sorted by (date, name).

    The benchmarks write their own outputs into ``results/`` by default (``bench_*.json``,
    git-ignored): those are no result summaries, and are skipped with a warning that names them.
    """
    results_dir = Path(results_dir)
    out = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name == "page.json":
            continue
        if path.name.startswith("bench_"):
            log.warning("%s: a benchmark's output, not a result summary; not on the page (summarise it first)", path)
            continue
        res = check_result(_read(path), str(path))
        if res["name"] != path.stem:
            raise ValueError(f"{path}: name '{res['name']}' differs from the file name; rename one of them")
        out.append(res)
    return sorted(out, key=lambda r: (r["date"], r["name"]))


def _no_figures(text: str, where: str) -> str:
    bare = re.sub(r"\]\([^)]*\)", "]", text)  # link targets may hold digits
    bare = re.sub(r"\d{4}-\d{2}-\d{2}", "", bare)  # so may dates
    if re.search(r"(?<![A-Za-z0-9_])\d", bare):  # a number; a name such as AVX2 or bf16 is no figure
        raise ValueError(f"{where}: free text carries a figure ({text!r}); figures come from result JSONs only")
    return text


_CURVE_POINT_KEYS = ("recipe", "step", "stage", "cpu_s", "wall_s", "train_tokens", "chain_tau", "chain_ci95",
                     "chain_K", "tree_tau", "tree_ci95")


def load_curve(results_dir: str | Path) -> dict | None:
    """``results/curve/curve.json`` (``bench curve``'s result, :func:`exittrain.bench.curve.result_of`),
    checked for what the page shows; None when there is none."""
    path = Path(results_dir) / "curve" / "curve.json"
    if not path.is_file():
        return None
    curve = _read(path)
    for key in ("domain", "command", "prompts", "temperature", "budget", "host", "recipes", "points"):
        _need(curve, key, str(path))
    for key in ("cpu_model", "cpu_capability"):
        _need(curve["host"], key, f"{path} host")
    for i, recipe in enumerate(curve["recipes"]):
        _need(_need(recipe, "data", f"{path} recipes[{i}]", dict), "cpu_s", f"{path} recipes[{i}].data")
    for i, point in enumerate(curve["points"]):
        for key in _CURVE_POINT_KEYS:
            _need(point, key, f"{path} points[{i}]")
    return curve


def load_page(results_dir: str | Path) -> dict:
    """``results/page.json``, checked: its free text holds no figure; with ``curve``, the learning curve
    :func:`load_curve` reads (None without one), which the page shows beside the text."""
    where = str(Path(results_dir) / "page.json")
    page = _read(Path(results_dir) / "page.json")
    for key in ("recipes", "not_measured", "ablation", "negatives", "notebook", "findings"):
        _need(page, key, where)
    for key in ("question", "answer", "default_recipe"):
        _no_figures(_need(page["findings"], key, f"{where} findings", str), f"{where} findings.{key}")
    for key in ("command", "notebook", "verdict"):
        _need(page["ablation"], key, f"{where} ablation", str)
    _no_figures(page["ablation"]["verdict"], f"{where} ablation.verdict")
    for i, neg in enumerate(page["negatives"]):
        _no_figures(_need(neg, "text", f"{where} negatives[{i}]", str), f"{where} negatives[{i}].text")
        _need(neg, "see", f"{where} negatives[{i}]", list)
    for i, entry in enumerate(page["notebook"]):
        _need(entry, "path", f"{where} notebook[{i}]", str)
        _no_figures(_need(entry, "title", f"{where} notebook[{i}]", str), f"{where} notebook[{i}].title")
    return {**page, "curve": load_curve(results_dir)}


# ----------------------------------------------------------------------------------------------
# writing the page


def write_page(root: str | Path = ".", check: bool = False) -> str:
    """Render ``ROOT/RESULTS.md`` from ``ROOT/results``; with ``check``, raise instead of writing a change."""
    root = Path(root)
    text = render_page(load_results(root / "results"), load_page(root / "results"))
    target = root / PAGE
    if check:
        old = target.read_text(encoding="utf-8") if target.is_file() else ""
        if old != text:
            raise SystemExit(f"{target} is not what results/ gives: run `python -m exittrain report --results`")
    else:
        target.write_text(text, encoding="utf-8")
    return text


# ----------------------------------------------------------------------------------------------
# writing results


def host_info(cpu_model: str | None = None, gpu: str | None = None) -> dict:
    """The rendering machine: CPU model (``/proc/cpuinfo``), torch's CPU capability, GPU name, torch."""

    import torch

    if cpu_model is None:
        from exittrain.precision import cpu_model as read_cpu_model

        cpu_model = read_cpu_model()
    if gpu is None and torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
    return {"cpu_model": cpu_model, "cores": __import__("os").cpu_count(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "gpu": gpu,
            "torch": torch.__version__.split("+")[0], "shared": False}


def _git_commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as err:
        raise ValueError(f"cannot read the commit of {root} ({err}); pass --commit") from err


def summarize_fit_run(run_dir: str | Path, *, name: str, command: str, commit: str, host: dict,
                      peak_rss_gb: float | None = None, notes: list[str] | None = None) -> dict:
    """A ``fit`` result from a run directory: its decoded tables, held-out tau and stage times.

    The date is the first log line's (``cli.log``); the CPU capability is the one ``auto`` logged
    there (the run's own, which an emulation such as ``ATEN_CPU_CAPABILITY=avx2`` changes), else
    ``host``'s. Only summaries are kept: no weights, no per-prompt rows.
    """
    run_dir = Path(run_dir)
    metrics = _read(run_dir / "metrics.json")
    where = str(run_dir / "metrics.json")
    tables = _need(metrics, "tables", where, dict)
    log = (run_dir / "cli.log").read_text(encoding="utf-8") if (run_dir / "cli.log").is_file() else ""
    dates = _LOG_DATE.findall(log)
    if not dates:
        raise ValueError(f"{run_dir / 'cli.log'}: no dated log line; the run's date cannot be read")
    host = dict(host)
    cap = _LOG_CAPABILITY.search(log)
    if cap:
        host["cpu_capability"] = cap.group(1)
    rows = []
    for label in ("warm_start", "exittrain", "served"):
        for r in tables.get(label, []):
            row = {k: r[k] for k in (*_ROW_KEYS, *_OPTIONAL_ROW_KEYS, "lossless", "chain_tau", "chain_ci95",
                                     "chain_K") if k in r} | {"label": label}
            if "vllm" in r:  # the serving track's engine measurement, flattened
                row |= {k: r["vllm"][k] for k in ("vllm_tau", "vllm_ci95", "vllm_matches_plain") if k in r["vllm"]}
            rows.append(row)
    val = metrics.get("pretrain_metrics", {})
    heldout = None
    if "val/greedy_block_length" in val:
        heldout = {"greedy_tau": val["val/greedy_block_length"], "analytic_tau": val.get("val/analytic_block_length")}
    new_tokens = _eval_tokens(run_dir)
    for row in rows:
        row["new_tokens"] = new_tokens.get(row["label"])
    res = {"schema": SCHEMA, "kind": "fit", "name": name, "recipe": _need(metrics, "recipe", where, str),
           "command": command, "commit": commit, "date": dates[0], "host": host,
           "target": metrics.get("target"), "tables": rows, "heldout": heldout,
           "wall_s": dict(_need(metrics, "timings", where, dict)), "peak_rss_gb": peak_rss_gb,
           "notes": list(notes or [])}
    if "served" in metrics:  # measured by the pooled evaluator, which leads metrics.json with the served drafter
        served = metrics["served"]
        res |= {"statistic": "pooled", "served": {"label": served["label"], "dropped": list(served["dropped"])}}
    return check_result(res, f"summary of {run_dir}")


def _eval_tokens(run_dir: Path) -> dict[str, int | None]:
    """New tokens per prompt of each evaluation (``eval_<label>.json``), when all prompts agree."""
    out = {}
    for path in run_dir.glob("eval_*.json"):
        tokens = {r.get("new_tokens") for r in _read(path)}
        out[path.stem.removeprefix("eval_")] = tokens.pop() if len(tokens) == 1 else None
    return out


def summarize_ablation(ablation_json: str | Path, *, name: str, command: str, commit: str, host: dict,
                       date: str, goal: float = 1.13) -> dict:
    """An ``ablation`` result: the settings and the summary block of an earlier ablation's JSON (the
    benchmark that wrote it is gone; its results stay on the page)."""
    data = _read(Path(ablation_json))
    res = {"schema": SCHEMA, "kind": "ablation", "name": name, "command": command, "commit": commit,
           "date": date, "host": host, "goal": goal,
           "settings": data.get("settings"), "summary": _need(data, "summary", str(ablation_json), dict)}
    return check_result(res, f"summary of {ablation_json}")


def summarize_experiment_json(path: str | Path, *, name: str, command: str, commit: str, host: dict,
                              date: str, notes: list[str] | None = None) -> dict:
    """An ``experiment`` result: the summary of ``bench exittrain``'s ``exittrain.json``. The CPU
    capability is the run's own (its JSON's ``host``, which an emulation changes), else ``host``'s."""
    data = read_experiment(path, _read)
    host = dict(host)
    own = data.get("host") or {}
    if own.get("cpu_capability"):
        host["cpu_capability"] = own["cpu_capability"]
    res = {"schema": SCHEMA, "kind": "experiment", "name": name, "command": command, "commit": commit,
           "date": date, "host": host, "summary": summarize_experiment(data), "notes": list(notes or [])}
    return check_result(res, f"summary of {path}")


def _peak_rss_gb(time_log: Path) -> float | None:
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_log.read_text(errors="replace"))
    return None if m is None else int(m.group(1)) / 1e6


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(prog="python -m exittrain report --results", description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=".", help="the checkout holding results/ and RESULTS.md")
    parser.add_argument("--check", action="store_true", help="fail if RESULTS.md differs from what results/ gives")
    parser.add_argument("--add", metavar="RUN_DIR", help="summarise a fit run directory into results/NAME.json")
    parser.add_argument("--add-ablation", metavar="ABLATION_JSON", help="summarise an earlier ablation's ablation.json")
    parser.add_argument("--add-experiment", metavar="EXITTRAIN_JSON", help="summarise bench exittrain's exittrain.json")
    parser.add_argument("--name", help="the result's name (its file results/NAME.json)")
    parser.add_argument("--command", help="the exact command that produced the run, environment variables included")
    parser.add_argument("--commit", help="the commit the run measured (default: the checkout's HEAD)")
    parser.add_argument("--date", help="YYYY-MM-DD, for --add-ablation (a fit run's date comes from its cli.log)")
    parser.add_argument("--cpu-model", help="the CPU model, when summarising on another machine")
    parser.add_argument("--gpu", help="the GPU name, when summarising on another machine")
    parser.add_argument("--shared", action="store_true", help="other jobs shared the machine during the run")
    parser.add_argument("--emulation", help="how the run's CPU capability was emulated (variables, real CPU)")
    parser.add_argument("--time-log", help="a `/usr/bin/time -v` log of the run, for its peak RSS")
    parser.add_argument("--note", action="append", default=[], help="a line of context (no figures), repeatable")
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.add or args.add_ablation or args.add_experiment:
        if not (args.name and args.command):
            parser.error("--add, --add-ablation and --add-experiment need --name and --command")
        host = host_info(args.cpu_model, args.gpu) | {"shared": args.shared}
        if args.emulation:
            host["emulation"] = args.emulation
        commit = args.commit or _git_commit(root)
        if args.add:
            rss = _peak_rss_gb(Path(args.time_log)) if args.time_log else None
            res = summarize_fit_run(args.add, name=args.name, command=args.command, commit=commit, host=host,
                                    peak_rss_gb=rss, notes=args.note)
        elif args.add_experiment:
            if not args.date:
                parser.error("--add-experiment needs --date")
            res = summarize_experiment_json(args.add_experiment, name=args.name, command=args.command,
                                            commit=commit, host=host, date=args.date, notes=args.note)
        else:
            if not args.date:
                parser.error("--add-ablation needs --date")
            res = summarize_ablation(args.add_ablation, name=args.name, command=args.command, commit=commit,
                                     host=host, date=args.date)
        out = root / "results" / f"{args.name}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        print(f"wrote {out}")
    text = write_page(root, check=args.check)
    print(f"{root / PAGE}: {'up to date' if args.check else 'written'} ({len(text.splitlines())} lines)")
    return text


if __name__ == "__main__":
    main(sys.argv[1:])
