"""The drafter's view of the committed context while decoding: a K/V cache, or the full re-read.

Shape legend: C committed positions the drafter sees (the positions before the root), F target
feature width, N positions committed in one round (root + accepted path), K drafter horizon,
V vocabulary, W the drafter's context window.

A round's drafter needs, for every committed position before the root, the target features of
that position (docs/algorithm.md section 7). Two interchangeable implementations:

- :class:`CachedDrafterContext` (the fast path, as DFlash decodes): each round projects only the
  positions it just committed into every drafter layer's keys and values
  (``drafter.project_context``, at their absolute positions) and appends them to a
  ``ContextKV``; the block is drafted over that cache (``drafter.draft_block``). The drafter's
  cost per round then no longer grows with the context. With a context window W the cache keeps
  only the last W positions, which is all ``draft_block`` reads.
- :class:`FullDrafterContext` (the slow reference twin, the decoder's behaviour before the
  cache): it keeps the raw features and re-reads them all every round with ``drafter(...)``,
  which re-projects the whole context (the last W positions with a window).

Both keep the committed token ids for the drafter's copy branch, and pass ``vocab_ids``, a draft
vocabulary (:mod:`exittrain.cpu_decode.draft_vocab`) or None, to the drafter's head. The two give
the same draft logits up to float rounding: attention scores depend only on position
differences, and the full re-read places the context at 0..C-1 where the cache keeps absolute
positions. The decoder tests compare them.
"""

from __future__ import annotations

import torch

__all__ = ["CachedDrafterContext", "FullDrafterContext", "drafter_context"]


class FullDrafterContext:
    """Reference twin: the raw features of every committed position, re-projected each round.

    ``features_1CF`` are the features of the first committed positions (a prefill's), and
    ``ids_1C`` their token ids; :meth:`extend` appends a round's committed positions.
    """

    def __init__(self, drafter, features_1CF: torch.Tensor, ids_1C: torch.Tensor, vocab_ids=None):
        self.drafter = drafter
        self.window = drafter.config.context_window
        self.vocab_ids = vocab_ids
        self.features = features_1CF
        self.ids = ids_1C
        self._trim()

    @property
    def length(self) -> int:
        """Positions committed so far: the position of the next root."""
        return self.ids.shape[1]

    def _trim(self) -> None:
        # keep at most W features: the drafter reads no more, and the copy of a growing tensor
        # every round would be the O(C) cost this path already pays once in the projection
        if self.window is not None and self.features.shape[1] > self.window:
            self.features = self.features[:, -self.window :]

    def extend(self, features_1NF: torch.Tensor, ids_1N: torch.Tensor) -> None:
        """Append the features and ids of the N positions a round committed (root first)."""
        self.features = torch.cat([self.features, features_1NF], dim=1)
        self.ids = torch.cat([self.ids, ids_1N], dim=1)
        self._trim()

    def draft(self, root_1: torch.Tensor) -> torch.Tensor:
        """Draft logits (1, K, V) for the root that follows the committed context."""
        return self.drafter(self.features, root_1, context_ids=self.ids, vocab_ids=self.vocab_ids)


class CachedDrafterContext:
    """Fast path: every drafter layer's K/V of the committed positions, grown by each round's.

    Same interface as :class:`FullDrafterContext`. Positions are absolute: the first committed
    position is 0, so the root of the next round sits at :attr:`length`.
    """

    def __init__(self, drafter, features_1CF: torch.Tensor, ids_1C: torch.Tensor, vocab_ids=None):
        self.drafter = drafter
        self.window = drafter.config.context_window
        self.vocab_ids = vocab_ids
        self.ids = ids_1C
        C = features_1CF.shape[1]
        start = C - self.window if self.window is not None and C > self.window else 0
        # only the positions the window can still reach are projected
        self.kv = self._project(features_1CF[:, start:], start)

    @property
    def length(self) -> int:
        return self.ids.shape[1]

    def _project(self, features_1NF: torch.Tensor, start: int):
        positions = torch.arange(start, start + features_1NF.shape[1], device=features_1NF.device).unsqueeze(0)
        return self.drafter.project_context(features_1NF, positions)

    def extend(self, features_1NF: torch.Tensor, ids_1N: torch.Tensor) -> None:
        new = self._project(features_1NF, self.length)
        self.kv = self.kv.extend(new)
        if self.window is not None:
            self.kv = self.kv.last(self.window)  # views; the next extend copies only W positions
        self.ids = torch.cat([self.ids, ids_1N], dim=1)

    def draft(self, root_1: torch.Tensor) -> torch.Tensor:
        position = torch.full((1,), self.length, dtype=torch.long, device=root_1.device)
        return self.drafter.draft_block(root_1, position, self.kv, context_ids=self.ids, vocab_ids=self.vocab_ids)


def drafter_context(drafter, features_1CF: torch.Tensor, ids_1C: torch.Tensor, *, cached: bool, vocab_ids=None):
    """The cached context (``cached=True``) or its full re-read reference twin."""
    cls = CachedDrafterContext if cached else FullDrafterContext
    return cls(drafter, features_1CF, ids_1C, vocab_ids)
