"""The held-out evaluator: every held-out measure of a drafter, one table layout, for fit and eval.

:class:`HeldOutEvaluator` holds one prompt set and its settings (``eval.*``, checked by
:func:`exittrain.settings.eval_settings`), and :meth:`~HeldOutEvaluator.measure` gives a drafter's
table rows (:func:`~exittrain.heldout.decode_eval.format_table` prints them). The measures, each
named once in docs/metrics.md:

- **decoded tree tau** (``tau``, ``ci95``): the recipe's draft tree decoded on the prompts at
  ``eval.budgets`` with ``eval.verifier`` (:func:`~exittrain.heldout.decode_eval.evaluate_prompts`).
  Without speed columns, the T = 0 rounds are walked along the target's greedy answers
  (:mod:`exittrain.heldout.round_walk`: equal to the decode's, a target pass per prompt; the
  answers generated in batches) and the first prompt is decoded for real as their live check
  (``walk_exact``, ``lossless``); with them, every prompt is decoded;
- **the oracle** (``tau_oracle``, ``efficiency``; ``eval.oracle``): trees of the same budget built
  from the target itself, the bound a drafter's tree can reach;
- **speed against the target alone** (``tokens_per_s``, ``ar_tokens_per_s``, ``speedup``): only where
  it means something, on a CUDA target or at ``eval.decode=auto`` (the caller passes the CPU's
  probe as ``auto``: this layer does not import :mod:`exittrain.cpu_decode`); the lossless check
  (``lossless``) runs at T = 0 either way with ``eval.baseline``;
- **expected tau at T** (``analytic``; ``eval.analytic_temperatures``): the exact expected TEV block
  length on answers sampled at T (:mod:`exittrain.heldout.heldout_law`), paired against the
  reference label's when it was measured;
- **chain tau at K** (``chain_tau``) and its expectation at T (``analytic_chain``): the greedy chain
  of K nodes a serving engine verifies (:mod:`exittrain.heldout.serving_track`), its rounds walked
  along the tree track's greedy answers (``ar_cache``; :mod:`exittrain.heldout.round_walk`), the
  first prompt decoded for real as their live check;
- **vLLM's acceptance** (``vllm``; ``eval.vllm``): :meth:`~HeldOutEvaluator.measure_vllm`, for a
  DFlash export.

The autoregressive baselines are decoded once per evaluator and shared by every drafter it measures,
so all rows of a table have one denominator. :func:`~exittrain.heldout.decode_eval.decode_check` is
the decoded tau of the in-training decode check (``val/block_length``): the same plain decoder on a
few prompts, pooled (it lives beside ``evaluate_prompts``, so training imports no serving track).
The other training-time measures are cheaper relatives logged on batches and validation rows
(docs/metrics.md names each and where it is computed).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from exittrain.heldout.decode_eval import auto_reasons, evaluate_prompts, format_table, summarize
from exittrain.heldout.heldout_law import format_differences, held_out_law
from exittrain.heldout.measures import cache_answers
from exittrain.heldout.serving_track import attach_chain, chain_rows, summarize_chain, vllm_track

log = logging.getLogger("exittrain")

LIVE = 1  # without speed columns, prompts decoded for real (the walks' live check); the rest are walked

DECODE_MODES = ("fixed", "auto")  # eval.decode: the plain decoder, or the CPU's decode probe for the speed columns

__all__ = ["DECODE_MODES", "HeldOutEvaluator", "format_report", "paired_reference", "speed_note"]


class HeldOutEvaluator:
    """Every held-out measure of drafters on ``prompts`` (see the module).

    ``settings``: :func:`exittrain.settings.eval_settings`' dict (``budgets``, ``temperatures``,
    ``max_new_tokens``, ``verifier``, ``baseline``, ``oracle``, ``seed``, ``decode``);
    ``analytic``: ``(temperatures, anchors per answer)`` of the expected tau ([] = off);
    ``auto``: with ``decode="auto"``, the function that probes and returns the speed decoder
    (:func:`exittrain.cpu_decode.auto_settings.auto_decoder` bound to its token counts), else None;
    ``reference``: the label each later drafter's expected tau is paired against.
    """

    def __init__(self, target, prompts: Sequence[Sequence[int]], settings: dict, analytic: tuple[list[float], int],
                 *, auto: Callable | None = None, reference: str | None = "warm_start", chain: bool = True):
        if settings["decode"] == "auto" and auto is None:
            raise ValueError("eval.decode=auto needs the CPU decode probe (exittrain.cpu_decode.auto_settings); "
                             "the command that reads eval.decode passes it")
        self.target, self.prompts, self.reference, self.chain = target, [list(p) for p in prompts], reference, chain
        self.settings = {k: v for k, v in settings.items() if k != "decode"}
        self.auto = auto
        # a plain decode's speed means something where users decode: a GPU; on a CPU the fast decoder is auto's
        self.speed = auto is not None or getattr(target.device, "type", "cpu") == "cuda"
        self.ar_cache: dict = {}  # (temperature, prompt index) -> the target's own decode, shared by every drafter
        self.law = held_out_law(target, self.prompts, analytic, max_new_tokens=settings["max_new_tokens"],
                                seed=settings["seed"])
        self.analytic: dict[str, dict] = {}  # label -> per-anchor expected tau, for the paired differences
        self.analytic_chain: dict[str, dict] = {}

    def measure(self, drafter, label: str, *, tree: bool = True) -> tuple[list[dict], list[dict], list[dict]]:
        """``(table, rows, chain)``: the drafter's table rows (one per budget and temperature), its
        per-prompt tree rows and its per-prompt chain rows (empty without the chain track).

        ``tree=False`` measures the serving track alone (chain tau and its expectation at T): what a
        chain-verifying engine gets of a drafter, such as the DFlash export. Its table has one row per
        budget at T = 0 with no tree columns."""
        log.info("eval %s: %s on %d held-out prompts", label, "tree and chain tracks" if tree else "chain track",
                 len(self.prompts))
        if self.law is not None and not self.speed:
            # the law's samples and the greedy answers the walks follow, from one prefill of the prompts
            greedy = self.law.sample(greedy=True).get(0.0, [])
            cache_answers(self.ar_cache, {i: row for i, row in enumerate(greedy) if i >= LIVE})
        rows = []
        if tree:
            # without speed columns nothing needs a decode's clock: the T = 0 rounds are walked, one prompt decoded
            rows = evaluate_prompts(self.target, drafter, self.prompts, label=label, ar_cache=self.ar_cache,
                                    auto=self.auto, speed=self.speed, live=None if self.speed else LIVE,
                                    **self.settings)
            table = summarize(rows)
        else:
            table = [{"label": label, "budget": b, "temperature": 0.0, "prompts": len(self.prompts)}
                     for b in self.settings["budgets"]]
        if self.law is not None and (tree or self.chain):  # the tree's and the chain's, one drafter pass a row
            log.info("eval %s: expected tau at T = %s", label, ", ".join(f"{t:g}" for t in self.law.temperatures))
            trees, chains = self.law.measure_both(drafter, self.settings["budgets"] if tree else [], chain=self.chain)
            if tree:
                self.analytic[label] = trees
                self.law.attach(table, trees, paired_reference(self.analytic, label, self.reference))
            if self.chain:
                self.analytic_chain[label] = chains
                self.law.attach_chain(table, chains, paired_reference(self.analytic_chain, label, self.reference))
        chain = []
        if self.chain:
            log.info("eval %s: chain tau (the greedy chain a serving engine verifies)", label)
            chain = chain_rows(self.target, drafter, self.prompts, max_new_tokens=self.settings["max_new_tokens"],
                               seed=self.settings["seed"], label=label, ar_cache=self.ar_cache, live=LIVE)
            attach_chain(table, summarize_chain(chain))
        return table, rows, chain

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


def paired_reference(measured: dict, label: str, reference: str | None) -> dict | None:
    """``reference``'s measure to pair ``label``'s against: None for the reference itself (a drafter
    paired with itself is no comparison) or when it was not measured."""
    return None if label == reference else measured.get(reference)


def speed_note(table: list[dict]) -> str | None:
    """The line printed under a table without speed columns: why, and how to get them."""
    if any("tokens_per_s" in r for r in table):
        return None
    return ("Speed: not measured. The target runs on a CPU, where the plain decoder's speed says nothing about a "
            "serving engine's; eval.decode=auto measures this host's fastest decode (docs/cpu_decoding.md).")


def format_report(table: list[dict], reference: str = "warm_start") -> str:
    """What fit's finish and ``eval`` print: the table, then each ``eval.decode=auto`` choice with its
    reason, the speed note, and the paired differences against ``reference``'s rows where it has some."""
    differences = "\n".join(format_differences(table, reference))
    parts = [format_table(table), *auto_reasons(table), speed_note(table), differences]
    return "\n\n".join(p for p in parts if p)
