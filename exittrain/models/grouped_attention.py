"""Masked attention over grouped keys and values without copying the cache per query head.

A target with grouped-query attention (several query heads share one key/value head: SmolLM2-135M
has 9 query heads over 3) keeps its cache at the key/value heads' width. Under a 4D attention
mask, which every tree forward passes (:mod:`exittrain.models.target_model`), transformers' ``sdpa``
attention copies the keys and values out to every query head (``repeat_kv``) before the kernel,
in every layer and every forward: the whole cached context, twice per layer. It does so because
on CUDA a mask with ``enable_gqa`` falls back to the slow math kernel. On a CPU the fused kernel
takes the mask and ``enable_gqa`` together, reads each key/value head for its group in place, and
gives the same numbers bit for bit on the hosts measured.

:func:`grouped_sdpa_forward` is that attention: ``enable_gqa`` under a mask on CPU tensors, and
transformers' own ``sdpa_attention_forward`` (its reference twin) for everything else: no mask,
no groups, another device, dropout, soft-capping, a position bias. It is registered with
transformers' ``AttentionInterface`` as :data:`GROUPED_SDPA`, and :func:`grouped_query_attention`
sets a config from ``sdpa`` to it while open. A config on ``eager`` or anything else is left alone.
Who opens it is an explicit option of the target:
:class:`~exittrain.models.target_model.TargetModel`'s ``grouped_attention`` (default True), read by
the tree forwards and the training-time tree scoring; a target made with
``grouped_attention=False`` runs transformers' sdpa, which repeats the keys (the reference twin,
for side-by-side timing: ``bench rows --attention grouped repeated``). This module holds no switch.

Measured in the profile of one tree forward of 2 rows over 300 tokens of context (SmolLM2-135M
in fp32, 2 cores of an AMX Xeon under the AVX2 emulation): the copies took 8 of its ~73 ms of
CPU time, and the one-row greedy step, which transformers already runs grouped, none.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

__all__ = ["GROUPED_SDPA", "grouped_query_attention", "grouped_sdpa_forward"]

GROUPED_SDPA = "exittrain_grouped_sdpa"
"""The name :func:`grouped_sdpa_forward` is registered under in transformers' ``AttentionInterface``."""

def _runs_grouped(module, query: torch.Tensor, attention_mask, dropout: float, kwargs: dict) -> bool:
    """Whether :func:`grouped_sdpa_forward` takes its own path: grouped heads under a mask on CPU,
    with nothing the fused call below does not apply (dropout, soft-capping, a position bias,
    attention weights asked back)."""
    return (
        getattr(module, "num_key_value_groups", 1) > 1
        and attention_mask is not None
        and query.device.type == "cpu"
        and not dropout
        and kwargs.get("softcap") is None
        and kwargs.get("position_bias") is None
        and not kwargs.get("output_attentions", False)
    )


def grouped_sdpa_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` (N, heads, Q, D), ``key``/``value``
    (N, kv_heads, KV, D), ``attention_mask`` (N or 1, 1, Q, KV) additive or boolean, or None.
    Returns the output (N, Q, heads, D) and no weights. See the module docstring for when it runs
    ``enable_gqa`` and when it hands over to ``sdpa_attention_forward``."""
    if not _runs_grouped(module, query, attention_mask, dropout, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                                      **kwargs)
    out_NHQD = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                              enable_gqa=True)
    return out_NHQD.transpose(1, 2).contiguous(), None


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa_forward)


@contextlib.contextmanager
def grouped_query_attention(config) -> Iterator[None]:
    """While open, a config whose ``_attn_implementation`` is ``sdpa`` runs :data:`GROUPED_SDPA`
    (the setter carries it to sub-configs); ``sdpa`` comes back on exit, also after an error.
    Any other implementation is left as it is. The masks passed must be 4D, as the tree forwards'
    are: transformers builds no mask for an implementation it does not know."""
    if getattr(config, "_attn_implementation", None) != "sdpa":
        yield
        return
    config._attn_implementation = GROUPED_SDPA
    try:
        yield
    finally:
        config._attn_implementation = "sdpa"
