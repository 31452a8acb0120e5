"""One causal target pass per held-out sequence, shared by every measure that reads it.

The held-out measures each need the target's causal pass over a prompt and its answer: the K/V that
tree scoring attends to and the fp32 features the drafter reads. The expected tau scores every
drafter, budget, temperature and tree shape on the same sampled answers; the walked tree and chain
tracks (:mod:`exittrain.heldout.round_walk`) of every drafter walk the same greedy answers. On a
small target the pass over a 250-token sequence costs about as much as scoring all of its trees,
so :func:`row_prefix` keeps the last :data:`KEPT` passes, keyed by the sequence's tokens (not its
tensor: each walk builds its own), the layers and the target object. The answers at each temperature
continue the same prompts, and a prompt is most of its row: a row's pass continues the kept pass over
its prompt instead of running it again.

Limits: the target must not change between calls (it is frozen while anything is measured). A
pass holds about 2 x layers x T x KV width floats and the features (12 MB for 250 tokens of
SmolLM2-135M; about 50 MB for an 8B target in bf16), hence two bounds: at most :data:`KEPT` passes
and :data:`KEPT_BYTES` bytes, so that a large target's passes cannot fill the GPU the drafter trains
on. The least recently used goes first; the newest pass is always kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["KEPT", "KEPT_BYTES", "row_prefix"]

KEPT = 96  # passes kept: fit's table reads 48 rows (16 walked answers, 16 sampled at each of two
# temperatures) and up to two passes over each of their 16 prompts
KEPT_BYTES = 2 << 30  # 2 GiB: all of fit's passes on SmolLM2-135M (about 1 GB); some 40 of an 8B target's

# (id(target), tokens, layers) -> (target, SequencePrefix, bytes); holding the target keeps its id unique
_PASSES: OrderedDict[tuple, tuple[object, object, int]] = OrderedDict()


def _nbytes(prefix) -> int:
    """The bytes a kept pass holds: its keys, values and features."""
    kv = sum(k.nbytes + v.nbytes for k, v in prefix.kv)
    return kv + (0 if prefix.features is None else prefix.features.nbytes)


def _kept(target, tokens: tuple, layers: tuple | None):
    key = (id(target), tokens, layers)  # an id held in _PASSES is its target's alone
    if key not in _PASSES:
        return None
    _PASSES.move_to_end(key)
    return _PASSES[key][1]


def _longest_kept_prefix(target, tokens: tuple, layers: tuple | None):
    """The kept pass over the longest proper prefix of ``tokens`` (same target and layers), or None."""
    best = None
    for (_, kept, kept_layers), (kept_target, prefix, _) in _PASSES.items():
        if kept_target is target and kept_layers == layers and len(kept) < len(tokens) \
                and (best is None or len(kept) > best.input_ids.shape[1]) and tokens[: len(kept)] == kept:
            best = prefix
    return best


def row_prefix(target, ids_T: torch.Tensor, layers: Sequence[int] | None, shared: int = 0):
    """The :class:`~exittrain.models.target_scoring.SequencePrefix` of ``ids_T[None]`` (T,) with the
    fp32 features of ``layers`` (None: no features), computed once per token sequence, layers and target.

    ``shared``: how many first tokens other sequences share (the prompt of an answer). Their pass is
    kept too, and a new sequence runs only what follows the longest kept pass over its first tokens
    (:meth:`~exittrain.models.target_scoring.TreeScoring.sequence_prefix` with ``past``): the
    answers to one prompt at every temperature pay for the prompt once."""
    tokens, key_layers = tuple(ids_T.tolist()), None if layers is None else tuple(layers)
    hit = _kept(target, tokens, key_layers)
    if hit is not None:
        return hit
    past = _longest_kept_prefix(target, tokens, key_layers)
    if 0 < shared < len(tokens) and (past is None or past.input_ids.shape[1] < shared):
        past = row_prefix(target, ids_T[:shared], layers)
    prefix = target.sequence_prefix(ids_T[None].to(target.device), None if layers is None else list(layers),
                                    past=past)
    if prefix.features is not None:
        prefix.features = prefix.features.float()
    _PASSES[(id(target), tokens, key_layers)] = (target, prefix, _nbytes(prefix))
    held = sum(entry[2] for entry in _PASSES.values())
    while len(_PASSES) > 1 and (len(_PASSES) > KEPT or held > KEPT_BYTES):
        held -= _PASSES.popitem(last=False)[1][2]
    return prefix
