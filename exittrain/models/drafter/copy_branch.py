"""The drafter's n-gram copy branch (docs/algorithm.md section 7.4; an exittrain extension that the DFlash
format has no place for, so the export drops it).

The root's last n tokens (n in ``copy_ngrams``, longest first) are looked up in the context ids,
and the tokens that followed their latest occurrence are mixed into ``q_k`` with a gate
``g = sigmoid(Linear(H -> len(copy_ngrams))(h_k))`` read at the n that matched
(:mod:`exittrain.core.ngram_copy`). The gate's weights start at 0 and its bias at
``logit(copy_gate_init)``. With the branch on, the drafter's outputs are the mixed
log-probabilities, which every consumer reads as logits (they are normalised).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as hf_init

from exittrain.core.ngram_copy import mix_copy, ngram_lookup

__all__ = ["copy_logits", "copy_terms", "init_copy_gate"]


def init_copy_gate(gate: nn.Linear, gate_init: float) -> None:
    """Weights 0, bias ``logit(gate_init)``: the gate starts at ``gate_init`` whatever the state."""
    hf_init.zeros_(gate.weight)
    hf_init.constant_(gate.bias, math.log(gate_init / (1.0 - gate_init)))


def copy_terms(
    gate: nn.Linear, ngrams: list[int], hidden_NKH: torch.Tensor, ids_LT: torch.Tensor, anchors_LA: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(copy_ids (N, K) long, gate_logits (N, K))`` for the anchors ``anchors_LA`` (L, A) of
    ``ids_LT`` (L, T) (row n = l * A + a, negative ids = padding), given their pre-head states."""
    K = hidden_NKH.shape[1]
    copy_LAK, order_LA = ngram_lookup(ids_LT.to(hidden_NKH.device), anchors_LA, ngrams, K)
    gates_NKG = gate(hidden_NKH)  # one logit per n-gram length
    order_N11 = order_LA.reshape(-1, 1, 1).clamp_min(0).expand(-1, K, 1)
    return copy_LAK.reshape(-1, K), gates_NKG.gather(2, order_N11).squeeze(-1)


def copy_logits(logits_NKV: torch.Tensor, copy: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The copy-mixed log-probabilities (float32) of the head's ``logits_NKV``."""
    copy_ids, gate_logits = copy
    return mix_copy(torch.log_softmax(logits_NKV.float(), dim=-1), copy_ids, gate_logits.float())
