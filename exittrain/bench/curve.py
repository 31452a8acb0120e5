"""The learning curve: the served tau against training CPU-seconds and training tokens, recipe by recipe.

``python -m exittrain bench curve [--recipe NAME=OVERRIDE,OVERRIDE ...] [--only NAME ...] [--every 100]
[--prompts 32] [--out results/curve]`` (``make bench-curve``: about an hour of a quiet 2-core CPU; run it
in the background). ``--smoke`` is the same run at ``debug=smoke``'s size, in minutes.

**Recipes.** A recipe is a name and Hydra overrides of the fit config of ``+recipe=<domain>``
(:func:`~exittrain.bench.recipe.compose_fit_config`; ``--override`` strings apply to every recipe first,
a recipe's own after them). The default set (:func:`default_recipes`) is the current default and budget
variants of it, sized from the composed default: twice the training prompts, twice the pretrain steps,
the full softmax instead of sampled negatives, one drafter layer more. ``--recipe NAME=O1,O2`` adds a
recipe (or replaces the default one of that name; commas inside brackets stay in their override), so a
new data path or budget joins the curve without a code change; ``--only`` picks which run.

**The x-axes.** Each recipe runs as ``fit`` runs it, from scratch: its seed, a fresh drafter
(``drafter.*``; a ``warm_start`` is refused: its training would be off the axis), its data step
(``prepare_data`` and ``setup``: the target's answers, features and soft labels, or whatever rows the
recipe's ``data.*`` names), then its stages (``stages.<stage>``, the objective), without fit's
validation epochs, decode checks and checkpoints. :class:`TrainClock` counts
the process CPU time (every thread, and waited-for child processes) and the wall time of all of it,
the data step included, and stops while a point is measured. The recipes share one data cache under
``<out>/work/cache``; the data step's cost is recorded per cache entry when the entry is made
(``<out>/work/data_costs.json``), and a recipe that reads an entry another recipe made is charged that
recorded cost: every recipe's curve starts where its own data would have put it. Training tokens: the
real tokens (prompt and answer, after truncation) of the training rows the steps so far consumed.

**The points.** At step 0 (after the data step), every ``--every`` optimizer steps (counted across the
stages) and at each stage's end, the drafter an engine serves (the drafter itself, or with the copy
branch on, its DFlash export without it, as ``fit`` serves it) is measured by one
:class:`~exittrain.heldout.evaluator.HeldOutEvaluator` for every recipe and point: the pooled chain tau
at K (the drafter's block size - 1) and the pooled tree tau at ``--budget``, each with its 95% interval
over prompts, at ``--temperature``, walked along the target's answers. The prompts are the held-out
prompts ``--skip .. --skip + --prompts`` of the recipe's evaluation set
(:func:`~exittrain.bench.recipe.heldout_prompts`); every recipe must give the same ones (a recipe that
changes ``data.eval_sources`` or ``eval.*`` is refused), so no recipe trained on them. A point's
measurement leaves the random generators as it found them: training runs the same with or without it.

Writes ``<out>/curve.json`` (:func:`result_of`), ``<out>/curve.md`` and ``<out>/curve.png`` (two
panels: tau against CPU-seconds and against training tokens, one line per recipe, the intervals as
bands). Each finished recipe's record is kept under ``<out>/work/recipes/``; ``--resume`` reuses it when
its overrides, the evaluator's settings, the prompts, the schedule and the measuring code are the same
(:class:`~exittrain.bench.measure_cache.MeasureCache`). ``python -m exittrain report --results`` shows
``results/curve/`` in RESULTS.md.

Limits: one domain per run; every recipe runs in this process, one after the other (a recipe's CPU
seconds are its own, but a busy host slows its wall seconds, and contention inflates CPU seconds too);
the first recipe's data step also pays the process's one-time costs (first imports and kernels: seconds,
against minutes of answers at the full size; at ``--smoke``'s size they can outweigh the answers); the
answers are generated in batches (``data.generation.batch_size``), so twice the prompts costs less than
twice the time while they fit one batch; a data path that makes its rows outside the datamodule's cache
entry would be charged only where its own ``prepare_data`` runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shlex
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from exittrain.bench.measure_cache import MeasureCache
from exittrain.bench.recipe import compose_fit_config, heldout_prompts
from exittrain.progress import Heartbeat
from exittrain.run_dir import write_json_atomic
from exittrain.safe_io import load_json_object

__all__ = ["Recipe", "TrainClock", "default_recipes", "parse_recipe", "result_of", "run", "to_markdown"]

STATISTIC = ("tau: tokens per round pooled over the prompts' rounds (total tokens / total rounds), walked by "
             "exittrain.heldout.evaluator.HeldOutEvaluator along the target's answers at the point's temperature; "
             "chain: the served drafter's greedy chain of K; tree: DDTree's tree of the budget's nodes")
# the sizes an option left unset takes: the full curve's, and --smoke's (debug=smoke's training, a few short answers)
FULL = {"every": 100, "prompts": 32, "max_new_tokens": 96}
SMOKE = {"every": 3, "prompts": 4, "max_new_tokens": 24}
WORK = "work"  # under --out: the shared data cache, the data costs, the finished recipes' records


def _log(msg: str) -> None:
    print(f"[bench curve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Recipe:
    """A curve's recipe: ``name`` and the Hydra overrides it adds to the fit config."""

    name: str
    overrides: tuple[str, ...] = ()


def split_overrides(text: str) -> list[str]:
    """``a=1,b=[2,3]`` -> ``["a=1", "b=[2,3]"]``: commas split only outside brackets, braces and quotes."""
    out, depth, quote, current = [], 0, None, []
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    out.append("".join(current).strip())
    return [o for o in out if o]


def parse_recipe(text: str) -> Recipe:
    """``NAME=OVERRIDE,OVERRIDE`` (``NAME=`` alone: the default config under that name); ValueError
    naming the option and the fix otherwise."""
    name, sep, rest = text.partition("=")
    name = name.strip()
    if not sep or not name or not all(c.isalnum() or c in "-_.+" for c in name):
        raise ValueError(f"--recipe {text!r}: write NAME=OVERRIDE,OVERRIDE (NAME: letters, digits, '-', '_', "
                         "'.', '+'), for example --recipe 'wide=drafter.num_layers=3,data.max_train_prompts=720'")
    overrides = split_overrides(rest)
    if any("=" not in o and not o.startswith("~") for o in overrides):
        raise ValueError(f"--recipe {text!r}: each override is KEY=VALUE (+KEY=VALUE, ~KEY), as on fit's command line")
    return Recipe(name, tuple(overrides))


def default_recipes(base) -> list[Recipe]:
    """The current default (``base``: the composed fit config with the common overrides) and budget
    variants sized from it: twice the training prompts (when ``data.max_train_prompts`` is set), twice the
    pretrain steps, the full softmax instead of sampled negatives, one drafter layer more."""
    recipes = [Recipe("default")]
    if base.data.max_train_prompts is not None:
        recipes.append(Recipe("2x-prompts", (f"data.max_train_prompts={2 * int(base.data.max_train_prompts)}",)))
    recipes += [Recipe("2x-pretrain", (f"stages.pretrain.max_steps={2 * int(base.stages.pretrain.max_steps)}",)),
                Recipe("full-softmax", ("objective.vocab_sample=null",)),
                Recipe("deeper", (f"drafter.num_layers={int(base.drafter.num_layers) + 1}",))]
    return recipes


class TrainClock:
    """Seconds counted only while running: the process's CPU time (user + system of every thread, plus its
    waited-for children: a data step's worker processes) and wall time, and any cost :meth:`charge` adds.

    ``with clock.running():`` counts; ``with clock.paused():`` inside it stops counting (a point's
    measurement). :meth:`read` gives ``(cpu_s, wall_s)`` so far."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0
        self._since: tuple[float, float] | None = None

    @staticmethod
    def _now() -> tuple[float, float]:
        t = os.times()  # process_time: every thread, at a finer grain than os.times' clock ticks
        return time.process_time() + t.children_user + t.children_system, time.perf_counter()

    def _stop(self) -> None:
        cpu, wall = self._now()
        self.cpu_s += cpu - self._since[0]
        self.wall_s += wall - self._since[1]
        self._since = None

    @contextmanager
    def running(self):
        if self._since is not None:
            raise RuntimeError("TrainClock.running: the clock already runs")
        self._since = self._now()
        try:
            yield self
        finally:
            self._stop()

    @contextmanager
    def paused(self):
        running = self._since is not None
        if running:
            self._stop()
        try:
            yield self
        finally:
            if running:
                self._since = self._now()

    def charge(self, cpu_s: float, wall_s: float) -> None:
        """Add a cost spent elsewhere (the data step of a cache entry another recipe made)."""
        self.cpu_s += cpu_s
        self.wall_s += wall_s

    def read(self) -> tuple[float, float]:
        if self._since is None:
            return self.cpu_s, self.wall_s
        cpu, wall = self._now()
        return self.cpu_s + cpu - self._since[0], self.wall_s + wall - self._since[1]


class DataCosts:
    """The data step's cost of the cache entries under ``cache_dir``, recorded when they are made, in
    ``path`` (JSON: ``{"groups": [{entries, cpu_s, wall_s, recipe}]}``). One ``prepare_data`` can make
    several entries at once (the target's answers and the corpus rows' entry): they are recorded as one
    group, and whoever reads any of them later is charged the whole group's cost once."""

    def __init__(self, path: Path, cache_dir: Path) -> None:
        self.path, self.cache_dir = path, cache_dir
        kept = load_json_object(path, what="the curve's data costs", fix=f"delete {path} and {cache_dir}") \
            if path.is_file() else {}
        self.groups: list[dict] = list(kept.get("groups", []))

    def key(self, entry: Path) -> str:
        return Path(os.path.relpath(entry, self.cache_dir)).as_posix()

    def record(self, entries: list[Path], cpu_s: float, wall_s: float, recipe: str) -> None:
        self.groups.append({"entries": [self.key(e) for e in entries], "cpu_s": cpu_s, "wall_s": wall_s,
                            "recipe": recipe})
        write_json_atomic(self.path, {"groups": self.groups})

    def recorded(self, entries: list[Path]) -> list[dict]:
        """The recorded groups that made ``entries``, each once; ValueError naming an entry none made."""
        found: list[dict] = []
        for entry in entries:
            group = next((g for g in self.groups if self.key(entry) in g["entries"]), None)
            if group is None:
                raise ValueError(f"the data cache entry {entry} exists but its data step's cost was never recorded in "
                                 f"{self.path} (made by another command, or a run killed before recording it): delete "
                                 f"{entry} so that the curve makes it and counts its cost")
            if group not in found:
                found.append(group)
        return found


def data_step(dm, clock: TrainClock, costs: DataCosts, recipe: str) -> dict:
    """``dm.prepare_data()`` and ``dm.setup("fit")`` under ``clock``. The entries it made (the answers'
    ``cache_path``, and ``corpus_cache_path`` with corpus rows) have the cost recorded; entries made before
    are charged at their recorded cost. Returns the step's record: ``cpu_s`` and ``wall_s`` (what the curve
    charges), ``entries``, ``made`` (those this recipe made), ``charged`` (the groups of the others), ``rows``."""
    entries = [Path(e) for e in (dm.cache_path, getattr(dm, "corpus_cache_path", None)) if e is not None]
    existed = [e for e in entries if e.is_dir()]
    made = [e for e in entries if e not in existed]
    cpu0, wall0 = clock.read()
    with clock.running():
        dm.prepare_data()
    cpu1, wall1 = clock.read()
    if made:
        costs.record(made, cpu1 - cpu0, wall1 - wall0, recipe)
    charged = costs.recorded(existed)
    for group in charged:
        clock.charge(group["cpu_s"], group["wall_s"])
    with clock.running():
        dm.setup("fit")
    cpu, wall = clock.read()
    return {"cpu_s": cpu - cpu0, "wall_s": wall - wall0, "entries": [costs.key(e) for e in entries],
            "made": [costs.key(e) for e in made], "charged": charged, "rows": int(len(dm.train_set))}


def served_drafter(drafter, target, folder: Path):
    """What an engine serves of ``drafter``: itself, or with the copy branch on, its DFlash export (which
    drops the branch) loaded back, as ``fit``'s finish serves it. ValueError when no export can hold it."""
    if not drafter.config.copy_ngrams:
        return drafter  # nothing to drop: the export is these weights
    from exittrain.export import export_beside
    from exittrain.models.dflash_format import load_dflash

    exported = export_beside(drafter, folder, target)
    if exported["path"] is None:
        raise ValueError(f"the recipe's drafter has no served form: {exported['why']}")
    return load_dflash(exported["path"], target)


@contextmanager
def _kept_random_state():
    """The random generators as they were: a point's measurement changes nothing training draws next."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def point_row(table: list[dict], budget: int, temperature: float) -> dict:
    """The served tau of one measurement: the chain's and the tree's at ``budget`` at ``temperature``,
    each with its 95% interval, from the evaluator's table."""
    for row in table:
        if row["budget"] == budget and abs(row["temperature"] - temperature) < 1e-9:
            return {"chain_tau": row["chain_tau"], "chain_ci95": list(row["chain_ci95"]), "chain_K": row["chain_K"],
                    "tree_tau": row["tau"], "tree_ci95": list(row["ci95"]), "budget": budget,
                    "temperature": temperature, "prompts": row["prompts"]}
    raise ValueError(f"the evaluator's table has no row at budget {budget}, T = {temperature:g}")


def schedule(stage_steps: list[int], every: int) -> list[int]:
    """The steps a curve point is measured at: 0, every ``every`` steps (counted across the stages) and
    each stage's last step."""
    total = sum(stage_steps)
    ends = [sum(stage_steps[: i + 1]) for i in range(len(stage_steps))]
    return sorted({0, *range(every, total + 1, every), *ends})


def train_recipe(recipe: Recipe, cfg, target, evaluator, costs: DataCosts, args, work: Path) -> dict:
    """One recipe from scratch, its points measured on the way (the module docstring); returns its record:
    ``name``, ``overrides``, ``stages`` (name and steps), ``data`` (:func:`data_step`), ``points``."""
    import torch

    from exittrain import progress
    from exittrain.build import build_datamodule, build_drafter, build_module
    from exittrain.lit import ProgressLogCallback, stage_progress_bar
    from exittrain.lit.curve_points import CurvePointsCallback
    from exittrain.lit.run_logging import seed_everything
    from exittrain.lit.train_steps import train_steps
    from exittrain.report.results_page import host_info
    from exittrain.settings import check_fit_config

    if cfg.warm_start is not None or cfg.ckpt_path is not None:
        raise ValueError(f"recipe {recipe.name}: warm_start / ckpt_path are set; a curve trains from scratch (the "
                         "warm start's training would be off the x-axis): drop them")
    stages = check_fit_config(cfg).stages
    steps = [int(cfg.stages[s].max_steps) for s in stages]
    at = schedule(steps, args.every)
    host = host_info()
    points: list[dict] = []
    clock = TrainClock()

    def measure(step: int, tokens: int, drafter, stage: str | None) -> None:
        with clock.paused(), _kept_random_state(), torch.no_grad():
            cpu_s, wall_s = clock.read()
            was_training = drafter.training
            drafter.eval()
            label = f"{recipe.name}@{step}"
            t0 = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory(dir=work) as folder, Heartbeat(label, every_s=60):
                    table, _, _ = evaluator.measure(served_drafter(drafter, target, Path(folder)), label)
            finally:
                drafter.train(was_training)
            row = point_row(table, args.budget, args.temperature)
            points.append({"recipe": recipe.name, "step": step, "stage": stage, "cpu_s": cpu_s, "wall_s": wall_s,
                           "train_tokens": tokens, **row, "cpu_model": host["cpu_model"],
                           "cpu_capability": host["cpu_capability"]})
            _log(f"{label}: chain tau {row['chain_tau']:.3f} at K={row['chain_K']}, tree tau {row['tree_tau']:.3f} at "
                 f"B={args.budget} ({cpu_s:.0f} CPU s, {tokens} tokens; measured in {time.perf_counter() - t0:.0f} s)")

    seed_everything(cfg.seed)  # once, as fit seeds once before its stages
    with clock.running():
        drafter = build_drafter(cfg, target)
        dm = build_datamodule(cfg, target, drafter.config.target_layer_ids, stages)
    data = data_step(dm, clock, costs, recipe.name)
    _log(f"{recipe.name}: data step {data['cpu_s']:.0f} CPU s, {data['wall_s']:.0f} s ({data['rows']} rows; made "
         f"{', '.join(data['made']) or 'nothing'}; charged the recorded cost of "
         f"{', '.join(e for g in data['charged'] for e in g['entries']) or 'nothing'})")
    measure(0, 0, drafter, None)
    offset, tokens = 0, 0
    for stage, n in zip(stages, steps):
        points_cb = CurvePointsCallback(
            [s - offset for s in at if offset < s <= offset + n],
            lambda step, seen, d, stage=stage: measure(step, seen, d, stage),
            step_offset=offset, tokens_before=tokens)
        shown = stage_progress_bar(stage) if progress.interactive() else ProgressLogCallback(stage, every_n_steps=10)
        with clock.running():
            module = build_module(cfg, stage, drafter, target)
            train_steps(module, dm, steps=n, trainer_cfg=cfg.trainer, logger=False, enable_checkpointing=False,
                        callbacks=[shown, points_cb], limit_val_batches=0,
                        **({} if progress.interactive() else {"enable_progress_bar": False}))
        offset, tokens = offset + n, points_cb.tokens
        del module
    dm.release_store()
    return {"name": recipe.name, "overrides": list(recipe.overrides),
            "stages": [{"stage": s, "steps": n} for s, n in zip(stages, steps)], "data": data,
            "train_cpu_s": clock.cpu_s, "train_wall_s": clock.wall_s, "host": host,
            "threads": torch.get_num_threads(), "points": points}


def eval_overrides(args) -> list[str]:
    """The evaluator's settings as overrides of every recipe's config: one budget, one temperature."""
    return [f"eval.budgets=[{args.budget}]", f"eval.temperatures=[{args.temperature}]",
            f"eval.max_new_tokens={args.max_new_tokens}", "eval.oracle=false", "eval.decode=fixed"]


def selected(args, base) -> list[Recipe]:
    """The default recipes with ``--recipe``'s added (a name given again replaces the default's), cut to
    ``--only``; ValueError naming an ``--only`` name no recipe has."""
    recipes = {r.name: r for r in default_recipes(base)}
    for text in args.recipe:
        recipe = parse_recipe(text)
        recipes[recipe.name] = recipe
    if args.only:
        unknown = [n for n in args.only if n not in recipes]
        if unknown:
            raise ValueError(f"--only {' '.join(unknown)}: no such recipe; the recipes are {', '.join(recipes)} "
                             "(add one with --recipe NAME=OVERRIDE,...)")
        return [recipes[n] for n in args.only]
    return list(recipes.values())


def result_of(args, recipes: list[dict], settings: dict, wall_s: float) -> dict:
    """What ``curve.json`` holds: the run (``domain``, ``overrides``, ``every``, ``host``, ``wall_s``), the
    measurement (``statistic``, ``prompts``, ``skip``, ``max_new_tokens``, ``budget``, ``temperature``,
    ``eval``), ``recipes`` (each :func:`train_recipe`'s record without its points, with ``reused``) and
    ``points``: every point of every recipe in order, each with ``recipe``, ``step``, ``stage``, ``cpu_s``,
    ``wall_s``, ``train_tokens``, ``chain_tau``, ``chain_ci95``, ``chain_K``, ``tree_tau``, ``tree_ci95``,
    ``budget``, ``temperature``, ``prompts``, ``cpu_model`` and ``cpu_capability``."""
    from exittrain.report.results_page import host_info

    return {"domain": args.domain, "statistic": STATISTIC, "prompts": args.prompts, "skip": args.skip,
            "max_new_tokens": args.max_new_tokens, "budget": args.budget, "temperature": args.temperature,
            "every": args.every, "overrides": list(args.override), "eval": settings, "host": host_info(),
            # the command quoted, so that a shell reruns it as it ran
            "wall_s": wall_s, "command": "python -m exittrain bench curve " + shlex.join(args.argv),
            "recipes": [{k: v for k, v in r.items() if k != "points"} for r in recipes],
            "points": [p for r in recipes for p in r["points"]]}


def to_markdown(result: dict) -> str:
    """The curve's table (:func:`exittrain.report.results_markdown.curve_table`, as RESULTS.md shows it)."""
    from exittrain.report.results_markdown import curve_table

    return "\n".join(curve_table(result)) + "\n"


def recipe_key(args, recipe: Recipe, prompts: list[list[int]], settings: dict, target_name: str) -> dict:
    """What a recipe's record depends on besides the measuring code: the overrides, the evaluator's
    settings, the prompts' token ids, the schedule."""
    ids = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {"domain": args.domain, "common": list(args.override), "recipe": list(recipe.overrides),
            "target": target_name, "prompt_ids": ids, "eval": settings, "every": args.every,
            "budget": args.budget, "temperature": args.temperature}


def run(args, target=None) -> dict:
    """Run (or with ``--resume`` reuse) every selected recipe; write ``curve.json``, ``curve.md`` and
    ``curve.png`` under ``--out``. ``target``: a built target instead of the config's (the tests' tiny one)."""
    from hydra.utils import instantiate

    from exittrain.heldout.evaluator import HeldOutEvaluator
    from exittrain.report.plots import plot_learning_curve
    from exittrain.settings import eval_settings

    t0 = time.perf_counter()
    out = Path(args.out)
    work = out / WORK
    work.mkdir(parents=True, exist_ok=True)
    common = [*args.override, *(["debug=smoke"] if args.smoke else []), f"paths.cache_dir={work / 'cache'}",
              *eval_overrides(args)]
    base = compose_fit_config(args.domain, work / "run", common)
    settings = eval_settings(base)
    target = instantiate(base.target) if target is None else target
    prompts = heldout_prompts(base, target, args.prompts, skip=args.skip)
    evaluator = HeldOutEvaluator(target, prompts, settings, reference=None)
    costs = DataCosts(work / "data_costs.json", work / "cache")
    records = []
    for recipe in selected(args, base):
        cfg = compose_fit_config(args.domain, work / "run" / recipe.name, [*common, *recipe.overrides])
        if eval_settings(cfg) != settings:
            raise ValueError(f"recipe {recipe.name} changes eval.*: every recipe is measured by one evaluator; drop "
                             "its eval overrides (--budget, --temperature, --max-new-tokens set them for all)")
        if heldout_prompts(cfg, target, args.prompts, skip=args.skip) != prompts:
            raise ValueError(f"recipe {recipe.name} has other held-out prompts than the default's (data.eval_sources?):"
                             " every recipe is measured on the same prompts, which none trains on")
        kept = MeasureCache(work / "recipes", recipe_key(args, recipe, prompts, settings, target.name))
        record = kept.load(recipe.name) if args.resume else None
        if record is not None:
            _log(f"{recipe.name}: reused ({len(record['points'])} points)")
            records.append({**record, "reused": True})
            continue
        _log(f"{recipe.name}: {' '.join(recipe.overrides) or 'the default config'}")
        record = train_recipe(recipe, cfg, target, evaluator, costs, args, work)
        kept.save(recipe.name, record)
        records.append({**record, "reused": False})
    result = result_of(args, records, settings, time.perf_counter() - t0)
    write_json_atomic(out / "curve.json", result)
    (out / "curve.md").write_text(to_markdown(result))
    plot_learning_curve(result, out / "curve.png")
    print(to_markdown(result))
    return result


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--recipe", action="append", default=[], metavar="NAME=OVERRIDE,...",
                        help="add a recipe (or replace the default one of that name): Hydra overrides of the fit "
                        "config")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these recipes (default: every one)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of every recipe's config")
    parser.add_argument("--every", type=int, help="a point every N optimizer steps and at each stage end "
                        f"(default {FULL['every']}; {SMOKE['every']} with --smoke)")
    parser.add_argument("--prompts", type=int, help=f"held-out evaluation prompts (default {FULL['prompts']}; "
                        f"{SMOKE['prompts']} with --smoke)")
    parser.add_argument("--skip", type=int, default=16, help="evaluation prompts to leave out first (fit decodes them)")
    parser.add_argument("--max-new-tokens", type=int, help="eval.max_new_tokens: tokens per answer (default "
                        f"{FULL['max_new_tokens']}; {SMOKE['max_new_tokens']} with --smoke)")
    parser.add_argument("--budget", type=int, default=16, help="the tree tau's budget (nodes)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the temperature of every point (0 = greedy)")
    parser.add_argument("--smoke", action="store_true",
                        help="debug=smoke's sizes (few prompts and steps) for every recipe: the whole curve in minutes")
    parser.add_argument("--resume", action="store_true", help="reuse the recipes already finished under --out")
    parser.add_argument("--out", default="results/curve")
    args = parser.parse_args(argv)
    args.argv = list(argv if argv is not None else sys.argv[1:])
    for key, value in (SMOKE if args.smoke else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("every", "prompts", "max_new_tokens", "budget"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.skip < 0 or args.temperature < 0:
        parser.error("--skip and --temperature must be >= 0")
    for text in args.recipe:
        try:
            parse_recipe(text)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
