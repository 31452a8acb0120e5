"""The frozen target wrapper: :class:`TargetModel` and the hooks that capture decoder-layer outputs.

Its decoding operations are in :mod:`exittrain.models.target_decode`, its training-time scoring in
:mod:`exittrain.models.target_scoring` and its loaders in :mod:`exittrain.models.target_loading`;
the conventions all of them follow are stated here.

docs/algorithm.md section 3. The target is a Hugging Face causal LM (Llama, Mistral, Phi-3, Qwen2,
Qwen3, Qwen3-MoE, Gemma 3, ...: docs/models.md lists what is tested and what is
refused) wrapped in :class:`TargetModel`, which never trains: its
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
implementation, and the model's own sliding window is not applied on top of it: for a
sliding-window layer (window w) the tree mask itself hides every key at ``query position - key
position >= w``, as the plain forward of the path does, and a model with both kinds of layers gets
a dict of masks by layer type (:func:`~exittrain.models.target_model.attention_windows`). On
``sdpa`` these forwards run :mod:`exittrain.models.grouped_attention` (the ``grouped_attention``
option, on by default), so grouped query heads read the cached keys in place on a CPU rather than
copies per head.
:class:`TargetModel` refuses at load time what a tree mask cannot express (bidirectional or
chunked attention, other layer types, attention soft-capping under sdpa), and a tree forward past
the limit of a position-dependent rotary embedding (``dynamic``, ``longrope``:
:func:`~exittrain.models.target_model.position_limit`). Padding nodes of a
:class:`~exittrain.core.DraftTree` see only the root and themselves, so they change no other row.

**Caches.** Decoding uses a ``transformers.DynamicCache`` whose layers are ``DynamicLayer``
(keys and values of shape (batch, kv_heads, seq, head_dim), grown by concatenation).
:meth:`TargetModel.new_cache` builds one for sliding-window layers too (transformers would drop
the keys that leave the window), so those layers hold the whole context.
:meth:`TargetModel.commit` gathers the kept positions along the sequence dimension of each
layer, so the cache then equals the cache of the plain accepted sequence.

**Devices.** Everything a method returns lives on :attr:`TargetModel.device`, the input
embeddings' device, where input ids go and where the drafter must run (it applies the shared
embeddings; the training module checks the drafter's device at fit start). This matters with
``device_map`` over several GPUs: the captured layer outputs sit on their layers' GPUs and the LM
head may sit on the last one. ``Tensor.to`` returns the tensor itself when it is already there,
so a single-device target pays no copy.

**Options.** What a decode may change about the tree forwards is given to the target's
constructor (or :meth:`TargetModel.with_options`, a new wrapper over the same model) and fixed for
the object's life; nothing outside the object switches it: ``row_kernels`` (faster products for a
tree forward's few rows, entered around each tree forward), ``head_product`` (the plain LM head's
product, :mod:`exittrain.models.head_product`) and ``grouped_attention``. Their defaults are what
training and the plain decoder run: ``F.linear`` everywhere, grouped attention on.

**Limits.** Batch decoding with per-row acceptance (ragged caches) is not supported: ``commit``
takes one row. ``score_trees`` returns full-vocabulary logits, (N, B+1, V) in the model dtype;
``chunk_size`` bounds the activations of one forward, not these logits: for a large vocabulary
call it on fewer anchors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from exittrain.models.grouped_attention import grouped_query_attention
from exittrain.models.head_product import HeadProduct, apply_head, is_plain_head
from exittrain.models.target_decode import TargetDecoding
from exittrain.models.target_scoring import TreeScoring

__all__ = ["SUPPORTED_ATTENTION", "TargetModel", "attention_windows", "layer_output_hooks", "position_limit"]

SUPPORTED_ATTENTION = ("eager", "sdpa")
"""Attention implementations that apply a 4D additive mask as given (tree attention needs one)."""

PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe"})
"""Model types whose causal-LM logits are ``lm_head(decoder(...).last_hidden_state)``, with no
scaling or soft-capping (read in their transformers modelling code): the tree forward may apply
the head itself (:meth:`TargetModel._causal_lm_logits`)."""


@contextlib.contextmanager
def layer_output_hooks(
    model: nn.Module, layers: Sequence[int], sink: Callable[[int, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``sink(layer_id, output)`` with the output of decoder layer ``layer_id`` of a Hugging
    Face causal LM (the layer-id convention in this module's docstring) at every forward of it, while
    the context is open. Each id is hooked once; the hooks are removed on exit."""
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


def _family(config) -> str:
    return str(getattr(config, "model_type", None) or type(config).__name__)


def attention_windows(config) -> dict[str, int | None]:
    """The attention kinds of a decoder config: ``{layer type: sliding window or None (full)}``.

    What transformers 5.x does with the config (read in ``masking_utils`` and the modelling files
    of Llama, Mistral, Phi-3, Qwen2, Qwen3, Qwen3-MoE and Gemma 3): a config with ``layer_types``
    gives each layer ``"full_attention"`` or ``"sliding_attention"`` (window ``sliding_window``),
    and the model looks each layer's mask up by its type; a config without them (Mistral, Phi-3,
    Qwen3-MoE) uses one mask for every layer, sliding when ``sliding_window`` is set (and
    ``use_sliding_window`` is not False). Sliding means: position p sees key position k only when
    ``p - k < sliding_window``. Families beyond those read are taken to follow the same
    convention; README.md "Model families tested" lists the ones whose exactness is tested.

    ValueError (naming the family and the reason) for what a tree mask cannot reproduce:
    non-causal or bidirectional attention, and any other layer type (chunked attention,
    linear-attention or state-space layers).
    """
    family = _family(config)
    if not getattr(config, "is_causal", True) or getattr(config, "use_bidirectional_attention", False):
        raise ValueError(
            f"target family {family!r}: its config makes attention bidirectional (is_causal=False or "
            "use_bidirectional_attention=True); a draft tree needs causal attention: load a causal LM"
        )
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", None) is False:  # the Qwen convention: the window is switched off
        window = None
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return {"sliding_attention": int(window)} if window is not None else {"full_attention": None}
    kinds = sorted(set(layer_types))
    unknown = [k for k in kinds if k not in ("full_attention", "sliding_attention")]
    if unknown:
        raise ValueError(
            f"target family {family!r} has layer types {unknown}: tree scoring reproduces full and "
            "sliding-window causal attention only (a 4D tree mask cannot express the others)"
        )
    if "sliding_attention" in kinds and (not isinstance(window, int) or window < 1):
        raise ValueError(
            f"target family {family!r} has sliding-attention layers but sliding_window={window!r}; "
            "set config.sliding_window to the window the model was trained with"
        )
    return {k: (int(window) if k == "sliding_attention" else None) for k in kinds}


_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def position_limit(config) -> int | None:
    """The positions below which the rotary frequencies do not depend on the forward, or None.

    ``dynamic`` (NTK) and ``longrope`` rotary embeddings recompute their frequencies from the
    largest position id of each forward (transformers' ``dynamic_rope_update``): beyond
    ``max_position_embeddings`` (dynamic) or ``original_max_position_embeddings`` (longrope) a tree
    forward, whose largest position is its deepest node, would rotate a node's keys differently
    from the plain forward of that node's path. Below the limit both use the base frequencies.
    Every other rotary type (default, linear, llama3, yarn) is static: None.
    """
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):
        groups = list(params.values())  # per layer type (Gemma 3)
    else:
        groups = [params]
    limits = []
    for group in groups:
        kind = str(group.get("rope_type", group.get("type", "default")))
        if not any(word in kind for word in _POSITION_DEPENDENT_ROPE):
            continue
        if "longrope" in kind:
            limit = group.get("original_max_position_embeddings") or getattr(
                config, "original_max_position_embeddings", None)
        else:
            limit = getattr(config, "max_position_embeddings", None)
        limits.append(int(limit or 0))
    return min(limits) if limits else None


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


class TargetModel(TargetDecoding, TreeScoring):
    """A frozen Hugging Face causal LM with the tree operations exittrain needs.

    Deliberately not an ``nn.Module``: assigning it to a LightningModule or a drafter attribute
    must not register the target's weights as parameters or checkpoint entries.

    Attributes: ``model`` (the HF model), ``tokenizer`` (or None), ``name`` (identifies the
    target for drafter pairing), ``vocab_size`` (rows of the LM head), ``hidden_size``,
    ``num_layers``, ``eos_token_id`` (primary) and ``eos_token_ids`` (all stop ids).
    ``input_embeddings`` and ``lm_head`` are the modules a drafter shares.

    ``family`` is the config's ``model_type``; ``attention_windows`` its attention kinds
    (:func:`attention_windows`), which the tree masks reproduce; ``position_limit`` the position a
    tree may not reach, for a position-dependent rotary embedding (:func:`position_limit`), else None.

    Options (keyword arguments, fixed for the object's life; :meth:`with_options` gives a wrapper
    with others over the same model):

    - ``row_kernels``: faster products for a tree forward's few rows, or None (``F.linear``, as in
      training and the plain decoder). An object with ``active()``, a context every tree forward
      runs in (the kernels' forwards while open), and ``apply(module, x)``, a linear's output from
      the kernels or None where the module's own product must run; the plain LM head's logits go
      through ``apply`` first. The CPU decoder passes its packed linears
      (:class:`exittrain.cpu_decode.fast_products.RowKernels`).
    - ``head_product``: the plain LM head's product where ``row_kernels`` gives none
      (:mod:`exittrain.models.head_product`); None: ``F.linear``.
    - ``grouped_attention`` (default True): tree forwards on sdpa read grouped key/value heads in
      place (:mod:`exittrain.models.grouped_attention`); False runs transformers' sdpa, which
      repeats them (the reference twin, for side-by-side timing).

    The decoding operations (:meth:`prefill`, :meth:`tree_forward`, :meth:`commit`) come from
    :class:`~exittrain.models.target_decode.TargetDecoding`, the training-time scoring
    (:meth:`score_trees`, :meth:`sequence_features`, :meth:`token_top_logprobs`) from
    :class:`~exittrain.models.target_scoring.TreeScoring`; this class holds what both use.
    """

    def __init__(self, model: nn.Module, tokenizer=None, *, name: str, row_kernels=None,
                 head_product: HeadProduct | None = None, grouped_attention: bool = True):
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string identifying the target, got {name!r}")
        config = model.config.get_text_config(decoder=True)
        self.family = _family(config)
        self.attention_windows = self._check_supported(model, config)
        self.position_limit = position_limit(config)
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.config = config
        self._set_options(row_kernels, head_product, grouped_attention)
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

    def _set_options(self, row_kernels, head_product, grouped_attention) -> None:
        """Check and keep the options (see the class docstring); ValueError naming the option."""
        if row_kernels is not None and not (callable(getattr(row_kernels, "active", None))
                                            and callable(getattr(row_kernels, "apply", None))):
            raise ValueError(f"row_kernels must be None or an object with active() and apply(module, x), got "
                             f"{type(row_kernels).__name__}")
        if head_product is not None and not callable(head_product):
            raise ValueError(f"head_product must be None (F.linear) or a function (x, weight) -> logits, got "
                             f"{type(head_product).__name__}")
        if not isinstance(grouped_attention, bool):
            raise ValueError(f"grouped_attention must be True or False, got {grouped_attention!r}")
        self.row_kernels, self.head_product, self.grouped_attention = row_kernels, head_product, grouped_attention

    def with_options(self, *, row_kernels=None, head_product: HeadProduct | None = None,
                     grouped_attention: bool = True) -> TargetModel:
        """A wrapper over the same model, tokenizer and attributes with these options (see the class
        docstring); an option not given takes its default, not this wrapper's. This one is unchanged."""
        other = copy.copy(self)
        other._set_options(row_kernels, head_product, grouped_attention)
        return other

    @staticmethod
    def _check_supported(model: nn.Module, config) -> dict[str, int | None]:
        """What tree scoring needs of the model; returns :func:`attention_windows` of its config.

        ValueError, naming the family, the reason and the fix: an attention implementation that
        ignores a 4D mask, attention logit soft-capping under sdpa (which cannot apply it), layer
        types a tree mask cannot express (:func:`attention_windows`), no LM head.
        """
        family = _family(config)
        attn = getattr(config, "_attn_implementation", None) or "eager"
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"tree attention needs a 4D additive mask, which attn_implementation={attn!r} ignores; "
                f"load the target with attn_implementation='sdpa' (or 'eager')"
            )
        if getattr(config, "attn_logit_softcapping", None) is not None and attn != "eager":
            raise ValueError(
                f"target family {family!r} soft-caps its attention logits (attn_logit_softcapping="
                f"{config.attn_logit_softcapping}), which attn_implementation={attn!r} cannot apply; load it with "
                "attn_implementation='eager' (load_target's default 'auto' does)"
            )
        windows = attention_windows(config)
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError(f"{type(model).__name__} has no LM head; pass a *ForCausalLM model")
        return windows

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
        """An empty ``DynamicCache`` for this target whose layers all keep every position.

        transformers would give a sliding-window layer a ``DynamicSlidingWindowLayer``, which drops
        the keys that fall out of the window; tree forwards and :meth:`commit` index the cache by
        position, so every layer is a plain ``DynamicLayer`` here, and the window is applied by the
        mask instead (the model's own for plain forwards, :meth:`_additive` for trees). The cost:
        sliding layers hold the whole context, as full-attention layers do.
        """
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        cache = DynamicCache(config=self.model.config)
        cache.layers = [DynamicLayer() if getattr(layer, "is_sliding", False) else layer for layer in cache.layers]
        return cache

    def _check_positions(self, last_position: int, what: str) -> None:
        """ValueError when a forward reaches ``last_position`` at or past :attr:`position_limit`
        (position-dependent rotary embeddings: :func:`position_limit`); no-op for other targets."""
        if self.position_limit is not None and last_position >= self.position_limit:
            raise ValueError(
                f"{what} reaches position {last_position}, but target {self.name!r} ({self.family}) uses a rotary "
                f"embedding whose frequencies change past position {self.position_limit - 1} with the longest "
                "position of each forward, so a tree forward would no longer equal the sequential forward of "
                f"each path: keep context + tree depth under {self.position_limit} tokens (data.max_length, "
                "eval.max_new_tokens)"
            )

    def check_layers(self, layers: Sequence[int] | None, argument: str = "layers") -> list[int] | None:
        """Validate target layer ids (the convention in this module's docstring); returns them as a list."""
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

    def plain_head(self) -> nn.Module | None:
        """The LM head where the logits are it applied to the decoder's last hidden state
        (:data:`PLAIN_HEAD_MODEL_TYPES`, :func:`~exittrain.models.head_product.is_plain_head`), else None."""
        head = self.lm_head
        plain = getattr(self.config, "model_type", None) in PLAIN_HEAD_MODEL_TYPES and is_plain_head(head)
        return head if plain else None

    def tree_linears(self) -> list[nn.Module]:
        """The modules a tree forward runs on its few rows: the decoder layers' and the LM head."""
        return [*self._decoder.layers.modules(), self.lm_head]

    def _row_kernels_active(self):
        """The :attr:`row_kernels`' forwards while open; nothing without them."""
        return contextlib.nullcontext() if self.row_kernels is None else self.row_kernels.active()

    def _tree_attention(self):
        """Open around a forward under a 4D tree mask: with :attr:`grouped_attention`, on sdpa,
        grouped query heads read their key/value heads in place instead of copies of the cache
        (:mod:`exittrain.models.grouped_attention`)."""
        return grouped_query_attention(self.config) if self.grouped_attention else contextlib.nullcontext()

    def _causal_lm_logits(self, **kwargs) -> torch.Tensor:
        """``self.model(**kwargs).logits``. Where the model's logits are its plain LM head applied to
        the decoder's last hidden state (:data:`PLAIN_HEAD_MODEL_TYPES`, a plain head:
        :func:`~exittrain.models.head_product.is_plain_head`), the decoder runs alone and the head is
        applied here: by the :attr:`row_kernels` option where it gives the product, else by the
        :attr:`head_product` option (None: ``F.linear``). Same numbers up to float summation order."""
        head = self.plain_head()
        if head is None:
            return self.model(**kwargs).logits
        hidden = self._decoder(**kwargs).last_hidden_state.to(head.weight.device)
        fast = None if self.row_kernels is None else self.row_kernels.apply(head, hidden)
        return apply_head(hidden, head.weight, self.head_product) if fast is None else fast

    def _mask_value(self) -> float:
        return torch.finfo(self.dtype).min

    def _additive(
        self,
        allowed: torch.Tensor,
        query_positions: torch.Tensor | None = None,
        key_positions: torch.Tensor | None = None,
    ):
        """bool (N, Q, KV) allowed-matrix -> the ``attention_mask`` the model takes for it.

        A full-attention target gets one (N, 1, Q, KV) additive mask in the model dtype, and the
        positions are not read. A target with sliding-window layers (:attr:`attention_windows`)
        needs ``query_positions`` (N, Q) and ``key_positions`` (N, KV), the position ids of the
        rows and of the keys: transformers applies a custom 4D mask as given, without the model's
        own window, so for a layer with window w the mask also hides every key with
        ``query - key >= w``, as the plain forward of the path would. One kind of layer gets one
        tensor; mixed kinds a dict ``{layer type: mask}``, which the models with ``layer_types``
        look their layers' masks up in. ValueError without the positions.
        """
        if set(self.attention_windows.values()) == {None}:
            return self._additive_one(allowed)
        if query_positions is None or key_positions is None:
            raise ValueError(
                f"target {self.name!r} ({self.family}) has sliding-window attention {self.attention_windows}: a "
                "tree mask must also hide the keys outside each row's window; pass query_positions and "
                "key_positions to _additive"
            )
        distance = query_positions.to(allowed.device).unsqueeze(-1) - key_positions.to(allowed.device).unsqueeze(-2)
        masks = {
            kind: self._additive_one(allowed if window is None else allowed & (distance < window))
            for kind, window in self.attention_windows.items()
        }
        return next(iter(masks.values())) if len(masks) == 1 else masks

    def _additive_one(self, allowed: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=allowed.device)
        mask.masked_fill_(~allowed, self._mask_value())
        return mask.unsqueeze(1)

    def _check_ids(self, input_ids: torch.Tensor, argument: str, dims: int) -> None:
        if not torch.is_tensor(input_ids) or input_ids.dim() != dims or input_ids.dtype != torch.long:
            shape = tuple(input_ids.shape) if torch.is_tensor(input_ids) else type(input_ids).__name__
            raise ValueError(f"{argument} must be a {dims}-D long tensor of token ids, got {shape}")
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= self.vocab_size):
            raise ValueError(f"{argument} holds token ids outside [0, {self.vocab_size})")
