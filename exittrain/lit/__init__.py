"""Lightning glue only: the training LightningModule and its callbacks (no math, no models here)."""

from exittrain.lit.callbacks import DecodeEvalCallback, ExportDrafterCallback, MetricsFileCallback, save_drafter
from exittrain.lit.module import TIMED_PARTS, ExitTrainModule
from exittrain.lit.progress_callbacks import ProgressLogCallback, stage_progress_bar
from exittrain.lit.schedule import WarmupCosine
from exittrain.lit.sharding import DrafterFSDPStrategy, full_drafter, is_sharded, shard_drafter

__all__ = [
    "TIMED_PARTS",
    "DecodeEvalCallback",
    "DrafterFSDPStrategy",
    "ExitTrainModule",
    "ExportDrafterCallback",
    "MetricsFileCallback",
    "ProgressLogCallback",
    "WarmupCosine",
    "full_drafter",
    "is_sharded",
    "save_drafter",
    "shard_drafter",
    "stage_progress_bar",
]
