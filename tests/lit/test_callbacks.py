"""Callbacks: decoding evaluation feeding ModelCheckpoint, atomic drafter export, the metrics file."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from exittrain.decoding import SpeculativeDecoder
from exittrain.lit import DecodeEvalCallback, ExportDrafterCallback, MetricsFileCallback, save_drafter
from exittrain.models import load_drafter
from exittrain.run_dir import write_json_atomic
from tests.lit.helpers import ListLogger, loader, make_module, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]


def test_decode_eval_matches_the_decoder_and_restores_train_mode(target):
    module = make_module(target)
    module.drafter.train()
    callback = DecodeEvalCallback(PROMPTS, every_n_steps=1, budget=8, max_new_tokens=6)
    stats = callback.evaluate(module.drafter, target)
    assert module.drafter.training
    decoder = SpeculativeDecoder(target, module.drafter, budget=8)
    results = [decoder.generate(p, max_new_tokens=6, seed=i) for i, p in enumerate(PROMPTS)]
    rounds = sum(len(r.rounds) for r in results)
    assert stats["rounds"] == rounds
    assert stats["tokens"] == sum(len(r.tokens) for r in results)
    assert stats["block_length"] == pytest.approx(sum(r.block_length for x in results for r in x.rounds) / rounds)
    assert stats["tokens_per_s"] > 0


def test_decode_eval_on_the_chain_decodes_what_a_serving_engine_verifies(target):
    """shape=chain (+serve=dflash's tree.shape): the chain decoder's rounds, whatever the budget."""
    from exittrain.decoding.chain_decoder import ChainDecoder

    module = make_module(target)
    stats = DecodeEvalCallback(PROMPTS, budget=16, max_new_tokens=6, shape="chain").evaluate(module.drafter, target)
    decoder = ChainDecoder(target, module.drafter.eval())
    results = [decoder.generate(p, max_new_tokens=6, seed=i) for i, p in enumerate(PROMPTS)]
    rounds = sum(len(r.rounds) for r in results)
    assert stats["rounds"] == rounds
    assert stats["block_length"] == pytest.approx(sum(r.block_length for x in results for r in x.rounds) / rounds)


def test_decode_eval_feeds_model_checkpoint_without_a_validation_loop(target, tmp_path, caplog):
    """Logged from on_train_batch_end, val/block_length reaches callback_metrics before ModelCheckpoint runs."""
    decode = DecodeEvalCallback(PROMPTS, every_n_steps=2, budget=8, max_new_tokens=6)
    ckpt = ModelCheckpoint(dirpath=tmp_path, monitor="val/block_length", mode="max", every_n_train_steps=2)
    logger = ListLogger()
    fit = trainer(4, callbacks=[decode, ckpt], logger=logger, checkpointing=True)
    with caplog.at_level(logging.INFO, logger="exittrain"):
        fit.fit(make_module(target, stage="pretrain", analytic_every=0), loader(8))
    assert [h["step"] for h in decode.history] == [2, 4]
    # each check says it started (a CPU decode check is silent for tens of seconds otherwise)
    started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("decode check at step")]
    assert started == ["decode check at step 2: 2 held-out prompts, trees of 8",
                       "decode check at step 4: 2 held-out prompts, trees of 8"]
    assert Path(ckpt.best_model_path).is_file()
    assert float(ckpt.best_model_score) == pytest.approx(max(h["block_length"] for h in decode.history))
    # the value logged at step 2 is the one evaluated at step 2
    assert logger.history["val/block_length"][0][1] == pytest.approx(decode.history[0]["block_length"])
    saved = torch.load(ckpt.best_model_path, weights_only=True)
    state = next(v for k, v in saved["callbacks"].items() if k.startswith("DecodeEvalCallback"))
    restored = DecodeEvalCallback(PROMPTS)
    restored.load_state_dict(state)
    assert restored.history == decode.history[: len(restored.history)] and restored.history


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"every_n_steps": -1}, "every_n_steps"),
        ({"budget": 0}, "budget"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"prompts": [[3]]}, "prompts"),
        ({"prompts": []}, "prompts"),
        ({"shape": "star"}, "shape"),
    ],
)
def test_decode_eval_rejects_bad_arguments(kwargs, key):
    kwargs = {"prompts": PROMPTS, **kwargs}
    with pytest.raises(ValueError, match=key):
        DecodeEvalCallback(**kwargs)


def test_decode_eval_resolves_a_prompt_callable_lazily():
    calls = []

    def source():
        calls.append(1)
        return PROMPTS

    callback = DecodeEvalCallback(source)
    assert not calls
    assert callback.prompts == PROMPTS and callback.prompts == PROMPTS
    assert len(calls) == 1


def test_save_drafter_replaces_and_never_leaves_a_partial_folder(target, tmp_path, monkeypatch):
    first = make_module(target, drafter_seed=1).drafter
    second = make_module(target, drafter_seed=2).drafter
    path = tmp_path / "drafter"
    save_drafter(first, path)
    save_drafter(second, path)  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"]
    loaded = load_drafter(path, target)
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in second.state_dict().items())

    def crash(save_directory, **kwargs):
        (Path(save_directory) / "config.json").write_text("{half")
        raise OSError("disk full")

    monkeypatch.setattr(first, "save_pretrained", crash)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(first, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drafter"], "temporary folder removed"
    loaded = load_drafter(path, target)  # the previous export is intact
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in second.state_dict().items())


def test_export_callback_writes_only_on_rank_zero(target, tmp_path):
    class FakeStrategy:
        def barrier(self, name=None):
            self.barriers = getattr(self, "barriers", 0) + 1

    class FakeTrainer:
        is_global_zero = False
        strategy = FakeStrategy()
        checkpoint_callbacks = []

    module = make_module(target)
    callback = ExportDrafterCallback(tmp_path / "out")
    callback.on_fit_end(FakeTrainer(), module)
    assert not (tmp_path / "out").exists() and FakeTrainer.strategy.barriers == 1
    FakeTrainer.is_global_zero = True
    callback.on_fit_end(FakeTrainer(), module)
    assert (tmp_path / "out" / "drafter" / "model.safetensors").is_file()
    assert callback.exported == [tmp_path / "out" / "drafter"]
    with pytest.raises(ValueError, match="name"):
        ExportDrafterCallback(tmp_path, name="a/b")


def test_write_json_atomic(tmp_path):
    path = write_json_atomic(tmp_path / "sub" / "metrics.json", {"a": 1.5, "b": None})
    assert json.loads(path.read_text()) == {"a": 1.5, "b": None}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"a": object()})
    assert json.loads(path.read_text()) == {"a": 1.5, "b": None}, "a failed write keeps the old file"
    assert sorted(p.name for p in path.parent.iterdir()) == ["metrics.json"]


def test_metrics_file_callback_writes_the_stage_file_of_the_run_directory(tmp_path):
    """Its one layout goes to metrics_<stage>.json: it cannot write the fit summary's metrics.json."""
    from types import SimpleNamespace

    callback = MetricsFileCallback(tmp_path / "run", "pretrain")
    assert callback.path == tmp_path / "run" / "metrics_pretrain.json"
    trainer = SimpleNamespace(
        callback_metrics={"train/loss": torch.tensor(2.5), "val/x": torch.tensor(float("nan")), "v": torch.ones(2)},
        checkpoint_callbacks=[], callbacks=[], global_step=3, current_epoch=1, is_global_zero=True,
        strategy=SimpleNamespace(barrier=lambda name: None),
    )
    callback.on_fit_end(trainer, None)
    saved = json.loads(callback.path.read_text())
    assert saved == {"global_step": 3, "epoch": 1, "final": {"train/loss": 2.5, "val/x": None}, "best": []}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics_pretrain.json"]
    with pytest.raises(ValueError, match=r"stage='\.\./x': need a plain name"):
        MetricsFileCallback(tmp_path, "../x")


def test_stage_progress_bar_shows_the_stages_steps():
    """The stages run by max_steps over many epochs (max_epochs -1: Lightning's Rich bar printed 'Epoch 6/-2')."""
    from types import SimpleNamespace

    from lightning.pytorch.callbacks import RichProgressBar

    from exittrain.lit import stage_progress_bar

    bar = stage_progress_bar("pretrain")
    if not isinstance(bar, RichProgressBar):
        pytest.skip("rich is not installed: the tqdm bar is tested in tests/lit/test_progress_callbacks.py")
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=600, global_step=120)
    assert bar._get_train_description(6).strip() == "pretrain step 120/600"
    bar._trainer = SimpleNamespace(max_epochs=-1, max_steps=600, global_step=7)
    assert bar._get_train_description(0) == "pretrain step   7/600", "the step keeps the total's width"
    bar._trainer = SimpleNamespace(max_epochs=3, max_steps=-1, global_step=7)
    assert bar._get_train_description(1).strip() == "pretrain step 7", "no max_steps: no total"
