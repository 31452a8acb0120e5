"""FSDP (``trainer=fsdp``) on 2 CPU processes (gloo): the drafter is sharded, trains like one process,
resumes from its single-file checkpoint, and rank 0 alone exports it whole.

The sharded run is ``tests/lit/fsdp_driver.py`` in a subprocess, with the strategy
``conf/trainer/fsdp.yaml`` builds (:class:`exittrain.lit.DrafterFSDPStrategy`, FSDP2 on Lightning's
``ModelParallelStrategy``). Lightning's launcher re-runs that command for rank 1. The
single-process reference runs in this process on the rows the two ranks saw together, in the
same order, for the fit and for the resumed step.

Why the runs must agree to float rounding: the argument of ``tests/lit/test_ddp.py`` (the ranks
split each global batch, every row has the same 10 anchor candidates and all are drawn, so both
ranks divide by the same counts and the averaged gradient is the global one) holds unchanged.
FSDP reduce-scatters the gradients where DDP all-reduces them: each rank keeps the average of
its own shard. On top of that, the driver clips every step (``gradient_clip_val`` below every
step's norm), so a norm computed per shard rather than over the whole drafter would scale the
two shards differently; it uses a weight decay whose matrices-only split would show if the
sharded parameters lost their shapes; and it resumes a fresh module from the checkpoint, whose
one more step matches only if the weights, the AdamW moments and the step count all came back.

Gradients are compared at every step before clipping (gathered in ``on_before_optimizer_step``)
and after (what AdamW used), the weights after the fit and after the resumed step. Writes are
observed through the ``sys.audit`` journal of ``ddp_driver`` in each process.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
import torch

from tests.lit import fsdp_driver
from tests.lit.test_ddp import (
    LATER_GRAD_TOL,
    LATER_TOL,
    STEP0_TOL,
    _rel_err,
    global_order,
    reference_run,
    run_two_ranks,
)

pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*_dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
]

STEPS = fsdp_driver.STEPS
# The tests of the two-process run (the `runs` fixture: two ranks in subprocesses plus a reference
# fit) are marked slow (make test-slow); the one-process checks at the end stay in the fast tier.


def _global_order(ranks: list[dict], phase: str) -> list[int]:
    return global_order(ranks[0]["row_ids"][phase], ranks[1]["row_ids"][phase])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The sharded run's per-rank records and the single-process reference on the same global batches."""
    out = tmp_path_factory.mktemp("fsdp")
    t0 = time.perf_counter()
    ranks, tensors = run_two_ranks("tests.lit.fsdp_driver", out, label="FSDP")
    order, resume_order = _global_order(ranks, "fit"), _global_order(ranks, "resume")
    ref_out = tmp_path_factory.mktemp("single")
    ref, ref_tensors = reference_run(
        lambda: fsdp_driver.train(1, ref_out, order=order, resume_order=resume_order), ref_out
    )
    print(f"FSDP driver and reference {time.perf_counter() - t0:.1f} s")
    return {"out": out, "ranks": ranks, "tensors": tensors, "ref": ref, "ref_tensors": ref_tensors}


# ----------------------------------------------------------------------------------------------
# the sharded run


@pytest.mark.slow
def test_each_rank_holds_half_of_every_parameter(runs):
    (r0, r1), (t0, t1) = runs["ranks"], runs["tensors"]
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["world_size"]) == (0, 1, 2, 2)
    for r in (r0, r1):
        s = r["sharding"]
        assert s["class"] == "FSDPBlockDrafter" and s["all_dtensor_shard0"], s
        assert 0.45 < s["local_numel"] / s["total_numel"] < 0.55, s
    assert r0["sharding"]["local_numel"] + r1["sharding"]["local_numel"] == r0["sharding"]["total_numel"]
    # the two shards are disjoint halves along dim 0 of the whole parameter, not two copies
    full = t0["fit_state"]
    assert t1["fit_state"] is None, "only rank 0 receives the gathered drafter"
    assert t0["local"].keys() == full.keys()
    for name, value in full.items():
        assert t0["local"][name].shape[0] < value.shape[0], name
        assert torch.equal(torch.cat([t0["local"][name], t1["local"][name]]), value), name


@pytest.mark.slow
def test_each_rank_sees_different_rows(runs):
    r0, r1 = runs["ranks"]
    assert r0["global_step"] == r1["global_step"] == [STEPS, fsdp_driver.RESUME_STEPS]
    seen0 = [i for rows in r0["row_ids"]["fit"] for i in rows]
    seen1 = [i for rows in r1["row_ids"]["fit"] for i in rows]
    assert all(len(rows) == fsdp_driver.GLOBAL_BATCH // 2 for rows in r0["row_ids"]["fit"] + r1["row_ids"]["fit"])
    assert not set(seen0) & set(seen1), "both ranks trained on the same rows: the data is not split"
    assert sorted(seen0 + seen1) == list(range(STEPS * fsdp_driver.GLOBAL_BATCH)), "every row exactly once"
    assert not set(r0["row_ids"]["resume"][0]) & set(r1["row_ids"]["resume"][0])
    batch = fsdp_driver.GLOBAL_BATCH
    for phase in ("fit", "resume"):
        order = _global_order(runs["ranks"], phase)
        assert runs["ref"]["row_ids"][phase] == [order[s : s + batch] for s in range(0, len(order), batch)]


@pytest.mark.slow
def test_gradients_are_reduced_and_clipped_like_one_process(runs):
    (t0, t1), ref = runs["tensors"], runs["ref_tensors"]
    per_row = fsdp_driver.ANCHOR_CANDIDATES
    assert all(n == 2 * per_row for r in runs["ranks"] for ph in ("fit", "resume") for n in r["anchors"][ph])
    assert runs["ref"]["anchors"]["fit"] == [4 * per_row] * STEPS
    for phase in ("fit", "resume"):
        for kind in ("grads", "clipped"):
            assert len(t0[kind][phase]) == len(ref[kind][phase]) == (STEPS if phase == "fit" else 1)
            for step, (g0, g1, g_ref) in enumerate(zip(t0[kind][phase], t1[kind][phase], ref[kind][phase])):
                assert g0.keys() == g_ref.keys()
                tol = STEP0_TOL if (phase, step) == ("fit", 0) else LATER_GRAD_TOL
                for name in g_ref:
                    assert torch.equal(g0[name], g1[name]), (phase, kind, step, name)
                    err = _rel_err(g0[name], g_ref[name])
                    assert err < tol, (phase, kind, step, name, err)
    # the checks can fail: clipping acted on every step, and a summed gradient is 100% off
    for phase in ("fit", "resume"):
        for pre, post in zip(ref["grads"][phase], ref["clipped"][phase]):
            norm = sum(float(g.norm()) ** 2 for g in pre.values()) ** 0.5
            assert norm > 2 * fsdp_driver.CLIP
            clipped = sum(float(g.norm()) ** 2 for g in post.values()) ** 0.5
            assert clipped == pytest.approx(fsdp_driver.CLIP, rel=1e-4)
    g0, g_ref = t0["grads"]["fit"][0], ref["grads"]["fit"][0]
    assert max(_rel_err(2 * g0[n], g_ref[n]) for n in g_ref) > 0.5


@pytest.mark.slow
def test_weights_and_losses_match_the_single_process_run(runs):
    (t0, _), ref = runs["tensors"], runs["ref_tensors"]
    start = _initial_drafter_state()
    for name, value in ref["fit_state"].items():
        assert _rel_err(t0["fit_state"][name], value) < LATER_TOL, (name, _rel_err(t0["fit_state"][name], value))
    moved = max(_rel_err(ref["fit_state"][n], start[n]) for n in start)
    assert moved > 100 * LATER_TOL, "training must move the weights far beyond the tolerance"
    r0, r1 = runs["ranks"]
    mean_loss = [(a + b) / 2 for a, b in zip(r0["losses"]["fit"], r1["losses"]["fit"])]
    assert mean_loss == pytest.approx(runs["ref"]["losses"]["fit"], rel=LATER_TOL)
    assert r0["val_loss_tok"] == r1["val_loss_tok"] == pytest.approx(runs["ref"]["val_loss_tok"], rel=LATER_TOL)
    # the decoding evaluation gathered the sharded drafter mid-training (step 2) and at the end
    assert r0["decode_history"] == r1["decode_history"] == runs["ref"]["decode_history"] == [2.0, float(STEPS)]


@pytest.mark.slow
def test_resume_restores_the_shards_and_continues_like_one_process(runs):
    (t0, _), ref = runs["tensors"], runs["ref_tensors"]
    fit = t0["fit_state"]
    assert t0["resume_start"].keys() == fit.keys()
    for name, value in fit.items():
        assert torch.equal(t0["resume_start"][name], value), f"the checkpoint did not restore {name}"
    for name, value in ref["resumed_state"].items():
        err = _rel_err(t0["resumed_state"][name], value)
        assert err < LATER_TOL, (name, err)
    moved = max(_rel_err(ref["resumed_state"][n], fit[n]) for n in fit)
    assert moved > 100 * LATER_TOL, "the resumed step must move the weights far beyond the tolerance"


@pytest.mark.slow
def test_checkpoint_is_one_file_with_the_whole_drafter(runs, target):
    from exittrain.lit import ExitTrainModule

    ckpt_path = runs["out"] / "run" / "ckpt" / "last.ckpt"
    assert ckpt_path.is_file()
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    fit = runs["tensors"][0]["fit_state"]
    assert set(ckpt["state_dict"]) == {f"drafter.{n}" for n in fit}
    optimizer = ckpt["optimizer_states"][0]
    assert sorted(optimizer["state"]) == list(range(len(fit))), "AdamW state of every parameter, whole"
    assert sum(s["exp_avg"].numel() for s in optimizer["state"].values()) == sum(v.numel() for v in fit.values())
    drafter = ExitTrainModule.drafter_from_checkpoint(ckpt_path, target)
    for name, value in drafter.state_dict().items():
        assert torch.equal(value, fit[name]), name


@pytest.mark.slow
def test_rank_zero_exports_the_whole_drafter(runs, target):
    from exittrain.models import load_drafter

    export = runs["out"] / "run" / "export"
    (t0, _) = runs["tensors"]
    for folder, state in (("drafter", t0["fit_state"]), ("resumed", t0["resumed_state"])):
        assert (export / folder / "model.safetensors").is_file()
        loaded = load_drafter(export / folder, target)
        got = loaded.state_dict()
        assert got.keys() == state.keys()
        for name, value in state.items():
            assert torch.equal(got[name], value), (folder, name)
    assert runs["ranks"][0]["exported"] == [str(export / "drafter"), str(export / "resumed")]
    assert runs["ranks"][1]["exported"] == []


@pytest.mark.slow
def test_only_rank_zero_writes(runs):
    r0, r1 = runs["ranks"]
    assert r1["writes"] == [], f"rank 1 wrote under the run directory: {r1['writes']}"
    written = {path for _, path in r0["writes"]}
    for expected in ("logs/csv/version_0/metrics.csv", "ckpt/last.ckpt", "metrics_exittrain.json", "export/drafter"):
        assert expected in written, (expected, sorted(written))
    run = runs["out"] / "run"
    assert len(list((run / "logs" / "csv").iterdir())) == 1, "one logger version: a second rank would add one"
    metrics = json.loads((run / "metrics_exittrain.json").read_text())
    assert metrics["global_step"] == STEPS and len(metrics["decode_eval"]["history"]) == 2


def _initial_drafter_state() -> dict[str, torch.Tensor]:
    """The drafter's weights before training (the driver's construction and seed)."""
    from tests.lit.helpers import make_module
    from tests.models.helpers import tiny_target

    module = make_module(tiny_target("llama"), **fsdp_driver.module_kwargs())
    return {k: v.detach().clone() for k, v in module.drafter.state_dict().items()}


# ----------------------------------------------------------------------------------------------
# one process: the unsharded paths cost nothing, bad settings fail early


def test_without_a_mesh_nothing_is_sharded_or_copied(target):
    from exittrain.lit import full_drafter, is_sharded
    from tests.lit.helpers import make_module

    module = make_module(target)
    params = list(module.drafter.parameters())
    module.configure_model()  # no strategy gave a mesh (single device, DDP)
    assert not is_sharded(module.drafter)
    assert list(module.drafter.parameters()) == params
    assert full_drafter(module.drafter, target) is module.drafter


def test_fsdp1_strategy_is_refused(target):
    from lightning.pytorch.strategies import FSDPStrategy

    from tests.lit.helpers import make_module

    module = make_module(target)
    module._trainer = SimpleNamespace(strategy=FSDPStrategy())
    with pytest.raises(ValueError, match="trainer=fsdp"):
        module.setup("fit")


def test_tensor_parallel_mesh_is_refused(target):
    from tests.lit.helpers import make_module

    class Mesh:  # the two attributes configure_model reads of a (data, tensor) DeviceMesh
        mesh_dim_names = ("data_parallel", "tensor_parallel")

        def __getitem__(self, name):
            return SimpleNamespace(size=lambda: 2)

    module = make_module(target)
    module._device_mesh = Mesh()
    with pytest.raises(ValueError, match=r"trainer\.strategy\.tensor_parallel_size=2"):
        module.configure_model()


def test_sharded_checkpoint_folders_are_refused(tmp_path, target):
    from exittrain.lit import DrafterFSDPStrategy, ExitTrainModule

    with pytest.raises(ValueError, match="save_distributed_checkpoint"):
        DrafterFSDPStrategy(save_distributed_checkpoint=True)
    (tmp_path / "last.ckpt").mkdir()
    with pytest.raises(ValueError, match="is a folder"):
        ExitTrainModule.drafter_from_checkpoint(tmp_path / "last.ckpt", target)


def test_trainer_fsdp_config_builds_the_sharded_strategy_on_cpu(tmp_path):
    from hydra import compose, initialize_config_dir

    from exittrain import configs
    from exittrain.lit import DrafterFSDPStrategy
    from exittrain.lit.trainer import build_trainer

    configs.register_recipes()
    overrides = ["+recipe=code", "trainer=fsdp", "trainer.accelerator=cpu", "trainer.devices=2"]
    with initialize_config_dir(config_dir=str(configs.CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=[*overrides, f"paths.output_dir={tmp_path}"])
    trainer = build_trainer(cfg.trainer, max_steps=1, logger=False, enable_checkpointing=False)
    assert isinstance(trainer.strategy, DrafterFSDPStrategy)
    assert trainer.num_devices == 2 and trainer.gradient_clip_val == 1.0
    assert trainer.strategy._tensor_parallel_size == 1
