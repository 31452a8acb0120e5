"""The block drafter's layers: Qwen3-style decoder layers whose block queries attend to
``[context; block]`` keys and values (the DFlash layer; module docstring of
:mod:`exittrain.models.drafter.block_drafter`).

Shape legend: B batch rows, Q block rows of one call, C context positions, D drafter width,
Hq query heads, Hkv key/value heads, hd head size.

One attention implementation serves training and decoding: a layer's keys and values of any rows
come from :meth:`DrafterAttention.project_kv` (k_proj, per-head k_norm, rotary at the rows'
positions; v_proj), so the context K/V a decoder caches (:class:`ContextKV`, built by
``BlockDrafter.project_context``) are exactly what the training forward computes in the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from exittrain.models.drafter.configuration import DrafterConfig

__all__ = ["ContextKV", "DrafterAttention", "DrafterLayer", "DrafterMLP", "DrafterRMSNorm", "rotary"]


class DrafterRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in float32; weight starts at ones."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def rotary(x_BhQd: torch.Tensor, positions_BQ: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (B, heads, Q, hd) by integer positions (B, Q): the default rotary embedding in the
    rotate-half layout, angles in float32."""
    hd = x_BhQd.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, device=x_BhQd.device, dtype=torch.float32) / hd))
    angles = positions_BQ.to(x_BhQd.device).float().unsqueeze(-1) * inv_freq  # (B, Q, hd/2)
    cos = torch.cat([angles.cos(), angles.cos()], -1).unsqueeze(1)  # (B, 1, Q, hd)
    sin = torch.cat([angles.sin(), angles.sin()], -1).unsqueeze(1)
    x1, x2 = x_BhQd.float().chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BhQd.float() * cos + rotated * sin).to(x_BhQd.dtype)


@dataclass(frozen=True)
class ContextKV:
    """The context's keys and values in every drafter layer: ``keys[i]``, ``values[i]`` of shape
    (B, Hkv, C, hd), keys already k-normed and rotated at their absolute positions.

    Immutable; :meth:`extend` appends newly committed positions (a decoder's cache grows by it),
    :meth:`crop` keeps the first positions, :meth:`last` the last W (a context window).
    """

    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]

    @property
    def length(self) -> int:
        """C, the number of context positions held."""
        return int(self.keys[0].shape[2]) if self.keys else 0

    @property
    def batch(self) -> int:
        return int(self.keys[0].shape[0])

    def extend(self, new: ContextKV) -> ContextKV:
        """This cache followed by ``new`` (same layers and batch) along the position axis."""
        if len(new.keys) != len(self.keys):
            raise ValueError(f"ContextKV.extend: {len(new.keys)} layers, expected {len(self.keys)}")
        return ContextKV(
            tuple(torch.cat([a, b], dim=2) for a, b in zip(self.keys, new.keys)),
            tuple(torch.cat([a, b], dim=2) for a, b in zip(self.values, new.values)),
        )

    def crop(self, length: int) -> ContextKV:
        """The first ``length`` positions (drops those of rejected rows)."""
        return ContextKV(tuple(k[:, :, :length] for k in self.keys), tuple(v[:, :, :length] for v in self.values))

    def last(self, window: int) -> ContextKV:
        """The last ``window`` positions (all when fewer are held)."""
        if self.length <= window:
            return self
        return ContextKV(tuple(k[:, :, -window:] for k in self.keys), tuple(v[:, :, -window:] for v in self.values))


class DrafterAttention(nn.Module):
    """Block queries over ``[context; block]`` keys/values under a boolean mask (no causal mask
    inside the block: each block row sees all rows of its own block)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, hd = config.hidden_size, config.head_dim
        self.heads, self.kv_heads, self.hd = config.num_heads, config.num_key_value_heads, hd
        self.theta = config.rope_theta
        self.q_proj = nn.Linear(D, self.heads * hd, bias=False)
        self.k_proj = nn.Linear(D, self.kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(D, self.kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.heads * hd, D, bias=False)
        self.q_norm = DrafterRMSNorm(hd, config.rms_norm_eps)
        self.k_norm = DrafterRMSNorm(hd, config.rms_norm_eps)

    def _heads(self, x_BQX: torch.Tensor, n: int) -> torch.Tensor:  # (B, Q, n*hd) -> (B, Q, n, hd)
        return x_BQX.view(x_BQX.shape[0], x_BQX.shape[1], n, self.hd)

    def project_kv(self, x_BQD: torch.Tensor, positions_BQ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_proj, k_norm, rotary at ``positions_BQ``) and values of rows ``x_BQD``, each
        (B, Hkv, Q, hd). The context rows enter here as they are (hidden_norm(fc(features))), with
        no layer norm; the block rows after the layer's input norm."""
        k = self.k_norm(self._heads(self.k_proj(x_BQD), self.kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x_BQD), self.kv_heads).transpose(1, 2)
        return rotary(k, positions_BQ, self.theta), v

    def forward(self, x_BQD, positions_BQ, ctx_k, ctx_v, allowed_BQK):
        """``x_BQD`` normed block rows at ``positions_BQ``; ``ctx_k``/``ctx_v`` (B, Hkv, C, hd) the
        context K/V; ``allowed_BQK`` (B, Q, C + Q) bool: which of [context; block] each row sees."""
        B, Q, _ = x_BQD.shape
        q = rotary(self.q_norm(self._heads(self.q_proj(x_BQD), self.heads)).transpose(1, 2), positions_BQ, self.theta)
        k_blk, v_blk = self.project_kv(x_BQD, positions_BQ)
        k = torch.cat([ctx_k.to(k_blk.dtype), k_blk], dim=2)
        v = torch.cat([ctx_v.to(v_blk.dtype), v_blk], dim=2)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed_BQK.unsqueeze(1), enable_gqa=self.heads != self.kv_heads
        )  # (B, Hq, Q, hd); scale 1/sqrt(hd)
        return self.o_proj(out.transpose(1, 2).reshape(B, Q, self.heads * self.hd))


class DrafterMLP(nn.Module):
    """SiLU-gated MLP without biases."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        D, I = config.hidden_size, config.intermediate_size  # noqa: E741
        self.gate_proj = nn.Linear(D, I, bias=False)
        self.up_proj = nn.Linear(D, I, bias=False)
        self.down_proj = nn.Linear(I, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """Pre-norm layer: ``x + attn(input_layernorm(x))``, then ``+ mlp(post_attention_layernorm(.))``.

    The context arrives either as its rows ``ctx_BCD`` at ``ctx_pos_BC`` (training: the K/V are
    projected inside this forward, where FSDP has gathered the layer) or as precomputed
    ``ctx_kv = (k, v)`` (decoding from a cache)."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = DrafterRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config)
        self.post_attention_layernorm = DrafterRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DrafterMLP(config)

    def context_kv(self, ctx_BCD: torch.Tensor, ctx_pos_BC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's K/V of the context rows (see :meth:`DrafterAttention.project_kv`)."""
        return self.self_attn.project_kv(ctx_BCD, ctx_pos_BC)

    def forward(self, x_BQD, positions_BQ, allowed_BQK, *, ctx_BCD=None, ctx_pos_BC=None, ctx_kv=None):
        if ctx_kv is None:
            ctx_kv = self.context_kv(ctx_BCD, ctx_pos_BC)
        h = self.input_layernorm(x_BQD)
        x_BQD = x_BQD + self.self_attn(h, positions_BQ, ctx_kv[0], ctx_kv[1], allowed_BQK)
        return x_BQD + self.mlp(self.post_attention_layernorm(x_BQD))
