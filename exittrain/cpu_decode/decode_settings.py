"""The settings ``decode: auto`` chooses among (:mod:`exittrain.cpu_decode.auto_settings`): one
:class:`DecodeSetting` (budget, draft vocabulary, copy tail, copy lead, steps after a miss), the
defaults the probe tries, and :func:`candidate_settings`, every combination to probe. No timing and
no model here: what a setting is, not how fast it decodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_COPY_LEADS",
    "DEFAULT_COPY_TAILS",
    "DEFAULT_MISS_STEPS",
    "DEFAULT_VOCAB_SIZES",
    "GREEDY",
    "PROMPT_LOOKUP_TOKENS",
    "DecodeSetting",
    "candidate_settings",
]

# Hugging Face prompt lookup proposes 10 copied tokens (prompt_lookup_num_tokens in bench decode).
# The copy tail appends its tokens after the deepest tree node that already holds the copy, so
# a tail of 10 copies at least as far past the root as prompt lookup does.
PROMPT_LOOKUP_TOKENS = 10
DEFAULT_BUDGETS = (2, 4, 8, 16)
DEFAULT_VOCAB_SIZES = (0, 4096)
DEFAULT_COPY_TAILS = (0, PROMPT_LOOKUP_TOKENS)
# copy-led rounds (RoundPolicyDecoder(copy_lead=n), cpu_decode/round_policy.py) where the root's last 4 tokens occurred
# before: a match that long is mostly a restated span, where a 2-gram match is often chance
DEFAULT_COPY_LEADS = (0, 4)
# steps after a round that accepted nothing (RoundPolicyDecoder(miss_steps=n)); priced from the same
# walk and timings as their setting without steps, so they cost the probe no decode of their own
DEFAULT_MISS_STEPS = (0, 1, 2, 4)


@dataclass(frozen=True)
class DecodeSetting:
    """One decoding setting: ``budget`` draft nodes, a draft vocabulary of ``draft_vocab`` tokens
    (0: every token), a copy tail of ``copy_tail`` tokens (0: off), copy-led rounds on
    ``copy_lead``-gram matches (0: off), up to ``miss_steps`` one-token steps after a drafted
    round that accepted nothing (0: off). Budget 0 is :data:`GREEDY`: no drafter at all."""

    budget: int
    draft_vocab: int = 0
    copy_tail: int = 0
    copy_lead: int = 0
    miss_steps: int = 0

    @property
    def rounds(self) -> DecodeSetting:
        """The setting without steps: its drafted and copy-led rounds are this setting's, so it is
        what the probe scores per anchor and times."""
        return DecodeSetting(self.budget, self.draft_vocab, self.copy_tail, self.copy_lead)

    @property
    def label(self) -> str:
        if self.budget == 0:
            return "greedy, no drafter"
        parts = [f"B={self.budget}"]
        if self.draft_vocab:
            parts.append(f"draft vocab {self.draft_vocab}")
        if self.copy_tail:
            parts.append(f"copy tail {self.copy_tail}")
        if self.copy_lead:
            parts.append(f"copy lead {self.copy_lead}")
        if self.miss_steps:
            parts.append(f"miss steps {self.miss_steps}")
        return ", ".join(parts)


GREEDY = DecodeSetting(0)  # auto's fallback when no drafting setting is expected to beat greedy decoding


def candidate_settings(max_budget: int, vocab_size: int, *, has_token_counts: bool,
                       budgets: Sequence[int] = DEFAULT_BUDGETS, vocab_sizes: Sequence[int] = DEFAULT_VOCAB_SIZES,
                       copy_tails: Sequence[int] = DEFAULT_COPY_TAILS,
                       copy_leads: Sequence[int] = DEFAULT_COPY_LEADS,
                       miss_steps: Sequence[int] = DEFAULT_MISS_STEPS) -> list[DecodeSetting]:
    """Every (budget, draft vocabulary, copy tail, copy lead, miss steps) to probe.

    Budgets: those of ``budgets`` up to ``max_budget`` (the recipe's budget, the most the run is
    meant to spend a round), and ``max_budget`` itself, so the recipe's own setting is measured
    beside. Draft vocabularies: 0 (every token), and each positive size below the target's
    vocabulary and at least the budget, only when the drafter has token counts. Copy tails as
    given. Copy leads: 0 with every tail, a positive one only with a positive tail (a copy-led
    round verifies K + tail tokens: with a tail it copies further than prompt lookup's 10), so
    every copy-led setting has its drafting twin (the same with copy lead 0) among the candidates.
    Miss steps: each value with every other setting, 0 always among them.
    """
    for key, values in (("budgets", budgets), ("copy_tails", copy_tails), ("vocab_sizes", vocab_sizes),
                        ("copy_leads", copy_leads), ("miss_steps", miss_steps)):
        if any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
            raise ValueError(f"{key} must be integers >= 0, got {list(values)}")
    if not isinstance(max_budget, int) or isinstance(max_budget, bool) or max_budget < 1:
        raise ValueError(f"max_budget must be an integer >= 1 (the recipe's budget), got {max_budget!r}")
    chosen_budgets = sorted({b for b in budgets if 1 <= b <= max_budget} | {max_budget})
    sizes = ([0] + sorted({s for s in vocab_sizes if 0 < s < vocab_size})) if has_token_counts else [0]
    leads = sorted(set(copy_leads) | {0})
    steps = sorted(set(miss_steps) | {0})
    return [DecodeSetting(b, s, t, n, m) for b in chosen_budgets for s in sizes if s == 0 or s >= b
            for t in sorted(set(copy_tails)) for n in leads if n == 0 or t > 0 for m in steps]
