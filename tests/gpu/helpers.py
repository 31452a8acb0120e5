"""What the gpu marker's tests share: the tiny targets of tests/models, built on the device under test."""

from __future__ import annotations

import torch

from exittrain.models import TargetModel
from tests.models.helpers import tiny_target


def target_on(device: torch.device, kind: str = "llama", dtype: torch.dtype | None = None) -> TargetModel:
    """``tiny_target(kind)`` (seeded: the same weights as the CPU reference) moved to ``device`` and ``dtype``."""
    target = tiny_target(kind)
    target.model.to(device=device, dtype=dtype)
    return target
