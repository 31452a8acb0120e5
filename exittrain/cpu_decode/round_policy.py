"""Which rounds skip the drafter: copy-led rounds and steps after a miss.

A plain :class:`~exittrain.decoding.SpeculativeDecoder` drafts every round. On a CPU the drafter's
pass and the tree's rows are a large part of a round, so two kinds of round leave the drafter out
where it is not expected to pay (``decode: auto`` measures whether they do on this host,
:mod:`exittrain.cpu_decode.auto_settings`):

- a **copy-led round** (``copy_lead``): where the root's last ``copy_lead`` tokens occurred
  earlier in the committed text, the target verifies the tokens that followed that occurrence,
  up to ``K + copy_tail`` of them, as one chain (:func:`~exittrain.core.copy_tail.copy_only_tree`),
  as prompt-lookup decoding does but further;
- a **step** (``miss_steps``): after a drafted round that accepted no draft token, the target
  scores the root alone (an empty tree, one row), as greedy decoding's step does.

:class:`RoundPolicyDecoder` chooses them through the plain decoder's one hook,
``SpeculativeDecoder._round_without_drafter``, from the committed text and the past rounds only,
never from the current round's target scores: each tree is fixed before the target scores it, so
every verifier stays exact (docs/algorithm.md section 2.5). Its products are the plain decoder's;
:class:`~exittrain.cpu_decode.fast_products.FastCpuDecoder` adds the CPU's faster ones.
"""

from __future__ import annotations

import torch

from exittrain.core import DraftTree
from exittrain.core.copy_tail import copy_chain, copy_only_tree
from exittrain.decoding.speculative import COPY_LED, DRAFTED, STEP, RoundStats, SpeculativeDecoder

__all__ = ["RoundPolicyDecoder", "steps_due"]


def steps_due(rounds: list[RoundStats], miss_steps: int) -> bool:
    """Whether the next round is a step: the rounds since the last drafted round that accepted no
    draft token are all steps, fewer than ``miss_steps`` of them. A copy-led round or a drafted
    round that accepted something ends the steps (there is no miss to step after)."""
    taken = 0
    for r in reversed(rounds):
        if r.kind != STEP:
            return r.kind == DRAFTED and r.accept_length == 0 and taken < miss_steps
        taken += 1
    return False  # only steps so far, or no round yet: no miss opened them


class RoundPolicyDecoder(SpeculativeDecoder):
    """:class:`~exittrain.decoding.SpeculativeDecoder` with copy-led rounds and steps after a miss.

    The arguments are the plain decoder's, and:

    ``copy_lead`` (default 0, off) makes a round copy-led when the root's last ``copy_lead``
    tokens occurred earlier in the committed text: the drafter is skipped, and the target verifies
    the tokens that followed that occurrence, up to :attr:`lead_length` (``K + copy_tail``) of
    them, as one chain. Other rounds draft as usual. A copy-led round costs one target forward,
    where a drafted round adds the drafter's pass; the decision depends on the committed text
    only, so decoding stays exact. The drafter's context still receives every committed position.

    ``miss_steps`` (default 0, off): after a drafted round that accepted no draft token, the next
    up to ``miss_steps`` rounds are steps: the target scores the root alone (an empty tree, one
    row), the drafter is skipped, and the round yields the bonus token (:func:`steps_due`). A
    copy-led round, when due, comes first and ends the steps. Why: a round that accepted nothing
    tends to be followed by more such (the text is where the drafter goes wrong), and on a CPU a
    round's tree costs 1.1-2.7 times a one-row step (``python -m exittrain bench rows``), so there
    a step yields the same token for less. The choice reads past rounds only, never the current
    round's target scores, so every verifier stays exact.

    With both 0 it decodes exactly as the plain decoder, round for round.
    """

    def __init__(self, target, drafter, *args, copy_lead: int = 0, miss_steps: int = 0, **kwargs):
        super().__init__(target, drafter, *args, **kwargs)
        for key, value in (("copy_lead", copy_lead), ("miss_steps", miss_steps)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{key} must be an integer >= 0 (0 turns it off), got {value!r}")
        self.copy_lead, self.miss_steps = copy_lead, miss_steps

    @property
    def lead_length(self) -> int:
        """The most tokens a copy-led round verifies: the drafter's K plus the copy tail."""
        return int(self.drafter.config.num_draft_tokens) + self.copy_tail

    def _most_nodes(self) -> int:
        return max(super()._most_nodes(), self.lead_length if self.copy_lead else 0)

    def _lead_tree(self, context, root_1: torch.Tensor) -> DraftTree | None:
        """The copy-led round's tree, or None when the root's last ``copy_lead`` tokens have no
        earlier occurrence (the round drafts then)."""
        ids_T = torch.cat([context.ids[0], root_1.reshape(1)])
        chain = copy_chain(ids_T, [self.copy_lead], self.lead_length)
        return copy_only_tree(chain, root_1.device) if chain else None

    def _round_without_drafter(self, context, root_1: torch.Tensor, rounds: list[RoundStats]):
        """A copy-led round when one is due, else a step when one is due, else None (the round drafts)."""
        if self.copy_lead:
            tree = self._lead_tree(context, root_1)
            if tree is not None:
                return COPY_LED, tree
        if self.miss_steps and steps_due(rounds, self.miss_steps):
            return STEP, DraftTree.empty(device=self.target.device)
        return None
