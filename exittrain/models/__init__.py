"""nn.Modules and wrappers: the frozen target (target.py) and the block drafter (drafter.py)."""

from exittrain.models.drafter import BlockDrafter
from exittrain.models.drafter_build import load_drafter, new_drafter
from exittrain.models.drafter_config import DrafterConfig, check_pairing
from exittrain.models.target import (
    EMBEDDED_TARGET_NAME,
    PrefillOutput,
    TargetModel,
    TreeForwardOutput,
    TreeScores,
    convert_embedded_target,
    load_target,
)

__all__ = [
    "EMBEDDED_TARGET_NAME",
    "BlockDrafter",
    "DrafterConfig",
    "PrefillOutput",
    "TargetModel",
    "TreeForwardOutput",
    "TreeScores",
    "check_pairing",
    "convert_embedded_target",
    "load_drafter",
    "load_target",
    "new_drafter",
]
