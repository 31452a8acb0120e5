"""A callback that records what a ``fit`` subprocess trains with, for tests/gpu/test_cuda_torchrun_fit.py.

Added to a fit through Hydra overrides (the subprocess runs from the repository root, so ``tests`` is
importable): ``+callbacks.probe._target_=tests.gpu.fit_probe.FitProbe +callbacks.probe.path=FILE``.
Appends one JSON line per stage at ``on_train_start`` (strategy, process group backend, devices,
precision, sharding) and one per optimizer step (finite loss and gradients, no gradient in the target).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import lightning.pytorch as pl
import torch

from exittrain.lit.sharding import is_sharded


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication); a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class FitProbe(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._grads: dict | None = None

    def _write(self, line: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_train_start(self, trainer, pl_module) -> None:
        dist = torch.distributed
        self._write({
            "event": "start",
            "stage": pl_module.hparams.stage,
            "strategy": type(trainer.strategy).__name__,
            "backend": dist.get_backend() if dist.is_available() and dist.is_initialized() else None,
            "world_size": trainer.world_size,
            "local_rank_env": os.environ.get("LOCAL_RANK"),
            "root_device": str(trainer.strategy.root_device),
            "module_device": str(pl_module.device),
            "target_device": str(pl_module.target.device),
            "target_dtype": str(pl_module.target.dtype),
            "precision": str(trainer.precision),
            "sharded": is_sharded(pl_module.drafter),
        })

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        grads = [_local(p.grad) for p in pl_module.drafter.parameters() if p.grad is not None]
        self._grads = {
            "grads": len(grads),
            "grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
            "grads_nonzero": any(bool(g.ne(0).any()) for g in grads),
            "target_grads": sum(p.grad is not None for p in pl_module.target.model.parameters()),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = float(outputs["loss"])
        self._write({"event": "step", "stage": pl_module.hparams.stage, "step": trainer.global_step - 1,
                     "loss_finite": math.isfinite(loss), **(self._grads or {})})
        self._grads = None
