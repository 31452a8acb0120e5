"""Training-time scoring with the frozen target: sequence features, top-k log-probabilities, and
the target logits of many anchors' trees inside training sequences.

docs/algorithm.md section 3. :class:`TreeScoring` is mixed into
:class:`~exittrain.models.target_model.TargetModel`; it uses the wrapper's ``model``, ``device``,
:meth:`~exittrain.models.target_model.TargetModel.check_layers`, feature capture, additive masks,
id checks and :meth:`~exittrain.models.target_model.TargetModel.new_cache`. The layer-id and
tree-attention conventions, the shape legend and the limits (``score_trees`` returns
full-vocabulary logits) are stated in :mod:`exittrain.models.target_model`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exittrain.core import DraftTree
from exittrain.models.hf_cache import cache_kwargs

__all__ = ["SequencePrefix", "TreeScores", "TreeScoring"]


@dataclass
class TreeScores:
    """Result of :meth:`TargetModel.score_trees`.

    ``logits`` (L*A, B+1, V): target logits of every tree row, tree n = l * A + a.
    ``features`` (L, T, F) target features at the sequence positions, or None if not requested.
    """

    logits: torch.Tensor
    features: torch.Tensor | None = None


@dataclass
class SequencePrefix:
    """One causal pass over L sequences, kept for reuse (:meth:`TreeScoring.sequence_prefix`).

    ``input_ids`` (L, T): the sequences; ``kv``: per decoder layer the (keys, values) of every
    position; ``features`` (L, T, F) of ``layers`` (None without layers). ``score_trees(...,
    prefix=...)`` (exact mode) attends to these keys and values instead of running the pass again.
    """

    input_ids: torch.Tensor
    kv: list[tuple[torch.Tensor, torch.Tensor]]
    features: torch.Tensor | None
    layers: list[int] | None


class TreeScoring:
    """Training-time operations of :class:`~exittrain.models.target_model.TargetModel`."""

    @torch.no_grad()
    def sequence_prefix(self, input_ids_LT: torch.Tensor, layers: Sequence[int] | None = None, *,
                        past: SequencePrefix | None = None) -> SequencePrefix:
        """The causal pass of exact tree scoring over ``input_ids_LT`` (L, T), with the features of
        ``layers``: reuse it across ``score_trees`` calls on the same sequences (other trees,
        budgets or drafters), each of which would otherwise run it again.

        ``past``: the pass over the first P < T tokens of these sequences, with the same layers (a
        prompt that several answers continue): only the last T - P positions run, attending to its
        keys and values, which stay untouched. The result equals a whole pass up to float rounding
        (the attention of the last positions is summed in another order)."""
        self._check_ids(input_ids_LT, "input_ids_LT", 2)
        layers = self.check_layers(layers)
        input_ids_LT = input_ids_LT.to(self.device)
        P = 0 if past is None else past.input_ids.shape[1]
        if past is not None:
            if past.layers != layers or not 0 < P < input_ids_LT.shape[1] or \
                    not torch.equal(past.input_ids.to(self.device), input_ids_LT[:, :P]):
                raise ValueError(f"past: a pass over the first tokens of these sequences with layers={layers} "
                                 f"(it covers {P} tokens with layers={past.layers}); pass None to run them all")
        cache = self.new_cache() if past is None else self._cache_from_kv(past.kv)
        with self._capture(layers) as captured:
            self._decoder(input_ids=input_ids_LT[:, P:], use_cache=True, **cache_kwargs(cache))
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        features = self._features(captured, layers)
        if past is not None and features is not None:
            features = torch.cat([past.features, features.to(past.features.dtype)], dim=1)
        return SequencePrefix(input_ids_LT, kv, features, layers)

    @torch.no_grad()
    def sequence_features(
        self, input_ids_LT: torch.Tensor, layers: Sequence[int], attention_mask_LT: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Features (L, T, F) of ``layers`` at every sequence position (causal forward).

        Right-padded batches need no mask: with causal attention, real positions never see the
        padding after them. ``attention_mask_LT`` (1 = real) is passed to the model as is.
        """
        self._check_ids(input_ids_LT, "input_ids_LT", 2)
        layers = self.check_layers(layers)
        mask_LT = None if attention_mask_LT is None else attention_mask_LT.to(self.device)
        with self._capture(layers) as captured:
            self._decoder(input_ids=input_ids_LT.to(self.device), attention_mask=mask_LT, use_cache=False)
        return self._features(captured, layers)

    @torch.no_grad()
    def token_top_logprobs(self, input_ids_LT: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's k most likely tokens at every position of each sequence, aligned with the tokens.

        Returns ``(ids (L, T, k) int32, log-probabilities (L, T, k) float32)`` on the CPU: entry
        (l, t) is the top-k of the target's distribution of token t given tokens ``< t`` (one
        causal forward); position 0 has no prefix and holds ``-inf``. Right padding never reaches
        real positions. Runs one sequence at a time to keep the (T, V) logits small.
        """
        self._check_ids(input_ids_LT, "input_ids_LT", 2)
        if not isinstance(k, int) or not 1 <= k <= self.vocab_size:
            raise ValueError(f"k={k!r} must be an int in [1, vocab_size={self.vocab_size}]")
        L, T = input_ids_LT.shape
        ids = torch.zeros(L, T, k, dtype=torch.int32)
        logp = torch.full((L, T, k), -torch.inf)
        input_ids_LT = input_ids_LT.to(self.device)
        for row in range(L):
            logits_TV = self.model(input_ids=input_ids_LT[row : row + 1], use_cache=False).logits[0, :-1]
            values, index = torch.log_softmax(logits_TV.float(), dim=-1).topk(k, dim=-1)
            logp[row, 1:], ids[row, 1:] = values.cpu(), index.to("cpu", torch.int32)
        return ids, logp

    @torch.no_grad()
    def score_trees(
        self,
        input_ids_LT: torch.Tensor,
        anchors_LA: torch.Tensor,
        trees: DraftTree,
        *,
        mode: str = "exact",
        window: int = 64,
        chunk_size: int | None = None,
        layers: Sequence[int] | None = None,
        prefix: SequencePrefix | None = None,
    ) -> TreeScores:
        """Target logits for many anchors' trees inside L training sequences (section 3).

        Tree n = l * A + a hangs off anchor ``anchors_LA[l, a]``: its root is token x_a at
        position a, node v at position a + depth(v). Every tree row sees its ancestors, itself and
        the sequence prefix:

        - ``mode="exact"``: all prefix positions < a. One causal pass over the sequences gives
          the keys and values, then the trees of ``chunk_size`` anchors at a time (default: all)
          run as one forward over that cache with a per-anchor prefix mask.
        - ``mode="windowed"``: only the last ``window`` prefix positions a-W..a-1, re-encoded from
          scratch as their own sequence (so window tokens see only the window too), with their
          original positions. Matches a plain forward over ``x[max(0, a-W):a]`` + the path. Trees
          run ``chunk_size`` at a time (default: all).

        Sequences may be right-padded (padding after every anchor is never seen). Anchors must
        lie in [0, T). Returns :class:`TreeScores` with logits (L*A, B+1, V) and, if ``layers``
        is given, the features (L, T, F) at the sequence positions. ``prefix``
        (:meth:`sequence_prefix` of the same ``input_ids_LT``, exact mode only) skips the causal
        pass; its layers must then be the ``layers`` asked for.
        """
        self._check_ids(input_ids_LT, "input_ids_LT", 2)
        layers = self.check_layers(layers)
        L, T = input_ids_LT.shape
        if not torch.is_tensor(anchors_LA) or anchors_LA.dim() != 2 or anchors_LA.shape[0] != L:
            raise ValueError(f"anchors_LA must be a (L={L}, A) long tensor of positions")
        A = anchors_LA.shape[1]
        if trees.num_trees != L * A:
            raise ValueError(f"trees holds {trees.num_trees} trees; need L*A = {L}*{A} (tree n = l*A + a)")
        if anchors_LA.numel() and (anchors_LA.min() < 0 or anchors_LA.max() >= T):
            raise ValueError(f"anchors_LA must lie in [0, T={T})")
        if mode not in ("exact", "windowed"):
            raise ValueError(f"mode must be 'exact' or 'windowed', got {mode!r}")
        if mode == "windowed" and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int (prefix tokens kept), got {window!r}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
        if prefix is not None:
            if mode != "exact":
                raise ValueError("prefix is the causal pass of mode='exact'; windowed scoring re-encodes each window")
            if prefix.input_ids.shape != input_ids_LT.shape or not torch.equal(
                    prefix.input_ids, input_ids_LT.to(prefix.input_ids.device)):
                raise ValueError("prefix was computed for other sequences than input_ids_LT: call "
                                 "sequence_prefix(input_ids_LT) for these")
            if layers is not None and prefix.layers != layers:
                raise ValueError(f"layers={layers} but the prefix holds the features of {prefix.layers}: "
                                 "compute the prefix with these layers")
        if self.position_limit is not None:
            deepest = int(anchors_LA.max()) + int(trees.positions.max()) if anchors_LA.numel() else 0
            self._check_positions(max(T - 1, deepest), "the sequences and their trees")
        device = self.device
        input_ids_LT = input_ids_LT.to(device)
        anchors_LA = anchors_LA.to(device=device, dtype=torch.long)
        if mode == "exact":
            logits, features = self._score_exact(input_ids_LT, anchors_LA, trees, chunk_size, layers, prefix)
        else:
            logits = self._score_windowed(input_ids_LT, anchors_LA, trees, window, chunk_size)
            features = self.sequence_features(input_ids_LT, layers) if layers else None
        return TreeScores(logits=logits, features=features)

    def _tree_inputs(self, input_ids_LT, anchors_LA, trees: DraftTree):
        """Per tree: input ids (N, B+1), positions (N, B+1), ancestor mask (N, B+1, B+1)."""
        device = self.device
        roots = input_ids_LT.gather(1, anchors_LA).reshape(-1)  # (N,)
        ids = torch.cat([roots.unsqueeze(1), trees.tokens.to(device)], dim=1)
        positions = anchors_LA.reshape(-1, 1) + trees.positions.to(device)
        return ids, positions, trees.ancestor_mask.to(device)

    def _score_exact(self, input_ids_LT, anchors_LA, trees, chunk_size, layers, prefix=None):
        L, T = input_ids_LT.shape
        A = anchors_LA.shape[1]
        B1 = trees.budget + 1
        device = self.device
        if prefix is None:
            prefix = self.sequence_prefix(input_ids_LT, layers)
        features = prefix.features if layers is not None else None
        kv = prefix.kv
        del prefix

        ids_N, pos_N, anc_N = self._tree_inputs(input_ids_LT, anchors_LA, trees)
        ids_LAB = ids_N.view(L, A, B1)
        pos_LAB = pos_N.view(L, A, B1)
        anc_LABB = anc_N.view(L, A, B1, B1)
        step = chunk_size or A
        out = None  # (L, A, B+1, V), filled chunk by chunk
        for a0 in range(0, A, step):
            a1 = min(A, a0 + step)
            nA = a1 - a0
            Q = nA * B1
            # prefix part: rows of anchor a see sequence positions j < a
            anchor_rows = anchors_LA[:, a0:a1].repeat_interleave(B1, dim=1)  # (L, Q)
            sees_prefix = torch.arange(T, device=device).view(1, 1, T) < anchor_rows.unsqueeze(-1)  # (L, Q, T)
            # tree part: block diagonal of the anchors' ancestor masks
            tree_part = torch.zeros(L, nA, B1, nA, B1, dtype=torch.bool, device=device)
            idx = torch.arange(nA, device=device)
            tree_part[:, idx, :, idx, :] = anc_LABB[:, a0:a1].transpose(0, 1)
            allowed = torch.cat([sees_prefix, tree_part.view(L, Q, Q)], dim=2)  # (L, Q, T+Q)
            rows_pos = pos_LAB[:, a0:a1].reshape(L, Q)
            keys_pos = torch.cat([torch.arange(T, device=device).expand(L, T), rows_pos], dim=1)
            cache = self._cache_from_kv(kv)
            with self._tree_attention():
                logits = self.model(
                    input_ids=ids_LAB[:, a0:a1].reshape(L, Q),
                    attention_mask=self._additive(allowed, rows_pos, keys_pos),
                    position_ids=rows_pos,
                    use_cache=True,
                    **cache_kwargs(cache),
                ).logits.view(L, nA, B1, -1)  # (L, nA, B+1, V)
            del cache
            if nA == A:  # a single chunk is the whole result
                return logits.to(device).view(L * A, B1, -1), features
            # Write each chunk into one preallocated result: the peak is the result plus one chunk,
            # where keeping the chunks for a final torch.cat held them and the concatenation (2x).
            if out is None:
                out = torch.empty(L, A, B1, logits.shape[-1], dtype=logits.dtype, device=device)
            out[:, a0:a1] = logits  # the copy also moves a chunk the LM head left on another GPU
            del logits  # free this chunk before the next forward
        return out.view(L * A, B1, -1), features

    def _cache_from_kv(self, kv):
        """A DynamicCache holding the given per-layer (keys, values) without copying them."""
        cache = self.new_cache()
        for layer, (k, v) in zip(cache.layers, kv, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v  # update() concatenates into new tensors: k, v stay intact
        return cache

    def _score_windowed(self, input_ids_LT, anchors_LA, trees, window, chunk_size):
        L, T = input_ids_LT.shape
        W = window
        B1 = trees.budget + 1
        device = self.device
        ids_N, pos_N, anc_N = self._tree_inputs(input_ids_LT, anchors_LA, trees)
        N = ids_N.shape[0]
        win_pos_NW = anchors_LA.reshape(-1, 1) - W + torch.arange(W, device=device)  # (N, W) positions a-W..a-1
        win_valid_NW = win_pos_NW >= 0
        seq_of = torch.arange(L, device=device).repeat_interleave(anchors_LA.shape[1])  # (N,)
        win_ids_NW = input_ids_LT[seq_of.unsqueeze(1), win_pos_NW.clamp_min(0)]
        win_ids_NW = torch.where(win_valid_NW, win_ids_NW, torch.zeros_like(win_ids_NW))

        causal_WW = torch.ones(W, W, dtype=torch.bool, device=device).tril()
        eye_WW = torch.eye(W, dtype=torch.bool, device=device)
        step = chunk_size or N
        out = None  # (N, B+1, V), filled chunk by chunk
        for n0 in range(0, N, step):
            n1 = min(N, n0 + step)
            n = n1 - n0
            valid = win_valid_NW[n0:n1]  # (n, W)
            # window rows: causal over valid window tokens; padding rows see only themselves
            win_rows = (causal_WW & valid.unsqueeze(1)) | eye_WW
            win_rows = torch.cat([win_rows, torch.zeros(n, W, B1, dtype=torch.bool, device=device)], dim=2)
            tree_rows = torch.cat([valid.unsqueeze(1).expand(n, B1, W), anc_N[n0:n1]], dim=2)
            allowed = torch.cat([win_rows, tree_rows], dim=1)  # (n, W+B+1, W+B+1)
            positions = torch.cat([win_pos_NW[n0:n1].clamp_min(0), pos_N[n0:n1]], dim=1)
            with self._tree_attention():
                logits = self.model(
                    input_ids=torch.cat([win_ids_NW[n0:n1], ids_N[n0:n1]], dim=1),
                    attention_mask=self._additive(allowed, positions, positions),
                    position_ids=positions,
                    use_cache=False,
                    logits_to_keep=B1,
                ).logits  # (n, B+1, V)
            if n == N:  # a single chunk is the whole result
                return logits.to(device)
            if out is None:  # one preallocated result, as in _score_exact
                out = torch.empty(N, B1, logits.shape[-1], dtype=logits.dtype, device=device)
            out[n0:n1] = logits
            del logits  # free this chunk before the next forward
        return out
