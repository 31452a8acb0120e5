"""The held-out evaluator: every held-out measure of drafters, one table layout, for fit, eval and the benches.

:class:`HeldOutEvaluator` holds one prompt set and its settings (``eval.*``, checked by
:func:`exittrain.settings.eval_settings`), and :meth:`~HeldOutEvaluator.measure` gives a drafter's
table rows (:func:`format_report` prints them). Every tau is what a decode reports: the tokens of
every round of every prompt over the number of rounds (pooled), with a 95% bootstrap interval over
prompts. Each measure is named once in docs/metrics.md:

- **chain tau** at each ``eval.temperatures`` T (``chain_tau``, ``chain_ci95``): the drafter's greedy
  chain of K nodes, the draft vLLM and SGLang verify (:mod:`exittrain.heldout.serving_track`);
- **tree tau** at each budget and T (``tau``, ``ci95``): the recipe's draft tree of ``eval.budgets``
  nodes, the plain decoder's (:func:`~exittrain.heldout.decode_eval.evaluate_prompts`);
- both walked along the target's own answers (:mod:`exittrain.heldout.round_walk`): its greedy answer
  at T = 0, where the walked rounds are the decode's exactly and the first prompt is decoded for real
  as their live check (``walk_exact``, ``lossless``); its sample at T > 0, where they are distributed
  as any exact verifier's rounds. The answers of every temperature come from one prefill of the
  prompts (:func:`~exittrain.heldout.answers.walk_answers`) and every drafter an evaluator measures
  walks the same ones, so two drafters' rows are paired: each later drafter's tree and chain tau
  carry their paired difference against the ``reference`` drafter's (``tau_vs_<ref>``,
  ``chain_tau_vs_<ref>``; :func:`~exittrain.core.paired_pooled_difference`);
- **the oracle** (``tau_oracle``, ``efficiency``; ``eval.oracle``): trees of the same budget built
  from the target itself, decoded: the bound a drafter's tree can reach;
- **speed against the target alone** (``tokens_per_s``, ``ar_tokens_per_s``, ``speedup``): only where
  it means something, on a CUDA target or at ``eval.decode=auto`` (the caller passes the CPU's
  probe as ``auto``: this layer does not import :mod:`exittrain.cpu_decode`); every tree row is then
  decoded for real;
- **vLLM's acceptance** (``vllm``; ``eval.vllm``): :meth:`~HeldOutEvaluator.measure_vllm`, for a
  DFlash export.

Every tree is built at ``eval.drafter_temperature`` t_d (1.0: the drafter as trained), from
``log_softmax(logits / t_d)``: a measurement option for asking whether a drafter's gain is only a
sharper distribution (a block cross-entropy drafter at its best t_d against another loss). t_d
changes which nodes a best-first tree of B nodes holds, not the greedy chain (each depth's argmax)
nor the verification (:mod:`exittrain.heldout.round_walk`, Drafter temperature); every table, tree
and chain row records it (``drafter_temperature``).

The answers and the causal passes over them (:class:`~exittrain.heldout.sequence_passes.SequencePasses`)
belong to the evaluator and go with it. :func:`~exittrain.heldout.decode_eval.decode_check` is the
decoded tau of the in-training decode check (``val/block_length``): the same plain decoder on a few
prompts, pooled. The per-anchor expected block length of the exit law is a training-time measure
(``train/analytic_block_length``), never a tau of this table.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from exittrain.core import paired_pooled_difference
from exittrain.heldout.answers import walk_answers
from exittrain.heldout.decode_eval import auto_reasons, evaluate_prompts, format_table, summarize
from exittrain.heldout.sequence_passes import SequencePasses
from exittrain.heldout.serving_track import attach_chain, chain_rows, summarize_chain, vllm_track

log = logging.getLogger("exittrain")

LIVE = 1  # without speed columns, prompts decoded for real (the walks' live check); the rest are walked

DECODE_MODES = ("fixed", "auto")  # eval.decode: the plain decoder, or the CPU's decode probe for the speed columns
# the keys of eval_settings' dict the evaluator reads
SETTINGS_KEYS = ("budgets", "temperatures", "max_new_tokens", "verifier", "baseline", "oracle", "seed", "decode",
                 "drafter_temperature")

__all__ = ["DECODE_MODES", "HeldOutEvaluator", "format_differences", "format_report", "speed_note"]


class HeldOutEvaluator:
    """Every held-out measure of drafters on ``prompts`` (see the module).

    ``settings``: :func:`exittrain.settings.eval_settings`' dict (``budgets``, ``temperatures``,
    ``max_new_tokens``, ``verifier``, ``baseline``, ``oracle``, ``seed``, ``decode``,
    ``drafter_temperature``);
    ``auto``: with ``decode="auto"``, the function that probes and returns the speed decoder
    (:func:`exittrain.cpu_decode.auto_settings.auto_decoder` bound to its token counts), else None;
    ``reference``: the label each later drafter's rows are paired against (None: no pairs);
    ``chain``: whether tables carry the chain track.
    """

    def __init__(self, target, prompts: Sequence[Sequence[int]], settings: dict, *, auto: Callable | None = None,
                 reference: str | None = "warm_start", chain: bool = True):
        missing = [k for k in SETTINGS_KEYS if k not in settings]
        if missing:
            raise ValueError(f"evaluator settings lack {missing}: pass exittrain.settings.eval_settings(cfg), which "
                             "reads every one from conf/eval/default.yaml")
        if settings["decode"] == "auto" and auto is None:
            raise ValueError("eval.decode=auto needs the CPU decode probe (exittrain.cpu_decode.auto_settings); "
                             "the command that reads eval.decode passes it")
        if not prompts:
            raise ValueError("no evaluation prompts: check the recipe's eval sources (eval.num_prompts > 0)")
        self.target, self.prompts, self.reference, self.chain = target, [list(p) for p in prompts], reference, chain
        self.settings = {k: v for k, v in settings.items() if k != "decode"}
        self.temperatures = [float(t) for t in settings["temperatures"]]
        self.auto = auto
        # a plain decode's speed means something where users decode: a GPU; on a CPU the fast decoder is auto's
        self.speed = auto is not None or getattr(target.device, "type", "cpu") == "cuda"
        # (temperature, prompt index) -> the target's own answer: batched answers to walk along, or (with
        # speed columns) the timed one-prompt baselines; shared by every drafter, so their rows are paired
        self.ar_cache: dict = {}
        self.passes = SequencePasses(target)  # the causal passes over those answers, shared likewise
        self.blocks: dict[str, dict[tuple, list[list[int]]]] = {}  # label -> track key -> per-prompt blocks

    def measure(self, drafter, label: str, *, drafter_temperature: float | None = None
                ) -> tuple[list[dict], list[dict], list[dict]]:
        """``(table, rows, chain)``: the drafter's table rows (one per budget and temperature), its
        per-prompt tree rows (one per prompt, budget and temperature) and its per-prompt chain rows (one
        per prompt and temperature; empty without the chain track), each with its ``drafter_temperature``.

        ``drafter_temperature``: the t_d of this measure (None: the settings' ``drafter_temperature``),
        so that one evaluator measures a drafter at several t_d on the same answers, paired: give
        each t_d its own ``label`` (a label's rows are what later drafters pair against)."""
        s = dict(self.settings)
        if drafter_temperature is not None:  # evaluate_prompts checks it (and refuses it with eval.decode=auto)
            s["drafter_temperature"] = drafter_temperature
        log.info("eval %s: tree and chain tracks on %d held-out prompts at T = %s, drafter temperature %s", label,
                 len(self.prompts), ", ".join(f"{t:g}" for t in self.temperatures), s["drafter_temperature"])
        if not self.speed:  # every temperature's answers from one prefill of the prompts
            walk_answers(self.target, self.prompts, self.ar_cache, self.temperatures, live=LIVE,
                         max_new_tokens=s["max_new_tokens"], seed=s["seed"])
        # without speed columns nothing needs a decode's clock: the rounds are walked, one prompt decoded
        rows = evaluate_prompts(self.target, drafter, self.prompts, label=label, ar_cache=self.ar_cache,
                                auto=self.auto, speed=self.speed, live=None if self.speed else LIVE,
                                passes=self.passes, **s)
        table, blocks = summarize(rows), {}
        for row in rows:
            blocks.setdefault(("tree", row["budget"], row["temperature"]), []).append(row["block_lengths"])
        chain = []
        if self.chain:
            log.info("eval %s: chain tau (the greedy chain a serving engine verifies)", label)
            chain = chain_rows(self.target, drafter, self.prompts, max_new_tokens=s["max_new_tokens"],
                               seed=s["seed"], label=label, ar_cache=self.ar_cache, live=LIVE,
                               temperatures=self.temperatures, passes=self.passes)
            attach_chain(table, summarize_chain(chain))
            measured_at = rows[0]["drafter_temperature"]  # t_d, as evaluate_prompts checked and recorded it
            for row in chain:
                # the chain is each depth's argmax, the same at every t_d: recorded, so a row says what measured it
                row["drafter_temperature"] = measured_at
                blocks.setdefault(("chain", row["temperature"]), []).append(row["block_lengths"])
        self.blocks[label] = blocks
        self._attach_pairs(table, label)
        return table, rows, chain

    def _attach_pairs(self, table: list[dict], label: str) -> None:
        """Each row's paired differences against the reference drafter measured on the same answers:
        ``tau_vs_<ref>`` (the tree at the row's budget and T) and ``chain_tau_vs_<ref>``, each
        ``{delta, ci95, prompts}`` (:func:`~exittrain.core.paired_pooled_difference`)."""
        reference = self.reference
        if reference is None or label == reference or reference not in self.blocks:
            return  # a drafter paired with itself is no comparison
        mine, theirs = self.blocks[label], self.blocks[reference]
        for row in table:
            for key, column in ((("tree", row["budget"], row["temperature"]), "tau"),
                                (("chain", row["temperature"]), "chain_tau")):
                if key in mine and key in theirs:
                    row[f"{column}_vs_{reference}"] = paired_pooled_difference(mine[key], theirs[key])

    def measure_vllm(self, table: list[dict], vllm_python: str | os.PathLike, target_dir: str,
                     dflash_dir: str | os.PathLike, workdir: Path) -> dict:
        """vLLM's acceptance of the DFlash export in ``dflash_dir`` on these prompts, added to every
        row of ``table`` as ``vllm`` (:func:`~exittrain.heldout.serving_track.vllm_track`)."""
        positions = getattr(getattr(self.target.model, "config", None), "max_position_embeddings", None) or 2048
        result = vllm_track(vllm_python, target_dir, dflash_dir, self.prompts,
                            max_new_tokens=self.settings["max_new_tokens"], workdir=workdir,
                            max_model_len=min(2048, int(positions)))
        for row in table:
            row["vllm"] = result
        return result


def speed_note(table: list[dict]) -> str | None:
    """The line printed under a table without speed columns: why, and how to get them."""
    if any("tokens_per_s" in r for r in table):
        return None
    return ("Speed: not measured. The target runs on a CPU, where the plain decoder's speed says nothing about a "
            "serving engine's; eval.decode=auto measures this host's fastest decode (docs/cpu_decoding.md).")


def format_differences(table: list[dict], reference: str = "warm_start") -> list[str]:
    """One line per drafter row with a paired difference against ``reference``: the chain's (one per
    drafter and temperature), then the tree's at each budget and temperature."""
    from exittrain.tables import paired_cell

    chain_lines, tree_lines = {}, []
    for row in table:
        label, T = row["label"] or "-", f"{row['temperature']:g}"
        pair = row.get(f"chain_tau_vs_{reference}")
        if pair is not None:  # every row of a drafter at T carries its chain: one line per drafter and T
            chain_lines[(label, T)] = (f"{label} - {reference}, chain tau at K={row['chain_K']} T={T}: "
                                       f"{paired_cell(pair)} ({pair['prompts']} prompts, paired, pooled)")
        pair = row.get(f"tau_vs_{reference}")
        if pair is not None:
            tree_lines.append(f"{label} - {reference}, tree tau at B={row['budget']} T={T}: {paired_cell(pair)} "
                              f"({pair['prompts']} prompts, paired, pooled)")
    return list(chain_lines.values()) + tree_lines


def format_report(table: list[dict], reference: str = "warm_start") -> str:
    """What fit's finish and ``eval`` print: the table, then each ``eval.decode=auto`` choice with its
    reason, the speed note, and the paired differences against ``reference``'s rows where it has some."""
    differences = "\n".join(format_differences(table, reference))
    parts = [format_table(table), *auto_reasons(table), speed_note(table), differences]
    return "\n\n".join(p for p in parts if p)
