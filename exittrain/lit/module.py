"""The LightningModule of drafter training: the step, its logging and the Lightning hooks.

The math lives elsewhere: :func:`exittrain.objective.compute_losses` computes every loss and tree
metric of a batch (the module docstring there describes one step), the target features and soft
labels arrive in the batch from the data's feature store (:mod:`exittrain.data.feature_store`),
the optimiser and its schedule come from :mod:`exittrain.lit.schedule`, and checkpoint contents
from :mod:`exittrain.lit.drafter_checkpoint`.

Logged per training step (on_step): ``train/loss``, ``train/loss_tok``, ``train/loss_exit``
(exittrain), ``train/acc_d{k}`` (k = 1..K), ``train/anchors`` (valid anchors), ``lr``,
``train/time_{part}_ms`` (:data:`TIMED_PARTS`), ``train/anchors_per_s``,
``train/feature_rows_computed`` (rows of the step whose target features the target computed; 0
when the batch carried them) and, when trees are scored, ``train/analytic_block_length``,
``train/greedy_block_length``, ``train/coverage``, ``train/mean_exit_depth`` and
``train/exit_mass_d{d}`` (d = 0..K, they sum to 1). Lightning keeps re-sending an on_step value
until the epoch ends, so with ``analytic_every > 1`` the tree metrics repeat the latest
measurement on the steps in between (the times do not: they are logged every step, 0 for the
parts skipped). Validation logs ``val/loss_tok`` (hard labels, comparable across settings),
``val/analytic_block_length``, ``val/greedy_block_length`` and ``val/coverage`` per epoch,
weighted by valid anchors.

The target is a plain attribute (``TargetModel`` is not an ``nn.Module``): the drafter is the
only submodule, so its parameters are the only trainable ones and the only checkpoint entries.
The target must already sit on the device the trainer puts the module on (checked at fit start).

Sharding (``trainer=fsdp``, :class:`exittrain.lit.sharding.DrafterFSDPStrategy`): the strategy
gives the module a device mesh, and :meth:`ExitTrainModule.configure_model` shards the drafter
over it with FSDP2 (``fully_shard``); the target stays whole on every rank. Under any other
strategy there is no mesh and ``configure_model`` does nothing. Lightning's ``FSDPStrategy``
(FSDP1) is refused at setup: use ``trainer=fsdp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import lightning.pytorch as pl
import torch

from exittrain.core import anchor_generator
from exittrain.lit.drafter_checkpoint import (
    CHECKPOINT_KEY,
    check_checkpoint_target,
    checkpoint_entry,
    drafter_from_checkpoint,
)
from exittrain.lit.schedule import OptimizerSettings, adamw_with_schedule
from exittrain.lit.sharding import is_sharded, shard_drafter
from exittrain.models import BlockDrafter, TargetModel
from exittrain.objective import OBJECTIVE_PARTS, ObjectiveSettings, compute_losses
from exittrain.timing import device_now

__all__ = ["TIMED_PARTS", "ExitTrainModule", "check_module_args", "split_module_args"]

TIMED_PARTS = (*OBJECTIVE_PARTS, "backward", "step")
"""Logged as ``train/time_{part}_ms`` every step: the objective's parts (:data:`exittrain.objective.OBJECTIVE_PARTS`),
backward, and the whole optimizer step (which contains the others)."""


def split_module_args(**kwargs: Any) -> tuple[ObjectiveSettings, OptimizerSettings]:
    """:class:`ExitTrainModule` keyword arguments (all but ``drafter`` and ``target``) as validated settings.

    Missing arguments take the settings' defaults. A bad value raises the settings' ``ValueError``
    naming the key; an unknown name raises a ``ValueError`` listing the known ones.
    """
    objective, optim = ObjectiveSettings.names(), OptimizerSettings.names()
    unknown = sorted(set(kwargs) - set(objective) - set(optim))
    if unknown:
        raise ValueError(f"unknown ExitTrainModule arguments {unknown}; the known ones are {sorted(objective + optim)}")
    return (
        ObjectiveSettings(**{k: v for k, v in kwargs.items() if k in objective}),
        OptimizerSettings(**{k: v for k, v in kwargs.items() if k in optim}),
    )


def check_module_args(**kwargs: Any) -> None:
    """Validate :class:`ExitTrainModule` keyword arguments alone (:func:`split_module_args`).

    ``fit`` calls it on every stage's arguments before loading the target, so that a bad objective
    or stage override fails at once instead of after regeneration and the earlier stages.
    """
    split_module_args(**kwargs)


class ExitTrainModule(pl.LightningModule):
    """Trains a :class:`BlockDrafter` against a frozen :class:`TargetModel` (see the module docstring).

    Args:
        drafter: the model to train; becomes the only submodule (attached to ``target`` if needed).
        target: the frozen target; a plain attribute, never registered or checkpointed.
        **settings: the fields of :class:`exittrain.objective.ObjectiveSettings` (what a step
            computes) and of :class:`exittrain.lit.schedule.OptimizerSettings` (AdamW and its
            schedule, over ``trainer.estimated_stepping_batches``). Every one is validated; a bad
            value raises ``ValueError`` naming the key. They are the module's ``hparams``.
    """

    def __init__(self, drafter: BlockDrafter, target: TargetModel, **settings: Any) -> None:
        super().__init__()
        self.objective, self.optim = split_module_args(**settings)
        if not isinstance(drafter, BlockDrafter):
            raise ValueError(
                f"drafter must be a BlockDrafter, got {type(drafter).__name__}; build one with new_drafter"
            )
        if not isinstance(target, TargetModel):
            raise ValueError(f"target must be a TargetModel, got {type(target).__name__}; load one with load_target")
        if not drafter.has_target:
            drafter.attach_target(target)
        self.save_hyperparameters({**asdict(self.objective), **asdict(self.optim)})
        self.drafter = drafter
        self.target = target  # not an nn.Module: a plain attribute, outside parameters() and state_dict()
        self._t_step: float | None = None  # start of the current optimizer step (first accumulated batch)
        self._t_backward: float | None = None
        self._step_anchors = 0  # valid anchors since the last optimizer step
        self._feature_rows_computed = 0  # of the latest compute_losses

    @property
    def horizon(self) -> int:
        """K, tokens the drafter predicts per anchor."""
        return self.drafter.config.num_draft_tokens

    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    # -- checkpoint -----------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = checkpoint_entry(self.drafter, self.target)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_checkpoint_target(checkpoint, self.target)

    drafter_from_checkpoint = staticmethod(drafter_from_checkpoint)

    # -- fit ------------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        """Refuse Lightning's ``FSDPStrategy`` (FSDP1): the callbacks and ``fit`` gather FSDP2 shards only."""
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is not None and isinstance(self.trainer.strategy, FSDPStrategy):
            raise ValueError(
                f"trainer.strategy={type(self.trainer.strategy).__name__} (FSDP1) is not supported: decoding, export "
                "and checkpoints of the drafter gather FSDP2 shards; use trainer=fsdp "
                "(exittrain.lit.DrafterFSDPStrategy) or trainer=ddp"
            )

    def configure_model(self) -> None:
        """Shard the drafter (FSDP2) over the strategy's data-parallel mesh; a no-op without a mesh.

        Only ``ModelParallelStrategy`` (``trainer=fsdp``: :class:`~exittrain.lit.sharding.DrafterFSDPStrategy`)
        gives a mesh; single-device and DDP runs leave the drafter as it is. Idempotent: a drafter
        already sharded (an earlier stage of the same run) is kept as it is. The target is never
        sharded. A mesh with a ``tensor_parallel`` dimension larger than 1 raises ValueError: the
        drafter has no tensor-parallel plan.
        """
        mesh = self.device_mesh
        if mesh is None:
            return
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"trainer.strategy.tensor_parallel_size={mesh['tensor_parallel'].size()}: ExitTrainModule only "
                "shards the drafter over data_parallel (FSDP); use trainer=fsdp (exittrain.lit.DrafterFSDPStrategy, "
                "tensor_parallel_size=1) instead of a bare ModelParallelStrategy"
            )
        shard_drafter(self.drafter, mesh["data_parallel"] if "data_parallel" in names else mesh)

    def on_fit_start(self) -> None:
        if self.target.device != self.device:
            raise ValueError(
                f"target is on {self.target.device} but the trainer put the drafter on {self.device}; "
                "load the target on the trainer's device (load_target(..., device=...))"
            )
        # A drafter from load_drafter (from_pretrained) comes in eval mode, and Lightning trains
        # modules in the mode it finds them; the stages train the drafter, dropout included.
        self.drafter.train()

    def on_fit_end(self) -> None:
        # Lightning's strategy teardown moves the module to the CPU before this hook (a single device
        # and DDP; FSDP's keeps it), while the target, no submodule, stays where it was loaded: put the
        # drafter back beside it, where the held-out evaluation after a stage runs them together.
        if not is_sharded(self.drafter):
            self.drafter.to(self.target.device)

    def configure_optimizers(self):
        """AdamW over the drafter's parameters; warmup + cosine, stepped every optimizer step."""
        return adamw_with_schedule(self.drafter, self.optim, self.trainer.estimated_stepping_batches)

    # -- the step -------------------------------------------------------------------------------

    def compute_losses(
        self, batch: Mapping[str, torch.Tensor], generator: torch.Generator, **kwargs: Any
    ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """:func:`exittrain.objective.compute_losses` of this module's drafter, target and settings;
        returns ``(values, times_ms)``. ``kwargs``: ``exit_loss``, ``metrics``, ``vocab_sample``, ``soft_labels``."""
        out = compute_losses(self.drafter, self.target, batch, self.objective, generator, **kwargs)
        self._feature_rows_computed = out.feature_rows_computed
        return out.values, out.times_ms

    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """One step of the stage's loss; logs the step's metrics (see the module docstring).

        Raises RuntimeError naming the global step and the batch index if the loss is not finite,
        before anything is logged or updated.
        """
        s = self.objective
        if self._t_step is None:
            self._t_step = device_now(self.device)
        step = self.global_step
        generator = anchor_generator(s.seed, step, self._rank(), stream=0)
        want_metrics = s.analytic_every > 0 and step % s.analytic_every == 0
        values, times = self.compute_losses(
            batch,
            generator,
            exit_loss=s.stage == "exittrain",
            metrics=want_metrics or s.stage == "exittrain",
            vocab_sample=s.vocab_sample,
            soft_labels=True,
        )
        loss = values["loss"]
        if not bool(torch.isfinite(loss)):
            parts = ", ".join(f"{k}={float(values[k].detach()):.4g}" for k in ("loss_tok", "loss_exit") if k in values)
            raise RuntimeError(
                f"non-finite training loss {float(loss.detach())} at global step {step}, batch index {batch_idx} "
                f"({parts}); refusing to train on it: check this batch's data, the learning rate and the target outputs"
            )
        self._step_anchors += int(values["anchors"])
        L = batch["input_ids"].shape[0]
        logged = {f"train/{k}": v.detach() for k, v in values.items() if k != "anchors"}
        logged["train/anchors"] = values["anchors"]
        logged.update({f"train/time_{k}_ms": torch.tensor(v) for k, v in times.items()})
        logged["train/feature_rows_computed"] = torch.tensor(float(self._feature_rows_computed))
        if self._trainer is not None and self.trainer.optimizers:
            logged["lr"] = torch.tensor(self.trainer.optimizers[0].param_groups[0]["lr"])
        prog = {"train/loss", "train/analytic_block_length"}
        self.log_dict({k: v for k, v in logged.items() if k not in prog}, on_step=True, on_epoch=False, batch_size=L)
        self.log_dict(
            {k: v for k, v in logged.items() if k in prog}, on_step=True, on_epoch=False, batch_size=L, prog_bar=True
        )
        return loss

    def validation_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> None:
        """Logs ``val/loss_tok``, ``val/analytic_block_length``, ``val/greedy_block_length`` and
        ``val/coverage`` per epoch (anchor-weighted)."""
        generator = anchor_generator(self.objective.seed, batch_idx, self._rank(), stream=1)  # same anchors every epoch
        values, _ = self.compute_losses(batch, generator, exit_loss=False, metrics=True)
        n = int(values["anchors"])
        if n == 0:
            return
        keys = ("loss_tok", "analytic_block_length", "greedy_block_length", "coverage")
        self.log_dict(
            {f"val/{k}": values[k].detach() for k in keys if k in values},
            on_step=False,
            on_epoch=True,
            batch_size=n,
            sync_dist=True,
            prog_bar=True,
        )

    # -- step timing (backward and whole step) --------------------------------------------------

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self._t_backward = device_now(self.device)

    def on_after_backward(self) -> None:
        if self._t_backward is None:
            return
        ms = (device_now(self.device) - self._t_backward) * 1e3
        self._t_backward = None
        self.log("train/time_backward_ms", ms, on_step=True, on_epoch=False)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer, optimizer_closure=None) -> None:
        """The default step, timed: ``train/time_step_ms`` runs from the first ``training_step`` since
        the previous update to the end of this one (forward, backward and update of every accumulated
        batch; not the data loading), and ``train/anchors_per_s`` divides their valid anchors by it."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if self._t_step is None:
            return
        seconds = device_now(self.device) - self._t_step
        self.log("train/time_step_ms", seconds * 1e3, on_step=True, on_epoch=False)
        self.log("train/anchors_per_s", self._step_anchors / max(seconds, 1e-9), on_step=True, on_epoch=False)
        self._t_step, self._step_anchors = None, 0
