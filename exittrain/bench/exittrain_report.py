"""The report of ``bench exittrain`` (:mod:`exittrain.bench.exittrain_arms`): the verdict lines, the
markdown table and the forest plot of every arm's paired difference from its matched control."""

from __future__ import annotations

from pathlib import Path

from exittrain.bench import registered_rule
from exittrain.report.experiment_page import separation, uncorrected, vllm_lines
from exittrain.tables import markdown_table, paired_cell

__all__ = ["SEQUENCE", "plot", "replicate_verdicts", "rule", "setting_key", "to_markdown", "vllm_verdict"]

# The decision rule of docs/experiments/2026-12-05-exittrain-confirmation.md, on the per-seed paired
# differences (ExitTrain minus its matched control of the same seed), in tokens per round:
CONFIRM_MEAN = 0.02  # confirmed: every seed > 0, the mean >= this, and >= FLOOR_MULTIPLE x the noise floor
FLOOR_MULTIPLE = 2.0
REFUTE_MEAN = 0.01  # refuted: the mean < this, or any seed <= REFUTE_SEED
REFUTE_SEED = -0.02
# The protocol's fixed sequence (gatekeeping): the primary, then the secondaries in order, each
# (shape, budget, T) with budget None on the chain (its K nodes). vLLM's acceptance, the last
# secondary, has no replicate row here. A setting is tested only while every one before it was confirmed.
SEQUENCE = (("ddtree", 16, 0.6), ("ddtree", 16, 0.0), ("ddtree", 16, 1.0), ("ddtree", 64, 0.6), ("chain", None, 0.6))


def rule(deltas: list[float], spread: float | None) -> str:
    """``confirmed``, ``refuted`` or ``inconclusive`` for per-seed differences ``deltas`` against a noise
    floor ``spread`` (the largest control-against-control difference; None: unknown, so never confirmed)."""
    mean = sum(deltas) / len(deltas)
    if mean < REFUTE_MEAN or min(deltas) <= REFUTE_SEED:
        return "refuted"
    if min(deltas) > 0 and mean >= CONFIRM_MEAN and spread is not None and mean >= FLOOR_MULTIPLE * spread:
        return "confirmed"
    return "inconclusive"


def setting_key(r: dict) -> str:
    """The setting a result row was measured at, as the noise floor names it: ``<budget>/<T>`` for a
    tree, ``chain/<T>`` for the chain (whose budget is K)."""
    return f"{'chain' if r.get('shape') == 'chain' else r['budget']}/{r['temperature']:g}"


def replicate_verdicts(rows: list[dict], floor: dict[str, dict]) -> list[dict]:
    """One entry per ExitTrain arm and setting (shape, budget, T) with replicates: the per-seed paired
    differences against the matched control of the same seed, their mean, the noise floor of that
    control at that setting, and :func:`rule`'s verdict."""
    from exittrain.bench.exittrain_grid import split_replicate

    groups: dict[tuple, dict[int, float]] = {}
    for r in rows:
        base, seed = split_replicate(r["drafter"])
        if seed is None or not r.get("vs_control"):
            continue
        control = split_replicate(r["control"])[0]
        setting = (base, control, r.get("shape", "ddtree"), r["budget"], r["temperature"], setting_key(r))
        groups.setdefault(setting, {})[seed] = r["vs_control"]["delta"]
    out = []
    for (arm, control, shape, budget, T, key), by_seed in sorted(groups.items()):
        deltas = [by_seed[s] for s in sorted(by_seed)]
        spread = floor.get(f"{control}/{key}", {}).get("spread")
        out.append({"drafter": arm, "control": control, "shape": shape, "budget": budget, "temperature": T,
                    "seeds": sorted(by_seed), "deltas": deltas, "mean": sum(deltas) / len(deltas),
                    "noise_floor": spread, "verdict": rule(deltas, spread)})
    _gatekeep(out)
    return out


def _gatekeep(verdicts: list[dict]) -> None:
    """Give each verdict its ``role`` in :data:`SEQUENCE` (``primary``, ``secondary k``, or None when the
    setting is not in it) and its ``reading``: the rule's word where the setting is tested (the primary,
    and a secondary while every setting before it, for the same arm, was confirmed), else
    ``descriptive``."""
    def position(v: dict) -> int | None:
        for i, (shape, budget, T) in enumerate(SEQUENCE):
            if v["shape"] == shape and (budget is None or v["budget"] == budget) and v["temperature"] == T:
                return i
        return None

    for v in verdicts:  # settings outside the sequence are descriptive
        v["role"], v["reading"] = None, "descriptive"
    for arm in {v["drafter"] for v in verdicts}:
        placed = {position(v): v for v in verdicts if v["drafter"] == arm}
        open_ = True  # the sequence goes on while every setting in it is confirmed; a missing one ends it
        for i in range(len(SEQUENCE)):
            v = placed.get(i)
            if v is not None:
                v["role"] = "primary" if i == 0 else f"secondary {i}"
                v["reading"] = v["verdict"] if open_ else "descriptive"
            open_ = open_ and v is not None and v["verdict"] == "confirmed"


def _sort_key(r: dict) -> tuple:
    """Tree rows by budget and temperature, then the chain rows together."""
    return r.get("shape", "ddtree") == "chain", r["budget"], r["temperature"]


def to_markdown(result: dict) -> str:
    """The report: one table row per (drafter, shape, budget, T), the chain's B cell reading ``chain K=7``.
    Every tau is pooled over the prompts' rounds (total tokens / total rounds), as a decode counts it."""
    rows = sorted(result["rows"], key=_sort_key)
    header = ["drafter", "B", "T", "tau (pooled)", "95% CI", "vs matched control (paired)", "vs warm start (paired)",
              "tau_oracle", "tau / oracle"]
    body = (
        [r["drafter"], f"chain K={r['budget']}" if r.get("shape") == "chain" else r["budget"],
         f"{r['temperature']:g}", f"{r['tau']:.3f}",
         f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}", paired_cell(r["vs_control"]), paired_cell(r["vs_warm_start"]),
         f"{r['tau_oracle']:.2f}" if "tau_oracle" in r else "-",
         f"{r['efficiency']:.2f}" if "efficiency" in r else "-"]
        for r in rows
    )
    train = [[name, f"{t.get('train_s', 0):.0f}", f"{t.get('s_per_step', 0):.1f}"]
             for name, t in result["train"].items() if not t.get("reused")]
    found = (uncorrected(result["rows"]) + vllm_verdict(result.get("vllm"))) or [
        "none: no ExitTrain setting's paired interval against its matched control excludes 0"]
    lines = [
        f"{result['domain']}: {result['steps']} steps per arm from {result['warm_start']}; held out: "
        f"{result['prompts']} evaluation prompts (from #{result['skip']}), up to {result['max_new_tokens']} new "
        "tokens, every drafter measured by the held-out evaluator (exittrain.heldout.evaluator). tau: tokens per "
        "round pooled over the prompts' rounds (total tokens / total rounds, as a decode and vLLM count it), the "
        "rounds walked along the target's greedy answers at T = 0 and along its own samples at T > 0, the same "
        "answers for every drafter. B = chain K=k: the drafter's greedy chain of its k draft tokens (what vLLM and "
        "SGLang verify). Paired: the difference of the two pooled taus over the same prompts, 95% interval "
        "bootstrapping prompts." + (" tau_oracle: the evaluator's oracle trees of the same budget." if
                                    result.get("oracle") else ""),
        "",
        *markdown_table(header, body),
        "",
        "Settings whose interval against the matched control excludes 0 (every T, greedy T = 0 included; each "
        "pair read alone, uncorrected):",
        "",
        *(f"- {line}" for line in found),
        "",
        *markdown_table(["arm", "train s", "s / step"], train),
    ]
    if result.get("replicates"):
        lines += ["", f"Replicates (training seeds {result['train_seeds']}): each seed's paired difference from "
                  "its matched control of the same seed; the noise floor is the largest control-against-control "
                  "difference between seeds at that setting; the verdict is the protocol's rule "
                  f"(confirmed: every seed > 0, mean >= {CONFIRM_MEAN}, mean >= {FLOOR_MULTIPLE:g} x floor; "
                  f"refuted: mean < {REFUTE_MEAN} or a seed <= {REFUTE_SEED}).", "",
                  *markdown_table(
                      ["arm", "B", "T", "in the sequence", "per seed", "mean", "noise floor", "rule", "reading"],
                      ([v["drafter"], f"chain K={v['budget']}" if v["shape"] == "chain" else v["budget"],
                        f"{v['temperature']:g}", v["role"] or "-", " ".join(f"{d:+.3f}" for d in v["deltas"]),
                        f"{v['mean']:+.4f}", "-" if v["noise_floor"] is None else f"{v['noise_floor']:.4f}",
                        v["verdict"], v["reading"]]
                       for v in result["replicates"]))]
    if result.get("registered"):
        lines += ["", *registered_lines(result)]
    if result.get("vllm"):
        lines += ["", *vllm_lines(result["vllm"])]
    return "\n".join(lines) + "\n"


def registered_lines(result: dict) -> list[str]:
    """The registered contrasts' readings (:func:`exittrain.bench.registered_rule.to_markdown`) under the
    protocol's name, and its transfer claim per primary arm."""
    transfer = [f"- {tag}: transfer to serving {'claimed' if t['claimed'] else 'not claimed'} ({t['why']})"
                for tag, t in result.get("transfer", {}).items()]
    return [f"Registered contrasts of {result['protocol']} (training seeds {result['train_seeds']}):", "",
            *registered_rule.to_markdown(result["registered"]).splitlines(), *transfer]


def plot(result: dict, path: Path) -> None:
    """Forest plot: each ExitTrain arm's paired difference from its control, one panel per (B, T) of the
    trees, then one per T of the chain. No file when no arm is paired (controls alone)."""
    if not any(r.get("vs_control") for r in result["rows"]):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if r.get("vs_control")]
    keys = sorted({_sort_key(r) for r in rows})  # (is chain, budget, T): a panel each
    names = sorted({r["drafter"] for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 0.5 * len(names) + 1.5), sharey=True, squeeze=False)
    for ax, key in zip(axes[0], keys):
        panel = [r for r in rows if _sort_key(r) == key]
        for y, name in enumerate(names):
            r = next((r for r in panel if r["drafter"] == name), None)
            if r is None:
                continue
            d, (lo, hi) = r["vs_control"]["delta"], r["vs_control"]["ci95"]
            ax.errorbar(d, y, xerr=[[d - lo], [hi - d]], fmt="o", color="C0" if lo <= 0 <= hi else "C3", capsize=3)
        ax.axvline(0, color="grey", lw=1)
        ax.set_title(f"chain K = {key[1]}, T = {key[2]:g}" if key[0] else f"B = {key[1]}, T = {key[2]:g}")
        ax.set_xlabel("pooled tau - matched control")
    axes[0][0].set_yticks(range(len(names)), names)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def vllm_verdict(vllm: dict | None) -> list[str]:
    """The arms whose vLLM acceptance length differs from their matched control's (paired interval
    excluding 0), in the words of :func:`~exittrain.report.experiment_page.uncorrected`."""
    lines = []
    for name, r in (vllm or {}).get("drafters", {}).items():
        pair = r.get("vs_control")
        if (word := separation(pair)) is not None:
            low, high = pair["ci95"]
            lines.append(f"{name} {word} {r['control']} in vLLM's measured acceptance length: "
                         f"{pair['delta']:+.4f} ({low:+.4f} to {high:+.4f})")
    return lines
