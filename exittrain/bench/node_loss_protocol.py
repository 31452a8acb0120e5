"""The registered contrasts of docs/experiments/2026-12-07-node-loss-served-drafters.md, as data.

Two primaries, each with its fixed sequence of secondaries (:func:`sequences`), read by
:func:`exittrain.bench.registered_rule.registered_readings` off ``bench exittrain --rule crossed``'s
measurements (:func:`totals`), and the protocol's transfer claim (:func:`transfer`). The protocol file
is the authority: this module states it for the code, and a test compares the two.

Arms (``bench exittrain`` names): C = :data:`C`, N = :data:`N`, E = :data:`E`, C5 = :data:`C5` (block CE
for N's CPU-seconds), S = :data:`S` (C at the drafter temperature the development split chose).
"""

from __future__ import annotations

from exittrain.bench.registered_rule import Contrast, evaluator_totals, vllm_totals

__all__ = ["C", "C5", "E", "N", "PROTOCOL", "S", "VLLM", "sequences", "totals", "transfer"]

PROTOCOL = "docs/experiments/2026-12-07-node-loss-served-drafters.md"
C, N, E = "control-soft-fresh", "nodeonly-flow-l1-fresh", "exittrain-soft-flow-l1-fresh"
C5, S = "control-soft-fresh-cpumatched", "sharpened-control-soft-fresh"
VLLM = "vllm"  # the shape of vLLM's own greedy acceptance in :func:`totals` (budget K, T = 0)
BUDGET = 16
# the margins: tokens a round at T = 0.6 (tree or chain), at T = 0, and for vLLM's acceptance
DELTA_T06, DELTA_T0, DELTA_VLLM = 0.05, 0.10, 0.03


def sequences(num_draft_tokens: int) -> list[list[Contrast]]:
    """P1 (N - C) and P2 (E - C) on the tree of 16 nodes at T = 0.6, each followed by its secondaries
    in the protocol's order: T = 0; X - S; X - C5; vLLM's acceptance X - C; the chain of K at T = 0."""
    K = int(num_draft_tokens)
    out = []
    for tag, arm in (("N", N), ("E", E)):
        out.append([
            Contrast(arm, C, ("ddtree", BUDGET, 0.6), DELTA_T06, f"{tag} - C"),
            Contrast(arm, C, ("ddtree", BUDGET, 0.0), DELTA_T0, f"{tag} - C, T = 0"),
            Contrast(arm, S, ("ddtree", BUDGET, 0.6), DELTA_T06, f"{tag} - S"),
            Contrast(arm, C5, ("ddtree", BUDGET, 0.6), DELTA_T06, f"{tag} - C5"),
            Contrast(arm, C, (VLLM, K, 0.0), DELTA_VLLM, f"{tag} - C, vLLM"),
            Contrast(arm, C, ("chain", K, 0.0), DELTA_T0, f"{tag} - C, chain"),
        ])
    return out


def totals(per_prompt: dict[str, dict], vllm: dict | None, num_draft_tokens: int) -> dict[str, dict]:
    """``{drafter: {setting: {prompt index: (tokens, rounds)}}}`` for the rule: each drafter's evaluator rows
    (``per_prompt``: ``{drafter: {setting: {prompt: row}}}``, :func:`~exittrain.bench.exittrain_arms.prompt_rows`
    of each measurement) and, with vLLM's block of the result, its per-prompt counts under ``(vllm, K, 0.0)``."""
    out = {name: evaluator_totals(rows) for name, rows in per_prompt.items()}
    for name, measured in ((vllm or {}).get("drafters") or {}).items():
        out.setdefault(name, {})[(VLLM, int(num_draft_tokens), 0.0)] = vllm_totals(measured["per_prompt"])
    return out


def transfer(readings: list[dict]) -> dict[str, dict]:
    """Per primary arm (``N``, ``E``): whether the protocol's claim of transfer to serving holds: vLLM's
    secondary confirmed (read, not descriptive) and its estimate at least half the chain's estimate (the
    chain secondary's estimate, read or not). ``claimed`` is False, with the reason, otherwise."""
    out = {}
    for tag in ("N", "E"):
        by = {r["label"]: r for r in readings if r["label"].startswith(f"{tag} - ")}
        served, chain = by.get(f"{tag} - C, vLLM"), by.get(f"{tag} - C, chain")
        if served is None or served.get("estimate") is None or chain is None or chain.get("estimate") is None:
            out[tag] = {"claimed": False, "why": "vLLM's or the chain's contrast was not measured"}
        elif served["reading"] != "confirmed":
            out[tag] = {"claimed": False, "why": f"vLLM's contrast reads {served['reading']}"}
        else:
            half = chain["estimate"] / 2
            out[tag] = {"claimed": served["estimate"] >= half, "vllm": served["estimate"], "chain": chain["estimate"],
                        "why": f"vLLM's gain {served['estimate']:+.3f} against half the chain's {half:+.3f}"}
    return out
