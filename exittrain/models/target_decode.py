"""Decoding operations of the frozen target: prefill, one tree forward per round, cache commit.

docs/algorithm.md section 3. :class:`TargetDecoding` is mixed into
:class:`~exittrain.models.target_model.TargetModel`; it uses the wrapper's ``model``, ``device``,
:meth:`~exittrain.models.target_model.TargetModel.check_layers`, feature capture, additive masks
and id checks. The layer-id, tree-attention and cache conventions, the shape legend and the limits
are stated in :mod:`exittrain.models.target_model`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from exittrain.core import DraftTree
from exittrain.models.hf_cache import cache_kwargs

__all__ = ["PrefillOutput", "TargetDecoding", "TreeForwardOutput"]


class PrefillOutput(NamedTuple):
    """``logits`` (N, V) at the last position; ``features`` (N, T, F) or None; ``cache``."""

    logits: torch.Tensor
    features: torch.Tensor | None
    cache: object


class TreeForwardOutput(NamedTuple):
    """``logits`` (N, B+1, V), row u scores u's children; ``features`` (N, B+1, F) or None."""

    logits: torch.Tensor
    features: torch.Tensor | None


class TargetDecoding:
    """Decode-time operations of :class:`~exittrain.models.target_model.TargetModel` (one row per
    cache for :meth:`commit`; see the limits in :mod:`exittrain.models.target_model`)."""

    @torch.no_grad()
    def prefill(self, input_ids_NT: torch.Tensor, layers: Sequence[int] | None = None) -> PrefillOutput:
        """Run the context through the target with a fresh ``DynamicCache``.

        Returns ``(logits (N, V) at the last position, features (N, T, F) of ``layers`` or None,
        cache)``. All N rows must have the same length (no padding).
        """
        self._check_ids(input_ids_NT, "input_ids_NT", 2)
        layers = self.check_layers(layers)
        cache = self.new_cache()
        with self._capture(layers) as captured:
            out = self.model(input_ids=input_ids_NT, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        return PrefillOutput(out.logits[:, -1].to(self.device), self._features(captured, layers), cache)

    @torch.no_grad()
    def tree_forward(
        self,
        cache,
        root_token: torch.Tensor | int,
        tree: DraftTree,
        root_position: torch.Tensor | int | None = None,
        layers: Sequence[int] | None = None,
    ) -> TreeForwardOutput:
        """Score N trees appended to a cached context in one forward (docs/algorithm.md section 3).

        ``cache`` holds the context of length C for N rows (the root is not in it yet).
        ``root_token`` (N,) or int; ``tree`` a DraftTree of N trees; ``root_position`` defaults
        to C (int, or (N,) long). Row u of the returned logits (N, B+1, V) is p_u; features are
        (N, B+1, F) for ``layers``. Afterwards the cache holds C + B + 1 positions: call
        :meth:`commit` to keep the accepted path, or ``cache.crop(-(B + 1))`` to drop the tree.
        Feature rows 0 (root) and the accepted rows are the features of the newly committed
        positions, which the drafter's next context needs. With sliding-window layers the cached
        context is taken to sit at positions 0..C-1 (what :meth:`prefill` and :meth:`commit` keep).
        """
        layers = self.check_layers(layers)
        N, B = tree.tokens.shape
        C = cache.get_seq_length()
        device = self.device
        root = torch.as_tensor(root_token, dtype=torch.long, device=device).reshape(-1).expand(N)
        if C > 0 and cache.layers[0].keys.shape[0] != N:
            raise ValueError(f"tree has N={N} trees but the cache holds {cache.layers[0].keys.shape[0]} rows")
        if root_position is None:
            root_position = C
        if self.position_limit is not None:  # a host synchronisation, for these targets only
            self._check_positions(int(torch.as_tensor(root_position).max()) + int(tree.positions.max()), "the tree")
        root_pos = torch.as_tensor(root_position, dtype=torch.long, device=device).reshape(-1, 1)
        input_ids = torch.cat([root.unsqueeze(1), tree.tokens.to(device)], dim=1)  # (N, B+1)
        # no value check on the ids here: it would cost a host synchronisation every round
        position_ids = root_pos + tree.positions.to(device)  # (N, B+1)
        allowed = torch.cat(
            [torch.ones(N, B + 1, C, dtype=torch.bool, device=device), tree.ancestor_mask.to(device)], dim=2
        )  # (N, B+1, C+B+1)
        key_positions = None
        if any(w is not None for w in self.attention_windows.values()):  # the cached context sits at 0..C-1
            key_positions = torch.cat([torch.arange(C, device=device).expand(N, C), position_ids], dim=1)
        with self._capture(layers) as captured, self._row_kernels_active(), self._tree_attention():
            logits = self._causal_lm_logits(
                input_ids=input_ids,
                attention_mask=self._additive(allowed, position_ids, key_positions),
                position_ids=position_ids,
                use_cache=True,
                **cache_kwargs(cache),
            )
        return TreeForwardOutput(logits.to(device), self._features(captured, layers))

    @torch.no_grad()
    def commit(self, cache, context_len: int, accepted_node_columns: Sequence[int] | torch.Tensor,
               reference: bool = False):
        """Compact the cache after :meth:`tree_forward` to context + root + accepted path.

        ``context_len`` is C (cache length before the tree forward); ``accepted_node_columns``
        are the accepted nodes' row indices in the root-included layout (1..B, the convention of
        ``DraftTree.parents``: node j sits in tree column j-1), in path order from the root,
        possibly empty. Keeps positions ``[0, C) + [C] + [C + j for j in accepted]`` along the
        sequence dimension of every layer; the cache then equals the cache of the plain sequence
        context + root + accepted tokens. One row (batch size 1) only. Returns the cache.

        The fast path touches the tree's rows only: the accepted rows move to C + 1 .. C + n and
        the cache is cut after them (a view; the next forward's append copies it anyway), so a
        round's commit does not grow with the context. ``reference=True`` is its slow twin,
        which gathers every kept position into a new tensor (45 ms a round at 1500 tokens of
        context on a 2-core EPYC, against about 1 ms at 150).
        """
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        cols = torch.as_tensor(accepted_node_columns, dtype=torch.long).reshape(-1).cpu()
        total = cache.get_seq_length()
        if not 0 <= context_len < total:
            raise ValueError(f"context_len={context_len} must be in [0, {total}) (the cache length)")
        if cols.numel() and (cols.min() < 1 or context_len + cols.max() >= total):
            raise ValueError(f"accepted_node_columns={cols.tolist()} must be node rows in 1..{total - context_len - 1}")
        keep = torch.cat([torch.arange(context_len + 1), context_len + cols])
        for layer in cache.layers:
            if type(layer) is not DynamicLayer or isinstance(layer, DynamicSlidingWindowLayer):
                raise ValueError(
                    f"commit supports DynamicLayer caches only, got {type(layer).__name__}; "
                    "build the cache with TargetModel.new_cache() / prefill()"
                )
            if not layer.is_initialized:
                continue
            if layer.keys.shape[0] != 1:
                raise ValueError(f"commit takes a cache of one row, got batch {layer.keys.shape[0]}")
            if reference:
                index = keep.to(layer.keys.device)
                layer.keys = layer.keys.index_select(-2, index)
                layer.values = layer.values.index_select(-2, index)
                continue
            n = cols.numel()
            if n:  # gathered first (a copy), so a source row is never overwritten before it is read
                source = (context_len + cols).to(layer.keys.device)
                layer.keys[..., context_len + 1 : context_len + 1 + n, :] = layer.keys.index_select(-2, source)
                layer.values[..., context_len + 1 : context_len + 1 + n, :] = layer.values.index_select(-2, source)
            layer.keys = layer.keys[..., : context_len + 1 + n, :]
            layer.values = layer.values[..., : context_len + 1 + n, :]
        return cache
