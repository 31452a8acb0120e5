"""The ExitTrain ablation against the DDTree baseline, the oracle bound and verifier latency.

``python -m exittrain bench ablation [--quick] [--domains dialogue code math] [--out results/ablation]``
(``make bench-ablation``; ``make bench-ablation-quick``)

**Same setup for every arm of a domain.** The fit config of ``+recipe=<domain>`` (conf/ and
recipes/, plus ``--override`` strings): the embedded target, the recipe's regenerated data (the
same cache ``fit`` uses), the same training rows in the same order (one seed), one warm-start
drafter, and the same held-out evaluation prompts. The arms:

- ``baseline``: the warm start (stage ``pretrain``, block CE): the DDTree baseline drafter;
- ``control``: the warm start plus M more block-CE steps (full softmax, and the ExitTrain arms'
  learning rate, anchors and data): separates "more training" from "exit-guided training";
- ``exittrain-<w>``: the warm start plus the same M ExitTrain steps, weight type w in
  ``flow``, ``exit``, ``missing``.

**What each arm reports, per budget B.**

- decoded tau at T=0 and T=1 (TEV), with a 95% bootstrap interval over prompts, and the ratio
  to the control arm at the same (B, T);
- analytic tau: ``sum_v P(v)`` with raw target probabilities on the anchors of the held-out
  rows (the validation split of the regenerated data, never trained on), with the exit mass by
  depth; it is what TEV achieves on those trees in expectation, and has far less noise than a
  few decoded prompts;
- tau_oracle (best-first oracle trees of the same B and depth limit, on the same prompts) and
  the efficiency tau / tau_oracle;
- tokens/s and speedup over autoregressive decoding of the same prompts.

**Verifier latency.** On one domain with the ``exittrain-flow`` drafter: TEV, predraw-and-follow
and the sequential residual verifier inside real decoding rounds, the verifiers interleaved
per prompt so machine noise hits all three alike. The block-length distributions must agree:
at T=0 the three give the same block length in every round (checked and reported); at T=1 they
are equal in law, and a permutation test of the mean block length against the sequential
verifier's is reported.

Writes ``<out>/ablation.json`` (everything), ``<out>/ablation.md`` (the tables) and PNG plots
(tau vs budget with the oracle bound, block-length histograms, exit mass by depth, one drafted
tree, tau relative to the control, verifier time per round). Each arm's drafter is saved under
``<out>/<domain>/<arm>/``. While later domains run, ``<out>/ablation_partial.json`` holds the
finished ones, so a crash or a kill keeps them.

Limits: the trees are trained at the recipe's ``tree.budget_train`` and evaluated at the
``--budgets``; a CPU run uses few prompts, so the decoded intervals are wide (the analytic tau
on many anchors is the sharper comparison).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from exittrain.bench.ablation_report import make_plots, summary, to_markdown
from exittrain.build import build_datamodule, build_module
from exittrain.core import WEIGHT_TYPES
from exittrain.lit.run_logging import seed_everything
from exittrain.lit.train_steps import scalar_metrics, train_steps
from exittrain.settings import module_overrides

VERIFIER_NAMES = ("tev", "predraw", "sequential")


@dataclass(frozen=True)
class Settings:
    """Knobs of one ablation run (``--quick`` swaps in :data:`QUICK`)."""

    domains: tuple[str, ...] = ("dialogue", "code", "math")
    warm_steps: int = 200  # block-CE steps of the shared warm start
    arm_steps: int = 30  # M: steps of the control and of each ExitTrain arm
    arm_anchors: int = 4  # anchors per sequence in the arms (each ExitTrain anchor scores B_train + 1 rows)
    budgets: tuple[int, ...] = (32, 64)
    temperatures: tuple[float, ...] = (0.0, 1.0)
    eval_prompts: int = 4
    new_tokens: int = 32
    analytic_anchors: int = 8  # anchors per held-out row for the analytic tau
    weight_types: tuple[str, ...] = WEIGHT_TYPES
    verifier_domain: str = "code"
    verifier_prompts: int = 4  # 0: no verifier-latency measurement
    oracle: bool = True
    warm_start_root: str | None = None  # reuse <root>/<domain>/baseline (a previous run's warm starts)
    seed: int = 0
    overrides: tuple[str, ...] = field(default_factory=tuple)  # extra Hydra overrides of the fit config


QUICK = Settings(
    domains=("code",),
    warm_steps=40,
    arm_steps=6,
    eval_prompts=2,
    new_tokens=16,
    analytic_anchors=4,
    verifier_prompts=2,
    overrides=("data.max_train_prompts=48", "data.max_length=448"),
)


def _log(msg: str) -> None:
    print(f"[ablation {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------
# setup


def compose_fit_config(domain: str, out: Path, overrides: Sequence[str] = ()):
    """The fit config of ``+recipe=<domain>`` as ``fit`` would compose it, with paths set for a bench."""
    from hydra import compose, initialize_config_dir

    from exittrain.configs import CONF_DIR, register_recipes

    cache = os.environ.get("EXITTRAIN_CACHE", str(Path.cwd() / "data" / "cache"))
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            "fit",
            overrides=[f"+recipe={domain}", "logger=csv", f"paths.output_dir={out}", f"paths.cache_dir={cache}",
                       *overrides],
        )


def stage_args(cfg, settings: Settings) -> tuple[dict, dict]:
    """The module arguments ``fit`` would give its stages (``stages.<stage>`` without the stage's own
    keys), adapted to the bench: ``(warm start, arms)``. The warm start scores no trees; every arm
    (the control included) uses the ExitTrain stage's lr with ``settings.arm_anchors`` anchors."""
    pre = {**module_overrides(cfg, "pretrain"), "analytic_every": 0}  # the arms are measured after training
    arms = {**module_overrides(cfg, "exittrain"), "anchors_per_seq": settings.arm_anchors}
    return pre, arms


def train_drafter(cfg, drafter, target, datamodule, stage: str, steps: int, **overrides) -> dict[str, float]:
    """Fit ``drafter`` for ``steps`` of ``stage`` on ``datamodule`` with ``cfg.objective`` and
    exactly ``overrides`` (no ``stages.*``: an arm states its own); returns the last scalar metrics.

    Every arm reads the same target features and soft labels from the DataModule's store."""
    from exittrain import progress
    from exittrain.lit import ProgressLogCallback, stage_progress_bar

    seed_everything(cfg.seed)  # the same data order and anchors for every arm
    module = build_module(cfg, stage, drafter, target, overrides)
    # as fit shows its stages: a bar on a terminal, else a progress line every 10 steps
    bar = progress.interactive()
    shown = stage_progress_bar(stage) if bar else ProgressLogCallback(stage, every_n_steps=10)
    trainer = train_steps(module, datamodule, steps=steps, trainer_cfg=cfg.trainer, logger=False,
                          enable_checkpointing=False, callbacks=[shown], limit_val_batches=0,
                          **({} if bar else {"enable_progress_bar": False}))
    return scalar_metrics(trainer)


def analytic_objective(cfg, budget: int, anchors: int):
    """The :class:`~exittrain.objective.ObjectiveSettings` of the analytic tau: the fit config's
    objective, scoring trees of ``budget`` on ``anchors`` anchors per row, full vocabulary."""
    from omegaconf import OmegaConf

    from exittrain.objective import ObjectiveSettings

    objective = OmegaConf.to_container(cfg.objective, resolve=True)
    known = {k: v for k, v in objective.items() if k in ObjectiveSettings.names()}
    return ObjectiveSettings(
        **{**known, "stage": "pretrain", "budget": budget, "anchors_per_seq": anchors, "vocab_sample": None}
    )


@torch.no_grad()
def analytic_tau(cfg, drafter, target, datamodule, budgets: Sequence[int], anchors: int) -> dict:
    """Per budget: ``sum P`` (raw target law) on ``anchors`` anchors of every held-out row, anchor-weighted.

    Returns ``{B: {"tau", "coverage", "exit_mass" [K+1], "acc" [K], "anchors"}}``. The anchors
    are drawn from the validation stream of the seed, so every arm is measured on the same ones.
    Calls :func:`exittrain.objective.compute_losses` on the DataModule's validation batches.
    """
    from exittrain.core import anchor_generator
    from exittrain.objective import compute_losses

    batches = datamodule.val_dataloader()
    if not batches:
        raise ValueError("the ablation's analytic tau needs held-out rows: set data.val_fraction > 0")
    was_training = drafter.training
    drafter.eval()
    out = {}
    for budget in budgets:
        settings = analytic_objective(cfg, budget, anchors)
        sums: dict[str, float] = {}
        n_total = 0
        for i, batch in enumerate(batches):
            batch = {k: v.to(target.device) for k, v in batch.items()}
            values = compute_losses(
                drafter, target, batch, settings, anchor_generator(cfg.seed, i, 0, stream=1), exit_loss=False,
                metrics=True,
            ).values
            n = int(values["anchors"])
            n_total += n
            for k, v in values.items():
                if k != "anchors" and v.numel() == 1:
                    sums[k] = sums.get(k, 0.0) + n * float(v)
        K = drafter.config.num_draft_tokens
        mean = {k: v / max(n_total, 1) for k, v in sums.items()}
        out[budget] = {
            "tau": mean["analytic_block_length"],
            "coverage": mean["coverage"],
            "exit_mass": [mean[f"exit_mass_d{d}"] for d in range(K + 1)],
            "acc": [mean[f"acc_d{k}"] for k in range(1, K + 1)],
            "anchors": n_total,
        }
    drafter.train(was_training)
    return out


def oracle_rows(target, prompts, budgets, temperatures, new_tokens: int, depth: int, seed: int) -> dict:
    """``{(B, T): {"tau_oracle", "block_lengths"}}`` with best-first oracle trees on ``prompts``."""
    from exittrain.decoding import oracle_generate

    out = {}
    for budget in budgets:
        for temperature in temperatures:
            lengths = []
            for i, prompt in enumerate(prompts):
                result, _ = oracle_generate(target, prompt, budget, new_tokens, temperature, seed=seed + i,
                                            max_depth=depth)
                lengths.extend(r.block_length for r in result.rounds)
            out[(budget, temperature)] = {"tau_oracle": sum(lengths) / len(lengths), "block_lengths": lengths}
    return out


# ----------------------------------------------------------------------------------------------
# verifier latency


def permutation_p_value(a: Sequence[float], b: Sequence[float], resamples: int = 5000, seed: int = 0) -> float:
    """Two-sided permutation p-value of ``mean(a) - mean(b)`` (pooled relabelling, fixed seed)."""
    if not a or not b:
        raise ValueError("permutation_p_value needs two non-empty samples")
    rng = random.Random(seed)
    pooled = list(a) + list(b)
    observed = abs(statistics.fmean(a) - statistics.fmean(b))
    hits = 0
    for _ in range(resamples):
        rng.shuffle(pooled)
        if abs(statistics.fmean(pooled[: len(a)]) - statistics.fmean(pooled[len(a):])) >= observed - 1e-12:
            hits += 1
    return (hits + 1) / (resamples + 1)


def verifier_latency(target, drafter, prompts, budgets, temperatures, new_tokens: int, seed: int) -> list[dict]:
    """TEV vs predraw vs sequential inside real rounds; one row per (B, T, verifier)."""
    from exittrain.decoding import SpeculativeDecoder

    SpeculativeDecoder(target, drafter, budget=budgets[0]).generate(prompts[0], 4)  # warm-up, not timed
    rows = []
    for budget in budgets:
        for temperature in temperatures:
            per: dict[str, dict[str, list]] = {v: {"verify": [], "lengths": [], "round": []} for v in VERIFIER_NAMES}
            for i, prompt in enumerate(prompts):
                for name in VERIFIER_NAMES:  # interleaved: machine noise hits all three alike
                    res = SpeculativeDecoder(target, drafter, budget=budget, verifier=name).generate(
                        prompt, new_tokens, temperature=temperature, seed=seed + i
                    )
                    per[name]["verify"].extend(r.times.get("verify", 0.0) for r in res.rounds)
                    per[name]["round"].extend(sum(r.times.values()) for r in res.rounds)
                    per[name]["lengths"].extend(r.block_length for r in res.rounds)
            ref = per["sequential"]
            for name in VERIFIER_NAMES:
                d = per[name]
                row = {
                    "budget": budget,
                    "temperature": temperature,
                    "verifier": name,
                    "rounds": len(d["lengths"]),
                    "tau": statistics.fmean(d["lengths"]),
                    "verify_ms_mean": 1e3 * statistics.fmean(d["verify"]),
                    "verify_ms_median": 1e3 * statistics.median(d["verify"]),
                    "round_ms_mean": 1e3 * statistics.fmean(d["round"]),
                    "verify_vs_sequential": statistics.fmean(d["verify"]) / statistics.fmean(ref["verify"]),
                    "block_lengths": d["lengths"],
                }
                if temperature == 0:
                    row["same_lengths_as_sequential"] = d["lengths"] == ref["lengths"]
                else:
                    row["p_same_mean_as_sequential"] = permutation_p_value(d["lengths"], ref["lengths"], seed=seed)
                rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# one domain


def run_domain(domain: str, settings: Settings, out: Path, target=None) -> tuple[dict, Any, list]:
    """Warm start, arms, evaluation and oracle for one domain.

    Returns ``(result, target, prompts)``: the domain's JSON-ready result, the target (loaded here
    when ``target`` is None, for the next domains to reuse) and the domain's held-out prompt ids.
    """
    from hydra.utils import instantiate

    from exittrain.heldout.decode_eval import evaluate_prompts, summarize
    from exittrain.lit import save_drafter
    from exittrain.models import load_drafter
    from exittrain.models.drafter.starting_points import default_layer_ids

    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    cfg = compose_fit_config(domain, out / domain, settings.overrides)
    cfg.seed = settings.seed
    target = target if target is not None else instantiate(cfg.target)
    layers = cfg.drafter.layer_ids or default_layer_ids(target.num_layers)  # those of the drafters trained below
    dm = build_datamodule(cfg, target, layers, ["pretrain", "exittrain"])
    dm.prepare_data()
    dm.setup("fit")
    prompts = dm.eval_prompts(max(settings.eval_prompts, settings.verifier_prompts))
    timings["data_s"] = time.perf_counter() - t0
    _log(f"{domain}: {len(dm.train_set)} train rows, {len(dm.val_set or [])} held-out rows, {len(prompts)} prompts")

    # the shared warm start (the baseline arm), trained here or reused from an earlier run
    t0 = time.perf_counter()
    pre, arm_args = stage_args(cfg, settings)
    train_metrics = {"baseline": {}}
    if settings.warm_start_root is not None:
        drafter = load_drafter(Path(settings.warm_start_root) / domain / "baseline", target)
    else:
        drafter = instantiate(cfg.drafter)(target)
        train_metrics["baseline"] = train_drafter(cfg, drafter, target, dm, "pretrain", settings.warm_steps, **pre)
    paths = {"baseline": save_drafter(drafter, out / domain / "baseline")}
    timings["warm_start_s"] = time.perf_counter() - t0
    _log(f"{domain}: warm start done ({timings['warm_start_s']:.0f} s)")

    # the arms: identical lr, anchors, data and steps; only the objective differs
    arm_specs = {"control": ("pretrain", {"vocab_sample": None, "analytic_every": 0})}
    arm_specs.update({f"exittrain-{w}": ("exittrain", {"weight_type": w}) for w in settings.weight_types})
    for arm, (stage, extra) in arm_specs.items():
        t0 = time.perf_counter()
        arm_drafter = load_drafter(paths["baseline"], target)
        train_metrics[arm] = train_drafter(cfg, arm_drafter, target, dm, stage, settings.arm_steps,
                                           **{**arm_args, **extra})
        paths[arm] = save_drafter(arm_drafter, out / domain / arm)
        timings[f"train_{arm}_s"] = time.perf_counter() - t0
        _log(f"{domain}: {arm} trained ({timings[f'train_{arm}_s']:.0f} s)")

    # evaluation of every arm on the same prompts and held-out anchors
    ar_cache: dict = {}
    arms = {}
    for arm, path in paths.items():
        t0 = time.perf_counter()
        d = load_drafter(path, target)
        analytic = analytic_tau(cfg, d, target, dm, settings.budgets, settings.analytic_anchors)
        rows = evaluate_prompts(
            target, d, prompts[: settings.eval_prompts], budgets=list(settings.budgets),
            temperatures=list(settings.temperatures), max_new_tokens=settings.new_tokens, verifier="tev",
            seed=settings.seed, baseline=True, label=arm, ar_cache=ar_cache,
        )
        table = summarize(rows)
        for r in table:
            r["analytic_tau"] = analytic[r["budget"]]["tau"]
        arms[arm] = {
            "path": str(path),
            "table": table,
            "analytic": {str(b): v for b, v in analytic.items()},
            "block_lengths": {f"{r['budget']}/{r['temperature']:g}": [x for row in rows if row["budget"] == r["budget"]
                              and row["temperature"] == r["temperature"] for x in row["block_lengths"]]
                              for r in table},
            "train": train_metrics[arm],
        }
        timings[f"eval_{arm}_s"] = time.perf_counter() - t0
        best = max(table, key=lambda r: (r["budget"], -r["temperature"]))
        _log(f"{domain}: {arm} tau {best['tau']:.2f} at B={best['budget']} T={best['temperature']:g}, "
             f"analytic {analytic[best['budget']]['tau']:.2f} ({timings[f'eval_{arm}_s']:.0f} s)")

    oracle = {}
    if settings.oracle:
        t0 = time.perf_counter()
        oracle = oracle_rows(target, prompts[: settings.eval_prompts], settings.budgets, settings.temperatures,
                             settings.new_tokens, drafter.config.num_draft_tokens, settings.seed)
        timings["oracle_s"] = time.perf_counter() - t0
        for arm in arms.values():
            for r in arm["table"]:
                o = oracle[(r["budget"], r["temperature"])]["tau_oracle"]
                r["tau_oracle"], r["efficiency"] = o, r["tau"] / o
    for arm in arms.values():  # the ratio to the control at the same (B, T)
        for r, c in zip(arm["table"], arms["control"]["table"]):
            r["tau_vs_control"] = r["tau"] / c["tau"]
            r["analytic_vs_control"] = r["analytic_tau"] / c["analytic_tau"]
    return {
        "domain": domain,
        "train_rows": len(dm.train_set),
        "held_out_rows": len(dm.val_set or []),
        "prompts": settings.eval_prompts,
        "arms": arms,
        "oracle": {f"{b}/{t:g}": v for (b, t), v in oracle.items()},
        "timings": timings,
    }, target, prompts


# ----------------------------------------------------------------------------------------------
# the whole run


def run(settings: Settings, out: Path) -> dict:
    from exittrain.heldout.tree_example import tree_example
    from exittrain.models import load_drafter
    from exittrain.run_dir import write_json_atomic

    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    domains, trees, target = [], {}, None
    verifiers = []
    for domain in settings.domains:
        d, target, prompts = run_domain(domain, settings, out, target)
        flow = load_drafter(d["arms"]["exittrain-flow"]["path"], target) if "exittrain-flow" in d["arms"] else None
        if flow is not None:
            trees[domain] = tree_example(target, flow, prompts[0], budget=min(settings.budgets))
            if domain == settings.verifier_domain and settings.verifier_prompts > 0:
                t0 = time.perf_counter()
                verifiers = verifier_latency(target, flow, prompts[: settings.verifier_prompts], settings.budgets,
                                             settings.temperatures, settings.new_tokens, settings.seed)
                d["timings"]["verifiers_s"] = time.perf_counter() - t0
        domains.append(d)
        # the finished domains survive a crash or a kill in a later one (ablation.json comes at the end)
        write_json_atomic(out / "ablation_partial.json", {"settings": asdict(settings), "domains": domains,
                                                          "verifiers": verifiers})
        _log(f"{domain}: done; timings {json.dumps({k: round(v) for k, v in d['timings'].items()})}")
    result = {
        "settings": asdict(settings),
        "threads": torch.get_num_threads(),
        "domains": domains,
        "verifiers": verifiers,
        "verifier_domain": settings.verifier_domain,
        "summary": summary(domains, settings),
        "seconds": time.perf_counter() - started,
    }
    result["plots"] = make_plots(result, out, trees)
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small setting (code only, minutes) to try the bench")
    parser.add_argument("--domains", nargs="+", choices=("dialogue", "code", "math"))
    parser.add_argument("--warm-steps", type=int)
    parser.add_argument("--arm-steps", type=int)
    parser.add_argument("--budgets", type=int, nargs="+")
    parser.add_argument("--eval-prompts", type=int)
    parser.add_argument("--new-tokens", type=int)
    parser.add_argument("--no-oracle", action="store_true")
    parser.add_argument("--weight-types", nargs="+", choices=WEIGHT_TYPES)
    parser.add_argument("--verifier-prompts", type=int, help="0 skips the verifier-latency measurement")
    parser.add_argument("--warm-start-root", help="reuse ROOT/<domain>/baseline from an earlier run's --out")
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of the fit config")
    parser.add_argument("--out", default="results/ablation")
    args = parser.parse_args(argv)
    settings = QUICK if args.quick else Settings()
    chosen = {"domains": tuple(args.domains) if args.domains else None, "warm_steps": args.warm_steps,
              "arm_steps": args.arm_steps, "budgets": tuple(args.budgets) if args.budgets else None,
              "eval_prompts": args.eval_prompts, "new_tokens": args.new_tokens,
              "weight_types": tuple(args.weight_types) if args.weight_types else None,
              "verifier_prompts": args.verifier_prompts, "warm_start_root": args.warm_start_root}
    settings = replace(settings, **{k: v for k, v in chosen.items() if v is not None},
                       oracle=settings.oracle and not args.no_oracle,
                       overrides=(*settings.overrides, *args.override))
    if settings.verifier_domain not in settings.domains:
        settings = replace(settings, verifier_domain=settings.domains[0])
    out = Path(args.out)
    result = run(settings, out)
    from exittrain.tables import write_results

    write_results(str(out / "ablation"), result, to_markdown(result))


if __name__ == "__main__":
    main()
