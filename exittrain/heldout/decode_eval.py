"""Decode held-out prompts and tabulate block length and speed (the `eval` command and fit's final table).

For every prompt and setting (budget, temperature) it runs, through the same target wrapper:
the speculative decoder with the drafter, the autoregressive baseline (for the speedup), and
optionally oracle trees (tau_oracle, docs/algorithm.md section 5.2).

Definitions used in every table:
- ``tau``: mean output block length per round (accepted tokens + bonus) pooled over all rounds
  of all prompts; each round counts the tokens it yielded before any EOS or length cut.
- ``tokens/s``: generated tokens / wall seconds, pooled over prompts (prefill included).
- ``speedup``: speculative tokens/s over autoregressive tokens/s at the same settings.
- ``tau_oracle``: tau with oracle trees of the same budget and depth limit; ``efficiency`` =
  tau / tau_oracle.
- ``ci95``: a 95% bootstrap interval of tau over prompts (1000 resamples, fixed seed).
- ``analytic`` (``fit``/``eval`` with ``eval.analytic_temperatures``): the exact expected TEV block
  length at each temperature on answers sampled at it (:mod:`exittrain.heldout.heldout_law`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from tqdm.auto import tqdm

from exittrain import progress as progress_log
from exittrain.decoding import SpeculativeDecoder, autoregressive_generate, oracle_generate

__all__ = ["evaluate_prompts", "summarize", "format_table", "bootstrap_ci", "optional_cell"]


def evaluate_prompts(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    *,
    budgets: Sequence[int] = (16,),
    temperatures: Sequence[float] = (0.0,),
    max_new_tokens: int = 128,
    verifier: str = "tev",
    seed: int = 0,
    baseline: bool = True,
    oracle: bool = False,
    label: str = "",
    progress: bool = True,
    ar_cache: dict | None = None,
) -> list[dict]:
    """One row per (prompt, budget, temperature): tau, rounds, speed, stage times, block lengths.

    ``ar_cache``: a dict to reuse autoregressive baselines across calls on the same ``prompts``,
    ``max_new_tokens`` and ``seed`` (keyed by temperature and prompt index); None = a fresh one.
    """
    if not prompts:
        raise ValueError("no evaluation prompts: check the recipe's eval sources (eval.num_prompts > 0)")
    for b in budgets:
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"budgets must be integers >= 1 (tree nodes), got {list(budgets)}")
    rows: list[dict] = []
    jobs = [(b, t, i) for t in temperatures for b in budgets for i in range(len(prompts))]
    ar_cache = {} if ar_cache is None else ar_cache  # (temperature, prompt index) -> baseline result
    # a bar on a terminal; elsewhere (a log file) a line per prompt or every 30 s
    as_lines = progress and not progress_log.interactive()
    bar = tqdm(jobs, desc=f"eval {label}".strip(), disable=not progress or as_lines, leave=False)
    ticker = progress_log.Ticker(f"eval {label}".strip(), len(jobs), unit="decode", every=1)
    for done, (budget, temperature, i) in enumerate(bar, 1):
        prompt = list(prompts[i])
        run_seed = seed + i
        result = SpeculativeDecoder(target, drafter, budget=budget, verifier=verifier).generate(
            prompt, max_new_tokens, temperature=temperature, seed=run_seed
        )
        row = {
            "label": label,
            "prompt_index": i,
            "budget": budget,
            "temperature": temperature,
            "verifier": verifier,
            "new_tokens": len(result.tokens),
            "rounds": len(result.rounds),
            "tau": result.mean_block_length,
            "block_lengths": [r.block_length for r in result.rounds],
            "seconds": result.seconds,
            "tokens_per_s": result.tokens_per_second,
            **{f"time_{k}": v for k, v in result.stage_seconds().items()},
        }
        if baseline:
            key = (temperature, i)
            if key not in ar_cache:  # the baseline does not depend on the budget
                ar_cache[key] = autoregressive_generate(target, prompt, max_new_tokens, temperature, seed=run_seed)
            ar = ar_cache[key]
            row["ar_tokens_per_s"] = ar.tokens_per_second
            row["speedup"] = result.tokens_per_second / ar.tokens_per_second if ar.tokens_per_second else 0.0
            if temperature == 0:  # lossless check on every greedy evaluation
                n = min(len(ar.tokens), len(result.tokens))
                row["matches_target"] = ar.tokens[:n] == result.tokens[:n]
        if oracle:
            depth = drafter.config.num_draft_tokens
            ores, analytic = oracle_generate(target, prompt, budget, max_new_tokens, temperature, seed=run_seed,
                                             max_depth=depth)
            row["tau_oracle"] = ores.mean_block_length
            row["tau_oracle_analytic"] = sum(analytic) / len(analytic)
            row["oracle_block_lengths"] = [r.block_length for r in ores.rounds]
        rows.append(row)
        bar.set_postfix(tau=f"{row['tau']:.2f}")
        if as_lines:
            ticker.update(done, B=budget, T=temperature, tau=row["tau"])
    return rows


def bootstrap_ci(per_prompt: list[list[int]], resamples: int = 1000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the pooled per-round mean, resampling prompts with replacement."""
    rng = random.Random(seed)
    n = len(per_prompt)
    stats = []
    for _ in range(resamples):
        pick = [per_prompt[rng.randrange(n)] for _ in range(n)]
        rounds = sum(len(p) for p in pick)
        stats.append(sum(sum(p) for p in pick) / rounds if rounds else 0.0)
    stats.sort()
    return stats[int(0.025 * resamples)], stats[min(resamples - 1, int(0.975 * resamples))]


def summarize(rows: list[dict]) -> list[dict]:
    """Pool rows per (label, budget, temperature) into table rows (see the module docstring)."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault((row["label"], row["budget"], row["temperature"]), []).append(row)
    table = []
    for (label, budget, temperature), items in groups.items():
        lengths = [r["block_lengths"] for r in items]
        n_rounds = sum(len(x) for x in lengths)
        tokens = sum(r["new_tokens"] for r in items)
        seconds = sum(r["seconds"] for r in items)
        out = {
            "label": label,
            "budget": budget,
            "temperature": temperature,
            "prompts": len(items),
            "tau": sum(map(sum, lengths)) / n_rounds,
            "ci95": bootstrap_ci(lengths),
            "tokens_per_s": tokens / seconds,
        }
        if all("ar_tokens_per_s" in r for r in items):
            ar_seconds = sum(r["new_tokens"] / r["ar_tokens_per_s"] for r in items if r["ar_tokens_per_s"])
            out["ar_tokens_per_s"] = tokens / ar_seconds if ar_seconds else 0.0
            out["speedup"] = out["tokens_per_s"] / out["ar_tokens_per_s"] if out["ar_tokens_per_s"] else 0.0
        if all("matches_target" in r for r in items):
            out["lossless"] = all(r["matches_target"] for r in items)
        if all("tau_oracle" in r for r in items):
            o = [r["oracle_block_lengths"] for r in items]
            out["tau_oracle"] = sum(map(sum, o)) / sum(len(x) for x in o)
            out["efficiency"] = out["tau"] / out["tau_oracle"]
        stage = {k: sum(r[k] for r in items) for k in items[0] if k.startswith("time_")}
        total = sum(stage.values()) or 1.0
        out["stage_share"] = {k.removeprefix("time_"): v / total for k, v in stage.items()}
        table.append(out)
    return table


def optional_cell(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    """``row[key]`` formatted for a markdown table cell, or ``-`` when the row lacks it."""
    return fmt.format(row[key]) if key in row else "-"


def _analytic_cell(row: dict, temperature: str) -> str:
    cell = row.get("analytic", {}).get(temperature)
    return "-" if cell is None else f"{cell['tau']:.2f} ({cell['ci95'][0]:.2f}-{cell['ci95'][1]:.2f})"


def format_table(table: list[dict]) -> str:
    """A markdown table of :func:`summarize` rows; rows with ``analytic`` entries
    (:meth:`~exittrain.heldout.heldout_law.HeldOutLaw.attach`) add one ``E[tau] T=..`` column per temperature."""
    from exittrain.tables import markdown_table

    analytic = sorted({t for r in table for t in r.get("analytic", {})}, key=float)
    header = ["run", "B", "T", "prompts", "tau", "95% CI", *(f"E[tau] T={t} (95% CI)" for t in analytic),
              "tau_oracle", "tau/oracle", "tok/s", "AR tok/s", "speedup"]
    rows = (
        [r["label"] or "-", r["budget"], f"{r['temperature']:g}", r["prompts"], f"{r['tau']:.2f}",
         f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}", *(_analytic_cell(r, t) for t in analytic),
         optional_cell(r, "tau_oracle"), optional_cell(r, "efficiency"),
         f"{r['tokens_per_s']:.1f}", optional_cell(r, "ar_tokens_per_s", "{:.1f}"), optional_cell(r, "speedup") + "x"]
        for r in table
    )
    return "\n".join(markdown_table(header, rows))
