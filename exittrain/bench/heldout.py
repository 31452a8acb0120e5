"""Held-out block lengths of saved drafters at the target's own answers: greedy at T = 0, analytic at T > 0.

``python -m exittrain bench heldout DRAFTER [DRAFTER ...] [--prompts 64] [--skip 16] [--budgets 16 64]
[--temperatures 0 0.6 1] [--analytic-anchors 16] [--no-oracle] [--no-chain]``

**T = 0 (greedy tau).** The fp32 target (as loaded) answers the domain's evaluation prompts
``skip .. skip + prompts`` greedily, keeping the target features of every drafter's layers. Each
answer position is an anchor: its token is the root, the target features before it are the
drafter's context, and the next K answer tokens are the target's own greedy continuation. Each
drafter builds its tree of budget B there, and 1 + :func:`exittrain.core.followed_depth` is
exactly the block a T = 0 verifier would accept on it. Every anchor is measured, with no target
forward per drafter. Also the per-depth accuracy of each drafter's argmax.

**T > 0 (analytic tau).** The target answers the same prompts again, *sampled* at T (seeded, one
answer set per temperature shared by all drafters), so the anchors follow the positions decoding
at T visits. At ``--analytic-anchors`` anchors per answer (fixed seed, the same for every drafter
of one block size) the drafter's tree is built as the decoder builds it and scored by the target;
``sum_v P(v)`` under the target warped to T is the exact expected TEV block length of a round
started there (:mod:`exittrain.heldout.measures`). **Oracle:** at the same anchors, ``sum_v P(v)``
of the tree of the B nodes of highest target reach, depth <= K (docs/algorithm.md section 5.2); at T = 0
it is ``1 + min(B, K)``. ``tau / tau_oracle`` is the tree efficiency.

**Chain** (unless ``--no-chain``): the same two measures on each drafter's greedy chain of K
nodes, the draft vLLM and SGLang verify (docs/algorithm.md section 4.6): the greedy chain tau at
every anchor (no target forward) and the analytic chain tau at the same anchors as the trees (one
target forward of K + 1 rows per anchor), each paired against the first drafter's chain.

Limits: neither is the decoded tau. Decoding visits only the anchors where rounds start, and
these are per-round expectations at every kind of answer position. The first ``skip`` prompts
are the ones ``fit`` decodes (``eval.num_prompts`` = 16), left out so that both measures use
separate prompts. Intervals are 95%, bootstrapping prompts (anchors of one answer are not
independent). Every drafter after the first is also compared with the first at the same anchors
(the mean paired difference and its interval, much narrower than the drafters' own, so a change
of 1-2% can be told from noise); drafters of another block size have other anchors and get no
paired difference. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import logging

import torch

from exittrain import progress as progress_log
from exittrain.heldout.measures import (
    analytic_block_lengths,
    answer_rows,
    heldout_anchors,
    oracle_block_lengths,
    paired_difference,
    summary,
)
from exittrain.tables import markdown_table, paired_cell, write_results

__all__ = ["answer_with_features", "chain_table", "greedy_block_lengths", "greedy_block_lengths_by_budget", "run",
           "to_markdown", "main"]


def answer_with_features(target, prompts: list[list[int]], layers: list[int], max_new_tokens: int, batch: int):
    """Greedy fp32 answers of ``prompts`` with the target features of ``layers`` at every position:
    a list of ``(ids (n,) long, n_prompt, features (n, F) bf16)`` (:func:`answer_rows` at T = 0)."""
    return answer_rows(target, prompts, layers, max_new_tokens, batch)


def greedy_block_lengths(drafter, rows, layers: list[int], budget: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per row, the (A,) T = 0 block lengths of ``drafter`` at its answer anchors; and the (K,)
    per-depth argmax accuracy over all anchors. ``rows`` as :func:`answer_with_features` returns,
    with the features of ``layers`` (a superset of the drafter's, in that order)."""
    per_budget, accuracy = greedy_block_lengths_by_budget(drafter, rows, layers, [budget])
    return per_budget[budget], accuracy


def greedy_block_lengths_by_budget(
    drafter, rows, layers: list[int], budgets: list[int], *, chain: bool = False
) -> tuple[dict[int | str, list[torch.Tensor]], torch.Tensor]:
    """:func:`greedy_block_lengths` at several budgets: ``{B: per-row lengths}`` and the accuracy.
    The drafter runs once per row; only the tree is built per budget. ``chain``: also the lengths on
    the drafter's greedy chain of K nodes, under the key ``"chain"``."""
    from exittrain.core import build_tree, chain_tree, followed_depth

    K, H = drafter.config.num_draft_tokens, drafter.config.target_hidden_size
    slots = [layers.index(x) for x in drafter.config.target_layer_ids]
    pick = torch.cat([torch.arange(s * H, (s + 1) * H) for s in slots])  # the drafter's slices of F
    per_budget: dict[int | str, list[torch.Tensor]] = {b: [] for b in budgets}
    if chain:
        per_budget["chain"] = []
    hits, anchors_seen = torch.zeros(K), 0
    with torch.no_grad():
        for ids, n_prompt, features in rows:
            T = ids.shape[0]
            if T - K <= n_prompt - 1:  # an answer shorter than K tokens has no full anchor
                continue
            anchors = torch.arange(n_prompt - 1, T - K)  # roots: the last prompt token, then the answer
            logits = drafter.forward_anchors(features[:, pick].float()[None], ids[None], anchors[None]).float()
            labels = ids[anchors.unsqueeze(1) + torch.arange(1, K + 1)]  # (A, K) the target's continuation
            hits += (logits.argmax(-1) == labels).float().sum(0)
            anchors_seen += labels.shape[0]
            logq_AKV = torch.log_softmax(logits, -1)
            for budget in budgets:
                tree = build_tree(logq_AKV, budget, validate=False)
                per_budget[budget].append(1.0 + followed_depth(tree, labels).float())
            if chain:
                per_budget["chain"].append(1.0 + followed_depth(chain_tree(logq_AKV), labels).float())
    return per_budget, hits / max(anchors_seen, 1)


def _check(budgets, temperatures, analytic_anchors) -> None:
    if not budgets or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in budgets):
        raise ValueError(f"--budgets must name at least one integer >= 1 (tree nodes), got {budgets!r}")
    if any(not isinstance(t, (int, float)) or not t >= 0 for t in temperatures):
        raise ValueError(f"--temperatures must be numbers >= 0 (0 = greedy), got {temperatures!r}")
    if not isinstance(analytic_anchors, int) or analytic_anchors < 1:
        raise ValueError(f"--analytic-anchors must be an integer >= 1 (anchors per answer), got {analytic_anchors!r}")


def run(
    drafters: list[str], prompts: int, skip: int, max_new_tokens: int, budgets: list[int] | int = (16,),
    domain: str = "code", batch: int = 32, temperatures: list[float] = (0.0, 0.6, 1.0),
    analytic_anchors: int = 16, oracle: bool = True, seed: int = 0, top_p: float | None = None, chain: bool = True,
) -> dict:
    """Measure every drafter at every budget: greedy tau on the greedy answers (always), analytic
    tau at each temperature > 0 on answers sampled at it, and the oracle bound unless ``oracle`` is
    False (see the module docstring). ``budgets`` may be one int. ``chain``: the same on each
    drafter's greedy chain of K nodes, in ``result["chain"]`` (one entry per drafter)."""
    from exittrain.data import ExitTrainDataModule
    from exittrain.models import load_drafter, load_target

    budgets = [budgets] if isinstance(budgets, int) else list(budgets)
    _check(budgets, temperatures, analytic_anchors)
    temperatures = sorted({0.0, *(float(t) for t in temperatures)})  # greedy tau is always measured
    if not drafters:
        raise ValueError("name at least one saved drafter folder (RUN_DIR/drafter or RUN_DIR/warmstart_drafter)")
    target = load_target(None)
    loaded = [load_drafter(path, target) for path in drafters]
    for d in loaded:
        d.eval()
    layers = sorted({x for d in loaded for x in d.config.target_layer_ids})
    data = ExitTrainDataModule(domain, tokenizer=target.tokenizer, progress=False)
    templated = data.eval_prompts(skip + prompts)[skip:]
    if not templated:
        raise ValueError(f"--skip {skip} leaves no {domain} evaluation prompt; lower --skip")
    greedy_rows = answer_rows(target, templated, layers, max_new_tokens, batch)
    results = [{"drafter": p, "budget": b, "analytic": {}} for b in budgets for p in drafters]
    chains = [{"drafter": p, "K": d.config.num_draft_tokens, "analytic": {}} for p, d in zip(drafters, loaded)]
    oracles, first = [], {}  # first[(budget, temperature)]: the first drafter's per-row values
    first_chain = {}  # first_chain[(K, temperature)]: the first chain's per-row values
    ticker = progress_log.Ticker("bench heldout", len(drafters) * len(temperatures), unit="drafter x T", every=1,
                                 every_s=0)
    done = 0
    for temperature in temperatures:
        rows = greedy_rows if temperature == 0 else answer_rows(
            target, templated, layers, max_new_tokens, batch, temperature, seed, top_p)
        anchors = {}  # per block size: the shared anchors
        for path, drafter in zip(drafters, loaded):
            K = drafter.config.num_draft_tokens
            anchors.setdefault(K, heldout_anchors(rows, K, analytic_anchors, seed))
            if temperature == 0:
                greedy, accuracy = greedy_block_lengths_by_budget(drafter, rows, layers, budgets, chain=chain)
            if chain:
                per_row = greedy["chain"] if temperature == 0 else analytic_block_lengths(
                    drafter, target, rows, layers, anchors[K], K, temperature, top_p=top_p, shape="chain")
                _fill_measure(next(c for c in chains if c["drafter"] == path), first_chain, (K, temperature), per_row)
            for budget in budgets:
                entry = next(r for r in results if r["drafter"] == path and r["budget"] == budget)
                per_row = greedy[budget] if temperature == 0 else analytic_block_lengths(
                    drafter, target, rows, layers, anchors[K], budget, temperature, top_p=top_p)
                _fill_measure(entry, first, (budget, temperature), per_row)
                if temperature == 0:
                    entry["accuracy_by_depth"] = accuracy.tolist()
                if oracle and not any(o["budget"] == budget and o["temperature"] == temperature
                                      and o["max_depth"] == K for o in oracles):
                    bound = summary(oracle_block_lengths(target, rows, anchors[K], budget, K, temperature, top_p=top_p))
                    oracles.append({"budget": budget, "temperature": temperature, "max_depth": K,
                                    "oracle_tau": bound["mean"], "ci95": bound["ci95"], "anchors": bound["anchors"]})
            done += 1
            ticker.update(done, drafter=path, T=temperature)
    return {
        "domain": domain, "prompts": len(greedy_rows), "skip": skip, "max_new_tokens": max_new_tokens,
        "budgets": budgets, "temperatures": temperatures, "analytic_anchors": analytic_anchors, "seed": seed,
        "rows": results, "oracle": oracles, **({"chain": chains} if chain else {}),
    }


def _fill_measure(entry: dict, first: dict, key: tuple, per_row: list[torch.Tensor]) -> None:
    """Fill one drafter's ``entry`` (a tree at a budget, or its chain) with ``per_row`` at the
    temperature of ``key`` (``(budget or K, temperature)``): the greedy block length at T = 0, else
    the analytic tau under ``entry["analytic"]``; paired against ``first[key]`` (the first drafter's)."""
    temperature = key[1]
    stats = summary(per_row)
    if temperature == 0:
        entry.update(greedy_block_length=stats["mean"], ci95=stats["ci95"], anchors=stats["anchors"])
        field = entry
    else:
        field = entry["analytic"][str(temperature)] = {
            "analytic_tau": stats["mean"], "ci95": stats["ci95"], "anchors": stats["anchors"]}
    pair = first.get(key)
    field["vs_first"] = None if pair is None else paired_difference(per_row, pair)
    first.setdefault(key, per_row)


def _oracle_tau(result: dict, budget: int, temperature: float) -> float | None:
    found = [o["oracle_tau"] for o in result.get("oracle", []) if o["budget"] == budget and
             o["temperature"] == temperature]
    return found[0] if len(found) == 1 else None  # drafters of two block sizes: no single bound


def _efficiency(tau: float | None, bound: float | None) -> str:
    return "-" if tau is None or not bound else f"{tau / bound:.3f}"


def law_table(result: dict) -> list[str]:
    """Drafter x budget: greedy tau, analytic tau per T > 0 with the paired difference, and the
    efficiency tau / tau_oracle; then one oracle row per budget."""
    temps = [t for t in result.get("temperatures", [0.0]) if t > 0]
    header = ["drafter", "B", "greedy tau (T=0)", "eff"]
    for t in temps:
        header += [f"analytic tau T={t:g}", "vs the first (paired 95% CI)", "eff"]
    body = []
    for r in result["rows"]:
        b = r["budget"]
        line = [r["drafter"], b, f"{r['greedy_block_length']:.3f}",
                _efficiency(r["greedy_block_length"], _oracle_tau(result, b, 0.0))]
        for t in temps:
            a = r["analytic"].get(str(t))
            bound = _oracle_tau(result, b, t)
            line += ["-", "-", "-"] if a is None else [
                f"{a['analytic_tau']:.3f}", paired_cell(a["vs_first"]), _efficiency(a["analytic_tau"], bound)]
        body.append(line)
    for b in result["budgets"] if result.get("oracle") else []:
        zero = _oracle_tau(result, b, 0.0)
        line = ["oracle", b, "-" if zero is None else f"{zero:.3f}", "1.000"]
        for t in temps:
            bound = _oracle_tau(result, b, t)
            line += ["-" if bound is None else f"{bound:.3f}", "-", "1.000"]
        body.append(line)
    return markdown_table(header, body)


def chain_table(result: dict) -> list[str]:
    """Drafter: the greedy chain tau (T = 0) and the analytic chain tau per T > 0, each with the paired
    difference from the first drafter's chain."""
    temps = [t for t in result.get("temperatures", [0.0]) if t > 0]
    header = ["drafter", "K", "greedy chain tau (T=0)", "vs the first (paired 95% CI)"]
    for t in temps:
        header += [f"analytic chain tau T={t:g}", "vs the first (paired 95% CI)"]
    body = []
    for c in result["chain"]:
        line = [c["drafter"], c["K"], f"{c['greedy_block_length']:.3f}", paired_cell(c.get("vs_first"))]
        for t in temps:
            a = c["analytic"].get(str(t))
            line += ["-", "-"] if a is None else [f"{a['analytic_tau']:.3f}", paired_cell(a["vs_first"])]
        body.append(line)
    return markdown_table(header, body)


def to_markdown(result: dict) -> str:
    K = len(result["rows"][0]["accuracy_by_depth"])
    budgets = result.get("budgets", [result.get("budget")])
    rows = (
        [r["drafter"], r.get("budget", budgets[0]), r["anchors"], f"{r['greedy_block_length']:.3f}",
         f"{r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}", paired_cell(r.get("vs_first")),
         *(f"{a:.2f}" for a in r["accuracy_by_depth"])]
        for r in result["rows"]
    )
    header = ["drafter", "B", "anchors", "greedy tau", "95% CI (prompts)", "vs the first (paired 95% CI)",
              *(f"acc d{k}" for k in range(1, K + 1))]
    lines = [
        f"T = 0 block length at every answer position of the fp32 target's greedy answers to {result['prompts']} "
        f"{result['domain']} evaluation prompts (from #{result['skip']}), {result['max_new_tokens']} new tokens "
        f"at most, B = {', '.join(map(str, budgets))}.",
        "",
        *markdown_table(header, rows),
    ]
    if any(t > 0 for t in result.get("temperatures", [])):
        lines += [
            "",
            f"Expected TEV block length sum_v P(v) at {result['analytic_anchors']} anchors per answer (fixed seed, the "
            "same for every drafter) of answers sampled from the target at each T; oracle: the B nodes of highest "
            "target reach, depth <= K; eff = tau / tau_oracle.",
            "",
            *law_table(result),
        ]
    if result.get("chain"):
        lines += [
            "",
            "The greedy chain of K nodes each drafter proposes, the draft vLLM and SGLang verify: its T = 0 block "
            "length at every anchor, and its expected block length sum_v P(v) at the anchors above "
            "(docs/algorithm.md section 4.6).",
            "",
            *chain_table(result),
        ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("drafters", nargs="+", help="saved drafter folders")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--skip", type=int, default=16, help="evaluation prompts to leave out first (fit decodes them)")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--budgets", "--budget", type=int, nargs="+", default=[16], help="tree budgets B")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6, 1.0],
                        help="0 = greedy tau; each T > 0: analytic tau on answers sampled at T")
    parser.add_argument("--analytic-anchors", type=int, default=16, help="anchors per answer scored at T > 0")
    parser.add_argument("--no-oracle", dest="oracle", action="store_false", help="skip the oracle bound")
    parser.add_argument("--no-chain", dest="chain", action="store_false",
                        help="skip the greedy chain of K nodes (the draft a serving engine verifies)")
    parser.add_argument("--seed", type=int, default=0, help="sampled answers and anchor draws")
    parser.add_argument("--domain", default="code", choices=["code", "dialogue", "math"])
    parser.add_argument("--out", default="results/bench_heldout")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")  # progress on stderr
    result = run(args.drafters, args.prompts, args.skip, args.max_new_tokens, args.budgets, args.domain,
                 temperatures=args.temperatures, analytic_anchors=args.analytic_anchors, oracle=args.oracle,
                 seed=args.seed, chain=args.chain)
    write_results(args.out, result, to_markdown(result))


if __name__ == "__main__":
    main()
