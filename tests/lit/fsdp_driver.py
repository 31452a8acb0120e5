"""Fit :class:`ExitTrainModule` with the sharded strategy of ``trainer=fsdp`` on CPU, resume it; record each rank.

``python -m tests.lit.fsdp_driver --out DIR --devices 2`` (run from the repository root) fits with
:class:`exittrain.lit.DrafterFSDPStrategy` (FSDP2 on Lightning's ``ModelParallelStrategy``) on
``devices`` CPU processes (gloo); Lightning's subprocess launcher re-runs this same command for
ranks 1.., so everything here runs on every rank. ``--devices 1`` (or :func:`train` called
in-process) is the single-process reference: no strategy, no sharding (``configure_model`` is a
no-op there), the same code otherwise.

Two fits in the same processes:

1. **fit**: :data:`STEPS` steps from a fresh drafter with every writer of a real ``fit`` under
   ``DIR/run``: a CSV logger, ``ModelCheckpoint`` (``save_last``), the drafter export, ``metrics_exittrain.json``
   and a one-prompt decoding evaluation at step 2, after validation and at fit end (each one
   gathers the sharded drafter on rank 0).
2. **resume**: a new module (a fresh drafter from the same seed) resumes from ``run/ckpt/last.ckpt``
   for one more step (Lightning scatters the full checkpoint into the new shards) and exports
   ``run/export/resumed``.

The learning rate is constant (no warmup, ``min_lr_ratio=1``), so the resumed schedule equals an
uninterrupted one; ``weight_decay`` is large enough that a wrong matrices-only split would show,
and ``gradient_clip_val`` is below every step's gradient norm, so clipping acts on every step.

Results ``DIR/rank{r}.json`` and ``DIR/rank{r}.pt``, per rank:

- ``row_ids``, ``losses``, ``anchors`` per phase (``fit``, ``resume``), as in ``ddp_driver``;
- ``val_loss_tok`` of the fit (``sync_dist``), ``decode_history`` (the evaluations' steps);
- ``sharding``: the drafter's class, whether every parameter is a DTensor sharded on dim 0, and
  this rank's and the total numel of its parameters;
- ``writes``: every write under the run directory (:class:`tests.lit.ddp_driver.WriteJournal`);
- ``rank{r}.pt``: per phase the full gradients before clipping (``on_before_optimizer_step``) and
  after (``on_train_batch_end``: the gradients AdamW used), gathered from the shards; this rank's
  local shards after the fit; the resumed drafter's full weights before its first step; and on
  rank 0 the full drafter of :func:`exittrain.lit.full_drafter` after each phase (None elsewhere).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tests.lit.ddp_driver import (
    ANCHOR_CANDIDATES,
    PROMPTS,
    STEPS,
    VAL_ROWS,
    IndexedRows,
    WriteJournal,
    collate_indexed,
    write_rank_record,
)

GLOBAL_BATCH = 4
RESUME_STEPS = STEPS + 1
LR = 1e-2
WEIGHT_DECAY = 0.5  # AdamW shrinks decayed matrices by lr * wd = 0.5% per step: far above the tolerance
CLIP = 1.0  # trainer=fsdp's value; the global gradient norms measured 200, 14, 12 and 3.6: every step is clipped


def module_kwargs() -> dict:
    """The module's arguments; anchors_per_seq = every candidate makes the anchor set draw-independent."""
    return dict(anchors_per_seq=ANCHOR_CANDIDATES, lr=LR, warmup_ratio=0.0, min_lr_ratio=1.0, weight_decay=WEIGHT_DECAY)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (an all-gather every rank must join); a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor itself."""
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def _sharding(drafter) -> dict:
    from torch.distributed.tensor import DTensor, Shard

    params = list(drafter.parameters())
    dtensor = all(isinstance(p, DTensor) for p in params)
    return {
        "class": type(drafter).__name__,
        "all_dtensor_shard0": dtensor and all(tuple(p.placements) == (Shard(0),) for p in params),
        "local_numel": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "total_numel": sum(p.numel() for p in params),
    }


def train(
    devices: int,
    out: Path,
    *,
    order: list[int] | None = None,
    resume_order: list[int] | None = None,
    journal: WriteJournal | None = None,
) -> dict:
    """Both phases on ``devices`` CPU processes; returns this rank's record (also saved to ``out``).

    ``order`` / ``resume_order``: the training rows to visit in the fit and the resumed step
    (single process only; the sharded run gets Lightning's ``DistributedSampler`` order).
    """
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from exittrain.lit import (
        DecodeEvalCallback,
        DrafterFSDPStrategy,
        ExportDrafterCallback,
        MetricsFileCallback,
        full_drafter,
    )
    from exittrain.lit.checkpoint_io import AtomicCheckpointIO
    from tests.lit.helpers import make_module
    from tests.models.helpers import tiny_target

    torch.set_num_threads(1)
    target = tiny_target("llama")
    rows = IndexedRows(STEPS * GLOBAL_BATCH, target.vocab_size, seed=1)
    val_rows = IndexedRows(VAL_ROWS, target.vocab_size, seed=2, offset=len(rows))
    batch_size = GLOBAL_BATCH // devices
    run = out / "run"

    class Record(pl.Callback):
        def __init__(self):
            self.row_ids, self.losses, self.anchors, self.grads, self.clipped = [], [], [], [], []
            self.start: dict[str, torch.Tensor] = {}

        def on_train_start(self, trainer, pl_module):
            self.start = {n: _full(p) for n, p in pl_module.drafter.named_parameters()}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.row_ids.append(batch["row_id"].tolist())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            self.grads.append({n: _full(p.grad) for n, p in pl_module.drafter.named_parameters()})

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.clipped.append({n: _full(p.grad) for n, p in pl_module.drafter.named_parameters()})
            self.losses.append(float(outputs["loss"]))
            self.anchors.append(int(trainer.callback_metrics["train/anchors"]))

    def make_trainer(max_steps: int, callbacks: list, **kwargs) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=devices,
            strategy=DrafterFSDPStrategy() if devices > 1 else "auto",
            precision="32-true",
            max_steps=max_steps,
            gradient_clip_val=CLIP,
            callbacks=callbacks,
            plugins=[AtomicCheckpointIO()],  # as in `fit`
            default_root_dir=run,
            enable_progress_bar=False,
            enable_model_summary=False,
            log_every_n_steps=1,
            num_sanity_val_steps=0,
            **kwargs,
        )

    # phase 1: fit
    module = make_module(target, **module_kwargs())
    record, decode = Record(), DecodeEvalCallback(PROMPTS, every_n_steps=2, budget=4, max_new_tokens=4,
                                                  on_validation=True)
    export = ExportDrafterCallback(run / "export")
    checkpoint = ModelCheckpoint(dirpath=run / "ckpt", save_last=True)
    callbacks = [record, decode, checkpoint, export, MetricsFileCallback(run, "exittrain")]
    trainer = make_trainer(STEPS, callbacks, logger=CSVLogger(run / "logs", name="csv"))
    train_loader = DataLoader(rows, batch_size=batch_size, sampler=order, collate_fn=collate_indexed)
    val_loader = DataLoader(val_rows, batch_size=batch_size, shuffle=False, collate_fn=collate_indexed)
    trainer.fit(module, train_loader, val_loader)
    sharding = _sharding(module.drafter)
    local = {n: _local(p) for n, p in module.drafter.named_parameters()}
    gathered = full_drafter(module.drafter, target)  # every rank joins; rank 0 gets the copy
    fit_state = None if gathered is None else {k: v.detach().clone() for k, v in gathered.state_dict().items()}
    val_loss = trainer.callback_metrics.get("val/loss_tok")

    # phase 2: a new module resumes from the fit's last checkpoint for one more step
    resumed_module = make_module(target, **module_kwargs())
    resumed_record = Record()
    resumed_export = ExportDrafterCallback(run / "export", name="resumed")
    resumed_trainer = make_trainer(
        RESUME_STEPS, [resumed_record, resumed_export], logger=False, enable_checkpointing=False
    )
    resume_loader = DataLoader(rows, batch_size=batch_size, sampler=resume_order, collate_fn=collate_indexed)
    resumed_trainer.fit(resumed_module, resume_loader, ckpt_path=run / "ckpt" / "last.ckpt")
    gathered = full_drafter(resumed_module.drafter, target)
    resumed_state = None if gathered is None else {k: v.detach().clone() for k, v in gathered.state_dict().items()}

    rank = trainer.global_rank
    result = {
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": [trainer.global_step, resumed_trainer.global_step],
        "row_ids": {"fit": record.row_ids, "resume": resumed_record.row_ids},
        "losses": {"fit": record.losses, "resume": resumed_record.losses},
        "anchors": {"fit": record.anchors, "resume": resumed_record.anchors},
        "val_loss_tok": float(val_loss) if val_loss is not None else None,
        "decode_history": [h["step"] for h in decode.history],
        "sharding": sharding,
        "exported": [str(p) for p in export.exported + resumed_export.exported],
        "writes": journal.writes if journal is not None else None,
    }
    tensors = {
        "grads": {"fit": record.grads, "resume": resumed_record.grads},
        "clipped": {"fit": record.clipped, "resume": resumed_record.clipped},
        "local": local,
        "resume_start": resumed_record.start,
        "fit_state": fit_state,
        "resumed_state": resumed_state,
    }
    write_rank_record(out, rank, result, tensors, resumed_trainer.strategy)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    journal = WriteJournal(args.out / "run")
    train(args.devices, args.out, journal=journal)


if __name__ == "__main__":
    main()
