"""The drafter's LM head over a draft vocabulary (:mod:`exittrain.cpu_decode.draft_vocab`).

Shape legend: N blocks, K drafter positions, H hidden width, V the target's vocabulary, S the
draft vocabulary's size.

:meth:`VocabRows.logits` gives (N, K, V) logits that equal the full head's on the S draft tokens
and are -inf elsewhere. It multiplies by the S rows of the head's weight only, so the head reads
S / V of the weight. The rows are gathered once per weight and vocabulary and kept in the
:class:`VocabRows` object, which its owner creates and drops (each
:class:`~exittrain.models.drafter.block_drafter.BlockDrafter` holds one for its head); nothing is
kept at module level. :func:`vocab_logits_reference` computes the full head and masks it, the twin
the tests compare against, and the path for a head whose weight is not in place (an accelerate hook).
"""

from __future__ import annotations

import torch

from exittrain.models.head_product import HeadProduct, apply_head

__all__ = ["VocabRows", "vocab_logits_reference"]


class VocabRows:
    """The (S, H) rows of an LM head's weight for one draft vocabulary, gathered on first use and
    kept until the weight (an in-place write bumps its version), the vocabulary or the device
    changes: one entry, since a decoder uses one target and one vocabulary, and a stale entry would
    hold S x H floats. :meth:`clear` drops it; so does dropping the object."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._rows: torch.Tensor | None = None

    def rows(self, weight_VH: torch.Tensor, ids_S: torch.Tensor) -> torch.Tensor:
        """The (S, H) rows ``weight_VH[ids_S]``, contiguous, on the weight's device."""
        key = (weight_VH.data_ptr(), weight_VH._version, ids_S.data_ptr(), ids_S.numel(), weight_VH.device)
        if key != self._key or self._rows is None:
            self._rows = weight_VH.detach()[ids_S.to(weight_VH.device)].contiguous()
            self._key = key
        return self._rows

    def clear(self) -> None:
        """Drop the kept rows."""
        self._key = self._rows = None

    def logits(self, hidden_NKH: torch.Tensor, weight_VH: torch.Tensor, ids_S: torch.Tensor,
               head_product: HeadProduct | None = None) -> torch.Tensor:
        """(N, K, V) head logits on the draft tokens ``ids_S`` (S,) long, -inf on every other token;
        ``head_product`` computes the rows' product (None: ``F.linear``; see
        :mod:`exittrain.models.head_product`)."""
        sub_NKS = apply_head(hidden_NKH, self.rows(weight_VH, ids_S), head_product)
        full = sub_NKS.new_full((*sub_NKS.shape[:-1], weight_VH.shape[0]), float("-inf"))
        return full.scatter_(-1, ids_S.to(sub_NKS.device).expand(*sub_NKS.shape[:-1], -1), sub_NKS)


def vocab_logits_reference(logits_NKV: torch.Tensor, ids_S: torch.Tensor) -> torch.Tensor:
    """The full head's ``logits_NKV`` with every token outside ``ids_S`` set to -inf."""
    keep = torch.zeros(logits_NKV.shape[-1], dtype=torch.bool, device=logits_NKV.device)
    keep[ids_S.to(logits_NKV.device)] = True
    return logits_NKV.masked_fill(~keep, float("-inf"))
