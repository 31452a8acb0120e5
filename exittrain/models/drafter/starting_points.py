"""Starting points of a block drafter: default layer ids and heads, and copies of target layers.

:func:`copy_target_layers` starts each drafter layer as a copy of a target decoder layer. Why: on
a few hundred self-distilled answers a randomly initialised drafter learns slowly; the target's
own top layer already maps its residual stream to next-token logits, a prior the block only has
to adapt (BENCHMARKS.md §4 measures it). The copy is only a starting point: the parameters are
the drafter's own afterwards and are saved in the usual layout, so a drafter started this way is
as exportable as any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["copy_target_layers", "default_heads", "default_layer_ids", "layer_copy_problem", "target_layer_shape"]


def target_layer_shape(target) -> dict[str, int]:
    """The drafter settings a copy of ``target``'s layers needs: width, heads, head size, MLP size."""
    cfg = target.config
    heads = int(cfg.num_attention_heads)
    return {
        "hidden_size": int(cfg.hidden_size),
        "num_heads": heads,
        "num_key_value_heads": int(getattr(cfg, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
        "intermediate_size": int(cfg.intermediate_size),
    }


def layer_copy_problem(target) -> str | None:
    """Why the drafter layers cannot start as copies of ``target``'s decoder layers, or None.

    A drafter layer is a pre-norm Qwen3-style layer: RMSNorm, attention with Q/K/V/O projections,
    per-head Q/K RMSNorms and rotary positions, RMSNorm, SiLU-gated MLP, no biases. Llama- and
    Qwen3-style targets are copied; targets whose layers add anything it lacks (attention biases
    as in Qwen2, another activation) would be copied into a different function, so they are
    refused. A Llama layer has no Q/K norms: those start at ones (they then rescale each head's
    queries and keys to norm sqrt(hd)), so the copy starts near, not at, the target layer.
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
        return f"target {target.name!r} layers are not Llama/Qwen3-style (no {missing})"
    if any(getattr(getattr(attn, n), "bias", None) is not None for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return f"target {target.name!r} has attention biases, which drafter layers lack"
    # transformers names the MLP activation hidden_act in most families, hidden_activation in Gemma's
    activation = getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None) or "silu"
    if activation != "silu":
        return f"target {target.name!r} uses activation {activation!r}; drafter layers use silu"
    extra = [n for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm") if hasattr(layer, n)]
    if extra:
        return f"target {target.name!r} layers have norms drafter layers lack ({extra})"
    return None


def copy_target_layers(drafter, target, source_layers: Sequence[int]) -> None:
    """Copy target decoder layers into ``drafter``'s layers (drafter layer i <- ``source_layers[i]``).

    Copied per layer: the two RMSNorms, Q/K/V/O (grouped-query heads as they are), the Q/K norms
    when the target has them (Qwen3; else they stay at ones), the MLP. The final norm is the
    target's. When the target layer just below ``source_layers[0]`` is one of the feature layers,
    ``fc`` starts as the identity on that layer's slice of the features, and ``hidden_norm`` as
    that source layer's input norm: the first drafter layer then reads the context as the target
    layer reads its input. Needs :func:`layer_copy_problem` to find none and a drafter shaped like
    the target's layers (``new_drafter(init_from_layers=...)`` sets it); else ValueError.
    """
    cfg = drafter.config
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
    got = {k: getattr(cfg, k) for k in want}
    if got != want:
        raise ValueError(
            f"init_from_layers needs a drafter shaped like the target's layers {want}, got {got}; leave "
            "drafter.hidden_size, num_heads and intermediate_size null to take the target's"
        )
    with torch.no_grad():
        for mine, source in zip(drafter.layers, sources):
            theirs = decoder.layers[source]
            mine.input_layernorm.weight.copy_(theirs.input_layernorm.weight)
            mine.post_attention_layernorm.weight.copy_(theirs.post_attention_layernorm.weight)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
                if hasattr(theirs.self_attn, name):
                    getattr(mine.self_attn, name).weight.copy_(getattr(theirs.self_attn, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(mine.mlp, name).weight.copy_(getattr(theirs.mlp, name).weight)
        drafter.norm.weight.copy_(decoder.norm.weight)
        below = sources[0] - 1
        if below in cfg.target_layer_ids:
            H, slot = cfg.target_hidden_size, cfg.target_layer_ids.index(below)
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, slot * H : (slot + 1) * H].copy_(torch.eye(H))
            drafter.hidden_norm.weight.copy_(decoder.layers[sources[0]].input_layernorm.weight)


def default_layer_ids(num_layers: int) -> list[int]:
    """About three target layers spread over its depth: [2, L // 2, L - 2], deduplicated."""
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    return sorted({min(2, num_layers - 1), num_layers // 2, max(num_layers - 2, 0)})


def default_heads(hidden_size: int) -> int:
    """hidden_size / 64, or the largest even head size that divides it."""
    for head_dim in (64, 32, 16, 8, 4, 2):
        if hidden_size % head_dim == 0:
            return hidden_size // head_dim
    raise ValueError(f"hidden_size={hidden_size} has no even head size; pass num_heads and an even hidden_size")
