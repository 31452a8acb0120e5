"""Does exit-guided training help? ExitTrain arms against matched block-CE controls and the warm start.

``python -m exittrain bench exittrain --warm-start RUN/warmstart_drafter [--steps 30] [--out results/exittrain]``
(``make bench-exittrain``; hours on a 2-core CPU: run it in the background)

**The arms.** One warm start (a saved drafter, for example the ``warmstart_drafter`` of a
default ``fit``; without ``--warm-start`` one is trained here with the recipe's pretrain stage).
From it every arm runs the same ``--steps`` of one stage, with the same seed, so the same batches
in the same order and the same anchors (the ExitTrain stage's lr and anchors per sequence):

- ``control-<labels>-<rows>``: block CE only (full softmax), the matched control;
- ``exittrain-<labels>-<weights>-l<lambda>[-B<budget>]-<rows>``: block CE + lambda x the node loss.

``labels``: ``soft`` (the recipe's labels: the target's top-16 distribution) or ``hard`` (the
answer token). ``rows``: ``fresh``, prompts the warm start never saw (``data.exclude_seed``: no
task of the warm start's sample, in either prompt form; the reference recipe's structure), or
``own``, the warm start's own rows. The budget is the training tree's (``tree.budget_train``).
:data:`ARMS` lists the grid that runs; it is a cut of the full factorial, stated in its comments.

**What each drafter reports** (the warm start included), on held-out prompts of the domain's
evaluation set (from ``--skip``, past the ones ``fit`` decodes), at every ``--budgets``:

- greedy tau: the T = 0 block length at every answer position of the target's greedy answers;
- analytic tau at each ``--temperatures`` > 0: the exact expected TEV block length ``sum_v P(v)``
  under the target law warped to T, at ``--analytic-anchors`` seeded positions per answer of the
  target's own samples at T (the same anchors for every drafter; ``--budget-anchors`` takes the
  first n of them at each budget, since a tree of B nodes costs B + 1 target rows per anchor);
- the oracle bound: the best-first tree of the same budget under the same law, at the same anchors
  of the first ``--oracle-prompts`` prompts (it costs a few times a drafter tree's rows per anchor),
  and each drafter's efficiency tau / tau_oracle on those prompts;
- paired differences against the arm's matched control and against the warm start (mean over the
  same anchors, 95% interval bootstrapping prompts), with the verdict per temperature.

Writes ``<out>/exittrain.json`` (everything; ``exittrain_partial.json``, rewritten after each
temperature, while it runs), ``<out>/exittrain.md`` and ``<out>/exittrain_vs_control.png``, each
arm's drafter under ``<out>/<arm>/`` (reused by a rerun with ``--resume``) and every drafter's
per-anchor values under ``<out>/measured/`` (reused by any rerun with the same measuring settings
and weights: adding an arm measures that arm only).

Limits: one domain per call, one seed; the fresh rows are fewer than the warm start's, and every
arm runs a few dozen steps on a CPU: a verdict here is about this scale.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from exittrain.bench.ablation import compose_fit_config, train_drafter
from exittrain.build import build_datamodule
from exittrain.settings import module_overrides
from exittrain.tables import markdown_table, paired_cell

PARTIAL = "exittrain_partial.json"


@dataclass(frozen=True)
class Arm:
    """One arm: the stage it trains (``pretrain`` = block CE only) and what differs from the others."""

    labels: str = "soft"  # "soft" | "hard"
    rows: str = "fresh"  # "fresh" | "own"
    lambda_exit: float = 0.0  # 0: the block-CE control
    weight_type: str = "flow"
    budget_train: int = 16

    @property
    def stage(self) -> str:
        return "exittrain" if self.lambda_exit > 0 else "pretrain"

    @property
    def name(self) -> str:
        if self.stage == "pretrain":
            return f"control-{self.labels}-{self.rows}"
        budget = "" if self.budget_train == 16 else f"-B{self.budget_train}"
        return f"exittrain-{self.labels}-{self.weight_type}-l{self.lambda_exit:g}{budget}-{self.rows}"

    @property
    def control(self) -> str:
        """The name of the matched control: the same labels and rows, no node loss."""
        return Arm(labels=self.labels, rows=self.rows).name

    def module_args(self) -> dict:
        """What the arm changes in the stage's module arguments."""
        args = {"soft_label_weight": 1.0 if self.labels == "soft" else 0.0, "vocab_sample": None,
                "budget": self.budget_train}
        if self.stage == "exittrain":
            args.update(lambda_exit=self.lambda_exit, weight_type=self.weight_type)
        else:
            args["analytic_every"] = 0
        return args


# The grid that runs: a cut of the factorial (2 labels x 2 lambdas x 2 weights x 2 rows x
# 2 budgets = 32 ExitTrain arms) to the ones that answer its questions on a CPU: each label kind
# at the reference's lambda 0.1 and at 1 (flow), the missing weights at 1, the training budget 32
# once, and the warm start's own rows once against their own control (at lambda 1).
ARMS = (
    Arm("soft"),
    Arm("hard"),
    Arm("soft", lambda_exit=0.1),
    Arm("soft", lambda_exit=1.0),
    Arm("soft", lambda_exit=1.0, weight_type="missing"),
    Arm("hard", lambda_exit=0.1),  # the reference recipe: hard-label CE + 0.1 x flow
    Arm("hard", lambda_exit=1.0),
    Arm("soft", lambda_exit=1.0, budget_train=32),
    Arm("soft", rows="own"),
    Arm("soft", rows="own", lambda_exit=1.0),
)


def selected_arms(args) -> list[Arm]:
    """The arms of ``--arms`` (all of :data:`ARMS` by default), in the grid's order."""
    return [a for a in ARMS if args.arms is None or a.name in args.arms]


def _log(msg: str) -> None:
    print(f"[bench exittrain {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _datamodules(args, target, layers):
    """``{"own": the warm start's rows, "fresh": rows of prompts it never saw}``, prepared."""

    out, cfgs, dms = Path(args.out), {}, {}
    needed = {a.rows for a in selected_arms(args)}
    fresh = [f"data.seed={args.seed + 1}", f"data.exclude_seed={args.seed}",
             f"data.max_train_prompts={args.fresh_prompts}"]
    for rows, extra in (("own", []), ("fresh", fresh)):
        if rows not in needed:
            continue
        cfg = compose_fit_config(args.domain, out, [*args.override, *extra])
        cfg.seed = args.seed
        dm = build_datamodule(cfg, target, layers, ["exittrain"])
        dm.prepare_data()
        dm.setup("fit")
        cfgs[rows], dms[rows] = cfg, dm
        _log(f"{rows} rows: {len(dm.train_set)} training rows")
    return cfgs, dms


def train_arms(args, target, warm_path: Path) -> tuple[dict, dict]:
    """Train (or, with ``--resume``, reuse) every arm; returns ``({arm: path}, {arm: train info})``."""
    from exittrain.lit import save_drafter
    from exittrain.models import load_drafter

    warm = load_drafter(warm_path, target)
    cfgs, dms = _datamodules(args, target, list(warm.config.target_layer_ids))
    paths, info = {}, {}
    for arm in selected_arms(args):
        folder = Path(args.out) / arm.name
        if args.resume and (folder / "config.json").is_file():
            paths[arm.name], info[arm.name] = folder, {"reused": True}
            _log(f"{arm.name}: reused {folder}")
            continue
        cfg = cfgs[arm.rows]
        stage_args = {**module_overrides(cfg, "exittrain"), **arm.module_args()}
        drafter = load_drafter(warm_path, target)
        t0 = time.perf_counter()
        final = train_drafter(cfg, drafter, target, dms[arm.rows], arm.stage, args.steps, **stage_args)
        seconds = time.perf_counter() - t0
        paths[arm.name] = save_drafter(drafter, folder)
        info[arm.name] = {"train_s": seconds, "s_per_step": seconds / args.steps, **asdict(arm),
                          "final": final}
        _log(f"{arm.name}: trained {args.steps} steps in {seconds:.0f} s")
    return paths, info


MEASURE_SETTINGS = ("domain", "prompts", "skip", "max_new_tokens", "analytic_anchors", "budget_anchors", "seed")


def measure(args, target, drafters: dict[str, Path], on_step=None) -> dict:
    """Greedy, analytic and oracle tau of every drafter at every budget and temperature.

    Each drafter's per-row values are kept under ``<out>/measured/`` (:class:`MeasureCache`, keyed
    by the measuring settings and the drafter's weights): a rerun measures only the drafters,
    budgets and temperatures it has not measured. ``on_step(measured)`` runs after each temperature.
    """
    from exittrain.bench.heldout import greedy_block_lengths_by_budget
    from exittrain.bench.measure_cache import MeasureCache
    from exittrain.data import ExitTrainDataModule
    from exittrain.heldout.measures import analytic_block_lengths, answer_rows, heldout_anchors, oracle_block_lengths
    from exittrain.models import load_drafter

    loaded = {name: load_drafter(path, target).eval() for name, path in drafters.items()}
    first = next(iter(loaded.values()))
    layers = list(first.config.target_layer_ids)
    K = first.config.num_draft_tokens
    data = ExitTrainDataModule(args.domain, tokenizer=target.tokenizer, progress=False)
    prompts = data.eval_prompts(args.skip + args.prompts)[args.skip:]
    cache = MeasureCache(Path(args.out) / "measured", {k: getattr(args, k) for k in MEASURE_SETTINGS})
    oracle_name = f"oracle-{args.oracle_prompts}-prompts"
    per_row = {name: cache.load(name, drafters[name]) for name in loaded}
    oracle = cache.load(oracle_name)
    measured = {"prompts": len(prompts), "per_row": per_row, "oracle": oracle}
    for T in args.temperatures:
        keys = {budget: f"{budget}/{T:g}" for budget in args.budgets}
        todo = [name for name in loaded if any(k not in per_row[name] for k in keys.values())]
        if not todo and (T == 0 or all(k in oracle for k in keys.values())):
            _log(f"T={T:g}: every drafter measured before ({cache.folder})")
            continue
        t0 = time.perf_counter()
        rows = answer_rows(target, prompts, layers, args.max_new_tokens, 32, temperature=T, seed=args.seed)
        anchors = None if T == 0 else heldout_anchors(rows, K, args.analytic_anchors, args.seed)
        _log(f"T={T:g}: {len(rows)} answers ({time.perf_counter() - t0:.0f} s); measuring {len(todo)} drafters")
        if T == 0:  # every answer position; one drafter pass per row serves every budget
            for name in todo:
                greedy = greedy_block_lengths_by_budget(loaded[name], rows, layers, list(args.budgets))[0]
                per_row[name].update({keys[b]: v for b, v in greedy.items()})
        else:
            for budget, per_answer in zip(args.budgets, args.budget_anchors):
                key = keys[budget]
                # the first per_answer of the seeded anchors: a subset, the same for every drafter
                mine = [a[:per_answer] for a in anchors]
                # drafter-free, and a few times a drafter tree's rows per anchor: the first prompts only
                n = args.oracle_prompts
                if key not in oracle:
                    oracle[key] = oracle_block_lengths(target, rows[:n], mine[:n], budget, K, T)
                    cache.save(oracle_name, oracle)
                for name in todo:
                    per_row[name][key] = analytic_block_lengths(loaded[name], target, rows, layers, mine, budget, T)
        for name in todo:
            cache.save(name, per_row[name], drafters[name])
        _log(f"T={T:g}: {len(todo)} drafters measured ({time.perf_counter() - t0:.0f} s)")
        if on_step is not None:
            on_step(measured)
    return measured


def compare(measured: dict, warm_name: str) -> list[dict]:
    """One row per (drafter, budget, temperature): tau, its interval, and the paired differences."""
    from exittrain.heldout.decode_eval import bootstrap_ci
    from exittrain.heldout.measures import paired_difference

    per_row, oracle = measured["per_row"], measured["oracle"]
    arms = {a.name: a for a in ARMS}
    out = []
    for name, by_key in per_row.items():
        for key, values in by_key.items():
            budget, T = key.split("/")
            flat = torch.cat(values)
            row = {"drafter": name, "budget": int(budget), "temperature": float(T), "tau": float(flat.mean()),
                   "ci95": list(bootstrap_ci([v.tolist() for v in values])), "anchors": int(flat.numel()),
                   "vs_warm_start": None if name == warm_name else paired_difference(values, per_row[warm_name][key]),
                   "vs_control": None}
            arm = arms.get(name)
            if arm is not None and arm.stage == "exittrain" and arm.control in per_row:
                row["control"] = arm.control
                row["vs_control"] = paired_difference(values, per_row[arm.control][key])
            if key in oracle:  # on the oracle's prompts (the first ones), so is the efficiency
                n = len(oracle[key])
                tau_oracle = float(torch.cat(oracle[key]).mean())
                row["tau_oracle"], row["oracle_prompts"] = tau_oracle, n
                row["efficiency"] = float(torch.cat(values[:n]).mean()) / tau_oracle
            out.append(row)
    return out


NEGLIGIBLE = 0.005  # tokens per round (~0.2% of tau here): an interval can exclude 0 and still mean nothing


def verdict(rows: list[dict]) -> list[str]:
    """The settings whose paired interval against their matched control excludes 0, per sign, at T > 0;
    a difference under :data:`NEGLIGIBLE` says so (a tiny lambda moves few trees, by little, consistently)."""
    lines = []
    for r in rows:
        pair = r.get("vs_control")
        if pair is None or r["temperature"] == 0:
            continue
        low, high = pair["ci95"]
        if low > 0 or high < 0:
            word = "beats" if low > 0 else "loses to"
            size = f" (under {NEGLIGIBLE} tokens per round: negligible)" if abs(pair["delta"]) < NEGLIGIBLE else ""
            lines.append(f"{r['drafter']} {word} {r['control']} at B = {r['budget']}, T = {r['temperature']:g}: "
                         f"{pair['delta']:+.4f} ({low:+.4f} to {high:+.4f}){size}")  # 4 places: some are tiny
    return lines


def to_markdown(result: dict) -> str:
    rows = sorted(result["rows"], key=lambda r: (r["budget"], r["temperature"]))
    header = ["drafter", "B", "T", "tau", "95% CI", "vs matched control (paired)", "vs warm start (paired)",
              "tau_oracle", "tau / oracle"]
    body = (
        [r["drafter"], r["budget"], f"{r['temperature']:g}", f"{r['tau']:.3f}",
         f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}", paired_cell(r["vs_control"]), paired_cell(r["vs_warm_start"]),
         f"{r['tau_oracle']:.2f}" if "tau_oracle" in r else "-",
         f"{r['efficiency']:.2f}" if "efficiency" in r else "-"]
        for r in rows
    )
    train = [[name, f"{t.get('train_s', 0):.0f}", f"{t.get('s_per_step', 0):.1f}"]
             for name, t in result["train"].items() if not t.get("reused")]
    found = result["verdict"] or ["none: no ExitTrain setting's paired interval against its matched control "
                                  "excludes 0 at T > 0"]
    lines = [
        f"{result['domain']}: {result['steps']} steps per arm from {result['warm_start']}; held out: "
        f"{result['prompts']} evaluation prompts (from #{result['skip']}), up to {result['max_new_tokens']} new "
        f"tokens; T = 0 is the greedy block length at every answer position, T > 0 the analytic (expected TEV) "
        f"block length at seeded positions of the target's samples at T (per answer, by budget: "
        f"{result.get('budget_anchors') or result['analytic_anchors']}). The oracle bound and tau / oracle: the "
        f"first {result.get('oracle_prompts', result['prompts'])} prompts.",
        "",
        *markdown_table(header, body),
        "",
        "Settings whose interval against the matched control excludes 0 (T > 0):",
        "",
        *(f"- {line}" for line in found),
        "",
        *markdown_table(["arm", "train s", "s / step"], train),
    ]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    """Forest plot: each ExitTrain arm's paired difference from its control, per (B, T)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("vs_control")]
    keys = sorted({(r["budget"], r["temperature"]) for r in rows})
    names = sorted({r["drafter"] for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 0.5 * len(names) + 1.5), sharey=True, squeeze=False)
    for ax, (budget, T) in zip(axes[0], keys):
        for y, name in enumerate(names):
            r = next((r for r in rows if r["drafter"] == name and (r["budget"], r["temperature"]) == (budget, T)), None)
            if r is None:
                continue
            d, (lo, hi) = r["vs_control"]["delta"], r["vs_control"]["ci95"]
            ax.errorbar(d, y, xerr=[[d - lo], [hi - d]], fmt="o", color="C0" if lo <= 0 <= hi else "C3", capsize=3)
        ax.axvline(0, color="grey", lw=1)
        ax.set_title(f"B = {budget}, T = {T:g}")
        ax.set_xlabel("tau - matched control")
    axes[0][0].set_yticks(range(len(names)), names)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args) -> dict:
    from hydra.utils import instantiate

    from exittrain.report.results_page import host_info
    from exittrain.run_dir import write_json_atomic

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

    def result_of(measured: dict) -> dict:
        rows = compare(measured, "warm start")
        return {
            "domain": args.domain, "warm_start": str(warm_path), "steps": args.steps,
            "prompts": measured["prompts"], "skip": args.skip, "max_new_tokens": args.max_new_tokens,
            "analytic_anchors": args.analytic_anchors,
            "budget_anchors": dict(zip(map(str, args.budgets), args.budget_anchors)),
            "oracle_prompts": args.oracle_prompts, "budgets": list(args.budgets),
            "temperatures": list(args.temperatures), "overrides": list(args.override),
            "arms": [{"name": a.name, "control": a.control, **asdict(a)} for a in selected_arms(args)],
            "train": train, "rows": rows, "verdict": verdict(rows), "host": host_info(),
            "wall_s": {"train": train_s, "measure": time.perf_counter() - t0 - train_s},
        }

    def write_partial(measured: dict) -> None:  # what is measured so far, readable while it runs
        write_json_atomic(out / PARTIAL, result_of(measured))

    result = result_of(measure(args, target, drafters, on_step=write_partial))
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
    from exittrain.models.drafter_init import default_layer_ids

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
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--override", action="append", default=[], help="a Hydra override of the fit config")
    parser.add_argument("--arms", nargs="+", choices=[a.name for a in ARMS], help="run only these arms (default all)")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the warm start and the arms already saved under --out")
    parser.add_argument("--out", default="results/exittrain")
    args = parser.parse_args(argv)
    for key in ("steps", "fresh_prompts", "prompts", "analytic_anchors", "oracle_prompts"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.budget_anchors is None:
        args.budget_anchors = [args.analytic_anchors] * len(args.budgets)
    if len(args.budget_anchors) != len(args.budgets) or not all(
            1 <= n <= args.analytic_anchors for n in args.budget_anchors):
        parser.error(f"--budget-anchors needs one count per budget ({len(args.budgets)}), each from 1 to "
                     f"--analytic-anchors ({args.analytic_anchors})")
    if any(T < 0 for T in args.temperatures):
        parser.error("--temperatures must be >= 0 (0 = greedy)")
    if args.warm_start is not None and not (Path(args.warm_start) / "config.json").is_file():
        parser.error(f"--warm-start {args.warm_start} is not a saved drafter folder (no config.json): pass "
                     "RUN_DIR/warmstart_drafter of a fit, or omit it to train one here")
    return args


def main(argv=None) -> None:
    run(parse_args(argv))


if __name__ == "__main__":
    main()
