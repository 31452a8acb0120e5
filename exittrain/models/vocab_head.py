"""The drafter's LM head over a draft vocabulary (:mod:`exittrain.cpu_decode.draft_vocab`).

Shape legend: N blocks, K drafter positions, H hidden width, V the target's vocabulary, S the
draft vocabulary's size.

:func:`vocab_logits` gives (N, K, V) logits that equal the full head's on the S draft tokens and
are -inf elsewhere. The fast path multiplies by the S rows of the head's weight only (gathered
once per weight and vocabulary, then kept), so the head reads S / V of the weight;
:func:`vocab_logits_reference` computes the full head and masks it, the twin the tests compare
against, and the path for a head whose weight is not in place (an accelerate hook).
"""

from __future__ import annotations

import torch

from exittrain.models.head_product import head_product

__all__ = ["vocab_logits", "vocab_logits_reference"]

# (weight storage, weight version, ids storage, S, device) -> the (S, H) gathered rows; one entry:
# a decoder uses one target and one vocabulary, and a stale entry would hold S x H floats
_ROWS: dict[tuple, torch.Tensor] = {}


def _vocab_rows(weight_VH: torch.Tensor, ids_S: torch.Tensor) -> torch.Tensor:
    key = (weight_VH.data_ptr(), weight_VH._version, ids_S.data_ptr(), ids_S.numel(), weight_VH.device)
    rows = _ROWS.get(key)
    if rows is None:
        _ROWS.clear()
        rows = _ROWS[key] = weight_VH.detach()[ids_S.to(weight_VH.device)].contiguous()
    return rows


def _scatter(sub_NKS: torch.Tensor, ids_S: torch.Tensor, vocab_size: int) -> torch.Tensor:
    full = sub_NKS.new_full((*sub_NKS.shape[:-1], vocab_size), float("-inf"))
    return full.scatter_(-1, ids_S.to(sub_NKS.device).expand(*sub_NKS.shape[:-1], -1), sub_NKS)


def vocab_logits(hidden_NKH: torch.Tensor, weight_VH: torch.Tensor, ids_S: torch.Tensor) -> torch.Tensor:
    """(N, K, V) head logits on the draft tokens ``ids_S`` (S,) long, -inf on every other token."""
    sub_NKS = head_product(hidden_NKH, _vocab_rows(weight_VH, ids_S))
    return _scatter(sub_NKS, ids_S, weight_VH.shape[0])


def vocab_logits_reference(logits_NKV: torch.Tensor, ids_S: torch.Tensor) -> torch.Tensor:
    """The full head's ``logits_NKV`` with every token outside ``ids_S`` set to -inf."""
    keep = torch.zeros(logits_NKV.shape[-1], dtype=torch.bool, device=logits_NKV.device)
    keep[ids_S.to(logits_NKV.device)] = True
    return logits_NKV.masked_fill(~keep, float("-inf"))
