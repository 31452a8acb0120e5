"""The cost of a decoding round on this host, for ``decode: auto`` (:mod:`exittrain.cpu_decode.auto_settings`).

:class:`HostTimer` times real decodes of a setting; :func:`round_costs` turns a timer's answer
into the cost of a drafted round and of a copy-led one. Timings are this host's, now.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from exittrain.cpu_decode.fast_products import FastCpuDecoder
from exittrain.decoding.speculative import COPY_LED, DRAFTED, autoregressive_generate, rounds_by_kind

__all__ = ["HostTimer", "round_costs"]


class HostTimer:
    """The real timer. ``timer(setting)`` decodes each of ``prompts`` for ``tokens`` tokens at that
    setting and returns ``(ms of a drafted round, ms of a copy-led round)``, each the mean over
    every such round of the decodes but their first (None for a kind that did not occur);
    ``timer(None)`` returns the mean ms of a greedy decode's step over the same prompts.

    The mean, not the median: tokens per second is total tokens over total time, so a slow round
    counts at its cost. What would bias it is one-off work, so each setting first decodes a few
    tokens untimed (the LM head's layout choice for new row counts,
    :mod:`exittrain.cpu_decode.row_layouts`, is timed then), and each decode's first round is left out.
    Several prompts, a few dozen tokens, and contexts that reach into the answers put the rounds
    at the contexts decoding sees: timed on one prompt's first 16 tokens, rounds came out 20%
    cheaper than in the decode they predicted (a round over 600 tokens of context costs 13-34 ms
    more than over 150, on a 2-core EPYC).
    """

    WARM_UP_TOKENS = 4

    def __init__(self, target, drafter, prompts: Sequence[Sequence[int]], vocabs: dict[int, torch.Tensor | None],
                 tokens: int, verifier: str = "tev"):
        self.target, self.drafter, self.prompts = target, drafter, [list(p) for p in prompts]
        self.vocabs, self.tokens, self.verifier = vocabs, tokens, verifier

    def __call__(self, setting):  # a decode_settings.DecodeSetting, or None
        if setting is None:
            steps = [r.times for p in self.prompts for r in autoregressive_generate(self.target, p, self.tokens).rounds
                     if "target" in r.times]  # the last token needs no forward
            if not steps:
                raise ValueError(f"the probe prompts gave no greedy step in {self.tokens} tokens: raise timed_tokens")
            return 1e3 * statistics.fmean(sum(t.values()) for t in steps)
        decoder = FastCpuDecoder(self.target, self.drafter, budget=setting.budget, verifier=self.verifier,
                                 copy_tail=setting.copy_tail, copy_lead=setting.copy_lead,
                                 draft_vocab=self.vocabs[setting.draft_vocab])
        decoder.generate(self.prompts[0], self.WARM_UP_TOKENS)
        rounds = [r for p in self.prompts for r in decoder.generate(p, self.tokens).rounds[1:]]
        if not rounds:
            raise ValueError(f"the probe prompts gave no timed round in {self.tokens} tokens: raise timed_tokens")

        kinds = rounds_by_kind(rounds)
        return tuple(kinds[kind]["ms"] if kind in kinds else None for kind in (DRAFTED, COPY_LED))


def round_costs(timed, twin) -> tuple[float, float]:
    """``(drafted ms, copy-led ms)`` from a timer's answer: one number is every round's cost; a
    pair leaves None where the timed decodes had no such round, filled from ``twin``, the drafting
    setting's round ms (a copy-led round skips its draft, so it costs at most that, roughly)."""
    if isinstance(timed, (int, float)):
        return float(timed), float(timed)
    drafted, led = timed
    drafted = twin if drafted is None else drafted
    return drafted, drafted if led is None else led
