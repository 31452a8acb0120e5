"""The LM head's product on a few rows: ``F.linear``, or a faster equal that a decode passes explicitly.

Training, tree scoring and the plain decoder run ``F.linear``. A decode that computes a few rows
faster on its host (the CPU's row layouts, :mod:`exittrain.cpu_decode.row_layouts`) passes its product
as an option of the object that applies the head: :class:`~exittrain.models.target_model.TargetModel`'s
``head_product`` (a constructor argument, :meth:`~exittrain.models.target_model.TargetModel.with_options`)
and :meth:`~exittrain.models.drafter.block_drafter.BlockDrafter.head`'s ``head_product`` (a per-call
argument). This module holds the contract and :func:`apply_head`; it has no switch and no state.

The contract of a product: ``product(x, weight_VH)`` returns exactly what ``F.linear(x, weight_VH)``
returns, up to float summation order, for ``x`` (..., H) -> (..., V).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["HeadProduct", "apply_head", "is_plain_head"]

HeadProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``product(x, weight_VH) -> logits``: ``F.linear``'s equal (see the module)."""


def is_plain_head(module: torch.nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight)``, so a head product may
    compute it from the weight: a bias-free ``nn.Linear`` with no accelerate hook (an offloaded or
    dispatched module's weight is only in place inside its own forward)."""
    return type(module) is torch.nn.Linear and module.bias is None and not hasattr(module, "_hf_hook")


def apply_head(x: torch.Tensor, weight_VH: torch.Tensor, product: HeadProduct | None = None) -> torch.Tensor:
    """``F.linear(x, weight_VH)`` (no bias) for ``x`` (..., H) -> (..., V), or ``product``'s equal
    where one is given (None: ``F.linear``)."""
    return F.linear(x, weight_VH) if product is None else product(x, weight_VH)
