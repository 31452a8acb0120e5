"""The block drafter (ALGORITHM.md section 6, in the style of DFlash).

Shape legend: N blocks (one per root / anchor), C context positions, F = len(layer_ids) * H
target feature width, H target hidden size, D drafter width, S = block_size, K = S - 1 predicted
tokens, V vocabulary, L sequences, T sequence length, A anchors per sequence, W context window.

**What it computes.** For a root token r whose preceding context has target features
``f_1..f_C`` (the concatenated hidden states of ``target_layer_ids``, see
:mod:`exittrain.models.target` for the layer-id convention):

1. ``ctx = RMSNorm(Linear(F -> D)(f))``: the context, projected once.
2. The block input is ``[emb(r), m, ..., m]`` (S rows): the frozen target embedding of the root
   followed by K copies of a learned mask embedding ``m`` (initialised from the target
   embedding of ``mask_token_id`` when given, else zero), mapped to the drafter width by
   ``Linear(H -> D)`` when D != H.
3. ``num_layers`` pre-norm transformer layers. In each, the block queries attend to the keys and
   values of ``[ctx; block]`` (the context enters every layer through that layer's own K/V
   projections and is not itself updated); attention is bidirectional inside the block.
4. ``RMSNorm``, ``Linear(D -> H)`` when D != H, then the frozen target LM head on block rows
   1..K gives the logits of ``q_1..q_K``.
5. The n-gram copy branch (``copy_ngrams``, e.g. [3, 2]; empty = off, ALGORITHM.md section 6
   exactly): the root's last n tokens are looked up in the context ids, and the tokens that
   followed their latest occurrence are mixed into ``q_k`` with a gate
   ``g = sigmoid(Linear(H -> len(copy_ngrams))(h_k))`` read at the n that matched
   (:mod:`exittrain.core.ngram_copy`). The gate starts at ``copy_gate_init`` (weights 0). With
   the branch on, the outputs are the mixed log-probabilities, which every consumer reads as
   logits (they are normalised). This needs the context's token ids: :meth:`forward` takes
   ``context_ids``, :meth:`forward_anchors` has them.

**Positions.** Rotary embeddings (``rope_theta``) on queries and keys, with each row at its
sequence position: context position j at j, block row k at ``root_position + k``. Attention
scores depend only on position differences, so the decode path (context right-aligned just
before the root) and the training path (absolute positions) compute the same function.

**Context window.** ``context_window`` W (config default, overridable per call; None = the whole
prefix) limits the context to the last W positions before the root. Training with a window is
cheaper and matches decoding only if decoding uses the same window: both read the config.

**Initialisation.** Random, or (``new_drafter(init_from_layers=...)``) with each drafter layer a
copy of a target decoder layer: see :meth:`BlockDrafter.init_from_target_layers`. The layers are
then the drafter's own parameters, trained like the rest.

**Sharing the target.** :meth:`BlockDrafter.attach_target` stores the target's embedding and LM
head in a plain dict, outside the module tree: they are not in ``parameters()``,
``state_dict()`` or the saved safetensors, so an optimizer over ``drafter.parameters()`` cannot
touch them and a checkpoint holds only the drafter's own weights. The config records the target
(name, vocabulary, hidden size, depth, layer ids); loading against another target raises a
``ValueError`` naming both targets and the field that differs.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel
from transformers import initialization as hf_init
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from exittrain.core.ngram_copy import check_ngrams, mix_copy, ngram_lookup
from exittrain.models.target import as_dtype
from exittrain.safe_io import check_safetensors, load_json_object

logger = logging.getLogger(__name__)

__all__ = ["BlockDrafter", "DrafterConfig", "check_pairing", "layer_copy_problem", "load_drafter", "new_drafter"]


class DrafterConfig(PreTrainedConfig):
    """Configuration of a :class:`BlockDrafter`; records the target it belongs to.

    ``target_*`` describe the target (empty/0 only in the default instance Hugging Face builds
    internally). ``block_size`` S >= 2 (the drafter predicts K = S - 1 tokens). ``hidden_size``
    D must be a multiple of ``num_heads`` with an even head size. ``intermediate_size`` defaults
    to 3 * D. ``context_window``: see the module docstring.
    """

    model_type = "exittrain_block_drafter"
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}

    target_name: str = ""
    target_vocab_size: int = 0
    target_hidden_size: int = 0
    target_num_layers: int = 0
    target_layer_ids: list[int] | None = None
    block_size: int = 8
    hidden_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int | None = None
    mask_token_id: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    context_window: int | None = None
    copy_ngrams: list[int] | None = None
    copy_gate_init: float = 0.7
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = 3 * self.hidden_size
        self.target_layer_ids = [int(x) for x in (self.target_layer_ids or [])]
        self.copy_ngrams = list(self.copy_ngrams or [])
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(
            isinstance(self.block_size, int) and self.block_size >= 2,
            f"block_size={self.block_size!r}: need an int >= 2 (root + at least one predicted token); "
            "set block_size to K + 1 for K draft tokens",
        )
        need(self.num_layers >= 1, f"num_layers={self.num_layers}: need at least 1 drafter layer")
        need(
            self.num_heads >= 1
            and self.hidden_size % self.num_heads == 0
            and (self.hidden_size // self.num_heads) % 2 == 0,
            f"hidden_size={self.hidden_size} and num_heads={self.num_heads}: hidden_size must be a multiple "
            "of num_heads with an even head size (rotary); change num_heads",
        )
        need(
            self.context_window is None or self.context_window >= 1,
            f"context_window={self.context_window!r}: need None (whole prefix) or a positive int",
        )
        check_ngrams(self.copy_ngrams, "copy_ngrams")
        need(
            0.0 < self.copy_gate_init < 1.0,
            f"copy_gate_init={self.copy_gate_init!r}: need the copy gate's starting value in (0, 1), e.g. 0.7",
        )
        if self.target_num_layers:
            bad = [x for x in self.target_layer_ids if not 0 <= x < self.target_num_layers]
            need(
                bool(self.target_layer_ids) and not bad,
                f"target_layer_ids={self.target_layer_ids}: need a non-empty list of layer ids in "
                f"[0, {self.target_num_layers}) of target {self.target_name!r}",
            )
        if self.mask_token_id is not None and self.target_vocab_size:
            need(
                0 <= self.mask_token_id < self.target_vocab_size,
                f"mask_token_id={self.mask_token_id}: need a token id in [0, {self.target_vocab_size}) or None",
            )

    @property
    def num_draft_tokens(self) -> int:
        """K = block_size - 1."""
        return self.block_size - 1

    @property
    def feature_size(self) -> int:
        """F = len(target_layer_ids) * target_hidden_size."""
        return len(self.target_layer_ids) * self.target_hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# ----------------------------------------------------------------------------------------------
# layers


class DrafterRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def _rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (B, heads, Q, hd) by positions (B, Q) (rotate-half convention, float32 angles)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd))
    angles = positions.float().unsqueeze(-1) * inv_freq  # (B, Q, hd/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(1)  # (B, 1, Q, hd)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(1)
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated * sin).to(x.dtype)


class DrafterAttention(nn.Module):
    """Block queries attend to [context; block] keys/values under a boolean mask."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, self.heads, self.hd = config.hidden_size, config.num_heads, config.head_dim
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)

    def _split(self, x: torch.Tensor) -> torch.Tensor:  # (B, Q, D) -> (B, heads, Q, hd)
        return x.view(x.shape[0], x.shape[1], self.heads, self.hd).transpose(1, 2)

    def forward(self, x, ctx, pos_x, pos_ctx, allowed):
        # x (B, Q, D), ctx (B, C, D), pos_x (B, Q), pos_ctx (B, C), allowed (B, Q, C+Q) bool
        kv_in = torch.cat([ctx, x], dim=1)
        pos_kv = torch.cat([pos_ctx, pos_x], dim=1)
        q = _rotary(self._split(self.q_proj(x)), pos_x, self.theta)
        k = _rotary(self._split(self.k_proj(kv_in)), pos_kv, self.theta)
        v = self._split(self.v_proj(kv_in))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1))
        return self.o_proj(out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))


class DrafterMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size  # noqa: E741
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.attn_norm = DrafterRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = DrafterAttention(config)
        self.mlp_norm = DrafterRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)

    def forward(self, x, ctx, pos_x, pos_ctx, allowed):
        x = x + self.attn(self.attn_norm(x), ctx, pos_x, pos_ctx, allowed)
        return x + self.mlp(self.mlp_norm(x))


# ----------------------------------------------------------------------------------------------
# pairing


def check_pairing(config: DrafterConfig, target, *, check_name: bool = True) -> None:
    """Raise ValueError if a drafter with ``config`` does not belong to ``target``.

    Compares vocabulary size, hidden size, number of layers, the layer ids' range and (unless
    ``check_name=False``) the target name.
    """
    mine, theirs = f"target {config.target_name!r}", f"target {target.name!r}"
    fix = "load the target it was trained for, or train a new drafter with new_drafter(target)"
    checks = [
        ("target_vocab_size", config.target_vocab_size, target.vocab_size),
        ("target_hidden_size", config.target_hidden_size, target.hidden_size),
        ("target_num_layers", config.target_num_layers, target.num_layers),
    ]
    for field, want, got in checks:
        if want != got:
            raise ValueError(f"drafter was saved for {mine} with {field}={want}, but {theirs} has {got}; {fix}")
    bad = [x for x in config.target_layer_ids if not 0 <= x < target.num_layers]
    if bad or not config.target_layer_ids:
        raise ValueError(
            f"drafter target_layer_ids={config.target_layer_ids} (saved for {mine}) are out of range for "
            f"{theirs} with {target.num_layers} layers; {fix}"
        )
    if check_name and config.target_name != target.name:
        raise ValueError(
            f"drafter was saved for {mine} (target_name), but it is being paired with {theirs}; {fix} "
            "(if both are the same model under different names, pass check_name=False)"
        )


# ----------------------------------------------------------------------------------------------
# the model


class BlockDrafter(PreTrainedModel):
    """Block drafter; see the module docstring for the computation and the sharing contract.

    Entry points: :meth:`forward` (decode: given the context features before each root) and
    :meth:`forward_anchors` (training: many anchors per sequence in one pass). Both need
    :meth:`attach_target` first.
    """

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
        self.context_proj = nn.Linear(Fw, D, bias=False)
        self.context_norm = DrafterRMSNorm(D, config.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self.input_proj = nn.Linear(H, D, bias=False) if D != H else None
        self.layers = nn.ModuleList([DrafterLayer(config) for _ in range(config.num_layers)])
        self.norm = DrafterRMSNorm(D, config.rms_norm_eps)
        self.output_proj = nn.Linear(D, H, bias=False) if D != H else None
        # one gate logit per n-gram length, read at the length that matched
        self.copy_gate = nn.Linear(H, len(config.copy_ngrams)) if config.copy_ngrams else None
        # plain dict: the shared target modules stay outside parameters() and state_dict()
        self._shared: dict[str, nn.Module] = {}
        self.post_init()

    def _init_weights(self, module):
        super()._init_weights(module)
        if module is self:
            hf_init.zeros_(self.mask_embedding)
        elif module is getattr(self, "copy_gate", None):
            # also when a drafter saved without the branch is loaded with it: its gate starts here
            hf_init.zeros_(module.weight)
            g = self.config.copy_gate_init
            hf_init.constant_(module.bias, math.log(g / (1.0 - g)))

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
        """Set the mask embedding to the target embedding of ``mask_token_id`` (else zero).

        Not the mean embedding row: in a tied-embedding target such as SmolLM2 the mean row points
        at the rarely trained tokens, so a block that starts near its input predicts those, and the
        fresh drafter's block CE was ~40-80 nats (~144 through an identity block). A zero mask
        starts the mask rows from the context and the root alone: about log V + 1.5 nats.
        """
        table = self._target_module("embeddings").weight
        with torch.no_grad():
            if self.config.mask_token_id is not None:
                self.mask_embedding.copy_(table[self.config.mask_token_id].to(self.mask_embedding))
            else:
                self.mask_embedding.zero_()

    def init_from_target_layers(self, target, source_layers: Sequence[int]) -> None:
        """Copy target decoder layers into the drafter layers (drafter layer i <- ``source_layers[i]``).

        Why: on a few hundred self-distilled answers a randomly initialised drafter learns slowly;
        the target's own top layer already maps its residual stream to next-token logits, a prior
        the block only has to adapt (BENCHMARKS.md §4 measures it). Copied per layer: the two
        RMSNorms, Q and O, the MLP, and K/V with each key/value head repeated for the query heads
        that share it (grouped-query attention, the ``repeat_kv`` order). The final norm is the
        target's. When the target layer just below ``source_layers[0]`` is one of the feature
        layers, the context projection starts as the identity on that layer's slice of the
        features, and the context norm as that source layer's input norm: the first drafter layer
        then reads the context exactly as the target layer reads its input. Needs a Llama-style
        target (:func:`layer_copy_problem`) and a drafter of the target's width, heads and MLP size
        (``new_drafter(init_from_layers=...)`` sets them); else ValueError.
        """
        cfg, tcfg = self.config, target.config
        decoder = target.model.get_decoder()
        sources = [int(x) for x in source_layers]
        problem = layer_copy_problem(target)
        if problem:
            raise ValueError(f"init_from_layers: {problem}; set drafter.init_from_layers=null for a random start")
        if len(sources) != cfg.num_layers or any(not 0 <= x < target.num_layers for x in sources):
            raise ValueError(
                f"init_from_layers={sources}: need {cfg.num_layers} target layer ids (one per drafter layer) "
                f"in [0, {target.num_layers})"
            )
        want = target_layer_shape(target)
        heads = want["num_heads"]
        kv_heads = int(getattr(tcfg, "num_key_value_heads", None) or heads)
        got = {k: getattr(cfg, k) for k in want}
        if got != want:
            raise ValueError(
                f"init_from_layers needs a drafter shaped like the target's layers {want}, got {got}; leave "
                "drafter.hidden_size, num_heads and intermediate_size null to take the target's"
            )
        hd = cfg.head_dim

        def expand_kv(weight: torch.Tensor) -> torch.Tensor:  # (kv_heads*hd, H) -> (heads*hd, H)
            return weight.view(kv_heads, hd, -1).repeat_interleave(heads // kv_heads, dim=0).reshape(heads * hd, -1)

        with torch.no_grad():
            for mine, source in zip(self.layers, sources):
                theirs = decoder.layers[source]
                attn, mlp = theirs.self_attn, theirs.mlp
                mine.attn_norm.weight.copy_(theirs.input_layernorm.weight)
                mine.mlp_norm.weight.copy_(theirs.post_attention_layernorm.weight)
                mine.attn.q_proj.weight.copy_(attn.q_proj.weight)
                mine.attn.k_proj.weight.copy_(expand_kv(attn.k_proj.weight))
                mine.attn.v_proj.weight.copy_(expand_kv(attn.v_proj.weight))
                mine.attn.o_proj.weight.copy_(attn.o_proj.weight)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mine.mlp, name).weight.copy_(getattr(mlp, name).weight)
            self.norm.weight.copy_(decoder.norm.weight)
            below = sources[0] - 1
            if below in cfg.target_layer_ids:
                H, slot = cfg.target_hidden_size, cfg.target_layer_ids.index(below)
                self.context_proj.weight.zero_()
                self.context_proj.weight[:, slot * H : (slot + 1) * H].copy_(torch.eye(H))
                self.context_norm.weight.copy_(decoder.layers[sources[0]].input_layernorm.weight)

    # -- core -------------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def _block_input(self, root_tokens: torch.Tensor) -> torch.Tensor:
        """(..., ) root ids -> (..., S, D) block input rows."""
        dtype = self.context_proj.weight.dtype
        emb = self._target_module("embeddings")(root_tokens.to(self.mask_embedding.device)).to(dtype)
        mask = self.mask_embedding.to(dtype).expand(*root_tokens.shape, self.config.num_draft_tokens, -1)
        block = torch.cat([emb.unsqueeze(-2), mask], dim=-2)  # (..., S, H)
        return self.input_proj(block) if self.input_proj is not None else block

    def _context(self, features: torch.Tensor) -> torch.Tensor:
        if features.shape[-1] != self.config.feature_size:
            raise ValueError(
                f"context features have width {features.shape[-1]}, expected F = {self.config.feature_size} "
                f"(layers {self.config.target_layer_ids} x hidden {self.config.target_hidden_size})"
            )
        return self.context_norm(self.context_proj(features.to(self.context_proj.weight.dtype)))

    def _run(self, x, ctx, pos_x, pos_ctx, allowed) -> torch.Tensor:
        """Layers, norm, output projection. x (B, Q, D) with Q = blocks * S; returns the pre-head
        states (B, Q/S, K, H) of block rows 1..K."""
        for layer in self.layers:
            x = layer(x, ctx, pos_x, pos_ctx, allowed)
        x = self.norm(x)
        if self.output_proj is not None:
            x = self.output_proj(x)
        S = self.config.block_size
        return x.view(x.shape[0], -1, S, x.shape[-1])[:, :, 1:]  # drop the root row

    def copy_terms(
        self, hidden_NKH: torch.Tensor, ids_LT: torch.Tensor, anchors_LA: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The copy branch's ``(copy_ids (N, K) long, gate_logits (N, K))`` for the anchors
        ``anchors_LA`` (L, A) of ``ids_LT`` (L, T) (row n = l * A + a, negative ids = padding),
        given their pre-head states ``hidden_NKH``; None when ``copy_ngrams`` is empty. Call it
        inside a forward (its gate is a drafter parameter, gathered there under FSDP)."""
        if self.copy_gate is None:
            return None
        K = self.config.num_draft_tokens
        copy_LAK, order_LA = ngram_lookup(ids_LT.to(hidden_NKH.device), anchors_LA, self.config.copy_ngrams, K)
        gates_NKG = self.copy_gate(hidden_NKH)  # one logit per n-gram length
        order_N11 = order_LA.reshape(-1, 1, 1).clamp_min(0).expand(-1, K, 1)
        return copy_LAK.reshape(-1, K), gates_NKG.gather(2, order_N11).squeeze(-1)

    def head(self, hidden_NKH: torch.Tensor, copy: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits (N, K, V) of ``q_1..q_K`` from the pre-head states: the frozen target LM head;
        with ``copy`` (:meth:`copy_terms`), the copy-mixed log-probabilities in float32."""
        lm_head = self._target_module("lm_head")
        # back on the drafter's device: with the target's device_map the head may sit on another GPU
        logits = lm_head(hidden_NKH.to(lm_head.weight.dtype)).to(hidden_NKH.device)
        if copy is None:
            return logits
        copy_ids, gate_logits = copy
        return mix_copy(torch.log_softmax(logits.float(), dim=-1), copy_ids, gate_logits.float())

    def _window(self, context_window: int | None) -> int | None:
        W = self.config.context_window if context_window is None else context_window
        if W is not None and (not isinstance(W, int) or W < 1):
            raise ValueError(f"context_window must be None or a positive int, got {W!r}")
        return W

    # -- decode path ------------------------------------------------------------------------------

    def forward(
        self,
        context_features: torch.Tensor,
        root_tokens: torch.Tensor,
        context_mask: torch.Tensor | None = None,
        *,
        context_ids: torch.Tensor | None = None,
        context_window: int | None = None,
        apply_lm_head: bool = True,
    ) -> torch.Tensor:
        """Draft one block per root.

        ``context_features`` (N, C, F): target features of the C positions just before each root,
        right-aligned (column C-1 is the position before the root); ``root_tokens`` (N,);
        ``context_mask`` (N, C) bool, True for real positions (left padding False; default all
        True). With a context window W only the last W columns are used. ``context_ids``
        (N, C') the token ids before each root, right-aligned, negative = padding (any C', the
        window does not apply): required by the copy branch, ignored without it. Returns logits
        (N, K, V), or the pre-head hidden states (N, K, H) with ``apply_lm_head=False``.
        """
        if context_features.dim() != 3:
            raise ValueError(f"context_features must be (N, C, F), got {tuple(context_features.shape)}")
        N, C, _ = context_features.shape
        if root_tokens.shape != (N,):
            raise ValueError(f"root_tokens must be (N={N},), got {tuple(root_tokens.shape)}")
        device = context_features.device
        if context_mask is None:
            context_mask = torch.ones(N, C, dtype=torch.bool, device=device)
        elif context_mask.shape != (N, C):
            raise ValueError(f"context_mask must be (N={N}, C={C}) bool, got {tuple(context_mask.shape)}")
        if self.copy_gate is not None and apply_lm_head and (
            context_ids is None or context_ids.dim() != 2 or context_ids.shape[0] != N
        ):
            got = None if context_ids is None else tuple(context_ids.shape)
            raise ValueError(
                f"this drafter copies n-grams (copy_ngrams={self.config.copy_ngrams}): pass context_ids, the "
                f"(N={N}, C') token ids before each root, got {got}"
            )
        W = self._window(context_window)
        if W is not None and C > W:
            context_features, context_mask, C = context_features[:, -W:], context_mask[:, -W:], W
        S = self.config.block_size
        x = self._block_input(root_tokens.to(device))  # (N, S, D)
        ctx = self._context(context_features)  # (N, C, D)
        pos_ctx = torch.arange(C, device=device).expand(N, C)
        pos_x = torch.arange(C, C + S, device=device).expand(N, S)
        allowed = torch.cat(
            [context_mask.bool().unsqueeze(1).expand(N, S, C), torch.ones(N, S, S, dtype=torch.bool, device=device)],
            dim=2,
        )  # (N, S, C+S)
        hidden = self._run(x, ctx, pos_x, pos_ctx, allowed)[:, 0]  # (N, K, H)
        if not apply_lm_head:
            return hidden
        copy = None
        if self.copy_gate is not None:
            ids = torch.cat([context_ids.to(device=device, dtype=torch.long), root_tokens.view(N, 1).to(device)], dim=1)
            copy = self.copy_terms(hidden, ids, torch.full((N, 1), ids.shape[1] - 1, device=device))
        return self.head(hidden, copy)

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
        :meth:`forward` would with those features as its context. The context is projected once
        per sequence and each anchor's block is masked to its own prefix, so the cost is
        O(A * S * T) attention scores per layer, with no per-anchor gather. Returns logits
        (L*A, K, V) with row n = l * A + a (the tree order of ``TargetModel.score_trees``), or
        hidden states (L*A, K, H) with ``apply_lm_head=False`` (for a sampled-softmax loss). The
        copy branch looks the anchors up in ``input_ids_LT``. ``with_copy_terms``: return
        ``(output, copy)`` with the :meth:`copy_terms` (None without the branch), which a
        sampled loss over hidden states needs.
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
        A = anchors_LA.shape[1]
        S = self.config.block_size
        W = self._window(context_window)

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
        hidden = self._run(x, ctx, pos_x, pos_ctx, allowed).reshape(L * A, S - 1, -1)  # (N, K, H)
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

        Weights are read from safetensors only: a folder holding only a pickled checkpoint
        (``pytorch_model.bin``, ``*.pt``) raises ValueError instead of being unpickled. In a local
        folder, a ``config.json`` that is not a valid JSON object and a weights file that is
        truncated or corrupt raise ValueError naming the file (:func:`_check_saved_files`) before
        Hugging Face reads either.
        """
        folder = Path(pretrained_model_name_or_path) / kwargs.get("subfolder", "")
        config = kwargs.pop("config", None)
        if folder.is_dir():
            _check_saved_files(folder, config_too=config is None)
        if config is None:
            hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only") if k in kwargs}
            config = DrafterConfig.from_pretrained(pretrained_model_name_or_path, **hub)
        if target is not None:
            check_pairing(config, target, check_name=check_name)
        # save_drafter writes safetensors; never fall back to unpickling a .bin (Hugging Face would)
        kwargs["use_safetensors"] = True
        model = super().from_pretrained(pretrained_model_name_or_path, *args, config=config, **kwargs)
        if target is not None:
            model.attach_target(target, check_name=check_name)
        return model


# what to do about a saved drafter folder whose files are bad (exittrain.safe_io adds the file and the cause)
_DRAFTER_FIX = (
    "point warm_start= (fit) or drafter= (eval) at another drafter folder saved by exittrain (RUN_DIR/drafter of a "
    "fit run), or re-export this one with exittrain.lit.save_drafter(drafter, path)"
)


def _check_saved_files(folder: str | os.PathLike, *, config_too: bool = True) -> None:
    """Check the files Hugging Face will read from the saved drafter ``folder``, in our words.

    ``config.json`` (when ``config_too``) must be a JSON object; the weights (``model.safetensors``,
    or every shard named by ``model.safetensors.index.json``) must exist and be whole
    safetensors files (:func:`exittrain.safe_io.check_safetensors`: header and size, no tensor
    data read). Raises ValueError naming the bad file and :data:`_DRAFTER_FIX`; a folder with no
    ``*.safetensors`` at all (only a pickled ``.bin``/``.pt``) raises ValueError saying drafters
    load from safetensors only. A missing ``config.json`` is left to Hugging Face's own error.
    """
    folder = Path(folder)
    if config_too and (folder / "config.json").is_file():
        load_json_object(folder / "config.json", what="drafter config", fix=_DRAFTER_FIX)
    if not any(folder.glob("*.safetensors")):
        found = sorted(p.name for p in folder.iterdir())
        raise ValueError(
            f"drafter folder {folder} holds no *.safetensors weights (found {found}); drafters are loaded "
            "from safetensors only, never from pickled .bin/.pt files: re-export it with "
            "exittrain.lit.save_drafter(drafter, path) or drafter.save_pretrained(path)"
        )
    index = folder / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        weight_map = load_json_object(index, what="drafter weights index", fix=_DRAFTER_FIX).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"drafter weights index {index} has no 'weight_map' object: {_DRAFTER_FIX}")
        files = sorted(set(weight_map.values()))
    else:
        files = [SAFE_WEIGHTS_NAME]
    for name in files:
        check_safetensors(folder / name, what="drafter weights", fix=_DRAFTER_FIX)


# ----------------------------------------------------------------------------------------------
# constructors


def target_layer_shape(target) -> dict[str, int]:
    """The drafter settings a copy of ``target``'s layers needs: hidden size, heads, MLP size."""
    cfg = target.config
    return {
        "hidden_size": int(cfg.hidden_size),
        "num_heads": int(cfg.num_attention_heads),
        "intermediate_size": int(cfg.intermediate_size),
    }


def layer_copy_problem(target) -> str | None:
    """Why the drafter layers cannot start as copies of ``target``'s decoder layers, or None.

    A drafter layer is a pre-norm Llama layer: RMSNorm, attention with Q/K/V/O projections and
    rotary positions, RMSNorm, SiLU-gated MLP, no biases. Targets whose layers add anything it
    lacks (attention biases as in Qwen2, per-head Q/K norms as in Qwen3, another activation)
    would be copied into a different function, so they are refused.
    """
    cfg = target.config
    decoder = target.model.get_decoder()
    layer = decoder.layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    parts = [(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")] + [
        (mlp, n) for n in ("gate_proj", "up_proj", "down_proj")
    ] + [(layer, "input_layernorm"), (layer, "post_attention_layernorm"), (decoder, "norm")]
    missing = [n for owner, n in parts if owner is None or not hasattr(owner, n)]
    if missing:
        return f"target {target.name!r} layers are not Llama-style (no {missing})"
    if any(getattr(getattr(attn, n), "bias", None) is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return f"target {target.name!r} has attention biases, which drafter layers lack"
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        return f"target {target.name!r} normalises queries and keys per head, which drafter layers do not"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"target {target.name!r} uses activation {cfg.hidden_act!r}; drafter layers use silu"
    return None


def default_layer_ids(num_layers: int) -> list[int]:
    """About three target layers spread over its depth: [2, L // 2, L - 2], deduplicated."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 2, 0)})


def _default_heads(hidden_size: int) -> int:
    for head_dim in (64, 32, 16, 8, 4, 2):
        if hidden_size % head_dim == 0:
            return hidden_size // head_dim
    raise ValueError(f"hidden_size={hidden_size} has no even head size; pass num_heads and an even hidden_size")


def new_drafter(
    target,
    *,
    block_size: int = 8,
    num_layers: int = 2,
    hidden_size: int | None = None,
    num_heads: int | None = None,
    intermediate_size: int | None = None,
    layer_ids: Sequence[int] | None = None,
    mask_token_id: int | None = None,
    context_window: int | None = None,
    rope_theta: float | None = None,
    init_from_layers: Sequence[int] | str | None = None,
    copy_ngrams: Sequence[int] | None = None,
    copy_gate_init: float = 0.7,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = torch.float32,
    seed: int | None = None,
) -> BlockDrafter:
    """A fresh drafter for ``target`` (attached), on ``device`` (default: the target's device).

    ``hidden_size`` defaults to the target's (then no input/output projections); ``layer_ids``
    to :func:`default_layer_ids`; ``num_heads`` to hidden_size / 64 (or the largest even head
    size that divides it); ``rope_theta`` to 10000. ``init_from_layers`` (one target layer id per
    drafter layer) starts the drafter layers as copies of those target layers
    (:meth:`BlockDrafter.init_from_target_layers`); the heads, MLP size and rope theta then
    default to the target's. ``"auto"`` copies the target's last layer into every drafter layer
    when :func:`layer_copy_problem` finds none and the shape settings left to the target allow
    it, and otherwise starts at random, logging why. ``copy_ngrams`` (e.g. [3, 2]; None or []
    = off) and ``copy_gate_init`` set the n-gram copy branch (module docstring, step 5). ``seed``
    makes the initialisation reproducible.
    """
    if isinstance(init_from_layers, str):
        if init_from_layers != "auto":
            raise ValueError(
                f"init_from_layers={init_from_layers!r}: use null (random start), 'auto', or a list of target "
                "layer ids, one per drafter layer"
            )
        problem = layer_copy_problem(target)
        if not problem:
            wanted = target_layer_shape(target)
            fixed = {"hidden_size": hidden_size, "num_heads": num_heads, "intermediate_size": intermediate_size}
            clash = {k: v for k, v in fixed.items() if v is not None and v != wanted[k]}
            if clash:
                problem = f"the drafter sets {clash}, unlike the target's layers {wanted}"
        if problem:
            logger.info("drafter layers start at random (init_from_layers=auto): %s", problem)
            init_from_layers = None
        else:
            init_from_layers = [target.num_layers - 1] * num_layers
    hidden_size = hidden_size or target.hidden_size
    if init_from_layers is not None:
        tcfg, shape = target.config, target_layer_shape(target)
        num_heads = num_heads or shape["num_heads"]
        intermediate_size = intermediate_size or shape["intermediate_size"]
        rope = getattr(tcfg, "rope_parameters", None) or {}
        rope_theta = rope_theta or rope.get("rope_theta") or getattr(tcfg, "rope_theta", None)
        norm_eps = float(getattr(tcfg, "rms_norm_eps", None) or DrafterConfig.rms_norm_eps)
    else:
        norm_eps = DrafterConfig.rms_norm_eps
    rope_theta = float(rope_theta or 10000.0)
    layer_ids = (
        target.check_layers(layer_ids, "layer_ids") if layer_ids is not None else default_layer_ids(target.num_layers)
    )
    config = DrafterConfig(
        target_name=target.name,
        target_vocab_size=target.vocab_size,
        target_hidden_size=target.hidden_size,
        target_num_layers=target.num_layers,
        target_layer_ids=list(layer_ids),
        block_size=block_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads or _default_heads(hidden_size),
        intermediate_size=intermediate_size,
        mask_token_id=mask_token_id,
        context_window=context_window,
        copy_ngrams=list(copy_ngrams or []),
        copy_gate_init=copy_gate_init,
        rope_theta=rope_theta,
        rms_norm_eps=norm_eps,
    )
    if seed is not None:
        torch.manual_seed(seed)
    drafter = BlockDrafter(config).attach_target(target)
    drafter.init_mask_embedding()
    if init_from_layers is not None:
        drafter.init_from_target_layers(target, init_from_layers)
    return drafter.to(device=device or target.device, dtype=as_dtype(dtype))


def load_drafter(
    path,
    target,
    *,
    device: str | torch.device | None = None,
    dtype: torch.dtype | str = torch.float32,
    check_name: bool = True,
    **hf_kwargs,
) -> BlockDrafter:
    """Load a saved drafter and attach ``target``; ValueError if it was saved for another target."""
    drafter = BlockDrafter.from_pretrained(
        path, target=target, check_name=check_name, dtype=as_dtype(dtype), **hf_kwargs
    )
    return drafter.to(device or target.device)
