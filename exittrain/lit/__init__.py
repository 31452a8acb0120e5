"""Lightning glue only: the training LightningModule and its callbacks (no math, no models here)."""

from exittrain.lit.callbacks import (
    DecodeEvalCallback,
    ExportDrafterCallback,
    MetricsFileCallback,
    ProgressLogCallback,
    save_drafter,
    stage_progress_bar,
    write_json_atomic,
)
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
from exittrain.lit.sharding import DrafterFSDPStrategy, full_drafter, is_sharded, shard_drafter

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
