"""One causal target pass per held-out sequence, shared by every measure that reads it.

The held-out tracks each need the target's causal pass over a prompt and its answer: the fp32
features the drafter reads and the K/V that a scored tree attends to. The walked tree and chain
tracks (:mod:`exittrain.heldout.round_walk`) of every drafter walk the same answers (the greedy
ones and the target's samples at each temperature), so a :class:`SequencePasses` keeps the passes
it ran, keyed by the sequence's tokens (not its tensor: each walk builds its own) and the layers.
The answers at each temperature continue the same prompts, and a prompt is most of its row: a row's
pass continues the kept pass over its prompt instead of running it again.

The evaluator creates one for its target and drops it with itself
(:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`); nothing is kept at module level.

Limits: the target must not change while the object lives (it is frozen while anything is
measured). A pass holds about 2 x layers x T x KV width floats and the features (12 MB for 250
tokens of SmolLM2-135M; about 50 MB for an 8B target in bf16), hence two bounds: at most ``kept``
passes and ``kept_bytes`` bytes, so that a large target's passes cannot fill the GPU the drafter
trains on. The least recently used goes first; the newest pass is always kept.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

__all__ = ["KEPT", "KEPT_BYTES", "SequencePasses"]

KEPT = 96  # passes kept: fit's table walks 32 answers (16 greedy, 16 sampled at T = 0.6) and passes over their prompts
KEPT_BYTES = 1 << 30  # 1 GiB: all of fit's passes on SmolLM2-135M (about 0.6 GB); some 20 of an 8B target's


def pass_bytes(prefix) -> int:
    """The bytes a kept pass holds: its keys, values and features."""
    kv = sum(k.nbytes + v.nbytes for k, v in prefix.kv)
    return kv + (0 if prefix.features is None else prefix.features.nbytes)


class SequencePasses:
    """The kept causal passes of ``target`` (see the module): :meth:`prefix` runs a pass once per token
    sequence and layers, within ``kept`` passes and ``kept_bytes`` bytes (least recently used first)."""

    def __init__(self, target, *, kept: int = KEPT, kept_bytes: int = KEPT_BYTES) -> None:
        if not isinstance(kept, int) or isinstance(kept, bool) or kept < 1:
            raise ValueError(f"kept={kept!r}: keep at least one pass (an integer >= 1)")
        self.target, self.kept, self.kept_bytes = target, kept, kept_bytes
        # (tokens, layers) -> (SequencePrefix, bytes)
        self._passes: OrderedDict[tuple, tuple[object, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._passes)

    @property
    def nbytes(self) -> int:
        """The bytes the kept passes hold."""
        return sum(size for _, size in self._passes.values())

    def keys(self) -> list[tuple]:
        """``(tokens, layers)`` of the kept passes, least recently used first."""
        return list(self._passes)

    def clear(self) -> None:
        """Drop every kept pass."""
        self._passes.clear()

    def _longest_kept_prefix(self, tokens: tuple, layers: tuple | None):
        """The kept pass over the longest proper prefix of ``tokens`` (same layers), or None."""
        best = None
        for (kept, kept_layers), (prefix, _) in self._passes.items():
            if kept_layers == layers and len(kept) < len(tokens) \
                    and (best is None or len(kept) > best.input_ids.shape[1]) and tokens[: len(kept)] == kept:
                best = prefix
        return best

    def prefix(self, ids_T: torch.Tensor, layers: Sequence[int] | None, shared: int = 0):
        """The :class:`~exittrain.models.target_scoring.SequencePrefix` of ``ids_T[None]`` (T,) with the
        fp32 features of ``layers`` (None: no features), computed once per token sequence and layers.

        ``shared``: how many first tokens other sequences share (the prompt of an answer). Their pass is
        kept too, and a new sequence runs only what follows the longest kept pass over its first tokens
        (:meth:`~exittrain.models.target_scoring.TreeScoring.sequence_prefix` with ``past``): the
        answers to one prompt at every temperature pay for the prompt once."""
        tokens, key_layers = tuple(ids_T.tolist()), None if layers is None else tuple(layers)
        key = (tokens, key_layers)
        if key in self._passes:
            self._passes.move_to_end(key)
            return self._passes[key][0]
        past = self._longest_kept_prefix(tokens, key_layers)
        if 0 < shared < len(tokens) and (past is None or past.input_ids.shape[1] < shared):
            past = self.prefix(ids_T[:shared], layers)
        prefix = self.target.sequence_prefix(ids_T[None].to(self.target.device),
                                             None if layers is None else list(layers), past=past)
        if prefix.features is not None:
            prefix.features = prefix.features.float()
        self._passes[key] = (prefix, pass_bytes(prefix))
        held = self.nbytes
        while len(self._passes) > 1 and (len(self._passes) > self.kept or held > self.kept_bytes):
            held -= self._passes.popitem(last=False)[1][1]
        return prefix
