"""The drafter's optimiser and LR schedule (exittrain.lit.schedule)."""

from __future__ import annotations

import pytest
import torch

from exittrain.lit.schedule import OptimizerSettings, WarmupCosine, adamw_with_schedule


def test_warmup_cosine_shape():
    f = WarmupCosine(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0) and f(10) == pytest.approx(1.0)
    assert f(55) == pytest.approx(0.55) and f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    after = [f(s) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(after, after[1:]))
    assert WarmupCosine(10, 0, 0.0)(0) == pytest.approx(1.0)


def test_adamw_decays_matrices_only_and_needs_a_finite_run():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    config = adamw_with_schedule(model, OptimizerSettings(lr=1e-3, weight_decay=0.1, warmup_ratio=0.5), 10)
    decay, no_decay = config["optimizer"].param_groups
    assert [p.dim() for p in decay["params"]] == [2] and decay["weight_decay"] == 0.1
    assert sorted(p.dim() for p in no_decay["params"]) == [1, 1, 1] and no_decay["weight_decay"] == 0.0
    schedule = config["lr_scheduler"]["scheduler"].lr_lambdas[0]
    assert (schedule.total_steps, schedule.warmup_steps) == (10, 5)
    assert config["lr_scheduler"]["interval"] == "step"
    with pytest.raises(ValueError, match="finite run"):
        adamw_with_schedule(model, OptimizerSettings(), float("inf"))


@pytest.mark.parametrize(
    "key, value", [("lr", 0.0), ("weight_decay", -1.0), ("warmup_ratio", 1.0), ("min_lr_ratio", 1.5)]
)
def test_bad_optimizer_settings_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"^{key}="):
        OptimizerSettings(**{key: value})
