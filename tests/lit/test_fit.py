"""End-to-end Lightning runs on a tiny target: fit, metrics, export, checkpoint, resume, stages, seeds."""

from __future__ import annotations

import json
import math

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader

from exittrain.lit import DecodeEvalCallback, ExitTrainModule, ExportDrafterCallback, MetricsFileCallback
from exittrain.models import load_drafter
from tests.lit.helpers import BLOCK, DistilledSequences, ListLogger, StepLosses, batch_of, collate, loader, make_module
from tests.lit.helpers import trainer as make_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

K = BLOCK - 1
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
TRAIN_METRICS = (
    ["train/loss", "train/loss_tok", "train/loss_exit", "train/analytic_block_length", "train/coverage"]
    + ["train/greedy_block_length"]
    + ["train/mean_exit_depth", "train/anchors", "train/anchors_per_s", "lr"]
    + [f"train/exit_mass_d{d}" for d in range(K + 1)]
    + [f"train/acc_d{k}" for k in range(1, K + 1)]
    + [f"train/time_{p}_ms" for p in ("features", "draft", "tree", "score", "exit", "backward", "step")]
)
VAL_METRICS = ["val/loss_tok", "val/analytic_block_length", "val/greedy_block_length", "val/coverage"] + [
    "val/block_length",
    "val/tokens_per_s",
]


def test_fit_smoke_exittrain(target, tmp_path):
    module = make_module(target, stage="exittrain", weight_type="flow")
    drafter = module.drafter
    before = {k: v.clone() for k, v in drafter.state_dict().items()}
    target_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    logger = ListLogger()
    decode = DecodeEvalCallback(lambda: PROMPTS, every_n_steps=3, budget=8, max_new_tokens=8, on_validation=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="val/block_length", mode="max", save_last=True)
    export = ExportDrafterCallback(tmp_path / "export", export_best=True)
    metrics_file = MetricsFileCallback(tmp_path, "exittrain")
    trainer = make_trainer(
        6, callbacks=[decode, ckpt, export, metrics_file], logger=logger, checkpointing=True, num_sanity_val_steps=1
    )
    trainer.fit(module, loader(8), loader(2, seed=1))  # 4 batches per epoch: validation after step 4
    assert trainer.global_step == 6

    # learning happened in the drafter only
    after = drafter.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before), "every drafter tensor must move"
    assert all(torch.equal(v, target.model.state_dict()[k]) for k, v in target_before.items())
    groups = trainer.optimizers[0].param_groups
    assert sum(len(g["params"]) for g in groups) == len(list(drafter.parameters()))

    # every metric was logged at every step (train) or every evaluation (val), and is finite
    for name in TRAIN_METRICS:
        steps = [s for s, _ in logger.history[name]]
        assert steps == list(range(6)), (name, steps)
        assert all(math.isfinite(v) for v in logger.values(name)), name
    for name in VAL_METRICS:
        assert logger.values(name) and all(math.isfinite(v) for v in logger.values(name)), name
    tau = logger.values("train/analytic_block_length")
    cov = logger.values("train/coverage")
    assert all(1.0 <= t <= K + 1 and t == pytest.approx(1 + c, abs=1e-5) for t, c in zip(tau, cov))
    for step in range(6):
        mass = sum(logger.history[f"train/exit_mass_d{d}"][step][1] for d in range(K + 1))
        assert mass == pytest.approx(1.0, abs=1e-5)
    lrs = logger.values("lr")
    assert lrs[1] == pytest.approx(module.hparams.lr) and lrs[-1] < lrs[1]  # 1 warmup step, then cosine down

    # decoding evaluation: steps 3 and 6 (every_n_steps), 4 (validation); none at the sanity check
    assert [h["step"] for h in decode.history] == [3, 4, 6]
    assert all(1.0 <= h["block_length"] <= K + 1 and h["tokens"] > 0 for h in decode.history)
    assert trainer.callback_metrics["val/block_length"] == pytest.approx(decode.history[-1]["block_length"])
    assert ckpt.best_model_score is not None and math.isfinite(float(ckpt.best_model_score))

    # metrics_exittrain.json: final and best
    saved = json.loads((tmp_path / "metrics_exittrain.json").read_text())
    assert saved["global_step"] == 6
    assert saved["final"]["val/block_length"] == pytest.approx(decode.history[-1]["block_length"])
    assert saved["final"]["train/loss"] == pytest.approx(logger.values("train/loss")[-1])
    assert saved["best"][0]["monitor"] == "val/block_length" and saved["best"][0]["path"] == ckpt.best_model_path
    assert [h["step"] for h in saved["decode_eval"]["history"]] == [3, 4, 6]

    # the checkpoint: plain, drafter only, rebuilds the drafter
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert set(last["state_dict"]) == {f"drafter.{k}" for k in drafter.state_dict()}
    assert last["exittrain"]["target_name"] == target.name
    assert last["hyper_parameters"]["stage"] == "exittrain" and "target" not in last["hyper_parameters"]
    assert last["global_step"] == 4  # saved after the validation of epoch 0
    rebuilt = ExitTrainModule.drafter_from_checkpoint(tmp_path / "ckpt" / "last.ckpt", target)
    assert all(torch.equal(v, last["state_dict"][f"drafter.{k}"]) for k, v in rebuilt.state_dict().items())

    # the exported drafter: safetensors, loads with load_drafter and gives the same logits
    out = tmp_path / "export"
    assert sorted(p.name for p in out.iterdir()) == ["drafter", "drafter-best"], "no temporary leftovers"
    assert (out / "drafter" / "model.safetensors").is_file() and (out / "drafter" / "config.json").is_file()
    loaded = load_drafter(out / "drafter", target)
    batch = batch_of(2, seed=9)
    features = target.sequence_features(batch["input_ids"], drafter.config.target_layer_ids)
    anchors = torch.tensor([[10, 12], [11, 13]])
    drafter.eval()
    with torch.no_grad():
        want = drafter.forward_anchors(features, batch["input_ids"], anchors)
        got = loaded.forward_anchors(features, batch["input_ids"], anchors)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    best = load_drafter(out / "drafter-best", target)
    best_ckpt = ExitTrainModule.drafter_from_checkpoint(ckpt.best_model_path, target)
    assert all(torch.equal(v, best.state_dict()[k]) for k, v in best_ckpt.state_dict().items())


def test_resume_continues_at_the_saved_step_with_the_same_losses(target, tmp_path):
    """Run 6 steps saving at step 3; a fresh module resumed from step 3 repeats steps 3..5 exactly."""
    data = loader(6)  # 3 batches per epoch: the step-3 checkpoint sits at an epoch boundary
    full = StepLosses()
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3, save_top_k=-1)
    make_trainer(6, callbacks=[full, ckpt], checkpointing=True).fit(make_module(target), data)
    assert (tmp_path / "step=3.ckpt").is_file()

    resumed = StepLosses()
    module = make_module(target, drafter_seed=123)  # other init: the checkpoint must overwrite it
    trainer = make_trainer(
        6,
        # the same checkpoint callback as the saving run (Lightning restores its state), writing elsewhere
        callbacks=[
            resumed,
            ModelCheckpoint(tmp_path / "resumed", filename="{step}", every_n_train_steps=3, save_top_k=-1),
        ],
        checkpointing=True,
    )
    trainer.fit(module, data, ckpt_path=tmp_path / "step=3.ckpt")
    assert trainer.global_step == 6
    assert sorted(resumed.losses) == [3, 4, 5]
    assert sorted(p.name for p in (tmp_path / "resumed").iterdir()) == ["step=6.ckpt"]
    for step in (3, 4, 5):
        assert resumed.losses[step] == pytest.approx(full.losses[step], rel=1e-6), step


@pytest.mark.parametrize(
    "stage, weight_type, scoring",
    [
        ("pretrain", "flow", "exact"),
        ("exittrain", "flow", "exact"),
        ("exittrain", "exit", "exact"),
        ("exittrain", "missing", "exact"),
        ("exittrain", "flow", "windowed"),
    ],
)
def test_every_stage_and_weight_type_trains(target, stage, weight_type, scoring):
    module = make_module(
        target, stage=stage, weight_type=weight_type, scoring=scoring, window=6, analytic_every=2, gamma=0.9
    )
    logger = ListLogger()
    make_trainer(3, logger=logger).fit(module, loader(6))
    losses = logger.values("train/loss")
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    if stage == "exittrain":
        assert len(logger.values("train/loss_exit")) == 3
        assert all(v > 0 for v in logger.values("train/loss_exit"))
        expect = [
            module.hparams.lambda_tok * t + module.hparams.lambda_exit * e
            for t, e in zip(logger.values("train/loss_tok"), logger.values("train/loss_exit"))
        ]
        assert losses == pytest.approx(expect, rel=1e-6)
        assert logger.values("train/time_tree_ms")[1] > 0  # trees every step
    else:
        assert "train/loss_exit" not in logger.history
        assert losses == pytest.approx(logger.values("train/loss_tok"), rel=1e-6)
        # analytic metrics at steps 0 and 2 only: no tree was built at step 1
        tree_ms = logger.values("train/time_tree_ms")
        assert tree_ms[0] > 0 and tree_ms[1] == 0 and tree_ms[2] > 0


def test_pretrain_with_analytic_every_zero_builds_no_tree(target):
    logger = ListLogger()
    make_trainer(2, logger=logger).fit(make_module(target, stage="pretrain", analytic_every=0), loader(4))
    assert "train/analytic_block_length" not in logger.history
    assert logger.values("train/time_score_ms") == [0.0, 0.0]


def test_same_seed_gives_identical_losses(target):
    def run(seed):
        losses = StepLosses()
        make_trainer(4, callbacks=[losses]).fit(make_module(target, seed=seed), loader(8))
        return [losses.losses[s] for s in range(4)]

    first, second, other = run(0), run(0), run(1)
    assert first == second  # bit for bit
    assert first != other  # the seed drives the anchors


def test_pretraining_on_self_distilled_data_raises_the_analytic_block_length(target):
    """STYLE habit 9: the drafter learns the target's continuations, so held-out tau rises and CE falls."""
    train = DataLoader(DistilledSequences(target, 128, seed=0), batch_size=8, shuffle=False, collate_fn=collate)
    val = DataLoader(DistilledSequences(target, 16, seed=1), batch_size=8, collate_fn=collate)
    module = make_module(target, stage="pretrain", lr=1e-2, warmup_ratio=0.1, analytic_every=0)
    trainer = make_trainer(48)
    before = trainer.validate(module, val, verbose=False)[0]
    trainer.fit(module, train, val)
    after = trainer.validate(module, val, verbose=False)[0]
    assert after["val/loss_tok"] < before["val/loss_tok"] - 0.5
    assert after["val/analytic_block_length"] > before["val/analytic_block_length"] + 0.03
