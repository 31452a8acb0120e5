"""The LM head's product on a few rows: ``F.linear``, unless a decode installs a faster one.

Training, tree scoring and the plain decoder always run ``F.linear``. A decode on a CPU may install,
for the length of a block, a product that runs a few rows in the layout the host computes faster
(:mod:`exittrain.cpu_decode.row_layouts`, entered by :mod:`exittrain.cpu_decode.fast_products`).
This module holds only the hook, so the model layer depends on nothing above it.

The contract of an installed product: ``product(x, weight_VH)`` returns exactly what
``F.linear(x, weight_VH)`` returns, up to float summation order, for ``x`` (..., H) -> (..., V).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

__all__ = ["head_product", "installed_head_product", "is_plain_head"]

HeadProduct = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
_INSTALLED: list[HeadProduct | None] = [None]  # the product installed_head_product holds, None: F.linear


def is_plain_head(module: torch.nn.Module) -> bool:
    """Whether ``module(x)`` is exactly ``F.linear(x, module.weight)``, so :func:`head_product` may
    compute it from the weight: a bias-free ``nn.Linear`` with no accelerate hook (an offloaded or
    dispatched module's weight is only in place inside its own forward)."""
    return type(module) is torch.nn.Linear and module.bias is None and not hasattr(module, "_hf_hook")


def head_product(x: torch.Tensor, weight_VH: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight_VH)`` (no bias), or the installed product's equal (see the module)."""
    product = _INSTALLED[0]
    return F.linear(x, weight_VH) if product is None else product(x, weight_VH)


@contextlib.contextmanager
def installed_head_product(product: HeadProduct) -> Iterator[None]:
    """Within the block :func:`head_product` calls ``product``; the one before is restored on exit."""
    before, _INSTALLED[0] = _INSTALLED[0], product
    try:
        yield
    finally:
        _INSTALLED[0] = before
