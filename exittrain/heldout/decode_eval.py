"""Decode held-out prompts and tabulate block length and speed (the `eval` command and fit's final table).

For every prompt and setting (budget, temperature) it runs, through the same target wrapper:
the speculative decoder with the drafter, the autoregressive baseline (for the speedup), and
optionally oracle trees (tau_oracle, docs/algorithm.md section 5.2).

Definitions used in every table:
- ``tau``: output block length per round (accepted tokens + bonus) pooled over all rounds of all
  prompts, as a decode counts it: total tokens / total rounds (:func:`~exittrain.core.pooled`).
- ``tokens/s``: generated tokens / wall seconds, pooled over prompts (prefill included).
- ``speedup``: speculative tokens/s over autoregressive tokens/s at the same settings.
- ``tau_oracle``: tau with oracle trees of the same budget and depth limit; ``efficiency`` =
  tau / tau_oracle.
- ``ci95``: a 95% bootstrap interval of tau over prompts (1000 resamples, fixed seed).
- the serving track (:mod:`exittrain.heldout.serving_track`): ``chain_tau`` (the greedy chain of K
  nodes that vLLM and SGLang verify, pooled likewise) and ``vllm`` (vLLM's mean acceptance length of
  the DFlash export, and whether its outputs with speculation equal those without: a ``MISMATCH``
  cell when not).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from tqdm.auto import tqdm

from exittrain import progress as progress_log
from exittrain.core import bootstrap_ci, pooled
from exittrain.decoding import SpeculativeDecoder, oracle_generate
from exittrain.decoding.chain_decoder import ChainDecoder
from exittrain.decoding.speculative import check_drafter_temperature
from exittrain.heldout.answers import cached_baseline, walk_answers
from exittrain.heldout.round_walk import check_live, walk_checks, walked_rounds
from exittrain.heldout.sequence_passes import SequencePasses

__all__ = [
    "check_eval_drafter_temperature", "decode_check", "evaluate_prompts", "summarize", "format_table", "auto_reasons",
    "optional_cell",
]

log = logging.getLogger("exittrain")


def _speed_keys(result, prefix: str = "", speed: bool = True) -> dict:
    """The speed facts of one decode: tokens, wall seconds and stage times, and with ``speed`` its tokens/s."""
    return {
        f"{prefix}new_tokens": len(result.tokens),
        f"{prefix}seconds": result.seconds,
        **({f"{prefix}tokens_per_s": result.tokens_per_second} if speed else {}),
        **{f"{prefix}time_{k}": v for k, v in result.stage_seconds().items()},
    }


def _same_prefix(a: list[int], b: list[int]) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


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
    auto=None,
    speed: bool = True,
    live: int | None = None,
    passes=None,
    drafter_temperature: float = 1.0,
) -> list[dict]:
    """One row per (prompt, budget, temperature): tau, rounds, speed, stage times, block lengths.

    ``ar_cache``: a dict to reuse autoregressive baselines across calls on the same ``prompts``,
    ``max_new_tokens`` and ``seed`` (keyed by temperature and prompt index); None = a fresh one.

    Every decode runs the plain :class:`~exittrain.decoding.SpeculativeDecoder` (``eval.decode=fixed``)
    unless ``auto`` is given (``eval.decode=auto``): a function ``auto(drafter, prompts, max_budget,
    answer_tokens)`` that returns ``(decoder, choice)``
    (:func:`exittrain.cpu_decode.auto_settings.auto_decoder`, bound by the command that asked for it:
    this layer does not import the CPU's decode layer). It is called once, its choice logged with
    its reason, and every prompt is decoded twice: at the row's budget for the quality columns, and
    at the auto setting for the speed columns.

    ``speed``: whether the rows carry tokens/s and speedup (with ``auto``, always). Where a plain
    decode's speed says nothing a user can act on (a CPU target: the plain decoder is not the
    fast one) the evaluator leaves them out.

    ``live``: None decodes every row. An integer (without ``speed``, which times real decodes)
    walks every row's rounds along the target's own answer instead
    (:func:`~exittrain.heldout.round_walk.walked_rounds`: one target pass a prompt, no decode): at
    T = 0 its greedy answer, at T > 0 its sample at T (``ar_cache[(T, i)]``, filled in batches by
    :func:`~exittrain.heldout.answers.walk_answers`; every drafter of one cache walks the same
    answers, so their rows are paired). At T = 0 the first ``live`` prompts are also decoded for
    real, each checked against its walk (``walk_matches_decode``, logged as an error where not);
    at T > 0 a decode draws its own text, so there is nothing to compare round for round. Walked
    rows have ``decoded`` False and carry the quality keys and ``new_tokens`` only; the other rows
    have ``decoded`` True. ``passes``: the :class:`~exittrain.heldout.sequence_passes.SequencePasses`
    the walks share (None: one for this call).

    ``drafter_temperature`` (t_d, ``eval.drafter_temperature``; 1.0 the drafter as trained): every
    drafter tree, walked or decoded, is built from ``log_softmax(logits / t_d)``
    (:func:`~exittrain.decoding.speculative.draft_logprobs`): it changes which nodes a budget holds
    and nothing else (:mod:`~exittrain.heldout.round_walk`, Drafter temperature). The oracle's trees
    are the target's and ignore it. ``auto`` refuses t_d != 1: the CPU's decode probe builds its
    trees from the drafter as trained.

    Row keys, both modes:
    - quality, the decode at ``budget``: ``tau``, ``rounds``, ``block_lengths``;
    - speed, the decode at the speed setting (the budget with ``"fixed"``, the auto setting with
      ``"auto"``): ``new_tokens``, ``seconds``, ``time_<stage>``, and with ``speed`` ``tokens_per_s``
      and, with ``baseline``, ``ar_tokens_per_s`` and ``speedup`` (over the autoregressive baseline);
    - ``matches_target`` (T = 0 with ``baseline``): every decode of the row equals greedy's;
    - ``decode``: ``"fixed"`` or ``"auto"``; ``drafter_temperature``: t_d.
    With ``"auto"`` also: ``auto_setting`` (e.g. ``"B=4, draft vocab 4096, copy tail 10"``),
    ``auto_budget`` (0: auto decodes greedily, without the drafter), ``auto_draft_vocab``,
    ``auto_copy_tail``, ``auto_copy_lead``, ``auto_miss_steps``, ``auto_tau`` (tau of the speed
    decode), ``auto_block_lengths``, ``auto_expected_speedup`` (the probe's estimate),
    ``auto_reason``; and the budget's own speed as ``fixed_new_tokens``, ``fixed_seconds``,
    ``fixed_tokens_per_s`` and ``fixed_speedup``.
    """
    if not prompts:
        raise ValueError("no evaluation prompts: check the recipe's eval sources (eval.num_prompts > 0)")
    for b in budgets:
        if not isinstance(b, int) or b < 1:
            raise ValueError(f"budgets must be integers >= 1 (tree nodes), got {list(budgets)}")
    check_live(live)
    drafter_temperature = check_eval_drafter_temperature(drafter_temperature, auto=auto is not None)
    if live is not None and (speed or auto is not None):
        raise ValueError("live walks rounds instead of decoding them, and the speed columns time real decodes: "
                         "pass live=None with speed or auto")
    if auto is not None:  # eval.decode=auto: the speed columns decode at the probe's choice
        auto, choice = auto(drafter, prompts, max(budgets), max_new_tokens)
        log.info("eval %s: %s", label or "-", choice.reason)
        speed = True
    auto_results: dict = {}  # (temperature, prompt index) -> the auto decode
    rows: list[dict] = []
    jobs = [(b, t, i) for t in temperatures for b in budgets for i in range(len(prompts))]
    ar_cache = {} if ar_cache is None else ar_cache  # (temperature, prompt index) -> baseline result
    if live is not None:  # the walked prompts' answers, in batches
        walk_answers(target, prompts, ar_cache, temperatures, live=live, max_new_tokens=max_new_tokens, seed=seed)
        passes = SequencePasses(target) if passes is None else passes
    # a bar on a terminal; elsewhere (a log file) a line per prompt or every 30 s
    as_lines = progress and not progress_log.interactive()
    bar = tqdm(jobs, desc=f"eval {label}".strip(), disable=not progress or as_lines, leave=False)
    ticker = progress_log.Ticker(f"eval {label}".strip(), len(jobs), unit="decode", every=1)
    for done, (budget, temperature, i) in enumerate(bar, 1):
        prompt = list(prompts[i])
        run_seed = seed + i
        row = {"label": label, "prompt_index": i, "budget": budget, "temperature": temperature, "verifier": verifier,
               "decode": "fixed" if auto is None else "auto", "drafter_temperature": drafter_temperature}
        walked = None
        if live is not None:
            answer = cached_baseline(ar_cache, target, prompt, i, max_new_tokens, temperature, run_seed).tokens
            # the plain decoder roots its first round at the prompt's last token (round_walk's module)
            walked = walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer,
                                   max_new_tokens=max_new_tokens + 1, shape="ddtree", budget=budget,
                                   temperature=temperature, seed=run_seed, passes=passes,
                                   drafter_temperature=drafter_temperature)
        if walked is not None and (i >= live or temperature > 0):
            row.update(decoded=False, rounds=len(walked), tau=sum(walked) / max(len(walked), 1), block_lengths=walked,
                       new_tokens=len(answer))
        else:
            result = SpeculativeDecoder(target, drafter, budget=budget, verifier=verifier,
                                        drafter_temperature=drafter_temperature).generate(
                prompt, max_new_tokens, temperature=temperature, seed=run_seed
            )
            row.update(decoded=True, rounds=len(result.rounds), tau=result.mean_block_length,
                       block_lengths=[r.block_length for r in result.rounds], **_speed_keys(result, speed=speed))
            if walked is not None:
                row["walk_matches_decode"] = walked == row["block_lengths"]
                if not row["walk_matches_decode"]:
                    log.error("eval %s, prompt %d at B=%d: the walked rounds %s differ from the decoded %s; the tree "
                              "tau of the walked prompts may be off (exittrain/heldout/round_walk.py, Limits)",
                              label, i, budget, walked, row["block_lengths"])
            decoded = [result]
            if auto is not None:
                if (temperature, i) not in auto_results:  # the auto decode does not depend on the row's budget
                    auto_results[temperature, i] = auto.generate(prompt, max_new_tokens, temperature=temperature,
                                                                 seed=run_seed)
                decoded.append(auto_results[temperature, i])
                _auto_columns(row, result, auto_results[temperature, i], choice)
            if baseline:
                ar = cached_baseline(ar_cache, target, prompt, i, max_new_tokens, temperature, run_seed)
                if speed and ar.tokens and not ar.seconds:
                    raise ValueError(f"ar_cache[{(temperature, i)}] holds a batched greedy answer (no timing) from a "
                                     "walk: speed columns need the one-prompt baseline; give a speed evaluation its "
                                     "own ar_cache")
                _baseline_columns(row, ar, decoded, speed=speed, greedy=temperature == 0)
        if oracle:
            depth = drafter.config.num_draft_tokens
            ores, analytic = oracle_generate(target, prompt, budget, max_new_tokens, temperature, seed=run_seed,
                                             max_depth=depth)
            row["tau_oracle"] = ores.mean_block_length
            row["tau_oracle_analytic"] = sum(analytic) / len(analytic)
            row["oracle_block_lengths"] = [r.block_length for r in ores.rounds]
        rows.append(row)
        _tick(bar, ticker, as_lines, done, row)
    return rows


def check_eval_drafter_temperature(value, *, auto: bool) -> float:
    """``eval.drafter_temperature`` as a float: a finite number > 0
    (:func:`~exittrain.decoding.speculative.check_drafter_temperature`), and 1.0 with ``auto``
    (``eval.decode=auto``), whose CPU decode probe drafts from the drafter as trained. ValueError
    naming the keys and the fix otherwise."""
    drafter_temperature = check_drafter_temperature(value, "eval.drafter_temperature")
    if auto and drafter_temperature != 1.0:
        raise ValueError(f"eval.decode=auto with eval.drafter_temperature={value!r}: the CPU's decode probe "
                         "drafts from the drafter as trained; set eval.decode=fixed to measure at a drafter "
                         "temperature, or eval.drafter_temperature=1.0")
    return drafter_temperature


def _auto_columns(row: dict, result, fast, choice) -> None:
    """An ``eval.decode=auto`` row's speed columns: the auto decode ``fast``'s speed keys, the budget's
    own decode ``result``'s as ``fixed_*``, and the probe's ``choice`` (what it decodes with, and why)."""
    row.update({f"fixed_{k}": v for k, v in _speed_keys(result).items() if not k.startswith("time_")})
    row.update(_speed_keys(fast))
    row.update(auto_setting=choice.setting.label, auto_budget=choice.setting.budget,
               auto_draft_vocab=choice.setting.draft_vocab, auto_copy_tail=choice.setting.copy_tail,
               auto_copy_lead=choice.setting.copy_lead, auto_miss_steps=choice.setting.miss_steps,
               auto_tau=fast.mean_block_length, auto_block_lengths=[r.block_length for r in fast.rounds],
               auto_expected_speedup=choice.chosen.speedup, auto_reason=choice.reason)


def _baseline_columns(row: dict, ar, decoded: list, *, speed: bool, greedy: bool) -> None:
    """The columns the autoregressive baseline ``ar`` gives a decoded row: with ``speed`` its tokens/s and
    the speedups (``speedup`` of the row's speed decode; ``fixed_speedup`` of the budget's own, ``decoded[0]``,
    where an auto decode follows it), and at T = 0 (``greedy``) the lossless check over every decode."""
    rate = ar.tokens_per_second
    if speed:
        row["ar_tokens_per_s"] = rate
        row["speedup"] = row["tokens_per_s"] / rate if rate else 0.0
    if len(decoded) > 1:  # eval.decode=auto: the budget's decode, then the auto one
        row["fixed_speedup"] = decoded[0].tokens_per_second / rate if rate else 0.0
    if greedy:  # lossless check on every greedy evaluation
        row["matches_target"] = all(_same_prefix(ar.tokens, r.tokens) for r in decoded)


def _tick(bar, ticker, as_lines: bool, done: int, row: dict) -> None:
    """Report one finished row: the bar's tau on a terminal, else a line every so often."""
    bar.set_postfix(tau=f"{row['tau']:.2f}")
    if as_lines:
        ticker.update(done, B=row["budget"], T=row["temperature"], tau=row["tau"])


def decode_check(target, drafter, prompts: Sequence[Sequence[int]], *, budget: int, shape: str = "ddtree",
                 verifier: str = "tev", temperature: float = 0.0, max_new_tokens: int = 48, seed: int = 0) -> dict:
    """Decoded tau of ``drafter`` pooled over ``prompts`` with the plain decoder: the recipe's tree of
    ``budget`` nodes (``shape="ddtree"``) or the greedy chain a serving engine verifies (``"chain"``),
    prompt i seeded ``seed + i``. Returns ``block_length`` (tau), ``tokens_per_s`` (the plain
    decoder's: a trend, not a speed claim), ``rounds``, ``tokens`` and ``seconds``."""
    if shape == "chain":
        decoder = ChainDecoder(target, drafter, verifier=verifier)
    else:
        decoder = SpeculativeDecoder(target, drafter, budget=budget, verifier=verifier)
    tokens = rounds = block_sum = 0
    seconds = 0.0
    for i, prompt in enumerate(prompts):
        result = decoder.generate(prompt, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed + i)
        tokens += len(result.tokens)
        rounds += len(result.rounds)
        block_sum += sum(r.block_length for r in result.rounds)
        seconds += result.seconds
    return {"block_length": block_sum / max(rounds, 1), "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
            "rounds": float(rounds), "tokens": float(tokens), "seconds": seconds}


def summarize(rows: list[dict]) -> list[dict]:
    """Pool rows per (label, budget, temperature, drafter temperature) into table rows (see the module
    docstring). Each table row carries its rows' ``drafter_temperature``; rows written before it was
    recorded (a run directory's older JSON) carry none, and neither does their table row."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["label"], row["budget"], row["temperature"], row.get("drafter_temperature"))
        groups.setdefault(key, []).append(row)
    table = []
    for (label, budget, temperature, drafter_temperature), items in groups.items():
        lengths = [r["block_lengths"] for r in items]
        tokens = sum(r["new_tokens"] for r in items)
        decoded = [r for r in items if r.get("decoded", True)]  # walked rows carry no decode's facts
        out = {
            "label": label,
            "budget": budget,
            "temperature": temperature,
            "prompts": len(items),
            "tau": pooled(lengths),
            "ci95": bootstrap_ci(lengths),
            **({} if drafter_temperature is None else {"drafter_temperature": drafter_temperature}),
        }
        out.update(walk_checks(items))
        if all("tokens_per_s" in r for r in items):
            out["tokens_per_s"] = tokens / sum(r["seconds"] for r in items)
        if all("ar_tokens_per_s" in r for r in items):
            ar_seconds = sum(r["new_tokens"] / r["ar_tokens_per_s"] for r in items if r["ar_tokens_per_s"])
            out["ar_tokens_per_s"] = tokens / ar_seconds if ar_seconds else 0.0
            out["speedup"] = out["tokens_per_s"] / out["ar_tokens_per_s"] if out["ar_tokens_per_s"] else 0.0
        if decoded and all("matches_target" in r for r in decoded):  # over the prompts decoded for real
            out["lossless"] = all(r["matches_target"] for r in decoded)
        if all("auto_setting" in r for r in items):  # eval.decode=auto: the speed columns decode at the probe's choice
            auto = [r["auto_block_lengths"] for r in items]
            out["auto_setting"], out["auto_reason"] = items[0]["auto_setting"], items[0]["auto_reason"]
            out["auto_tau"] = sum(map(sum, auto)) / sum(len(x) for x in auto)
        if all("tau_oracle" in r for r in items):
            o = [r["oracle_block_lengths"] for r in items]
            out["tau_oracle"] = sum(map(sum, o)) / sum(len(x) for x in o)
            out["efficiency"] = out["tau"] / out["tau_oracle"]
        stage = {k: sum(r[k] for r in decoded) for k in decoded[0] if k.startswith("time_")} if decoded else {}
        total = sum(stage.values()) or 1.0
        out["stage_share"] = {k.removeprefix("time_"): v / total for k, v in stage.items()}
        table.append(out)
    return table


def optional_cell(row: dict, key: str, fmt: str = "{:.2f}") -> str:
    """``row[key]`` formatted for a markdown table cell, or ``-`` when the row lacks it."""
    return fmt.format(row[key]) if key in row else "-"


def _vllm_cell(row: dict) -> str:
    """vLLM's acceptance length (with its 95% interval over prompts when measured per prompt), flagged
    loudly when speculation changed vLLM's greedy outputs."""
    vllm = row.get("vllm")
    if vllm is None:
        return "-"
    ci = vllm.get("vllm_ci95")
    interval = "" if ci is None else f" ({ci[0]:.2f}-{ci[1]:.2f})"
    return f"{vllm['vllm_tau']:.2f}{interval}" + ("" if vllm["vllm_matches_plain"] else " MISMATCH")


def auto_reasons(table: list[dict]) -> list[str]:
    """Each distinct ``eval.decode=auto`` choice of a table's rows, with its reason (the round cost
    against tau of the setting the speed columns decoded at), to print under the table."""
    return list(dict.fromkeys(r["auto_reason"] for r in table if "auto_reason" in r))


def _interval(row: dict, key: str) -> str:
    return f"{row[key][0]:.2f}-{row[key][1]:.2f}" if key in row else "-"


def format_table(table: list[dict]) -> str:
    """A markdown table of :func:`summarize` rows, led by what a serving engine runs: the chain tau at K
    (the greedy chain vLLM and SGLang verify) with its 95% interval, then the tree tau at B of the same
    weights, both pooled (tokens / rounds) at the row's temperature; rows of the serving track alone
    have ``-`` in the tree's columns. Then ``vLLM tau`` where measured, the oracle, and, for rows
    decoded with ``eval.decode=auto``, the setting the speed columns were decoded at and its tau.
    A ``t_d`` column after ``T`` gives each row's drafter temperature where some row's is not 1."""
    from exittrain.tables import markdown_table

    drafter_t = any(r.get("drafter_temperature", 1.0) != 1.0 for r in table)
    chain = any("chain_tau" in r for r in table)
    vllm = any("vllm" in r for r in table)
    auto = any("auto_setting" in r for r in table)
    speed = any("tokens_per_s" in r for r in table)
    header = ["run", "B", "T", *(["t_d"] if drafter_t else []), "prompts",
              *(["chain tau (K)", "chain 95% CI"] if chain else []),
              "tree tau", "tree 95% CI", *(["vLLM tau"] if vllm else []),
              "tau_oracle", "tau/oracle", *(["speed decoded at (tau)"] if auto else []),
              *(["tok/s", "AR tok/s", "speedup"] if speed else [])]
    rows = (
        [r["label"] or "-", r["budget"], f"{r['temperature']:g}",
         *([optional_cell(r, "drafter_temperature", "{:g}")] if drafter_t else []), r["prompts"],
         *([optional_cell(r, "chain_tau") + (f" ({r['chain_K']})" if "chain_K" in r else ""),
            _interval(r, "chain_ci95")] if chain else []),
         optional_cell(r, "tau"), _interval(r, "ci95"),
         *([_vllm_cell(r)] if vllm else []),
         optional_cell(r, "tau_oracle"), optional_cell(r, "efficiency"),
         *([f"{r['auto_setting']} ({r['auto_tau']:.2f})" if "auto_setting" in r else "-"] if auto else []),
         *([optional_cell(r, "tokens_per_s", "{:.1f}"), optional_cell(r, "ar_tokens_per_s", "{:.1f}"),
            optional_cell(r, "speedup") + "x"] if speed else [])]
        for r in table
    )
    return "\n".join(markdown_table(header, rows))
