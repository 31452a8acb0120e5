"""nn.Modules and wrappers: the frozen target (target_model.py, loaded by target_loading.py) and the block
drafter (the subpackage drafter/, whose __init__ maps its modules)."""

from exittrain.models.drafter.block_drafter import BlockDrafter
from exittrain.models.drafter.configuration import DrafterConfig, check_pairing
from exittrain.models.drafter.construction import load_drafter, new_drafter
from exittrain.models.target_decode import PrefillOutput, TreeForwardOutput
from exittrain.models.target_loading import convert_embedded_target, load_target
from exittrain.models.target_model import TargetModel
from exittrain.models.target_scoring import TreeScores

__all__ = [
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
