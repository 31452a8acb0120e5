"""Does exit-guided training help? ExitTrain arms against matched block-CE controls and the warm start.

``python -m exittrain bench exittrain --warm-start RUN/warmstart_drafter [--steps 30] [--out results/exittrain]``
(``make bench-exittrain``; hours on a 2-core CPU: run it in the background)

Chain against tree ExitTrain under the serving profile (every arm trained as ``+serve=dflash``
trains, from the warm start of a ``+serve=dflash`` fit: K = 7 draft tokens; the arm, not
``tree.shape``, sets each arm's shape)::

    python -m exittrain bench exittrain --warm-start RUN/warmstart_drafter --override +serve=dflash \\
        --arms control-soft-fresh exittrain-soft-flow-l1-chain-fresh exittrain-soft-flow-l1-fresh --budgets 16 ...

**The arms.** One warm start (a saved drafter, for example the ``warmstart_drafter`` of a
default ``fit``; without ``--warm-start`` one is trained here with the recipe's pretrain stage).
From it every arm runs the same ``--steps`` of one stage, with the same seed, so the same batches
in the same order and the same anchors (the ExitTrain stage's lr and anchors per sequence):

- ``control-<labels>-<rows>``: block CE only (full softmax), the matched control;
- ``exittrain-<labels>-<weights>-l<lambda>[-B<budget>]-<rows>``: block CE + lambda x the node loss
  on DDTree's best-first tree of the budget's nodes (16 without the suffix);
- ``exittrain-<labels>-<weights>-l<lambda>-chain-<rows>``: the same on the drafter's greedy chain
  of its K draft tokens (``tree_shape=chain``), the draft vLLM and SGLang verify.

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

**What each drafter reports** (the warm start included), on held-out prompts of the domain's
evaluation set (from ``--skip``, past the ones ``fit`` decodes), at every ``--budgets``:

- greedy tau: the T = 0 block length at every answer position of the target's greedy answers;
- analytic tau at each ``--temperatures`` > 0: the exact expected TEV block length ``sum_v P(v)``
  under the target law warped to T, at ``--analytic-anchors`` seeded positions per answer of the
  target's own samples at T (the same anchors for every drafter; ``--budget-anchors`` takes the
  first n of them at each budget, since a tree of B nodes costs B + 1 target rows per anchor);
- the chain (unless ``--no-chain``): the same two on the drafter's greedy chain of its K draft
  tokens (the draft vLLM and SGLang verify: at T = 0 their acceptance length), at T > 0 at all
  ``--analytic-anchors`` anchors (a chain costs K + 1 target rows per anchor); a row with
  ``shape: chain`` and ``budget`` = K;
- the oracle bound (trees only): the best-first tree of the same budget under the same law, at the same
  anchors of the first ``--oracle-prompts`` prompts (it costs a few times a drafter tree's rows per
  anchor), and each drafter's efficiency tau / tau_oracle on those prompts;
- paired differences against the arm's matched control and against the warm start (mean over the
  same anchors, 95% interval bootstrapping prompts); the report lists the settings whose interval
  excludes 0 (T = 0 included), each pair read alone, uncorrected.

**vLLM** (``--vllm``): every drafter is exported to the DFlash format (``<out>/vllm/<name>/``) and
vLLM (``.venv-vllm``, or ``--vllm-python``) decodes the first ``--vllm-prompts`` held-out prompts
greedily with it, one prompt at a time after one plain run: vLLM's own acceptance length, its
interval over prompts, paired against the warm start and the matched control on the same prompts,
and whether speculation left vLLM's outputs unchanged (:mod:`exittrain.bench.vllm_acceptance`). An
arm whose interval against its control excludes 0 joins the report's uncorrected list.

Writes ``<out>/exittrain.json`` (everything; ``exittrain_partial.json``, rewritten after each
temperature, while it runs), ``<out>/exittrain.md`` and ``<out>/exittrain_vs_control.png``, each
arm's drafter under ``<out>/<arm>/`` (reused by a rerun with ``--resume``) and every drafter's
per-anchor values under ``<out>/measured/`` (reused by any rerun with the same measuring settings
and weights: adding an arm measures that arm only).

**Replicates** (``--train-seeds S1 S2 ...``): every arm is trained once per seed (the drafter
``ARM@seedS``), each ExitTrain replicate paired with its control of the same seed. The controls'
replicates, paired with each other, give the noise floor (:func:`noise_floor`: the largest
control-against-control difference); :func:`~exittrain.bench.exittrain_report.replicate_verdicts`
reads each ExitTrain arm's per-seed differences against it under the decision rule of
docs/experiments/2026-12-05-exittrain-confirmation.md, and each setting under its fixed sequence
(the primary first; the secondaries in order while each before was confirmed; the rest descriptive).

Limits: one domain per call; the fresh rows are fewer than the warm start's, and every arm runs a
few dozen steps on a CPU: a verdict here is about this scale.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from exittrain.bench.ablation import compose_fit_config, train_drafter
from exittrain.bench.exittrain_grid import ARMS, replicate, selected_arms, split_replicate
from exittrain.bench.exittrain_report import plot, replicate_verdicts, to_markdown
from exittrain.build import build_datamodule
from exittrain.progress import Heartbeat
from exittrain.run_dir import write_json_atomic
from exittrain.safe_io import load_json_object
from exittrain.settings import module_overrides

PARTIAL = "exittrain_partial.json"
TRAIN_INFO = "bench_train.json"  # an arm's training record, beside its saved drafter


def _log(msg: str) -> None:
    print(f"[bench exittrain {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@contextmanager
def _measuring(label: str):
    """Log one measurement's start and end, with a heartbeat each minute between them: one drafter's
    greedy walks at K = 15 over 64 answers run for minutes on a CPU, and were silent before."""
    _log(f"{label}: measuring")
    t0 = time.perf_counter()
    with Heartbeat(label, every_s=60):
        yield
    _log(f"{label}: done ({time.perf_counter() - t0:.0f} s)")


def fresh_overrides(args, warm_prompts: int | None) -> list[str]:
    """The data overrides of the fresh rows: ``--fresh-prompts`` prompts under the next seed, without every
    task of the warm start's sample (``warm_prompts``, its ``data.max_train_prompts``, drawn under ``--seed``)."""
    if warm_prompts is None:
        raise ValueError("data.max_train_prompts is null: the warm start trained on every training prompt, so "
                         "no fresh rows are left; set data.max_train_prompts (--override) for the warm start")
    return [f"data.seed={args.seed + 1}", f"data.exclude_seed={args.seed}", f"data.exclude_size={warm_prompts}",
            f"data.max_train_prompts={args.fresh_prompts}"]


def _datamodules(args, target, layers):
    """``{"own": the warm start's rows, "fresh": rows of prompts it never saw}``, prepared."""

    out, cfgs, dms = Path(args.out), {}, {}
    needed = {a.rows for a in selected_arms(args)}
    own = compose_fit_config(args.domain, out, args.override)  # the warm start's data settings
    for rows in ("own", "fresh"):
        if rows not in needed:
            continue
        extra = fresh_overrides(args, own.data.max_train_prompts) if rows == "fresh" else []
        cfg = compose_fit_config(args.domain, out, [*args.override, *extra])
        cfg.seed = args.seed
        dm = build_datamodule(cfg, target, layers, ["exittrain"])
        dm.prepare_data()
        dm.setup("fit")
        cfgs[rows], dms[rows] = cfg, dm
        _log(f"{rows} rows: {len(dm.train_set)} training rows")
    return cfgs, dms


def train_arms(args, target, warm_path: Path) -> tuple[dict, dict]:
    """Train (or, with ``--resume``, reuse) every arm, once per training seed; returns ``({drafter: path},
    {drafter: train info})``, drafters named by :func:`~exittrain.bench.exittrain_grid.replicate`.

    A training seed sets everything random in an arm's training and nothing else: the order of the
    batches (:attr:`~exittrain.data.ExitTrainDataModule.order_seed`), the anchors (the objective's seed)
    and dropout (the global generators). The rows, the split and the warm start are the same for every
    seed. Without ``--train-seeds`` the one replicate trains under ``--seed``, as before."""
    from omegaconf import OmegaConf

    from exittrain.lit import save_drafter
    from exittrain.models import load_drafter

    warm = load_drafter(warm_path, target)
    cfgs, dms = _datamodules(args, target, list(warm.config.target_layer_ids))
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
            cfg = cfgs[arm.rows]
            if seed is not None:  # the rows are built: the seed now reaches only the order, anchors and dropout
                cfg = OmegaConf.merge(cfg, {"seed": seed})
            dms[arm.rows].order_seed = seed
            stage_args = {**module_overrides(cfg, "exittrain"), **arm.module_args()}
            drafter = load_drafter(warm_path, target)
            t0 = time.perf_counter()
            final = train_drafter(cfg, drafter, target, dms[arm.rows], arm.stage, args.steps, **stage_args)
            seconds = time.perf_counter() - t0
            paths[name] = save_drafter(drafter, folder)
            info[name] = {"train_s": seconds, "s_per_step": seconds / args.steps, **asdict(arm),
                          "train_seed": seed, "final": final}
            write_json_atomic(folder / TRAIN_INFO, info[name])  # a --resume run reports it again
            _log(f"{name}: trained {args.steps} steps in {seconds:.0f} s")
    return paths, info


MEASURE_SETTINGS = ("domain", "prompts", "skip", "max_new_tokens", "analytic_anchors", "budget_anchors", "seed")


def _eval_data(args) -> dict:
    """The fit config's data settings (``--override`` applied), as plain values."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_fit_config(args.domain, Path(args.out), args.override).data, resolve=True)


def measure_settings(args) -> dict:
    """What the measured values depend on besides a drafter's weights: :data:`MEASURE_SETTINGS`, and the
    evaluation sources where an ``--override`` names them (absent otherwise, so earlier caches keep their key)."""
    from exittrain.data.prompts.domain_sources import DOMAIN_SOURCES

    settings = {k: getattr(args, k) for k in MEASURE_SETTINGS}
    sources = list(_eval_data(args).get("eval_sources") or DOMAIN_SOURCES[args.domain].eval)
    return settings if sources == list(DOMAIN_SOURCES[args.domain].eval) else {**settings, "eval_sources": sources}


def heldout_prompts(args, target) -> list[list[int]]:
    """The held-out evaluation prompts every drafter is measured on: ``--skip .. --skip + --prompts`` of the
    fit config's evaluation prompts, as ``fit`` reads them (an ``--override`` of ``data.eval_sources``
    included; their equals are left out of every training sample)."""
    from exittrain.data.prompts.prompt_plan import PromptPlan

    plan = PromptPlan.from_data_args(_eval_data(args))
    prompts = plan.eval_ids(target.tokenizer, args.skip + args.prompts)[args.skip:]
    if len(prompts) < args.prompts:
        held = plan.prompts()
        raise ValueError(f"--skip {args.skip} --prompts {args.prompts}: the {args.domain} evaluation prompts "
                         f"({', '.join(s.source for s in held.eval_stats)}) are {len(held.eval)}; lower --skip or "
                         "--prompts, or name others with --override 'data.eval_sources=[...]'")
    return prompts


def measure_in_vllm(args, target, drafters: dict[str, Path], warm_name: str) -> dict:
    """vLLM's own acceptance length of every drafter's DFlash export (exported under ``<out>/vllm/``)
    on the first ``--vllm-prompts`` held-out prompts, greedy, each paired against the warm start and
    the arm's matched control on the same prompts (:func:`exittrain.bench.vllm_acceptance.measure_vllm`).

    Returns the ``vllm`` block of the result: ``prompts``, ``max_new_tokens``, ``vllm_version`` and
    ``drafters``: name -> ``tau``, ``ci95``, ``vs_warm_start``, ``vs_control``, ``lossless``, ``K``,
    ``per_prompt``. A drafter the DFlash format cannot hold raises ``ValueError`` (the reason named).
    """
    from exittrain.bench.vllm_acceptance import dflash_folder, measure_vllm
    from exittrain.heldout.serving_track import target_folder
    from exittrain.serve.compare import paired_acceptance

    work = Path(args.out) / "vllm"
    folders = {name: dflash_folder(path, name.replace(" ", "_"), work, target) for name, path in drafters.items()}
    prompts = heldout_prompts(args, target)[: args.vllm_prompts]
    _log(f"vLLM: {len(folders)} DFlash exports on {len(prompts)} prompts, one worker each")
    measured = measure_vllm(args.vllm_python, target_folder(target, None), folders, prompts,
                            max_new_tokens=args.max_new_tokens, workdir=work)
    per = measured["drafters"]
    for name, r in per.items():
        control = matched_control(name)
        r["vs_warm_start"] = None if name == warm_name else paired_acceptance(r["per_prompt"],
                                                                              per[warm_name]["per_prompt"])
        r["control"] = control if control in per else None
        r["vs_control"] = paired_acceptance(r["per_prompt"], per[control]["per_prompt"]) if r["control"] else None
        r.pop("vs_first", None)  # the warm start is first: vs_warm_start says the same
    return {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "vllm_version": measured["vllm_version"], "drafters": per}


def measure(args, target, drafters: dict[str, Path], on_step=None) -> dict:
    """Greedy, analytic and oracle tau of every drafter at every budget and temperature, and (unless
    ``args.chain`` is False) on every drafter's greedy chain of K nodes.

    Returns ``{"prompts", "K": the drafters' num_draft_tokens, "per_row": {drafter: {key: per-row
    (A_r,) tensors}}, "oracle": {key: ...}}`` with keys ``<budget>/<T>`` (DDTree's tree of that
    budget) and ``chain/<T>`` (the chain; no oracle). Each drafter's per-row values are kept under
    ``<out>/measured/`` (:class:`MeasureCache`, keyed by the measuring settings and the drafter's
    weights): a rerun measures only the keys it has not measured (a cache from before the chain
    gets its chain keys). ``on_step(measured)`` runs after each temperature.
    """
    from exittrain.bench.heldout import greedy_block_lengths_by_budget
    from exittrain.bench.measure_cache import MeasureCache
    from exittrain.heldout.measures import analytic_block_lengths, answer_rows, heldout_anchors, oracle_block_lengths
    from exittrain.models import load_drafter

    loaded = {name: load_drafter(path, target).eval() for name, path in drafters.items()}
    first = next(iter(loaded.values()))
    layers = list(first.config.target_layer_ids)
    K = first.config.num_draft_tokens
    prompts = heldout_prompts(args, target)
    cache = MeasureCache(Path(args.out) / "measured", measure_settings(args))
    oracle_name = f"oracle-{args.oracle_prompts}-prompts"
    per_row = {name: cache.load(name, drafters[name]) for name in loaded}
    oracle = cache.load(oracle_name)
    measured = {"prompts": len(prompts), "K": K, "per_row": per_row, "oracle": oracle}
    for T in args.temperatures:
        keys = {budget: f"{budget}/{T:g}" for budget in args.budgets}  # the oracle's keys too
        chain_key = f"chain/{T:g}" if args.chain else None
        wanted = [*keys.values(), *([chain_key] if chain_key else [])]
        todo = [name for name in loaded if any(k not in per_row[name] for k in wanted)]
        if not todo and (T == 0 or all(k in oracle for k in keys.values())):
            _log(f"T={T:g}: every drafter measured before ({cache.folder})")
            continue
        t0 = time.perf_counter()
        rows = answer_rows(target, prompts, layers, args.max_new_tokens, 32, temperature=T, seed=args.seed)
        anchors = None if T == 0 else heldout_anchors(rows, K, args.analytic_anchors, args.seed)
        _log(f"T={T:g}: {len(rows)} answers ({time.perf_counter() - t0:.0f} s); measuring {len(todo)} drafters")
        if T == 0:  # every answer position; one drafter pass per row serves every budget and the chain
            key_of = {**keys, "chain": chain_key}  # greedy's keys: the budgets and "chain"
            for name in todo:
                with _measuring(f"T=0: {name}, greedy walks"):
                    greedy = greedy_block_lengths_by_budget(loaded[name], rows, layers, list(args.budgets),
                                                            chain=args.chain)[0]
                per_row[name].update({key_of[b]: v for b, v in greedy.items()})
        else:
            for budget, per_answer in zip(args.budgets, args.budget_anchors):
                key = keys[budget]
                # the first per_answer of the seeded anchors: a subset, the same for every drafter
                mine = [a[:per_answer] for a in anchors]
                # drafter-free, and a few times a drafter tree's rows per anchor: the first prompts only
                n = args.oracle_prompts
                if key not in oracle:
                    with _measuring(f"T={T:g} B={budget}: the oracle on {n} prompts"):
                        oracle[key] = oracle_block_lengths(target, rows[:n], mine[:n], budget, K, T)
                    cache.save(oracle_name, oracle)
                for name in todo:
                    if key not in per_row[name]:
                        with _measuring(f"T={T:g} B={budget}: {name}"):
                            per_row[name][key] = analytic_block_lengths(loaded[name], target, rows, layers, mine,
                                                                        budget, T)
            # the chain at every anchor: it costs K + 1 target rows per anchor, fewer than a tree of B = 16
            for name in todo if chain_key else ():
                if chain_key not in per_row[name]:
                    with _measuring(f"T={T:g} chain of {K}: {name}"):
                        per_row[name][chain_key] = analytic_block_lengths(loaded[name], target, rows, layers,
                                                                          anchors, K, T, shape="chain")
        for name in todo:
            cache.save(name, per_row[name], drafters[name])
        _log(f"T={T:g}: {len(todo)} drafters measured ({time.perf_counter() - t0:.0f} s)")
        if on_step is not None:
            on_step(measured)
    return measured


def _parse_key(key: str, K: int | None) -> tuple[str, int, float]:
    """A per-row key as ``(shape, budget, temperature)``: ``<budget>/<T>`` is DDTree's tree of that
    budget, ``chain/<T>`` the greedy chain, whose budget is its K nodes (``measured["K"]``)."""
    size, T = key.split("/")
    if size != "chain":
        return "ddtree", int(size), float(T)
    if K is None:
        raise ValueError(f"measured holds {key!r} but no 'K' (the drafters' num_draft_tokens, the chain's nodes)")
    return "chain", int(K), float(T)


def matched_control(name: str) -> str | None:
    """The drafter an ExitTrain drafter is paired with: its arm's matched control, of the same training
    seed; None for a control, the warm start or a name outside the grid."""
    base, seed = split_replicate(name)
    arm = next((a for a in ARMS if a.name == base), None)
    return replicate(arm.control, seed) if arm is not None and arm.stage == "exittrain" else None


def noise_floor(measured: dict) -> dict[str, dict]:
    """Per key and control arm: the paired differences between its replicates (each pair of training
    seeds, on the same anchors), and the spread, the largest of their absolute values: how far two
    trainings of the same arm part by training noise alone. Empty with fewer than two replicates."""
    from exittrain.heldout.measures import paired_difference

    per_row = measured["per_row"]
    replicates: dict[str, dict[int, str]] = {}
    for name in per_row:
        base, seed = split_replicate(name)
        if seed is not None and base.startswith("control-"):
            replicates.setdefault(base, {})[seed] = name
    floor = {}
    for base, by_seed in replicates.items():
        seeds = sorted(by_seed)
        keys = set.intersection(*(set(per_row[by_seed[s]]) for s in seeds)) if seeds else set()
        for key in sorted(keys):
            pairs = [{"seeds": [a, b], **pair} for i, a in enumerate(seeds) for b in seeds[i + 1:]
                     if (pair := paired_difference(per_row[by_seed[b]][key], per_row[by_seed[a]][key]))]
            if pairs:
                floor[f"{base}/{key}"] = {"control": base, "key": key, "pairs": pairs,
                                          "spread": max(abs(p["delta"]) for p in pairs)}
    return floor


def per_prompt(measured: dict) -> dict[str, dict[str, list[list[float]]]]:
    """Every drafter's per-prompt values at every key: ``[mean block length, anchors]`` per prompt, in the
    prompts' order, so that any contrast can be recomputed on a subset of the prompts."""
    return {name: {key: [[float(v.mean()) if v.numel() else 0.0, int(v.numel())] for v in values]
                   for key, values in by_key.items()}
            for name, by_key in measured["per_row"].items()}


def compare(measured: dict, warm_name: str) -> list[dict]:
    """One row per (drafter, shape, budget, temperature): tau, its interval, and the paired differences.

    ``shape`` is ``ddtree`` (``budget`` = the tree's nodes) or ``chain`` (``budget`` = K); both are
    paired against the warm start and the matched control at the same key. The oracle (and the
    efficiency) is DDTree's bound: ddtree rows only.
    """
    from exittrain.core import bootstrap_ci
    from exittrain.heldout.measures import paired_difference

    per_row, oracle = measured["per_row"], measured["oracle"]
    out = []
    for name, by_key in per_row.items():
        for key, values in by_key.items():
            shape, budget, T = _parse_key(key, measured.get("K"))
            flat = torch.cat(values)
            row = {"drafter": name, "shape": shape, "budget": budget, "temperature": T, "tau": float(flat.mean()),
                   "ci95": list(bootstrap_ci([v.tolist() for v in values])), "anchors": int(flat.numel()),
                   "vs_warm_start": None if name == warm_name or key not in per_row[warm_name]
                   else paired_difference(values, per_row[warm_name][key]),
                   "vs_control": None}
            control = matched_control(name)
            # a key the other lacks (a cache from a --no-chain run beside one with the chain): unpaired
            if control is not None and key in per_row.get(control, {}):
                row["control"] = control
                row["vs_control"] = paired_difference(values, per_row[control][key])
            if shape == "ddtree" and key in oracle:  # on the oracle's prompts (the first ones), so is the efficiency
                n = len(oracle[key])
                tau_oracle = float(torch.cat(oracle[key]).mean())
                row["tau_oracle"], row["oracle_prompts"] = tau_oracle, n
                row["efficiency"] = float(torch.cat(values[:n]).mean()) / tau_oracle
            out.append(row)
    return out


def run(args) -> dict:
    from hydra.utils import instantiate

    from exittrain.report.results_page import host_info

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = compose_fit_config(args.domain, out, args.override)
    target = instantiate(cfg.target)
    t0 = time.perf_counter()
    if args.warm_start is None and args.resume and (out / "warm_start" / "config.json").is_file():
        warm_path = out / "warm_start"
        _log(f"warm start: reused {warm_path}")
    elif args.warm_start is None:
        warm_path = train_warm_start(cfg, target, out)
    else:
        warm_path = Path(args.warm_start)
    paths, train = train_arms(args, target, warm_path)
    train_s = time.perf_counter() - t0
    drafters = {"warm start": warm_path, **paths}

    def result_of(measured: dict, vllm: dict | None = None) -> dict:
        rows = compare(measured, "warm start")
        floor = noise_floor(measured)
        return {
            "domain": args.domain, "warm_start": str(warm_path), "steps": args.steps,
            "prompts": measured["prompts"], "skip": args.skip, "max_new_tokens": args.max_new_tokens,
            "analytic_anchors": args.analytic_anchors,
            "budget_anchors": dict(zip(map(str, args.budgets), args.budget_anchors)),
            "oracle_prompts": args.oracle_prompts, "budgets": list(args.budgets),
            "chain": args.chain, "num_draft_tokens": measured["K"],
            "temperatures": list(args.temperatures), "overrides": list(args.override),
            "arms": [{"name": a.name, "control": a.control, **asdict(a)} for a in selected_arms(args)],
            "train_seeds": args.train_seeds, "noise_floor": floor, "per_prompt": per_prompt(measured),
            "replicates": replicate_verdicts(rows, floor) if args.train_seeds else [],
            "train": train, "rows": rows, "host": host_info(),
            "wall_s": {"train": train_s, "measure": time.perf_counter() - t0 - train_s},
            **({"vllm": vllm} if vllm else {}),
        }

    def write_partial(measured: dict) -> None:  # what is measured so far, readable while it runs
        write_json_atomic(out / PARTIAL, result_of(measured))

    measured = measure(args, target, drafters, on_step=write_partial)
    vllm = measure_in_vllm(args, target, drafters, "warm start") if args.vllm else None
    result = result_of(measured, vllm)
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
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--analytic-anchors", type=int, default=4, help="anchors per answer for T > 0")
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--budget-anchors", type=int, nargs="+", default=None,
                        help="anchors per answer at each budget (<= --analytic-anchors; default: all of them)")
    parser.add_argument("--oracle-prompts", type=int, default=8, help="prompts the oracle bound is measured on")
    parser.add_argument("--no-chain", dest="chain", action="store_false",
                        help="skip the measure of every drafter's greedy chain of K nodes (default: measured)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0])
    parser.add_argument("--seed", type=int, default=0,
                        help="the data's seed (which rows, the split) and the measurement's (answers, anchors)")
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
    parser.add_argument("--resume", action="store_true",
                        help="reuse the warm start and the arms already saved under --out")
    parser.add_argument("--out", default="results/exittrain")
    args = parser.parse_args(argv)
    for key in ("steps", "fresh_prompts", "prompts", "analytic_anchors", "oracle_prompts", "vllm_prompts"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.budget_anchors is None:
        args.budget_anchors = [args.analytic_anchors] * len(args.budgets)
    if len(args.budget_anchors) != len(args.budgets) or not all(
            1 <= n <= args.analytic_anchors for n in args.budget_anchors):
        parser.error(f"--budget-anchors needs one count per budget ({len(args.budgets)}), each from 1 to "
                     f"--analytic-anchors ({args.analytic_anchors})")
    if args.train_seeds is not None and len(set(args.train_seeds)) != len(args.train_seeds):
        parser.error(f"--train-seeds {args.train_seeds}: each seed once")
    if any(T < 0 for T in args.temperatures):
        parser.error("--temperatures must be >= 0 (0 = greedy)")
    if args.warm_start is not None and not (Path(args.warm_start) / "config.json").is_file():
        parser.error(f"--warm-start {args.warm_start} is not a saved drafter folder (no config.json): pass "
                     "RUN_DIR/warmstart_drafter of a fit, or omit it to train one here")
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
