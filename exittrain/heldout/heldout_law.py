"""Expected TEV block length at temperatures, beside the decoded tau of ``fit``'s and ``eval``'s tables.

Decoding at T > 0 gives a tau with sampling noise on top of the prompts' spread (a few prompts of
64 tokens cannot tell two drafters apart, RESULTS.md). The analytic tau has none: at each anchor it
is the exact expected block length ``sum_v P(v)`` of one TEV round (docs/algorithm.md sections 4.2 and 6.5;
:func:`~exittrain.heldout.measures.analytic_block_lengths`). :class:`HeldOutLaw` holds, per
temperature, the target's answers to the held-out prompts sampled at it and the seeded anchors
within them, so every drafter of a run (the warm start, the ExitTrain drafter, the served one) is
measured at the same anchors and their paired difference is valid. :meth:`HeldOutLaw.measure_chain`
gives the same on the drafter's greedy chain of K nodes, the draft vLLM and SGLang verify, whose
``sum_v P(v)`` is their expected acceptance length at T (docs/algorithm.md section 4.6); it uses the
tree's anchors, so the chain and the tree of one drafter are paired too.

Limits: answers are at most ``max_new_tokens`` long, so the anchors sit early in the answer; a
drafter with another block size gets its own anchors and no paired difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from exittrain.progress import Heartbeat

log = logging.getLogger("exittrain")

__all__ = ["HeldOutLaw", "held_out_law", "check_analytic_settings", "format_differences"]


def check_analytic_settings(temperatures: Sequence, anchors_per_answer, key: str = "eval") -> None:
    """ValueError naming ``{key}.analytic_temperatures`` / ``{key}.analytic_anchors`` when they are bad."""
    for t in temperatures:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ValueError(
                f"{key}.analytic_temperatures={list(temperatures)}: each must be a number > 0 (T = 0 is the "
                f"decoded tau itself); use [] to leave the analytic tau out"
            )
    if isinstance(anchors_per_answer, bool) or not isinstance(anchors_per_answer, int) or anchors_per_answer < 1:
        raise ValueError(f"{key}.analytic_anchors={anchors_per_answer!r} must be an integer >= 1 (anchors per answer)")


class HeldOutLaw:
    """Analytic tau of drafters at ``temperatures`` on the target's answers to ``prompts``.

    ``prompts``: templated token ids (the held-out prompts the table decodes). The answers of every
    temperature are sampled together, once, on first use (:meth:`sample`), seeded by ``seed`` and
    without touching the global RNG (training that follows draws what it would have drawn);
    anchors: ``anchors_per_answer`` seeded positions per answer and block size.
    """

    def __init__(self, target, prompts: Sequence[Sequence[int]], temperatures: Sequence[float], *,
                 anchors_per_answer: int, max_new_tokens: int, seed: int = 0, batch: int = 16,
                 key: str = "eval") -> None:
        check_analytic_settings(temperatures, anchors_per_answer, key)
        if not prompts:
            raise ValueError(f"{key}.num_prompts: no held-out prompts to sample answers to")
        self.target, self.prompts = target, [list(p) for p in prompts]
        self.temperatures = [float(t) for t in temperatures]
        self.anchors_per_answer, self.max_new_tokens, self.seed, self.batch = (
            anchors_per_answer, max_new_tokens, seed, batch)
        self._rows: dict[float, list] = {}  # T -> answer rows
        self._anchors: dict[tuple[float, int], list[torch.Tensor]] = {}  # (T, K) -> per-row anchors

    def sample(self, greedy: bool = False) -> dict[float, list]:
        """Sample the answers of every temperature not yet held, in one pass a batch of prompts
        (:func:`~exittrain.heldout.measures.answer_sets`); ``greedy`` adds the T = 0 answers, which
        the law keeps too. Returns ``{T: rows}`` of what was sampled now (empty when all were held)."""
        from exittrain.heldout.measures import answer_sets

        todo = [T for T in [*self.temperatures, *([0.0] if greedy else [])] if T not in self._rows]
        if not todo:
            return {}
        t0 = time.perf_counter()
        what = ", ".join(f"{T:g}" for T in todo)
        with Heartbeat(f"analytic tau: the target's answers at T = {what}"):
            sets = answer_sets(self.target, self.prompts, todo, self.max_new_tokens, seed=self.seed, batch=self.batch)
        self._rows.update(sets)
        log.info("analytic tau: %d answers at each T = %s (%.0f s)", len(self.prompts), what, time.perf_counter() - t0)
        return sets

    def _rows_at(self, temperature: float) -> list:
        if temperature not in self._rows:
            self.sample()
        return self._rows[temperature]

    def anchors(self, temperature: float, num_draft_tokens: int) -> list[torch.Tensor]:
        """Per answer at ``temperature``, the sorted (A_r,) anchors of drafters with K = ``num_draft_tokens``."""
        from exittrain.heldout.measures import heldout_anchors

        key = (temperature, num_draft_tokens)
        if key not in self._anchors:
            self._anchors[key] = heldout_anchors(self._rows_at(temperature), num_draft_tokens,
                                                 self.anchors_per_answer, self.seed)
        return self._anchors[key]

    def measure(self, drafter, budgets: Sequence[int]) -> dict[tuple[int, float], list[torch.Tensor]]:
        """``{(budget, T): per-answer (A_r,) expected block lengths}`` of ``drafter``."""
        return self.measure_both(drafter, budgets, chain=False)[0]

    def measure_chain(self, drafter) -> dict[tuple[int, float], list[torch.Tensor]]:
        """``{(K, T): per-answer (A_r,) expected block lengths}`` of ``drafter``'s greedy chain of K nodes
        (K = ``num_draft_tokens``), at the anchors :meth:`measure` uses; the tree numbers are untouched."""
        return self.measure_both(drafter, [], chain=True)[1]

    @torch.no_grad()
    def measure_both(self, drafter, budgets: Sequence[int], *, chain: bool = True) -> tuple[dict, dict]:
        """``(trees, chain)``: :meth:`measure`'s and (with ``chain``) :meth:`measure_chain`'s dicts, from
        one drafter pass a row (:func:`~exittrain.heldout.measures.expected_block_lengths`)."""
        from exittrain.heldout.measures import expected_block_lengths

        K = drafter.config.num_draft_tokens
        layers = list(drafter.config.target_layer_ids)
        drafts = [("ddtree", b) for b in budgets] + ([("chain", K)] if chain else [])
        what = ", ".join([f"trees of {b} nodes" for b in budgets] + ([f"chains of {K} nodes"] if chain else []))
        trees, chains = {}, {}
        for T in self.temperatures:
            rows, anchors = self._rows_at(T), self.anchors(T, K)
            with Heartbeat(f"analytic tau: scoring {what} at T={T:g}"):
                measured = expected_block_lengths(drafter, self.target, rows, layers, anchors, drafts, T)
            for (shape, budget), per_row in measured.items():
                (chains if shape == "chain" else trees)[(budget, T)] = per_row
        return trees, chains

    @staticmethod
    def attach_chain(table: list[dict], measured: dict, reference: dict | None = None,
                     reference_label: str = "warm_start") -> None:
        """Add ``row["analytic_chain"] = {"T": {tau, ci95, anchors, nodes[, vs_<reference_label>]}}`` to
        every row of one drafter's table (the chain has K nodes whatever the row's budget), from
        :meth:`measure_chain`; the paired difference against ``reference`` (another drafter's
        :meth:`measure_chain`) where it was measured at the same anchors."""
        from exittrain.heldout.measures import paired_difference, summary

        cells = {}
        for (K, T), per_row in measured.items():
            stats = summary(per_row)
            cell = {"tau": stats["mean"], "ci95": stats["ci95"], "anchors": stats["anchors"], "nodes": K}
            if reference is not None and (K, T) in reference:
                pair = paired_difference(per_row, reference[(K, T)])
                if pair is not None:
                    cell[f"vs_{reference_label}"] = pair
            cells[f"{T:g}"] = cell
        for row in table:
            row.setdefault("analytic_chain", {}).update({T: dict(cell) for T, cell in cells.items()})

    @staticmethod
    def attach(table: list[dict], measured: dict, reference: dict | None = None,
               reference_label: str = "warm_start") -> None:
        """Add ``row["analytic"] = {"T": {tau, ci95, anchors[, vs_<reference_label>]}}`` to every table
        row of a measured budget; the paired difference against ``reference`` (another drafter's
        :meth:`measure`) where it was measured at the same anchors."""
        from exittrain.heldout.measures import paired_difference, summary

        for row in table:
            for (budget, T), per_row in measured.items():
                if row["budget"] != budget:
                    continue
                stats = summary(per_row)
                cell = {"tau": stats["mean"], "ci95": stats["ci95"], "anchors": stats["anchors"]}
                if reference is not None and (budget, T) in reference:
                    pair = paired_difference(per_row, reference[(budget, T)])
                    if pair is not None:
                        cell[f"vs_{reference_label}"] = pair
                row.setdefault("analytic", {})[f"{T:g}"] = cell


def held_out_law(target, prompts: Sequence[Sequence[int]], analytic: tuple[Sequence[float], int], *,
                 max_new_tokens: int, seed: int) -> HeldOutLaw | None:
    """The :class:`HeldOutLaw` of ``analytic`` (the checked ``(eval.analytic_temperatures,
    eval.analytic_anchors)``) on ``prompts``, or None when no temperature is set: the analytic tau
    beside the decoded tau of ``fit``'s and ``eval``'s tables."""
    temperatures, anchors = analytic
    if not temperatures:
        return None
    return HeldOutLaw(target, prompts, temperatures, anchors_per_answer=anchors, max_new_tokens=max_new_tokens,
                      seed=seed)


def format_differences(table: list[dict], reference_label: str = "warm_start") -> list[str]:
    """One line per table row and temperature with a paired difference against ``reference_label``, then
    one per drafter and temperature for the chain (:meth:`HeldOutLaw.attach_chain`)."""
    from exittrain.tables import paired_cell

    lines, chain_lines = [], {}
    for row in table:
        label = row["label"] or "-"
        for T, cell in row.get("analytic", {}).items():
            pair = cell.get(f"vs_{reference_label}")
            if pair is not None:
                lines.append(f"{label} - {reference_label}, expected tau at B={row['budget']} T={T}: "
                             f"{paired_cell(pair)} ({cell['anchors']} anchors, paired)")
        for T, cell in row.get("analytic_chain", {}).items():
            pair = cell.get(f"vs_{reference_label}")
            if pair is not None:  # every row of a drafter carries its chain: one line per drafter and T
                chain_lines[(label, T)] = (f"{label} - {reference_label}, expected chain tau at K={cell['nodes']} "
                                           f"T={T}: {paired_cell(pair)} ({cell['anchors']} anchors, paired)")
    return lines + list(chain_lines.values())
