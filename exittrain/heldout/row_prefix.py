"""One causal target pass per held-out sequence, shared by every measure that reads it.

The held-out measures each need the target's causal pass over a prompt and its answer: the K/V that
tree scoring attends to and the fp32 features the drafter reads. The expected tau scores every
drafter, budget, temperature and tree shape on the same sampled answers; the walked tree and chain
tracks (:mod:`exittrain.heldout.round_walk`) of every drafter walk the same greedy answers. On a
small target the pass over a 250-token sequence costs about as much as scoring all of its trees,
so :func:`row_prefix` keeps the last :data:`KEPT` passes, keyed by the sequence's tokens (not its
tensor: each walk builds its own), the layers and the target object.

Limits: the target must not change between calls (it is frozen while anything is measured). A
pass holds about 2 x layers x T x KV width floats (12 MB for 250 tokens of SmolLM2-135M; a few GB
for an 8B target on a GPU at :data:`KEPT`), hence the bound; the least recently used goes first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["KEPT", "row_prefix"]

KEPT = 64  # passes kept: fit's table reads 48 (16 walked answers, 16 sampled at each of two temperatures)

# (id(target), tokens, layers) -> (target, SequencePrefix); holding the target keeps its id unique
_PASSES: OrderedDict[tuple, tuple[object, object]] = OrderedDict()


def row_prefix(target, ids_T: torch.Tensor, layers: Sequence[int] | None):
    """The :class:`~exittrain.models.target_scoring.SequencePrefix` of ``ids_T[None]`` (T,) with the
    fp32 features of ``layers`` (None: no features), computed once per token sequence, layers and target."""
    key = (id(target), tuple(ids_T.tolist()), None if layers is None else tuple(layers))
    hit = _PASSES.get(key)
    if hit is not None and hit[0] is target:
        _PASSES.move_to_end(key)
        return hit[1]
    prefix = target.sequence_prefix(ids_T[None].to(target.device), None if layers is None else list(layers))
    if prefix.features is not None:
        prefix.features = prefix.features.float()
    _PASSES[key] = (target, prefix)
    if len(_PASSES) > KEPT:
        _PASSES.popitem(last=False)
    return prefix
