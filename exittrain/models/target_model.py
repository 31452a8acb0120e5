"""The frozen target wrapper: :class:`TargetModel` and the hooks that capture decoder-layer outputs.

The conventions (layer ids, tree attention, caches, devices), the shape legend and the limits are
stated in :mod:`exittrain.models.target`, the public face of the target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from exittrain.models.row_matmul import head_rows, is_plain_head
from exittrain.models.target_decode import TargetDecoding
from exittrain.models.target_scoring import TreeScoring

__all__ = ["SUPPORTED_ATTENTION", "TargetModel", "layer_output_hooks"]

SUPPORTED_ATTENTION = ("eager", "sdpa")
"""Attention implementations that apply a 4D additive mask as given (tree attention needs one)."""

PLAIN_HEAD_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""Model types whose causal-LM logits are ``lm_head(decoder(...).last_hidden_state)``, with no
scaling or soft-capping (read in their transformers modelling code): the tree forward may apply
the head itself (:meth:`TargetModel._causal_lm_logits`)."""


@contextlib.contextmanager
def layer_output_hooks(
    model: nn.Module, layers: Sequence[int], sink: Callable[[int, torch.Tensor], None]
) -> Iterator[None]:
    """Call ``sink(layer_id, output)`` with the output of decoder layer ``layer_id`` of a Hugging
    Face causal LM (the layer-id convention of :mod:`exittrain.models.target`) at every forward of it,
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

    The decoding operations (:meth:`prefill`, :meth:`tree_forward`, :meth:`commit`) come from
    :class:`~exittrain.models.target_decode.TargetDecoding`, the training-time scoring
    (:meth:`score_trees`, :meth:`sequence_features`, :meth:`token_top_logprobs`) from
    :class:`~exittrain.models.target_scoring.TreeScoring`; this class holds what both use.
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
        if attn not in SUPPORTED_ATTENTION:
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
        """Validate target layer ids (the convention of :mod:`exittrain.models.target`); returns them as a list."""
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

    def _causal_lm_logits(self, **kwargs) -> torch.Tensor:
        """``self.model(**kwargs).logits``. Where the model's logits are its plain LM head applied to
        the decoder's last hidden state (:data:`PLAIN_HEAD_MODEL_TYPES`, a plain head:
        :func:`~exittrain.models.row_matmul.is_plain_head`), the decoder runs alone and the head goes through
        :func:`~exittrain.models.row_matmul.head_rows`: a few tree rows in the layout this host
        runs faster. Same numbers up to float summation order."""
        head = self.lm_head
        if getattr(self.config, "model_type", None) not in PLAIN_HEAD_MODEL_TYPES or not is_plain_head(head):
            return self.model(**kwargs).logits
        hidden = self._decoder(**kwargs).last_hidden_state
        return head_rows(hidden.to(head.weight.device), head.weight)

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
