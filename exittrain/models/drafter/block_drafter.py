"""The block drafter (docs/algorithm.md section 7): a DFlash draft model, plus exittrain's extensions.

Shape legend: N blocks (one per root / anchor), C context positions, F = len(layer_ids) * H
target feature width, H target hidden size, D drafter width, S = block_size, K = S - 1 predicted
tokens, V vocabulary, L sequences, T sequence length, A anchors per sequence, W context window,
Hkv key/value heads, hd head size.

**What it computes** (with the extensions off this is, parameter for parameter, the function of
a DFlash draft model, ``dflash.DFlashDraftModel``; ``tests/models/test_dflash_format.py`` checks
equal logits both ways). For a root token r at position p whose preceding context has target
features ``f_j`` at positions j < p (the concatenated outputs of ``target_layer_ids``, in the
layer-id convention of :mod:`exittrain.models.target_model`, which is DFlash's):

1. ``ctx_j = hidden_norm(fc(f_j))``: the context rows (``fc`` F -> D without bias).
2. The block input is ``[emb(r), m, ..., m]`` (S rows, positions p .. p+K): the frozen target
   embedding of the root followed by K mask rows ``m``: the target embedding of
   ``mask_token_id`` (``learned_mask=False``, DFlash), or a learned vector (``learned_mask=True``,
   initialised from that embedding, else zero), mapped by ``input_proj`` (H -> D) when D != H.
3. ``num_layers`` Qwen3-style layers ``layers.{i}``: ``x += o_proj(attn(input_layernorm(x)))``
   then ``x += mlp(post_attention_layernorm(x))``. The block queries (q_proj, per-head q_norm,
   rotary) attend to the keys and values of ``[ctx; block]``: each layer projects the context
   rows itself (k_proj, per-head k_norm, rotary at their absolute positions; v_proj), without the
   layer's input norm, and never updates them. Grouped-query heads; no causal mask in the block.
4. ``norm``, ``output_proj`` (D -> H) when D != H, then the frozen target LM head on block rows
   1..K gives the logits of ``q_1..q_K``.
5. The n-gram copy branch (``copy_ngrams``; :mod:`exittrain.models.drafter.copy_branch`).

**Context window.** ``context_window`` W (config default, overridable per call; None = the whole
prefix) limits the context to the last W positions before the root; training and decoding read
the same config.

**Entry points** (all need :meth:`BlockDrafter.attach_target` first):

- :meth:`~BlockDrafter.project_context` and :meth:`~BlockDrafter.draft_block`: the context K/V
  of every layer is projected once per position and kept (:class:`ContextKV`), and a block is
  drafted from it. A decoder projects only the newly committed positions each round and
  :meth:`ContextKV.extend` s its cache: the drafter's cost per round then no longer grows with
  the context beyond the attention itself.
- :meth:`~BlockDrafter.forward`: one block per root from right-aligned context features.
- :meth:`~BlockDrafter.forward_anchors`: training, many anchors per sequence in one pass.

All three run the same layer code (:mod:`exittrain.models.drafter.layers`).

**Sharing the target.** :meth:`BlockDrafter.attach_target` stores the target's embedding and LM
head in a plain dict, outside the module tree: they are not in ``parameters()``,
``state_dict()`` or the saved safetensors. The config records the target (name, vocabulary,
hidden size, depth, layer ids); loading against another target raises a ``ValueError`` naming
both targets and the field that differs. :func:`~exittrain.models.drafter.construction.load_drafter`
also reads DFlash folders (:mod:`exittrain.models.dflash_format`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as hf_init

from exittrain.models.drafter.configuration import DrafterConfig, check_pairing
from exittrain.models.drafter.copy_branch import copy_logits, copy_terms, init_copy_gate
from exittrain.models.drafter.layers import ContextKV, DrafterLayer, DrafterRMSNorm
from exittrain.models.drafter.saved_files import check_saved_files, check_weight_shapes
from exittrain.models.drafter.starting_points import copy_target_layers
from exittrain.models.head_product import HeadProduct, apply_head, is_plain_head
from exittrain.models.vocab_head import VocabRows, vocab_logits_reference

logger = logging.getLogger(__name__)

__all__ = ["BlockDrafter"]


class BlockDrafter(PreTrainedModel):
    """Block drafter; see the module docstring for the computation and the sharing contract."""

    config_class = DrafterConfig
    base_model_prefix = "drafter"
    main_input_name = "root_tokens"
    _no_split_modules = ["DrafterLayer"]

    def __init__(self, config: DrafterConfig):
        super().__init__(config)
        H, D, Fw = config.target_hidden_size, config.hidden_size, config.feature_size
        if H < 1 or Fw < 1:
            raise ValueError(
                "DrafterConfig has no target (target_hidden_size / target_layer_ids unset); "
                "create drafters with new_drafter(target) or load them with load_drafter(path, target)"
            )
        self.fc = nn.Linear(Fw, D, bias=False)
        self.hidden_norm = DrafterRMSNorm(D, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H)) if config.learned_mask else None
        self.input_proj = nn.Linear(H, D, bias=False) if D != H else None
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_layers)])
        self.norm = DrafterRMSNorm(D, config.rms_norm_eps)
        self.output_proj = nn.Linear(D, H, bias=False) if D != H else None
        # one gate logit per n-gram length, read at the length that matched
        self.copy_gate = nn.Linear(H, len(config.copy_ngrams)) if config.copy_ngrams else None
        # plain dict: the shared target modules stay outside parameters() and state_dict()
        self._shared: dict[str, nn.Module] = {}
        # the head's rows for a draft vocabulary, kept while this drafter decodes with one (not a buffer)
        self._vocab_rows = VocabRows()
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self and self.mask_embedding is not None:
            hf_init.zeros_(self.mask_embedding)
        elif module is getattr(self, "copy_gate", None):
            # also when a drafter saved without the branch is loaded with it: its gate starts here
            init_copy_gate(module, self.config.copy_gate_init)

    # -- the target ------------------------------------------------------------------------------

    def attach_target(self, target, *, check_name: bool = True) -> BlockDrafter:
        """Share ``target``'s input embeddings and LM head (frozen, not registered); returns self."""
        check_pairing(self.config, target, check_name=check_name)
        self._shared = {"embeddings": target.input_embeddings, "lm_head": target.lm_head}
        return self

    @property
    def has_target(self) -> bool:
        return bool(self._shared)

    def _target_module(self, key: str) -> nn.Module:
        if not self._shared:
            raise ValueError("the drafter has no target attached: call drafter.attach_target(target) first")
        return self._shared[key]

    def init_mask_embedding(self) -> None:
        """Set the learned mask to the target embedding of ``mask_token_id`` (else zero).

        Not the mean embedding row: in a tied-embedding target such as SmolLM2 the mean row points
        at the rarely trained tokens, so a block that starts near its input predicts those. A zero
        mask starts the mask rows from the context and the root alone. No-op without a learned mask.
        """
        if self.mask_embedding is None:
            return
        table = self._target_module("embeddings").weight
        with torch.no_grad():
            if self.config.mask_token_id is not None:
                self.mask_embedding.copy_(table[self.config.mask_token_id].to(self.mask_embedding))
            else:
                self.mask_embedding.zero_()

    def init_from_target_layers(self, target, source_layers: Sequence[int]) -> None:
        """Start the layers as copies of target layers
        (:func:`exittrain.models.drafter.starting_points.copy_target_layers`)."""
        copy_target_layers(self, target, source_layers)

    # -- pieces -----------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _block_input(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """(..., ) root ids -> (..., S, D) block input rows."""
        dtype = self.fc.weight.dtype
        embeddings = self._target_module("embeddings")
        device = self.fc.weight.device
        emb = embeddings(root_tokens.to(device)).to(dtype)
        if self.mask_embedding is not None:
            mask = self.mask_embedding.to(dtype)
        else:
            mask = embeddings(torch.tensor(self.config.mask_token_id, device=device)).to(dtype)
        mask = mask.expand(*root_tokens.shape, self.config.num_draft_tokens, -1)
        block = torch.cat([emb.unsqueeze(-2), mask], dim=-2)  # (..., S, H)
        return self.input_proj(block) if self.input_proj is not None else block

    def _context(self, features: torch.Tensor) -> torch.Tensor:
        """(..., C, F) target features -> (..., C, D) context rows ``hidden_norm(fc(f))``."""
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(
                f"context features have width {features.shape[-1]}, expected F = {self.config.feature_size} "
                f"(layers {self.config.target_layer_ids} x hidden {self.config.target_hidden_size})"
            )
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _run(self, x, pos_x, allowed, *, ctx=None, pos_ctx=None, context_kv: ContextKV | None = None):
        """Layers, norm, output projection over block rows x (B, Q, D), Q = blocks * S; the context
        as rows (``ctx``, ``pos_ctx``) or as cached K/V. Returns the pre-head states (B, Q/S, K, H)
        of block rows 1..K."""
        for i, layer in enumerate(self.layers):
            kv = None if context_kv is None else (context_kv.keys[i], context_kv.values[i])
            x = layer(x, pos_x, allowed, ctx_BCD=ctx, ctx_pos_BC=pos_ctx, ctx_kv=kv)
        x = self.norm(x)
        if self.output_proj is not None:
            x = self.output_proj(x)
        S = self.config.block_size
        return x.view(x.shape[0], -1, S, x.shape[-1])[:, :, 1:]  # drop the root row

    def copy_terms(
        self, hidden_NKH: torch.Tensor, ids_LT: torch.Tensor, anchors_LA: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The copy branch's ``(copy_ids (N, K), gate_logits (N, K))`` for the anchors ``anchors_LA``
        of ``ids_LT`` (:func:`exittrain.models.drafter.copy_branch.copy_terms`); None without the branch.
        Call it inside a forward (its gate is a drafter parameter, gathered there under FSDP)."""
        if self.copy_gate is None:
            return None
        return copy_terms(self.copy_gate, self.config.copy_ngrams, hidden_NKH, ids_LT, anchors_LA)

    def head(
        self,
        hidden_NKH: torch.Tensor,
        copy: tuple[torch.Tensor, torch.Tensor] | None = None,
        vocab_ids: torch.Tensor | None = None,
        *,
        head_product: HeadProduct | None = None,
    ) -> torch.Tensor:
        """Logits (N, K, V) of ``q_1..q_K`` from the pre-head states: the frozen target LM head;
        with ``copy`` (:meth:`copy_terms`), the copy-mixed log-probabilities in float32. With
        ``vocab_ids`` (S,) only those tokens are scored and the others get -inf before the copy
        mix (:mod:`exittrain.models.vocab_head`; a decode-time option). ``head_product``: the
        plain head's product, a decode-time option (:mod:`exittrain.models.head_product`; None:
        ``F.linear``, as training runs it); a hooked head runs its own forward."""
        lm_head = self._target_module("lm_head")
        # contiguous: the blocks' states come out strided, and a strided (N, K, H) input sends the
        # product through a batched matmul over an expanded weight, about 3x slower than one mm on a CPU
        hidden = hidden_NKH.to(lm_head.weight.dtype).contiguous()
        if is_plain_head(lm_head):
            # the weight is in place (no accelerate hook), so the rows go to its device
            hidden, weight = hidden.to(lm_head.weight.device), lm_head.weight
            logits = (apply_head(hidden, weight, head_product) if vocab_ids is None
                      else self._vocab_rows.logits(hidden, weight, vocab_ids, head_product))
        else:  # a hooked head moves its inputs itself (its weight may be offloaded until its forward)
            logits = lm_head(hidden)
            logits = logits if vocab_ids is None else vocab_logits_reference(logits, vocab_ids)
        # back on the drafter's device: with the target's device_map the head may sit on another GPU
        logits = logits.to(hidden_NKH.device)
        return logits if copy is None else copy_logits(logits, copy)

    def _window(self, context_window: int | None) -> int | None:
        W = self.config.context_window if context_window is None else context_window
        if W is not None and (not isinstance(W, int) or W < 1):
            raise ValueError(f"context_window must be None or a positive int, got {W!r}")
        return W

    # -- decode path: a cached context ------------------------------------------------------------

    def project_context(self, features_BCF: torch.Tensor, positions_BC: torch.Tensor) -> ContextKV:
        """Every layer's K/V of context positions: ``hidden_norm(fc(features))``, then per layer
        k_proj + k_norm + rotary at the absolute ``positions_BC`` (B, C) and v_proj.

        Call it once per committed position (a decoder: on the positions a round just accepted)
        and :meth:`ContextKV.extend` the cache; positions must be those the target gave the tokens.
        Returns K/V of shape (B, Hkv, C, hd) per layer, in the drafter's dtype.
        """
        if features_BCF.dim() != 3 or positions_BC.shape != features_BCF.shape[:2]:
            raise ValueError(
                f"features_BCF (B, C, F) and positions_BC (B, C) must agree, got {tuple(features_BCF.shape)} "
                f"and {tuple(positions_BC.shape)}"
            )
        ctx = self._context(features_BCF)
        pos = positions_BC.to(ctx.device)
        kv = [layer.context_kv(ctx, pos) for layer in self.layers]
        return ContextKV(tuple(k for k, _ in kv), tuple(v for _, v in kv))

    def draft_block(
        self,
        root_tokens: torch.Tensor,
        root_positions: torch.Tensor,
        context_kv: ContextKV,
        *,
        context_mask: torch.Tensor | None = None,
        context_ids: torch.Tensor | None = None,
        context_window: int | None = None,
        apply_lm_head: bool = True,
        vocab_ids: torch.Tensor | None = None,
        head_product: HeadProduct | None = None,
    ) -> torch.Tensor:
        """Draft one block per root from cached context K/V (:meth:`project_context`).

        ``root_tokens`` (N,) at ``root_positions`` (N,) (block row k sits at root position + k);
        ``context_kv`` with batch N or 1 (shared by every root) and C positions, all before the
        roots; ``context_mask`` (N, C) bool, True where a root may see the position (default
        all). With a context window W (``context_window``, else the config's) only the last W
        cached positions are used. ``context_ids`` (N, C') the token ids before each root,
        right-aligned, negative = padding: required by the copy branch, ignored without it.
        Returns logits (N, K, V), or the pre-head states (N, K, H) with ``apply_lm_head=False``;
        ``vocab_ids`` restricts the head to a draft vocabulary and ``head_product`` computes its
        product (:meth:`head`).
        """
        N = root_tokens.shape[0]
        if root_tokens.shape != (N,) or root_positions.shape != (N,):
            raise ValueError(
                f"root_tokens and root_positions must both be (N,), got {tuple(root_tokens.shape)} and "
                f"{tuple(root_positions.shape)}"
            )
        if context_kv.batch not in (1, N) or len(context_kv.keys) != len(self.layers):
            raise ValueError(
                f"context_kv must hold {len(self.layers)} layers with batch 1 or N={N}, got "
                f"{len(context_kv.keys)} layers with batch {context_kv.batch}"
            )
        if self.copy_gate is not None and apply_lm_head and (
            context_ids is None or context_ids.dim() != 2 or context_ids.shape[0] != N
        ):
            got = None if context_ids is None else tuple(context_ids.shape)
            raise ValueError(
                f"this drafter copies n-grams (copy_ngrams={self.config.copy_ngrams}): pass context_ids, the "
                f"(N={N}, C') token ids before each root, got {got}"
            )
        device = self.fc.weight.device
        C = context_kv.length
        if context_mask is None:
            context_mask = torch.ones(N, C, dtype=torch.bool, device=device)
        elif context_mask.shape != (N, C):
            raise ValueError(f"context_mask must be (N={N}, C={C}) bool, got {tuple(context_mask.shape)}")
        W = self._window(context_window)
        if W is not None and C > W:
            context_kv, context_mask, C = context_kv.last(W), context_mask[:, -W:], W
        if context_kv.batch != N:
            context_kv = ContextKV(
                tuple(k.expand(N, -1, -1, -1) for k in context_kv.keys),
                tuple(v.expand(N, -1, -1, -1) for v in context_kv.values),
            )
        S = self.config.block_size
        x = self._block_input(root_tokens.to(device))  # (N, S, D)
        pos_x = root_positions.to(device).view(N, 1) + torch.arange(S, device=device)
        sees = context_mask.to(device).bool().unsqueeze(1).expand(N, S, C)
        allowed = torch.cat([sees, torch.ones(N, S, S, dtype=torch.bool, device=device)], dim=2)  # (N, S, C+S)
        hidden = self._run(x, pos_x, allowed, context_kv=context_kv)[:, 0]  # (N, K, H)
        if not apply_lm_head:
            return hidden
        copy = None
        if self.copy_gate is not None:
            ids = torch.cat([context_ids.to(device=device, dtype=torch.long), root_tokens.view(N, 1).to(device)], dim=1)
            copy = self.copy_terms(hidden, ids, torch.full((N, 1), ids.shape[1] - 1, device=device))
        return self.head(hidden, copy, vocab_ids, head_product=head_product)

    def forward(
        self,
        context_features: torch.Tensor,
        root_tokens: torch.Tensor,
        context_mask: torch.Tensor | None = None,
        *,
        context_ids: torch.Tensor | None = None,
        context_window: int | None = None,
        apply_lm_head: bool = True,
        vocab_ids: torch.Tensor | None = None,
        head_product: HeadProduct | None = None,
    ) -> torch.Tensor:
        """Draft one block per root from its context features (no cache).

        ``context_features`` (N, C, F): target features of the C positions just before each root,
        right-aligned (column C-1 is the position before the root); ``root_tokens`` (N,);
        ``context_mask`` (N, C) bool, True for real positions (left padding False; default all
        True). The context sits at positions 0..C-1 and the root at C (scores depend only on
        position differences). Otherwise as :meth:`draft_block`, which it calls.
        """
        if context_features.dim() != 3:
            raise ValueError(f"context_features must be (N, C, F), got {tuple(context_features.shape)}")
        N, C, _ = context_features.shape
        if root_tokens.shape != (N,):
            raise ValueError(f"root_tokens must be (N={N},), got {tuple(root_tokens.shape)}")
        W = self._window(context_window)
        if W is not None and C > W:
            context_features, C = context_features[:, -W:], W
            context_mask = None if context_mask is None else context_mask[:, -W:]
        device = context_features.device
        kv = self.project_context(context_features, torch.arange(C, device=device).expand(N, C))
        return self.draft_block(
            root_tokens, torch.full((N,), C, device=device), kv, context_mask=context_mask,
            context_ids=context_ids, context_window=W, apply_lm_head=apply_lm_head, vocab_ids=vocab_ids,
            head_product=head_product,
        )

    # -- training path ----------------------------------------------------------------------------

    def forward_anchors(
        self,
        features_LTF: torch.Tensor,
        input_ids_LT: torch.Tensor,
        anchors_LA: torch.Tensor,
        *,
        context_window: int | None = None,
        apply_lm_head: bool = True,
        with_copy_terms: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """Draft the block of every anchor of L sequences in one pass.

        Anchor a of sequence l has root ``input_ids_LT[l, a]`` and sees the features of positions
        ``max(0, a - W) <= j < a`` (W = context window; all j < a when None), exactly as
        :meth:`draft_block` would with a cache of those positions. Each layer projects the context
        K/V once per sequence (inside the layer's forward) and each anchor's block is masked to its
        own prefix, so the cost is O(A * S * T) attention scores per layer. Returns logits
        (L*A, K, V) with row n = l * A + a (the tree order of ``TargetModel.score_trees``), or
        hidden states (L*A, K, H) with ``apply_lm_head=False`` (for a sampled-softmax loss). The
        copy branch looks the anchors up in ``input_ids_LT``. ``with_copy_terms``: return
        ``(output, copy)`` with the :meth:`copy_terms` (None without the branch).
        """
        if features_LTF.dim() != 3 or input_ids_LT.shape != features_LTF.shape[:2]:
            raise ValueError(
                f"features_LTF (L, T, F) and input_ids_LT (L, T) must agree, got {tuple(features_LTF.shape)} "
                f"and {tuple(input_ids_LT.shape)}"
            )
        L, T, _ = features_LTF.shape
        if anchors_LA.dim() != 2 or anchors_LA.shape[0] != L:
            raise ValueError(f"anchors_LA must be (L={L}, A) positions, got {tuple(anchors_LA.shape)}")
        if anchors_LA.numel() and (anchors_LA.min() < 0 or anchors_LA.max() >= T):
            raise ValueError(f"anchors_LA must lie in [0, T={T})")
        device = features_LTF.device
        anchors_LA = anchors_LA.to(device=device, dtype=torch.long)
        A, S, W = anchors_LA.shape[1], self.config.block_size, self._window(context_window)

        roots_LA = input_ids_LT.to(device).gather(1, anchors_LA)
        x = self._block_input(roots_LA).reshape(L, A * S, -1)  # (L, A*S, D)
        ctx = self._context(features_LTF)  # (L, T, D)
        pos_ctx = torch.arange(T, device=device).expand(L, T)
        anchor_rows = anchors_LA.repeat_interleave(S, dim=1)  # (L, A*S)
        pos_x = anchor_rows + torch.arange(S, device=device).repeat(A)
        j = torch.arange(T, device=device).view(1, 1, T)
        sees = j < anchor_rows.unsqueeze(-1)  # (L, A*S, T)
        if W is not None:
            sees &= j >= anchor_rows.unsqueeze(-1) - W
        block_id = torch.arange(A, device=device).repeat_interleave(S)
        same_block = (block_id.view(-1, 1) == block_id.view(1, -1)).expand(L, A * S, A * S)
        allowed = torch.cat([sees, same_block], dim=2)  # (L, A*S, T + A*S)
        hidden = self._run(x, pos_x, allowed, ctx=ctx, pos_ctx=pos_ctx).reshape(L * A, S - 1, -1)  # (N, K, H)
        # the lookup and gate only where they are used: the head's mixture, or the caller's sampled loss
        copy = self.copy_terms(hidden, input_ids_LT, anchors_LA) if apply_lm_head or with_copy_terms else None
        out = self.head(hidden, copy) if apply_lm_head else hidden
        return (out, copy) if with_copy_terms else out

    # -- loading ----------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, target=None, check_name: bool = True, **kwargs):
        """``PreTrainedModel.from_pretrained``, plus pairing: with ``target`` given, the saved config
        is checked against it (ValueError on mismatch, before any weight is read) and the target
        is attached.

        Weights are read from safetensors only: a folder holding only a pickled checkpoint raises
        ValueError instead of being unpickled. In a local folder, a bad ``config.json`` or weights
        file, or weights in the layout before the DFlash one, raise ValueError naming the file
        (:func:`exittrain.models.drafter.saved_files.check_saved_files`) before Hugging Face reads either,
        and so does a tensor whose shape does not fit the config (:func:`~exittrain.models.drafter.saved_files.
        check_weight_shapes`, from the headers).
        """
        folder = Path(pretrained_model_name_or_path) / kwargs.get("subfolder", "")
        config = kwargs.pop("config", None)
        if folder.is_dir():
            check_saved_files(folder, config_too=config is None)
        if config is None:
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
            config = DrafterConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        if target is not None:
            check_pairing(config, target, check_name=check_name)
        if folder.is_dir():
            with torch.device("meta"):  # the config's shapes, without allocating a weight
                expected = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
            check_weight_shapes(folder, expected)
        # save_drafter writes safetensors; never fall back to unpickling a .bin (Hugging Face would)
        kwargs["use_safetensors"] = True
        model = super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        if target is not None:
            model.attach_target(target, check_name=check_name)
        return model
