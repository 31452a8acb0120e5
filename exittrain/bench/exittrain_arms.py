"""Does exit-guided training help? ExitTrain arms against matched block-CE controls and the warm start.

``python -m exittrain bench exittrain --warm-start RUN/warmstart_drafter [--steps 30] [--out results/exittrain]``
(``make bench-exittrain``; hours on a 2-core CPU: run it in the background)

Chain against tree ExitTrain under the serving profile (every arm trained as ``+serve=dflash``
trains, from the warm start of a ``+serve=dflash`` fit: K = 7 draft tokens; the arm, not
``tree.shape``, sets each arm's shape)::

    python -m exittrain bench exittrain --warm-start RUN/warmstart_drafter --override +serve=dflash \\
        --arms control-soft-fresh exittrain-soft-flow-l1-chain-fresh exittrain-soft-flow-l1-fresh --budgets 16 ...

**The config.** The fit config of ``+recipe=<domain>`` is composed once (``--override`` strings,
then the bench's options as ``seed`` and ``eval.*``: :func:`measure_overrides`); the fresh rows
are that config with their data settings changed (:func:`fresh_overrides`).

**The arms.** One warm start (a saved drafter, for example the ``warmstart_drafter`` of a
default ``fit``; without ``--warm-start`` one is trained here with the recipe's pretrain stage).
From it every arm runs the same ``--steps`` of one stage, with the same seed, so the same batches
in the same order and the same anchors (the ExitTrain stage's lr and anchors per sequence):

- ``control-<labels>-<rows>``: block CE only (full softmax), the matched control;
- ``exittrain-<labels>-<weights>-l<lambda>[-B<budget>]-<rows>``: block CE + lambda x the node loss
  on DDTree's best-first tree of the budget's nodes (16 without the suffix);
- ``exittrain-<labels>-<weights>-l<lambda>-chain-<rows>``: the same on the drafter's greedy chain
  of its K draft tokens (``tree_shape=chain``), the draft vLLM and SGLang verify;
- ``nodeonly-<weights>-l<lambda>-<rows>``: the node loss without block CE;
- ``control-soft-fresh-cpumatched``: block CE for as many CPU-seconds as the node-only arm trains,
  its steps decided once per run from the first training seed's CPU ratio and recorded
  (:func:`cpu_matched_steps`, ``<out>/cpu_match.json``).

``labels``: ``soft`` (the recipe's labels: the target's top-16 distribution) or ``hard`` (the
answer token). ``rows``: ``fresh``, prompts the warm start never saw (``data.exclude_seed`` and
``data.exclude_size``: no task of the warm start's sample, in either prompt form; the reference
recipe's structure), or
``own``, the warm start's own rows. The budget is the training tree's (``tree.budget_train``).
Every arm passes its tree shape and budget to the stage's module, so an ``--override`` of
``tree.shape`` (``+serve=dflash`` sets chain) changes no arm's shape; ``--override +serve=dflash``
trains every arm under the serving profile's settings. The drafter (K included) is the warm
start's: pass the ``warmstart_drafter`` of a ``+serve=dflash`` fit, or none to train one here under it.
:data:`exittrain.bench.exittrain_grid.ARMS` lists the grid that runs; it is a cut of the full factorial,
stated in its comments.

**What each drafter reports** (the warm start included): what the held-out evaluator
(:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`, the one ``fit`` and ``eval`` use) measures,
one evaluator for every drafter, on the held-out prompts ``--skip .. --skip + --prompts`` of the
recipe's evaluation set (:func:`~exittrain.bench.recipe.heldout_prompts`; ``fit`` decodes the first
ones), at every ``--budgets`` and ``--temperatures``. This module defines no measurement of its own:

- tau of DDTree's tree of B nodes, pooled: total tokens / total rounds over the prompts, as a decode
  (and vLLM) counts it; at T = 0 the rounds are walked along the target's greedy answer, at T > 0
  along the target's own samples at T, the same answers for every drafter;
- the chain (unless ``--no-chain``): the same on the drafter's greedy chain of its K draft tokens
  (the draft vLLM and SGLang verify); a row with ``shape: chain`` and ``budget`` = K;
- with ``--oracle``: the evaluator's decoded oracle (``tau_oracle``: trees of the same budget built
  from the target itself) and each drafter's efficiency tau / tau_oracle;
- paired differences against the arm's matched control and against the warm start: the pooled tau
  of one minus the other's over the same prompts (the same answers walked), with a 95% interval
  bootstrapping prompts (:func:`exittrain.core.paired_pooled_difference`); the report lists the
  settings whose interval excludes 0 (T = 0 included), each pair read alone, uncorrected.

**The sharpening control** (``--sharpen-temperatures T_D ...``): is an arm's gain more than a sharper
drafter distribution gives? The warm start and the replicates of the soft-label control are measured on
a development split of the held-out prompts (``--dev-skip``, ``--dev-prompts``; disjoint from the
measured ones) at each drafter temperature t_d (``eval.drafter_temperature``: every tree built from
``log_softmax(logits / t_d)``), on the tree of ``--sharpen-budget`` nodes at ``--sharpen-at``; the t_d
with the highest pooled tau (the control's averaged over its seeds) is chosen
(:func:`choose_sharpening`), and the same weights at that t_d are measured on the held-out prompts as
``sharpened-control-soft-fresh@seedS`` and ``sharpened warm start``, on the same answers as every other
drafter. The greedy chain, an argmax, is the same at every t_d.

**vLLM** (``--vllm``): every drafter is exported to the DFlash format (``<out>/vllm/<name>/``) and
vLLM (``.venv-vllm``, or ``--vllm-python``) decodes the first ``--vllm-prompts`` of the same held-out
prompts greedily with it (``--vllm-arms``: only those arms' replicates and the warm start; a sharpened
drafter is never exported: an engine drafts at t_d = 1), one prompt at a time after one plain run:
vLLM's own acceptance length, its interval over prompts, paired against the warm start and the matched
control on the same prompts, and whether speculation left vLLM's outputs unchanged
(:mod:`exittrain.bench.vllm_acceptance`). An arm whose interval against its control excludes 0 joins the
report's uncorrected list.

Writes ``<out>/exittrain.json`` (``exittrain_partial.json``, rewritten after each drafter's
measurement, while it runs; the layout: :func:`result_of`), ``<out>/exittrain.md`` and
``<out>/exittrain_vs_control.png``, each arm's drafter under ``<out>/<arm>/`` (reused by a rerun with
``--resume``) and every drafter's measurement under ``<out>/measured/`` (reused by any rerun with the
same prompts, evaluator settings, weights and measuring code, :class:`MeasureCache`: adding an arm
measures that arm only). Each drafter's measurement logs its start and end, with a heartbeat each
minute between them.

**Replicates** (``--train-seeds S1 S2 ...``): every arm is trained once per seed (the drafter
``ARM@seedS``), each ExitTrain replicate paired with its control of the same seed. ``--rule crossed``
(the default) reads the registered contrasts of docs/experiments/2026-12-07-node-loss-served-drafters.md
(:mod:`exittrain.bench.node_loss_protocol`: N and E against C, S, C5, on the tree, the chain and vLLM)
under its rule (:mod:`exittrain.bench.registered_rule`: a crossed bootstrap over seeds and prompts, a
margin per setting, two fixed sequences). ``--rule noise-floor`` is the 2026-12-05 protocol's: the
controls' replicates, paired with each other, give the noise floor (:func:`noise_floor`: the largest
control-against-control difference); :func:`~exittrain.bench.exittrain_report.replicate_verdicts`
reads each ExitTrain arm's per-seed differences against it under the decision rule of
docs/experiments/2026-12-05-exittrain-confirmation.md, and each setting under its fixed sequence
(the primary first; the secondaries in order while each before was confirmed; the rest descriptive).

Limits: one domain per call; the fresh rows are fewer than the warm start's, and every arm runs a
few dozen steps on a CPU: a verdict here is about this scale. The measurement is the evaluator's:
on a CPU target with ``eval.decode=fixed`` (the bench refuses ``auto``), without speed columns.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from exittrain.bench import node_loss_protocol
from exittrain.bench.exittrain_grid import ARMS, replicate, selected_arms, split_replicate
from exittrain.bench.exittrain_report import plot, replicate_verdicts, setting_key, to_markdown
from exittrain.bench.measure_cache import MeasureCache
from exittrain.bench.recipe import compose_fit_config, heldout_prompts, train_drafter
from exittrain.bench.registered_rule import registered_readings
from exittrain.build import build_datamodule
from exittrain.core import bootstrap_ci, paired_pooled_difference, pooled
from exittrain.progress import Heartbeat
from exittrain.run_dir import write_json_atomic
from exittrain.safe_io import load_json_object
from exittrain.settings import module_overrides

PARTIAL = "exittrain_partial.json"
TRAIN_INFO = "bench_train.json"  # an arm's training record, beside its saved drafter
CPU_MATCH = "cpu_match.json"  # the step counts of the CPU-matched controls, decided once per run
SHARPENED = "control-soft-fresh"  # the arm whose replicates (and the warm start) get a sharpening control
WARM = "warm start"  # the warm start's drafter name: the evaluator's reference, paired with every other drafter
STATISTIC = ("tau: tokens per round pooled over the prompts' rounds (total tokens / total rounds), the rounds walked "
             "by exittrain.heldout.evaluator.HeldOutEvaluator along the target's greedy answers (T = 0) or its own "
             "samples at T (T > 0)")


def _log(msg: str) -> None:
    print(f"[bench exittrain {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def _measuring(label: str):
    """Log one measurement's start and end, with a heartbeat each minute between them: one drafter's
    walks at every budget and temperature over 64 answers run for minutes on a CPU."""
    _log(f"{label}: measuring")
    t0 = time.perf_counter()
    with Heartbeat(label, every_s=60):
        yield
    _log(f"{label}: done ({time.perf_counter() - t0:.0f} s)")


def measure_overrides(args) -> list[str]:
    """The bench's options as overrides of the fit config, applied after ``--override``: the seed (the
    data's and the measurement's) and the evaluator's ``eval.*`` settings."""
    def listed(values) -> str:
        return "[" + ",".join(str(v) for v in values) + "]"

    return [f"seed={args.seed}", f"eval.budgets={listed(args.budgets)}",
            f"eval.temperatures={listed(args.temperatures)}", f"eval.max_new_tokens={args.max_new_tokens}",
            f"eval.oracle={str(args.oracle).lower()}"]


def fresh_overrides(args, warm_prompts: int | None) -> list[str]:
    """The data overrides of the fresh rows: ``--fresh-prompts`` prompts under the next seed, without every
    task of the warm start's sample (``warm_prompts``, its ``data.max_train_prompts``, drawn under ``--seed``)."""
    if warm_prompts is None:
        raise ValueError("data.max_train_prompts is null: the warm start trained on every training prompt, so "
                         "no fresh rows are left; set data.max_train_prompts (--override) for the warm start")
    return [f"data.seed={args.seed + 1}", f"data.exclude_seed={args.seed}", f"data.exclude_size={warm_prompts}",
            f"data.max_train_prompts={args.fresh_prompts}"]


def _datamodules(args, cfg, target, layers):
    """``{"own": the warm start's rows, "fresh": rows of prompts it never saw}``, prepared, with the config
    of each: ``cfg`` itself for the own rows, ``cfg`` with :func:`fresh_overrides` for the fresh ones."""
    from omegaconf import OmegaConf

    cfgs, dms = {}, {}
    needed = {a.rows for a in selected_arms(args)}
    for rows in ("own", "fresh"):
        if rows not in needed:
            continue
        rows_cfg = cfg if rows == "own" else OmegaConf.merge(
            cfg, OmegaConf.from_dotlist(fresh_overrides(args, cfg.data.max_train_prompts)))
        dm = build_datamodule(rows_cfg, target, layers, ["exittrain"])
        dm.prepare_data()
        dm.setup("fit")
        cfgs[rows], dms[rows] = rows_cfg, dm
        _log(f"{rows} rows: {len(dm.train_set)} training rows")
    return cfgs, dms


def train_arms(args, cfg, target, warm_path: Path) -> tuple[dict, dict, dict]:
    """Train (or, with ``--resume``, reuse) every arm, once per training seed; returns ``({drafter: path},
    {drafter: train info}, choices)``, drafters named by :func:`~exittrain.bench.exittrain_grid.replicate`;
    ``choices``: per rows kind (``fresh``, ``own``) the settings the host decided for them
    (:func:`exittrain.build.run_choices`: the answers' dtype, the trainer's precision, and how each was chosen).

    A training seed sets everything random in an arm's training and nothing else: the order of the
    batches (:attr:`~exittrain.data.ExitTrainDataModule.order_seed`), the anchors (the objective's seed)
    and dropout (the global generators). The rows, the split and the warm start are the same for every
    seed. Without ``--train-seeds`` the one replicate trains under ``--seed``, as before."""
    from omegaconf import OmegaConf

    from exittrain.build import run_choices
    from exittrain.lit import save_drafter
    from exittrain.models import load_drafter

    warm = load_drafter(warm_path, target)
    cfgs, dms = _datamodules(args, cfg, target, list(warm.config.target_layer_ids))
    choices = {rows: run_choices(cfgs[rows], dm) for rows, dm in dms.items()}
    paths, info = {}, {}
    for seed in args.train_seeds or [None]:
        for arm in selected_arms(args):
            name = replicate(arm.name, seed)
            folder = Path(args.out) / name
            if args.resume and (folder / "config.json").is_file():
                trained = folder / TRAIN_INFO  # absent in folders saved before it was written
                kept = load_json_object(trained, what="an arm's training record", fix=f"delete {trained}") \
                    if trained.is_file() else {}
                paths[name], info[name] = folder, {**kept, "reused": True}
                _log(f"{name}: reused {folder}")
                continue
            arm_cfg = cfgs[arm.rows]
            if seed is not None:  # the rows are built: the seed now reaches only the order, anchors and dropout
                arm_cfg = OmegaConf.merge(arm_cfg, {"seed": seed})
            dms[arm.rows].order_seed = seed
            stage_args = {**module_overrides(arm_cfg, "exittrain"), **arm.module_args()}
            matched = None if arm.cpu_match is None else cpu_matched_steps(args, arm, info)
            steps = args.steps if matched is None else matched["steps"]
            drafter = load_drafter(warm_path, target)
            t0, cpu0 = time.perf_counter(), time.process_time()
            final = train_drafter(arm_cfg, drafter, target, dms[arm.rows], arm.stage, steps, **stage_args)
            seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
            paths[name] = save_drafter(drafter, folder)
            info[name] = {"train_s": seconds, "train_cpu_s": cpu_s, "steps": steps, "s_per_step": seconds / steps,
                          **asdict(arm), "train_seed": seed, "final": final,
                          **({} if matched is None else {"cpu_matched": matched})}
            write_json_atomic(folder / TRAIN_INFO, info[name])  # a --resume run reports it again
            _log(f"{name}: trained {steps} steps in {seconds:.0f} s ({cpu_s:.0f} CPU-s)")
    return paths, info, choices


def cpu_matched_steps(args, arm, info: dict[str, dict]) -> dict:
    """The steps of ``arm``, a block-CE control trained for the CPU-seconds of the arm it names
    (``arm.cpu_match``): ``--steps`` x the ratio of that arm's training CPU-seconds to its matched
    control's (``arm.control``: the same block CE for ``--steps``), both at the run's first training
    seed, rounded, and never below ``--steps``. CPU-seconds are the process's (every thread), over the
    training alone.

    Decided once per run: the first call writes ``<out>/cpu_match.json`` and every later seed, and a
    ``--resume``, reads it back, so the count does not follow the host's load from one seed to the
    next; the record (both CPU-seconds, the ratio, the steps) goes into the arm's training record.
    ValueError when the two arms it is derived from have no CPU-seconds in ``info`` (not trained in
    this run, or reused from a record written before they were kept) or when the record was written
    for other ``--steps``."""
    path = Path(args.out) / CPU_MATCH
    kept = load_json_object(path, what="the run's CPU-matched step counts", fix=f"delete {path}") \
        if path.is_file() else {}
    if arm.name in kept:
        record = kept[arm.name]
        if record.get("base_steps") != args.steps:
            raise ValueError(f"{path}: {arm.name}'s steps were decided for --steps {record.get('base_steps')}, "
                             f"this run has --steps {args.steps}; use another --out, or delete {path} to decide again")
        return record
    seed = (args.train_seeds or [None])[0]
    matched, control = replicate(arm.cpu_match, seed), replicate(arm.control, seed)
    cpu = {name: info.get(name, {}).get("train_cpu_s") for name in (matched, control)}
    if any(v is None or v <= 0 for v in cpu.values()):
        raise ValueError(f"{arm.name} trains for the CPU-seconds of {matched} against {control}, and this run has "
                         f"no training CPU-seconds for both ({cpu}): run them in the same call (--arms {arm.cpu_match} "
                         f"{arm.control} {arm.name}), retraining them if their records predate train_cpu_s")
    ratio = cpu[matched] / cpu[control]
    record = {"matches": matched, "control": control, "cpu_s": cpu, "ratio": ratio, "base_steps": args.steps,
              "steps": max(args.steps, round(args.steps * ratio)), "record": str(path)}
    write_json_atomic(path, {**kept, arm.name: record})
    _log(f"{arm.name}: {record['steps']} steps, {ratio:.2f} x the CPU-seconds of {control} ({matched}'s)")
    return record


def measure_settings(args, target, prompts: list[list[int]], settings: dict) -> dict:
    """What a drafter's measurement depends on besides its weights and the measuring code: the target,
    the held-out prompts' token ids (so the domain, ``--skip``, ``--prompts`` and any ``data.eval_sources``
    override), the evaluator's settings and whether the chain is measured."""
    ids = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()
    return {"target": target.name, "prompts": len(prompts), "prompt_ids": ids, "eval": settings,
            "chain": args.chain}


def measure(args, target, drafters: dict[str, Path], prompts: list[list[int]], settings: dict,
            on_step=None, drafter_temperatures: dict[str, float] | None = None) -> dict[str, dict]:
    """Every drafter measured by one :class:`~exittrain.heldout.evaluator.HeldOutEvaluator` on
    ``prompts`` with ``settings`` (:func:`exittrain.settings.eval_settings`' dict), the warm start
    (:data:`WARM`) as its reference; the chain unless ``args.chain`` is False. ``drafter_temperatures``:
    the drafter temperature t_d a name is measured at (``eval.drafter_temperature``; default the settings'),
    on the same answers as every other drafter.

    Returns ``{drafter: {"table", "rows", "chain", "num_draft_tokens"}}``: the evaluator's table, its
    per-prompt tree rows and its per-prompt chain rows (as JSON reads them back), and the drafter's K.
    Each drafter's measurement is kept under ``<out>/measured/`` (:class:`MeasureCache`, its key with the
    drafter's t_d); a rerun measures only the drafters it holds nothing for under this key (their answers
    are the same: they follow from the target, the prompts, the settings and the code the key holds).
    ``on_step(measured)`` runs after each drafter."""
    from exittrain.heldout.evaluator import HeldOutEvaluator
    from exittrain.models import load_drafter

    evaluator = HeldOutEvaluator(target, prompts, settings, reference=WARM, chain=args.chain)
    temperatures = drafter_temperatures or {}
    keyed = measure_settings(args, target, prompts, settings)
    caches: dict[float, MeasureCache] = {}
    measured: dict[str, dict] = {}
    t0 = time.perf_counter()
    for done, (name, path) in enumerate(drafters.items(), 1):
        t_d = float(temperatures.get(name, settings["drafter_temperature"]))
        cache = caches.setdefault(t_d, MeasureCache(Path(args.out) / "measured",
                                                    {**keyed, "eval": {**settings, "drafter_temperature": t_d}}))
        kept = cache.load(name, path)
        if kept is not None:
            measured[name] = kept
            _log(f"{name}: measured before ({cache.path(name)})")
        else:
            drafter = load_drafter(path, target).eval()
            with _measuring(name):
                table, rows, chain = evaluator.measure(drafter, name, drafter_temperature=t_d)
            # as JSON keeps it, so that a measurement and its kept copy read the same
            measured[name] = json.loads(json.dumps({"table": table, "rows": rows, "chain": chain,
                                                    "num_draft_tokens": drafter.config.num_draft_tokens}))
            cache.save(name, measured[name], path)
        _log(f"{done}/{len(drafters)} drafters measured ({time.perf_counter() - t0:.0f} s)")
        if on_step is not None:
            on_step(measured)
    return measured


def sharpened_name(name: str) -> str:
    """The name of ``name``'s sharpening control (its weights at the drafter temperature chosen on the
    development split): ``sharpened-<arm>@seedS``, or ``sharpened warm start``; the training seed stays
    last, so :func:`~exittrain.bench.exittrain_grid.split_replicate` reads it."""
    return f"sharpened {name}" if name == WARM else f"sharpened-{name}"


def choose_sharpening(args, cfg, target, drafters: dict[str, Path], settings: dict) -> dict:
    """The sharpening control's drafter temperature, chosen on the development split alone.

    On the held-out prompts ``--dev-skip .. --dev-skip + --dev-prompts`` (disjoint from the measured
    ones: :func:`parse_args` checks it), the warm start and every replicate of :data:`SHARPENED` are
    measured by one evaluator at each t_d of ``--sharpen-temperatures``, on the tree of
    ``--sharpen-budget`` nodes at ``--sharpen-at`` (T; no chain: an argmax chain does not change with
    t_d). Per base (the warm start; the control over its seeds) the chosen t_d is the one whose pooled tau,
    averaged over the base's replicates, is highest; a tie goes to the t_d nearest 1.

    Returns the result's ``sharpening`` block: the split, the setting, the grid, ``tau`` (``{base: {t_d:
    seed-averaged pooled tau}}``), ``per_drafter`` (``{drafter: {t_d: pooled tau}}``) and ``chosen``
    (``{base: t_d}``). The measurements are kept under ``<out>/measured_dev/`` like the main ones."""
    from exittrain.heldout.evaluator import HeldOutEvaluator
    from exittrain.models import load_drafter

    dev = heldout_prompts(cfg, target, args.dev_prompts, skip=args.dev_skip)
    dev_settings = {**settings, "budgets": [args.sharpen_budget], "temperatures": [args.sharpen_at]}
    evaluator = HeldOutEvaluator(target, dev, dev_settings, reference=None, chain=False)
    keyed = {**measure_settings(args, target, dev, dev_settings), "chain": False}
    bases = {name: split_replicate(name)[0] for name in drafters
             if name == WARM or split_replicate(name)[0] == SHARPENED}
    per: dict[str, dict[float, float]] = {}
    for t_d in args.sharpen_temperatures:
        cache = MeasureCache(Path(args.out) / "measured_dev", {**keyed, "eval": {**dev_settings,
                                                                                 "drafter_temperature": t_d}})
        for name in bases:
            label = f"{name} at t_d {t_d:g}"
            rows = cache.load(label, drafters[name])
            if rows is None:
                with _measuring(f"development split: {label}"):
                    _, rows, _ = evaluator.measure(load_drafter(drafters[name], target).eval(), label,
                                                   drafter_temperature=t_d)
                rows = json.loads(json.dumps(rows))
                cache.save(label, rows, drafters[name])
            per.setdefault(name, {})[t_d] = pooled([r["block_lengths"] for r in rows])
    tau: dict[str, dict[float, float]] = {}
    for base in sorted(set(bases.values())):
        names = [n for n, b in bases.items() if b == base]
        tau[base] = {t: sum(per[n][t] for n in names) / len(names) for t in args.sharpen_temperatures}
    chosen = {base: max(by_t, key=lambda t: (by_t[t], -abs(t - 1.0))) for base, by_t in tau.items()}
    for base, t_d in chosen.items():
        _log(f"sharpening: {base} at t_d {t_d:g} (development split, tau {tau[base][t_d]:.3f}; at 1: "
             f"{tau[base].get(1.0, float('nan')):.3f})")
    return {"dev_skip": args.dev_skip, "dev_prompts": len(dev), "budget": args.sharpen_budget,
            "temperature": args.sharpen_at, "temperatures": list(args.sharpen_temperatures),
            "tau": {b: {f"{t:g}": v for t, v in by_t.items()} for b, by_t in tau.items()},
            "per_drafter": {n: {f"{t:g}": v for t, v in by_t.items()} for n, by_t in per.items()},
            "chosen": chosen}


def prompt_rows(one: dict) -> dict[tuple[str, int, float], dict[int, dict]]:
    """``{(shape, budget, T): {prompt index: row}}`` of one drafter's measurement: ``ddtree`` from the
    evaluator's tree rows (budget = the tree's nodes), ``chain`` from its chain rows (budget = K)."""
    out: dict[tuple[str, int, float], dict[int, dict]] = {}
    for shape, rows in (("ddtree", one["rows"]), ("chain", one["chain"])):
        for r in rows:
            out.setdefault((shape, int(r["budget"]), float(r["temperature"])), {})[int(r["prompt_index"])] = r
    return out


def paired(first: dict[int, dict], second: dict[int, dict] | None) -> dict | None:
    """``first``'s pooled tau minus ``second``'s over the same prompts (``{prompt index: row}`` each, the
    same answers walked), with its 95% interval bootstrapping prompts
    (:func:`exittrain.core.paired_pooled_difference`); None when ``second`` is missing or was measured
    on other prompts."""
    if second is None or set(first) != set(second):
        return None
    order = sorted(first)
    return paired_pooled_difference([first[p]["block_lengths"] for p in order],
                                    [second[p]["block_lengths"] for p in order])


def matched_control(name: str) -> str | None:
    """The drafter an ExitTrain drafter is paired with: its arm's matched control, of the same training
    seed; None for a control, the warm start or a name outside the grid."""
    base, seed = split_replicate(name)
    arm = next((a for a in ARMS if a.name == base), None)
    return replicate(arm.control, seed) if arm is not None and arm.stage == "exittrain" else None


def noise_floor(measured: dict[str, dict]) -> dict[str, dict]:
    """Per setting and control arm: the paired pooled differences between its replicates (each pair of
    training seeds, on the same prompts), and the spread, the largest of their absolute values: how far
    two trainings of the same arm part by training noise alone. Empty with fewer than two replicates."""
    per = {name: prompt_rows(one) for name, one in measured.items()}
    replicates: dict[str, dict[int, str]] = {}
    for name in per:
        base, seed = split_replicate(name)
        if seed is not None and base.startswith("control-"):
            replicates.setdefault(base, {})[seed] = name
    floor = {}
    for base, by_seed in replicates.items():
        seeds = sorted(by_seed)
        settings = set.intersection(*(set(per[by_seed[s]]) for s in seeds))
        for shape, budget, T in sorted(settings):
            key = setting_key({"shape": shape, "budget": budget, "temperature": T})
            pairs = [{"seeds": [a, b], **pair} for i, a in enumerate(seeds) for b in seeds[i + 1:]
                     if (pair := paired(per[by_seed[b]][shape, budget, T], per[by_seed[a]][shape, budget, T]))]
            if pairs:
                floor[f"{base}/{key}"] = {"control": base, "key": key, "pairs": pairs,
                                          "spread": max(abs(p["delta"]) for p in pairs)}
    return floor


def compare(measured: dict[str, dict], warm_name: str = WARM) -> list[dict]:
    """One row per (drafter, shape, budget, temperature) of the evaluator's per-prompt rows: ``tau``
    pooled over every prompt's rounds (:func:`exittrain.core.pooled`), its 95% interval bootstrapping
    prompts, ``prompts`` and ``rounds``, and the paired pooled differences against the warm start
    (``vs_warm_start``) and the matched control (``vs_control``, with ``control``) at the same setting
    (:func:`paired`: None where the other lacks it). ``shape`` is ``ddtree`` (``budget`` = the tree's
    nodes) or ``chain`` (``budget`` = K). With the evaluator's oracle in the rows: ``tau_oracle``,
    pooled over the same prompts' oracle rounds, and ``efficiency`` = tau / tau_oracle."""
    per = {name: prompt_rows(one) for name, one in measured.items()}
    out = []
    for name, by_setting in per.items():
        control = matched_control(name)
        for setting, rows in by_setting.items():
            shape, budget, T = setting
            order = sorted(rows)
            lengths = [rows[p]["block_lengths"] for p in order]
            row = {"drafter": name, "shape": shape, "budget": budget, "temperature": T, "prompts": len(order),
                   "rounds": sum(map(len, lengths)), "tau": pooled(lengths), "ci95": list(bootstrap_ci(lengths)),
                   "vs_warm_start": None if name == warm_name else paired(rows, per.get(warm_name, {}).get(setting)),
                   "vs_control": None}
            # a setting the other lacks (a control measured --no-chain beside an arm with the chain): unpaired
            if control is not None and (pair := paired(rows, per.get(control, {}).get(setting))) is not None:
                row["control"], row["vs_control"] = control, pair
            if all("oracle_block_lengths" in rows[p] for p in order):
                row["tau_oracle"] = pooled([rows[p]["oracle_block_lengths"] for p in order])
                row["efficiency"] = row["tau"] / row["tau_oracle"] if row["tau_oracle"] else 0.0
            out.append(row)
    return out


def measure_in_vllm(args, target, drafters: dict[str, Path], prompts: list[list[int]]) -> dict:
    """vLLM's own acceptance length of every drafter's DFlash export (exported under ``<out>/vllm/``)
    on ``prompts`` (the first ``--vllm-prompts`` held-out prompts), greedy, each paired against the warm
    start and the arm's matched control on the same prompts
    (:func:`exittrain.bench.vllm_acceptance.measure_vllm`).

    Returns the ``vllm`` block of the result: ``prompts``, ``max_new_tokens``, ``vllm_version`` and
    ``drafters``: name -> ``tau``, ``ci95``, ``vs_warm_start``, ``vs_control``, ``lossless``, ``K``,
    ``per_prompt``. A drafter the DFlash format cannot hold raises ``ValueError`` (the reason named).
    """
    from exittrain.bench.vllm_acceptance import dflash_folder, measure_vllm
    from exittrain.heldout.serving_track import target_folder
    from exittrain.serve.compare import paired_acceptance

    work = Path(args.out) / "vllm"
    folders = {name: dflash_folder(path, name.replace(" ", "_"), work, target) for name, path in drafters.items()}
    _log(f"vLLM: {len(folders)} DFlash exports on {len(prompts)} prompts, one worker each")
    measured = measure_vllm(args.vllm_python, target_folder(target, None), folders, prompts,
                            max_new_tokens=args.max_new_tokens, workdir=work)
    per = measured["drafters"]
    for name, r in per.items():
        control = matched_control(name)
        r["vs_warm_start"] = None if name == WARM else paired_acceptance(r["per_prompt"], per[WARM]["per_prompt"])
        r["control"] = control if control in per else None
        r["vs_control"] = paired_acceptance(r["per_prompt"], per[control]["per_prompt"]) if r["control"] else None
        r.pop("vs_first", None)  # the warm start is first: vs_warm_start says the same
    return {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "vllm_version": measured["vllm_version"], "drafters": per}


def result_of(args, warm_path: Path, measured: dict[str, dict], train: dict, wall_s: dict,
              vllm: dict | None = None, choices: dict | None = None, sharpening: dict | None = None,
              registered: dict | None = None) -> dict:
    """What ``exittrain.json`` (and, while it runs, the partial file) holds:

    - the run: ``domain``, ``warm_start``, ``steps``, ``overrides``, ``arms``, ``train_seeds``, ``train``
      (each arm's training record), ``host``, ``wall_s``, ``choices`` (:func:`train_arms`': how the
      host-decided settings of the arms' rows were chosen; a ``--warm-start`` from a fit has its own in
      that fit's ``metrics.json``);
    - the measurement's settings: ``statistic`` (what tau is), ``prompts``, ``skip``, ``max_new_tokens``,
      ``budgets``, ``temperatures``, ``chain``, ``oracle``, ``seed``, ``num_draft_tokens`` (K);
    - ``rows``: :func:`compare`'s rows (tau pooled, the paired pooled differences);
    - ``tables``: ``{drafter: the evaluator's table}``; ``per_prompt``: ``{drafter: {"rows": the
      evaluator's per-prompt tree rows, "chain": its per-prompt chain rows}}``, from which every
      figure of ``rows`` can be recomputed, on any subset of the prompts;
    - ``rule``; ``noise_floor`` (:func:`noise_floor`, empty without replicates); with ``--train-seeds``,
      under ``--rule noise-floor`` ``replicates``
      (:func:`~exittrain.bench.exittrain_report.replicate_verdicts`, the 2026-12-05 protocol's rule), under
      ``--rule crossed`` what :func:`registered_block` gives (``registered``: the finished run's; the
      partial file has none);
    - ``vllm`` with ``--vllm`` (:func:`measure_in_vllm`);
    - ``sharpening`` with ``--sharpen-temperatures`` (:func:`choose_sharpening`: the development split's
      grid and the chosen drafter temperatures; the sharpened drafters are rows like any other).
    """
    from exittrain.report.results_page import host_info

    rows = compare(measured, WARM)
    floor = noise_floor(measured)
    K = measured[WARM]["num_draft_tokens"] if WARM in measured else None
    return {
        "domain": args.domain, "warm_start": str(warm_path), "steps": args.steps, "statistic": STATISTIC,
        "prompts": args.prompts, "skip": args.skip, "max_new_tokens": args.max_new_tokens,
        "budgets": list(args.budgets), "temperatures": list(args.temperatures), "chain": args.chain,
        "oracle": args.oracle, "seed": args.seed,
        "num_draft_tokens": K, "rule": args.rule,
        "overrides": list(args.override),
        "arms": [{"name": a.name, "control": a.control, **asdict(a)} for a in selected_arms(args)],
        "train_seeds": args.train_seeds, "noise_floor": floor,
        "replicates": replicate_verdicts(rows, floor) if args.train_seeds and args.rule == "noise-floor" else [],
        **(registered or {}),
        "rows": rows, "tables": {name: one["table"] for name, one in measured.items()},
        "per_prompt": {name: {"rows": one["rows"], "chain": one["chain"]} for name, one in measured.items()},
        "train": train, "host": host_info(), "wall_s": wall_s, "choices": choices or {},
        **({"vllm": vllm} if vllm else {}), **({"sharpening": sharpening} if sharpening else {}),
    }


def registered_block(args, measured: dict[str, dict], vllm: dict | None) -> dict:
    """``--rule crossed``'s part of the result, once every drafter is measured: ``protocol``, ``registered``
    (the contrasts of :mod:`~exittrain.bench.node_loss_protocol` read by
    :func:`~exittrain.bench.registered_rule.registered_readings`, vLLM's among them with ``--vllm``) and
    ``transfer`` (:func:`~exittrain.bench.node_loss_protocol.transfer`). Empty without replicates, under
    ``--rule noise-floor``, or without the warm start (its K names the chain's setting)."""
    if not args.train_seeds or args.rule != "crossed" or WARM not in measured:
        return {}
    K = measured[WARM]["num_draft_tokens"]
    per_prompt = {name: prompt_rows(one) for name, one in measured.items()}
    readings = registered_readings(node_loss_protocol.totals(per_prompt, vllm, K), node_loss_protocol.sequences(K))
    return {"protocol": node_loss_protocol.PROTOCOL, "registered": readings,
            "transfer": node_loss_protocol.transfer(readings)}


def run(args) -> dict:
    from hydra.utils import instantiate

    from exittrain.settings import eval_settings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_fit_config(args.domain, out, [*args.override, *measure_overrides(args)])  # the one composition
    settings = eval_settings(cfg)
    if settings["decode"] != "fixed":
        raise ValueError(f"eval.decode={settings['decode']}: bench exittrain measures with the plain decoder "
                         "(eval.decode=fixed); drop --override eval.decode=...")
    target = instantiate(cfg.target)
    prompts = heldout_prompts(cfg, target, args.prompts, skip=args.skip)  # a bad --skip fails before training
    t0 = time.perf_counter()
    if args.warm_start is None and args.resume and (out / "warm_start" / "config.json").is_file():
        warm_path = out / "warm_start"
        _log(f"warm start: reused {warm_path}")
    elif args.warm_start is None:
        warm_path = train_warm_start(cfg, target, out)
    else:
        warm_path = Path(args.warm_start)
    paths, train, choices = train_arms(args, cfg, target, warm_path)
    train_s = time.perf_counter() - t0
    drafters = {WARM: warm_path, **paths}
    sharpening, temperatures = None, {}
    if args.sharpen_temperatures:  # S: the chosen t_d's drafters join the measurement, on the same answers
        sharpening = choose_sharpening(args, cfg, target, drafters, settings)
        for name in list(drafters):
            base = split_replicate(name)[0]  # the warm start is its own base
            if base in sharpening["chosen"]:
                drafters[sharpened_name(name)] = drafters[name]
                temperatures[sharpened_name(name)] = sharpening["chosen"][base]

    def wall() -> dict:
        return {"train": train_s, "measure": time.perf_counter() - t0 - train_s}

    def write_partial(measured: dict) -> None:  # what is measured so far, readable while it runs
        write_json_atomic(out / PARTIAL, result_of(args, warm_path, measured, train, wall(), choices=choices,
                                                   sharpening=sharpening))

    measured = measure(args, target, drafters, prompts, settings, on_step=write_partial,
                       drafter_temperatures=temperatures)
    served = {name: path for name, path in drafters.items() if name not in temperatures  # engines run t_d = 1
              and (name == WARM or args.vllm_arms is None or split_replicate(name)[0] in args.vllm_arms)}
    vllm = measure_in_vllm(args, target, served, prompts[: args.vllm_prompts]) if args.vllm else None
    result = result_of(args, warm_path, measured, train, wall(), vllm, choices, sharpening,
                       registered_block(args, measured, vllm))
    write_json_atomic(out / "exittrain.json", result)
    (out / PARTIAL).unlink(missing_ok=True)
    (out / "exittrain.md").write_text(to_markdown(result))
    plot(result, out / "exittrain_vs_control.png")
    print(to_markdown(result))
    return result


def train_warm_start(cfg, target, out: Path) -> Path:
    """The recipe's pretrain stage on its own rows (``stages.pretrain``), saved under ``<out>/warm_start``."""
    from hydra.utils import instantiate

    from exittrain.lit import save_drafter
    from exittrain.models.drafter.starting_points import default_layer_ids

    drafter = instantiate(cfg.drafter)(target)
    layers = cfg.drafter.layer_ids or default_layer_ids(target.num_layers)
    dm = build_datamodule(cfg, target, layers, ["pretrain"])
    dm.prepare_data()
    dm.setup("fit")
    _log(f"warm start: {cfg.stages.pretrain.max_steps} block-CE steps")
    train_drafter(cfg, drafter, target, dm, "pretrain", cfg.stages.pretrain.max_steps,
                  **{**module_overrides(cfg, "pretrain"), "analytic_every": 0})
    return save_drafter(drafter, out / "warm_start")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", help="a saved drafter folder (default: train the recipe's pretrain stage here)")
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--steps", type=int, default=30, help="steps of every arm")
    parser.add_argument("--fresh-prompts", type=int, default=240, help="prompts of the fresh rows")
    parser.add_argument("--prompts", type=int, default=64, help="held-out evaluation prompts")
    parser.add_argument("--skip", type=int, default=16, help="evaluation prompts to leave out first (fit decodes them)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="eval.max_new_tokens: tokens per answer")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64], help="eval.budgets: tree nodes")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0],
                        help="eval.temperatures (0 = greedy)")
    parser.add_argument("--oracle", action="store_true",
                        help="eval.oracle: also the evaluator's oracle trees (tau_oracle) for every drafter; "
                             "a decode of the oracle per prompt, budget and temperature (default: off)")
    parser.add_argument("--no-chain", dest="chain", action="store_false",
                        help="skip the measure of every drafter's greedy chain of K nodes (default: measured)")
    parser.add_argument("--seed", type=int, default=0,
                        help="the data's seed (which rows, the split) and the measurement's (eval: the answers)")
    parser.add_argument("--train-seeds", type=int, nargs="+", default=None,
                        help="train every arm once per seed (replicates: batch order, anchors, dropout), named "
                             "ARM@seedS; the controls' replicates give the noise floor (default: one, under --seed)")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of the fit config")
    parser.add_argument("--arms", nargs="+", choices=[a.name for a in ARMS], help="run only these arms (default all)")
    parser.add_argument("--vllm", action="store_true",
                        help="also measure vLLM's own acceptance length of every drafter's DFlash export (greedy)")
    parser.add_argument("--vllm-prompts", type=int, default=16, help="held-out prompts vLLM decodes (the first ones)")
    parser.add_argument("--vllm-python", default=None,
                        help="the vLLM interpreter (default: $EXITTRAIN_VLLM_PYTHON, else .venv-vllm/bin/python)")
    parser.add_argument("--vllm-arms", nargs="+", choices=[a.name for a in ARMS], default=None,
                        help="with --vllm: only these arms' replicates (and the warm start) (default: every drafter)")
    parser.add_argument("--sharpen-temperatures", type=float, nargs="+", default=None, metavar="T_D",
                        help=f"the sharpening control: choose the drafter temperature of the warm start and of "
                             f"{SHARPENED} among these on the development split, and measure them at it as "
                             "'sharpened-...' drafters (default: off)")
    parser.add_argument("--dev-skip", type=int, default=0, help="the development split's first held-out prompt")
    parser.add_argument("--dev-prompts", type=int, default=64, help="the development split's prompts")
    parser.add_argument("--sharpen-budget", type=int, default=16, help="the tree (nodes) the choice reads")
    parser.add_argument("--sharpen-at", type=float, default=0.6, help="the temperature T the choice reads")
    parser.add_argument("--rule", choices=["crossed", "noise-floor"], default="crossed",
                        help="the replicates' decision rule: crossed (the 2026-12-07 protocol: a crossed bootstrap "
                             "over seeds and prompts of its registered contrasts) or noise-floor (the 2026-12-05 "
                             "protocol's); needs --train-seeds")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the warm start and the arms already saved under --out")
    parser.add_argument("--out", default="results/exittrain")
    args = parser.parse_args(argv)
    for key in ("steps", "fresh_prompts", "prompts", "max_new_tokens", "vllm_prompts"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.skip < 0:
        parser.error("--skip must be >= 0")
    if any(b < 1 for b in args.budgets):
        parser.error(f"--budgets {args.budgets}: each must be >= 1 (tree nodes)")
    for arm in ARMS:  # a CPU-matched control's steps come from the two arms it is matched between
        needs = [n for n in (arm.cpu_match, arm.control) if arm.cpu_match is not None and n not in (args.arms or [n])]
        if args.arms is not None and arm.name in args.arms and needs:
            parser.error(f"--arms {arm.name} trains for the CPU-seconds of {arm.cpu_match} against {arm.control}: "
                         f"add {' '.join(needs)} to --arms")
    if args.sharpen_temperatures is not None:
        if any(not math.isfinite(t) or t <= 0 for t in args.sharpen_temperatures) or \
                len(set(args.sharpen_temperatures)) != len(args.sharpen_temperatures):
            parser.error(f"--sharpen-temperatures {args.sharpen_temperatures}: each a number > 0, once")
        if args.dev_skip < 0 or args.dev_prompts < 1 or args.sharpen_budget < 1 or args.sharpen_at < 0:
            parser.error("--dev-skip >= 0, --dev-prompts >= 1, --sharpen-budget >= 1 and --sharpen-at >= 0")
        if args.dev_skip < args.skip + args.prompts and args.skip < args.dev_skip + args.dev_prompts:
            parser.error(f"the development split (--dev-skip {args.dev_skip} --dev-prompts {args.dev_prompts}) "
                         f"overlaps the measured prompts (--skip {args.skip} --prompts {args.prompts}): the "
                         "temperature would be chosen on the prompts it is read on; move one of them")
        if args.arms is not None and SHARPENED not in args.arms:
            parser.error(f"--sharpen-temperatures sharpens {SHARPENED}: add it to --arms")
    if args.train_seeds is not None and len(set(args.train_seeds)) != len(args.train_seeds):
        parser.error(f"--train-seeds {args.train_seeds}: each seed once")
    if any(T < 0 for T in args.temperatures):
        parser.error("--temperatures must be >= 0 (0 = greedy)")
    if args.warm_start is not None and not (Path(args.warm_start) / "config.json").is_file():
        parser.error(f"--warm-start {args.warm_start} is not a saved drafter folder (no config.json): pass "
                     "RUN_DIR/warmstart_drafter of a fit, or omit it to train one here")
    if args.vllm_arms is not None and not args.vllm:
        parser.error("--vllm-arms picks the drafters vLLM measures: add --vllm")
    if args.vllm:
        from exittrain.vllm_interpreter import default_vllm_python

        args.vllm_python = args.vllm_python or default_vllm_python()
        if not Path(args.vllm_python).is_file():
            parser.error(f"--vllm needs vLLM's interpreter, and {args.vllm_python} is none: build it with "
                         "`make vllm-setup` or pass --vllm-python")
    return args


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
