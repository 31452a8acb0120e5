"""The drafter's optimiser and learning-rate schedule: AdamW, linear warmup, then cosine decay."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch

from exittrain.objective import is_number, settings_check

__all__ = ["OptimizerSettings", "WarmupCosine", "adamw_with_schedule"]


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and its schedule; every field is validated (``ValueError`` naming the key).

    ``lr``, ``weight_decay`` (matrices only, not norms or the mask embedding); a linear warmup over
    ``warmup_ratio`` of the run's optimizer steps, then cosine down to ``min_lr_ratio * lr``.
    """

    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.05
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        a = asdict(self)
        need = settings_check(a)

        need(is_number(a["lr"]) and a["lr"] > 0, "lr", "need a float > 0")
        need(is_number(a["weight_decay"]) and a["weight_decay"] >= 0, "weight_decay", "need a float >= 0")
        need(is_number(a["warmup_ratio"]) and 0 <= a["warmup_ratio"] < 1, "warmup_ratio", "need a float in [0, 1)")
        need(is_number(a["min_lr_ratio"]) and 0 <= a["min_lr_ratio"] <= 1, "min_lr_ratio", "need a float in [0, 1]")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


class WarmupCosine:
    """LR factor: linear warmup over ``warmup_steps`` then cosine from 1 to ``min_ratio`` at ``total_steps``.

    A callable object (not a closure) so that ``LambdaLR.state_dict`` stores its fields and a
    checkpoint restores the same schedule. After ``total_steps`` the factor stays at ``min_ratio``.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_ratio: float):
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps)
        self.min_ratio = float(min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def adamw_with_schedule(model: torch.nn.Module, settings: OptimizerSettings, total_steps: float) -> dict:
    """AdamW over ``model``'s trainable parameters with :class:`WarmupCosine`, stepped every optimizer step.

    Returns what ``LightningModule.configure_optimizers`` returns. ``total_steps`` is the run's
    optimizer steps (``trainer.estimated_stepping_batches``); an infinite one raises ValueError.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
    )
    if not math.isfinite(total_steps):
        raise ValueError("the LR schedule needs a finite run: set trainer max_steps or max_epochs")
    total = max(1, int(total_steps))
    schedule = WarmupCosine(total, round(settings.warmup_ratio * total), settings.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1}}
