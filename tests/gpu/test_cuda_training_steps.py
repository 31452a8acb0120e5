"""Training steps on the device under test: a bf16-autocast step of each stage against the same step in
fp32 on the CPU, the fp32 step on both devices, and a short Lightning fit in ``bf16-mixed``.

Each step is :meth:`ExitTrainModule.compute_losses` as ``training_step`` calls it (anchors from the CPU
generator of ``(seed, step, rank)``, so both devices draw the same ones), then ``backward``. ``pretrain``
runs the sampled block CE (16 negatives, drawn on the CPU too) with soft labels from a target forward
(``soft_label_weight=0.5``) and the tree metrics; ``exittrain`` the full block CE plus the ``flow`` node
loss over scored trees (tests/lit/helpers.py ``make_module``'s settings).

Tolerances, and why:

- fp32 on the device against the CPU: losses and tree metrics to ``rel=1e-4``, each parameter's
  gradient to a relative error (in norm) of 1e-3: only the order of fp32 sums differs (~1e-6 relative).
  The trees must come out identical for the node loss to agree, so the batch has no near-tie between
  candidate paths: on the CPU, Gaussian noise of 3e-5 added to its drafter log-probabilities never
  changed its trees in 300 trials (batch seed 5; seed 4's changed in 264).
- bf16 autocast against fp32 on the CPU: ``loss_tok`` to ``rel=1e-2`` and gradients to 0.2 in norm.
  Measured with CPU autocast on batch seeds 4-7: at most 6.6e-4 in ``loss_tok`` and 0.04 in a gradient.
  ``loss_exit`` is not compared: trees built from bf16 drafter logits may differ from fp32 ones (it
  moved by 8% on seed 6 where a tree changed).

At initialisation the drafter's learned mask is zero, so its block rows enter attention as zero queries
and the query/key projections and norms get exactly zero gradient on the first step (on every device);
the test checks that the device's non-zero gradients are exactly the CPU's.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

from exittrain.core import anchor_generator
from exittrain.lit import full_drafter
from tests.gpu.helpers import target_on
from tests.lit.helpers import ListLogger, StepLosses, batch_of, loader, make_module, trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*_dataloader' does not have many workers"),
]

STAGES = {
    "pretrain": dict(stage="pretrain", vocab_sample=16, soft_label_weight=0.5),
    "exittrain": dict(stage="exittrain"),
}
BATCH_SEED = 5
CPU = torch.device("cpu")


def one_step(device: torch.device, stage: str, *, bf16: bool):
    """A fresh module (same seeds on every device), one step on batch ``BATCH_SEED``, its backward;
    returns ``(module, values)``."""
    module = make_module(target_on(device), **STAGES[stage])
    batch = {k: v.to(device) for k, v in batch_of(3, seed=BATCH_SEED).items()}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        values, _ = module.compute_losses(batch, anchor_generator(0, 0), exit_loss=stage == "exittrain",
                                          metrics=True, vocab_sample=module.objective.vocab_sample, soft_labels=True)
    values["loss"].backward()
    return module, values


def number(value: torch.Tensor) -> float:
    return float(value.detach())


def grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in module.drafter.named_parameters()}


def assert_trains_the_drafter_only(module, reference, device: torch.device, tolerance: float) -> None:
    """Finite drafter gradients, non-zero exactly where the CPU reference's are, each within ``tolerance``
    of it (relative error in norm); no gradient anywhere in the frozen target."""
    got, want = grads(module), grads(reference)
    assert set(got) == set(want) and all(g is not None for g in got.values()), "a drafter parameter got no gradient"
    nonzero = {n for n, g in got.items() if bool(g.ne(0).any())}
    assert nonzero == {n for n, g in want.items() if bool(g.ne(0).any())}
    assert {"fc.weight", "mask_embedding", "layers.0.self_attn.v_proj.weight"} <= nonzero
    for name, g in got.items():
        assert g.device.type == device.type and bool(torch.isfinite(g).all()), name
        if name in nonzero:
            err = float((g.cpu() - want[name]).norm() / want[name].norm())
            assert err <= tolerance, f"{name}: gradient differs by {err:.2e} (relative, in norm) from the CPU's"
    for p in module.target.model.parameters():
        assert not p.requires_grad and p.grad is None, "the frozen target received a gradient"


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_bf16_autocast_step_on_the_device_agrees_with_fp32_on_the_cpu(stage, device):
    reference, ref_values = one_step(CPU, stage, bf16=False)
    module, values = one_step(device, stage, bf16=True)
    loss = values["loss"]
    assert loss.device.type == device.type and math.isfinite(number(loss))
    assert number(values["loss_tok"]) == pytest.approx(number(ref_values["loss_tok"]), rel=1e-2)
    if stage == "exittrain":
        assert math.isfinite(number(values["loss_exit"])) and number(values["loss_exit"]) > 0
    assert 1.0 <= number(values["analytic_block_length"]) <= 1 + module.horizon
    assert_trains_the_drafter_only(module, reference, device, tolerance=0.2)


@pytest.mark.parametrize("stage", list(STAGES))
def test_an_fp32_step_on_the_device_equals_the_cpu(stage, device, fp32_matmuls):
    reference, ref_values = one_step(CPU, stage, bf16=False)
    module, values = one_step(device, stage, bf16=False)
    keys = {"loss", "loss_tok", "loss_exit", "analytic_block_length", "coverage", "greedy_block_length",
            *(f"acc_d{k}" for k in range(1, module.horizon + 1))} & set(ref_values)
    assert {"loss", "loss_tok", "analytic_block_length"} <= keys
    for key in sorted(keys):
        assert number(values[key]) == pytest.approx(number(ref_values[key]), rel=1e-4, abs=1e-6), key
    assert_trains_the_drafter_only(module, reference, device, tolerance=1e-3)


class Devices(pl.Callback):
    """Records where the drafter and the target are at every training batch."""

    def __init__(self):
        self.seen: set[tuple[str, str]] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.add((str(pl_module.device), str(pl_module.target.device)))


def fit_on(device: torch.device, steps: int, *callbacks, **trainer_kwargs):
    """A fresh ExitTrain module on the target on ``device``, fitted for ``steps`` steps on that device."""
    module = make_module(target_on(device), stage="exittrain")
    fit = trainer(steps, callbacks=list(callbacks), accelerator="gpu" if device.type == "cuda" else "cpu",
                  **trainer_kwargs)
    fit.fit(module, loader(4))
    return module, fit


def test_a_lightning_fit_in_bf16_mixed_on_the_device(device):
    """Two ExitTrain steps under Lightning's bf16-mixed precision on the device: both models on the device
    while training, finite losses, step times logged (synchronised: exittrain.timing.device_now), the
    drafter moves and the frozen target does not."""
    target_before = {k: v.clone() for k, v in target_on(device).model.state_dict().items()}  # same seed
    drafter_before = {n: p.detach().clone() for n, p in make_module(target_on(CPU)).drafter.named_parameters()}
    losses, logger, devices = StepLosses(), ListLogger(), Devices()
    module, fit = fit_on(device, 2, losses, devices, logger=logger, precision="bf16-mixed")
    assert fit.global_step == 2
    assert {(d.split(":")[0], t.split(":")[0]) for d, t in devices.seen} == {(device.type, device.type)}
    assert len(losses.losses) == 2 and all(math.isfinite(v) for v in losses.losses.values())
    step_ms = logger.values("train/time_step_ms")
    assert len(step_ms) == 2 and all(ms > 0 for ms in step_ms)
    moved = [n for n, p in module.drafter.named_parameters() if not torch.equal(p.detach().cpu(), drafter_before[n])]
    assert {"fc.weight", "mask_embedding"} <= set(moved), moved
    for k, v in module.target.model.state_dict().items():
        assert torch.equal(v, target_before[k]), f"the frozen target's {k} changed"
    assert all(p.grad is None for p in module.target.model.parameters())


def test_after_a_fit_the_drafter_fit_evaluates_sits_with_the_target(device):
    """What ``exittrain.fit.train_stage`` does after ``trainer.fit``: ``full_drafter`` hands the drafter to
    the held-out evaluation, which runs it on the target's outputs. It must sit on the target's device
    then; Lightning's strategy teardown moves the LightningModule (the drafter) to the CPU at fit end,
    while the target, a plain attribute, stays on the device."""
    module, _ = fit_on(device, 1)
    target = module.target
    drafter = full_drafter(module.drafter, target)
    where = {p.device for p in drafter.parameters()}
    assert where == {target.device}, f"after trainer.fit the drafter is on {where}, the target on {target.device}"
    batch = batch_of(2, seed=BATCH_SEED)
    ids = batch["input_ids"].to(target.device)
    features = target.sequence_features(ids, drafter.config.target_layer_ids)
    with torch.no_grad():
        logits = drafter.forward_anchors(features, ids, torch.tensor([[5, 9], [6, 10]], device=target.device))
    assert logits.device == target.device and bool(torch.isfinite(logits).all())
