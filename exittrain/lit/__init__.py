"""Lightning glue only: the training LightningModule and its callbacks (no math, no models here)."""

from exittrain.lit.callbacks import DecodeEvalCallback, ExportDrafterCallback, MetricsFileCallback, save_drafter
from exittrain.lit.module import (
    SCORING_MODES,
    STAGES,
    TIMED_PARTS,
    ExitTrainModule,
    WarmupCosine,
    anchor_generator,
    sample_anchors,
    select_trees,
    tree_metrics,
)
from exittrain.lit.progress_callbacks import ProgressLogCallback, stage_progress_bar
from exittrain.lit.sharding import DrafterFSDPStrategy, full_drafter, is_sharded, shard_drafter
from exittrain.run_dir import write_json_atomic  # not Lightning: kept here for the callers of exittrain.lit

__all__ = [
    "SCORING_MODES",
    "STAGES",
    "TIMED_PARTS",
    "DecodeEvalCallback",
    "DrafterFSDPStrategy",
    "ExitTrainModule",
    "ExportDrafterCallback",
    "MetricsFileCallback",
    "ProgressLogCallback",
    "WarmupCosine",
    "anchor_generator",
    "full_drafter",
    "is_sharded",
    "sample_anchors",
    "save_drafter",
    "select_trees",
    "shard_drafter",
    "stage_progress_bar",
    "tree_metrics",
    "write_json_atomic",
]
