"""`fit` on a process that is not global rank 0 answers its shard of the regeneration, trains and
leaves the rest to rank 0, which evaluates and writes every file.

tests/lit/test_ddp.py runs two processes but builds its own trainer, not ``fit``. These tests
instead set Lightning's ``rank_zero_only.rank``, the rank that
``exittrain.fit`` and Lightning's loggers read, in one CPU process. Lightning changes it only
when a multi-process strategy builds its world; the single-device trainer used here leaves it
alone, so the whole of ``fit`` runs as rank 1 would. The tiny target is passed to ``fit``.
Everything is tiny and offline.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import hydra.utils
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.utilities import rank_zero_only

from exittrain.build import prepare_data
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.fit import fit
from exittrain.lit.run_logging import close_logger, make_logger
from exittrain.models import TargetModel
from tests.models.helpers import VOCAB, tiny_target

pytestmark = [
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*_dataloader' does not have many workers"),
]

WORDS = [f"w{i}" for i in range(2, VOCAB)]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture()
def rank(monkeypatch):
    """Set this process's global rank as Lightning (and exittrain.fit) see it; restored afterwards."""

    def set_rank(value: int) -> None:
        monkeypatch.setattr(rank_zero_only, "rank", value)

    return set_rank


# ----------------------------------------------------------------------------------------------
# the W&B logger


def test_wandb_logger_is_not_configured_on_ranks_above_zero(rank, tmp_path, monkeypatch):
    """On rank 1 `experiment` is Lightning's dummy: touching its `config` raised AttributeError."""
    wandb = pytest.importorskip("wandb")  # an optional extra

    monkeypatch.setenv("WANDB_MODE", "offline")
    rank(1)
    cfg = _compose("logger=wandb", f"paths.output_dir={tmp_path}")
    logger = make_logger(cfg, "code-pretrain")
    try:
        assert type(logger).__name__ == "WandbLogger"
        assert wandb.run is None, "a rank above 0 started a W&B run"
    finally:
        close_logger(logger)
    assert not (tmp_path / "wandb").exists()


# ----------------------------------------------------------------------------------------------
# regeneration: every rank answers its shard, then waits for the complete entry


class FakeData:
    """What fit.prepare_data uses of the DataModule: prepare_data() and cache_path. ``completes``:
    this rank's shard is the last one, so its prepare_data writes the entry."""

    def __init__(self, path: Path, completes: bool = True):
        self.cache_path = path
        self.prepared = 0
        self.completes = completes

    def prepare_data(self) -> None:
        self.prepared += 1
        if self.completes:
            self.cache_path.mkdir()


def test_rank_zero_regenerates(rank, tmp_path):
    rank(0)
    data = FakeData(tmp_path / "entry")
    prepare_data(data, wait_s=0)
    assert data.prepared == 1


def test_other_ranks_wait_for_the_complete_entry(rank, tmp_path):
    rank(1)
    data = FakeData(tmp_path / "entry", completes=False)
    timer = threading.Timer(0.3, data.cache_path.mkdir)  # "rank 0" finishes the last shard a moment later
    timer.start()
    try:
        prepare_data(data, wait_s=30, poll_s=0.02)
    finally:
        timer.cancel()
    assert data.prepared == 1 and data.cache_path.is_dir()


def test_other_ranks_give_up_with_a_clear_error(rank, tmp_path):
    rank(2)
    data = FakeData(tmp_path / "entry", completes=False)
    with pytest.raises(TimeoutError, match=r"rank 2: no regenerated data at .*entry after data_wait_s=0.05 s"):
        prepare_data(data, wait_s=0.05, poll_s=0.01)
    assert data.prepared == 1


# ----------------------------------------------------------------------------------------------
# fit end to end as rank 1


def _compose(*overrides: str):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("fit", overrides=["+recipe=code", "debug=smoke", *overrides])


def _word_target() -> TargetModel:
    """tiny_target with a word-level tokenizer (w2..w63) and a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{w: i for i, w in enumerate(WORDS, start=2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    target = tiny_target("llama")
    return TargetModel(target.model, tokenizer, name="tiny-words")


def _sources(tmp_path: Path) -> tuple[str, str]:
    g = torch.Generator().manual_seed(0)

    def prompts(n: int, offset: int) -> str:
        rows = []
        for i in range(n):
            ids = torch.randint(0, len(WORDS), (6,), generator=g).tolist()
            rows.append(json.dumps({"text": " ".join([WORDS[(offset + i) % len(WORDS)], *(WORDS[j] for j in ids)])}))
        return "\n".join(rows) + "\n"

    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text(prompts(8, 0))
    evals.write_text(prompts(2, 30))
    return f"data.train_sources=[jsonl:{train}:text]", f"data.eval_sources=[jsonl:{evals}:text]"


def _tiny_fit(tmp_path: Path):
    """A fit config of a few steps, and the tiny target to pass to ``fit``: returns (cfg, target)."""
    cfg = _compose(
        *_sources(tmp_path),
        f"paths.output_dir={tmp_path / 'run'}",
        f"paths.cache_dir={tmp_path / 'cache'}",
        "~logger",
        "~callbacks.checkpoint",
        "~callbacks.lr_monitor",
        "callbacks.decode_eval.max_new_tokens=4",
        "data.generation.max_new_tokens=8",
        "data.max_length=32",
        "data.batch_size=2",
        "stages.pretrain.max_steps=2",
        "stages.exittrain.max_steps=1",
        "tree.budget_train=4",
        "eval.budgets=[4]",
        "eval.num_prompts=1",
        "eval.max_new_tokens=4",
        "drafter.block_size=3",
        "data_wait_s=0",
    )
    return cfg, _word_target()


RANK_ZERO_FILES = ("eval_warm_start.json", "eval_exittrain.json", "tree_example.json", "metrics.json", "drafter")


def test_fit_on_rank_zero_regenerates_evaluates_and_writes(rank, tmp_path, monkeypatch):
    cfg, target = _tiny_fit(tmp_path)
    from exittrain import decoding

    baselines = []
    real_ar = decoding.autoregressive_generate

    def counting_ar(target, prompt, *args, **kwargs):
        baselines.append(list(prompt))
        return real_ar(target, prompt, *args, **kwargs)

    monkeypatch.setattr(decoding, "autoregressive_generate", counting_ar)  # the evaluator's baselines read it here
    from exittrain.data import ExitTrainDataModule
    from exittrain.heldout.evaluator import HeldOutEvaluator

    released, real_release, real_measure = [], ExitTrainDataModule.release_store, HeldOutEvaluator.measure

    def release(self):
        released.append("release")
        real_release(self)

    def measure(self, drafter, label):
        released.append(label)
        return real_measure(self, drafter, label)

    monkeypatch.setattr(ExitTrainDataModule, "release_store", release)
    monkeypatch.setattr(HeldOutEvaluator, "measure", measure)
    rank(0)
    summary = fit(cfg, target=target)
    assert set(summary["tables"]) == {"warm_start", "exittrain"}
    # the training rows' store goes once the last stage has trained, before its evaluation
    assert released == ["warm_start", "release", "exittrain"], released
    for name in RANK_ZERO_FILES:
        assert (tmp_path / "run" / name).exists(), name
    # the answer tokens a CPU decoder's draft vocabulary reads: written only when eval.decode=auto asks for that lab
    assert not (tmp_path / "run" / "drafter" / "draft_vocab.json").exists()
    # one autoregressive baseline, the live prompt's at T = 0, serves both tables; every other answer is
    # walked along the target's batched answers (and at T > 0 no prompt is decoded)
    assert len(baselines) == 1
    # a CPU target's table carries no speed (the plain decoder's says nothing a user can act on); the shared
    # baselines still give every greedy row its lossless check
    rows = [r for table in summary["tables"].values() for r in table]
    assert all("ar_tokens_per_s" not in r and "speedup" not in r for r in rows)
    assert all(r["lossless"] is True for r in rows if r["temperature"] == 0)
    assert any(r["temperature"] == 0 for r in rows)
    # every temperature's pooled tree and chain tau, the ExitTrain drafter's paired with the warm start's
    for label, table in summary["tables"].items():
        assert {row["temperature"] for row in table} == set(cfg.eval.temperatures), label
        for row in table:
            assert 1.0 <= row["tau"] <= cfg.drafter.block_size and 1.0 <= row["chain_tau"] <= cfg.drafter.block_size
            assert ("tau_vs_warm_start" in row) == ("chain_tau_vs_warm_start" in row) == (label != "warm_start")
    assert summary["served"]["label"] == "exittrain" and summary["served"]["dropped"] == []


def test_fit_at_decode_auto_takes_the_cpu_decode_lab_and_writes_the_token_counts(rank, tmp_path):
    """``eval.decode=auto``: without the lab (fit does not import it), fit stops before anything
    loads and names the fix; with it, as ``python -m exittrain fit`` binds it, the speed columns
    decode at the probe's choice and the answer tokens, counted once by the lab, are written beside
    the drafter for a later decode."""
    from exittrain.cpu_decode.decode_lab import DecodeLab
    from exittrain.cpu_decode.draft_vocab import count_answer_tokens, load_token_counts

    cfg, target = _tiny_fit(tmp_path)
    cfg.eval.decode = "auto"
    with pytest.raises(ValueError, match=r"eval.decode=auto needs the CPU decode lab.*lab=DecodeLab\(\)"):
        fit(cfg, target=lambda: pytest.fail("the target loaded before the check"))
    rank(0)
    counted = []
    lab = DecodeLab(count_answer_tokens=lambda rows: counted.append(1) or count_answer_tokens(rows))
    summary = fit(cfg, target=target, lab=lab)
    assert counted == [1]  # the probe's draft vocabulary and the file share one count
    rows = [r for table in summary["tables"].values() for r in table if "tau" in r]
    assert rows and all("auto_setting" in r and r["speedup"] > 0 for r in rows)
    counts = load_token_counts(tmp_path / "run" / "drafter")
    assert counts["rows"] > 0 and counts["counts"] == sorted(counts["counts"], reverse=True)

def test_fit_rejects_a_greedy_verifier_at_a_temperature_before_anything_loads(tmp_path):
    cfg, _ = _tiny_fit(tmp_path)
    cfg.eval.verifier = "greedy"
    cfg.eval.temperatures = [0.0, 0.6]

    def no_target():
        raise AssertionError("the target was built before the settings were checked")

    with pytest.raises(ValueError, match=r"eval.verifier=greedy with eval.temperatures=\[0.0, 0.6\]"):
        fit(cfg, target=no_target)


def test_fit_on_rank_one_trains_and_leaves_evaluation_and_files_to_rank_zero(rank, tmp_path, monkeypatch):
    cfg, target = _tiny_fit(tmp_path)

    def rank_zero_only_work(*args, **kwargs):
        raise AssertionError("rank 1 ran rank 0's evaluation or export")

    monkeypatch.setattr("exittrain.heldout.evaluator.evaluate_prompts", rank_zero_only_work)
    monkeypatch.setattr("exittrain.lit.save_drafter", rank_zero_only_work)
    rank(1)
    cfg.data.generation.batch_size = 4  # the 8 training prompts in 2 batches: one per shard of 2

    # an empty cache under torchrun's variables: rank 1 answers its batch, then waits (here 0 s) for the entry
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(TimeoutError, match="every rank answers its shard"):
        fit(cfg, target=target)
    written = sorted(p.name for p in (tmp_path / "cache").rglob("shard_*"))
    assert written == ["shard_00001"], "rank 1 answered another shard's batch or merged a partial entry"

    # rank 0's shard completes the entry, then rank 1's whole fit finds it
    monkeypatch.setenv("RANK", "0")
    datamodule = hydra.utils.instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
    )
    datamodule.prepare_data()
    assert datamodule.cache_path.is_dir()
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    summary = fit(cfg, target=target)

    assert summary["stages"] == ["pretrain", "exittrain"] and summary["tables"] == {}
    assert summary["exittrain_metrics"]["train/loss_tok"] > 0
    # drafter/ is left out: the export callback writes it too (trainer.is_global_zero is True in one process)
    for name in RANK_ZERO_FILES[:-1]:
        assert not (tmp_path / "run" / name).exists(), f"rank 1 wrote {name}"


def test_an_entry_without_features_has_every_stage_compute_them(rank, tmp_path, monkeypatch, caplog):
    """A cache entry regenerated without feature_layers keeps no features: the DataModule says so, and
    every step of both stages has the target compute its rows' features (nothing is kept between steps)."""
    cfg, target = _tiny_fit(tmp_path)
    cfg.stages.pretrain.max_steps = 8  # several epochs over the few rows
    cfg.stages.exittrain.max_steps = 2
    rank(0)
    hydra.utils.instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
    ).prepare_data()
    with caplog.at_level("WARNING", logger="exittrain.data.datamodule"):
        fit(cfg, target=target)
    assert "keeps no target features of layers" in caplog.text
    pretrain = json.loads((tmp_path / "run" / "metrics_pretrain.json").read_text())["final"]
    exittrain = json.loads((tmp_path / "run" / "metrics_exittrain.json").read_text())["final"]
    assert pretrain["train/feature_rows_computed"] > 0  # the rows of its last batch
    assert exittrain["train/feature_rows_computed"] > 0


def test_fit_trains_on_the_features_kept_by_the_regeneration(rank, tmp_path, monkeypatch):
    """A fresh regeneration keeps the drafter's target features and the soft labels' top-k
    log-probabilities: no stage runs the target over a row."""
    cfg, target = _tiny_fit(tmp_path)
    assert cfg.objective.soft_label_weight > 0  # the defaults train on soft labels
    cfg.eval.temperatures = [0.0]  # the final table's walks at T > 0 read the target over answers of their own

    def no_forward(*args, **kwargs):
        raise AssertionError("the target ran over a training row whose features the regeneration kept")

    monkeypatch.setattr(target, "sequence_features", no_forward)
    monkeypatch.setattr(target, "token_top_logprobs", no_forward)
    rank(0)
    summary = fit(cfg, target=target)
    assert summary["pretrain_metrics"]["train/feature_rows_computed"] == 0
    assert summary["exittrain_metrics"]["train/feature_rows_computed"] == 0
    assert summary["exittrain_metrics"]["train/loss_exit"] > 0


def test_without_wandb_the_wandb_logger_falls_back_to_csv_and_says_so(tmp_path, monkeypatch, caplog):
    """wandb is an optional extra: logger=wandb without it logs to CSV in the run folder, with a warning
    naming the extra and logger=csv. (With wandb installed, the test above builds the W&B logger.)"""
    import importlib.util

    from exittrain.lit import run_logging

    cfg = _compose("logger=wandb", f"paths.output_dir={tmp_path}")
    real = importlib.util.find_spec
    monkeypatch.setattr(run_logging.importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with caplog.at_level("WARNING", logger=run_logging.__name__):
        logger = make_logger(cfg, "code-pretrain")
    assert type(logger).__name__ == "CSVLogger" and Path(logger.save_dir) == tmp_path
    assert "exittrain[wandb]" in caplog.text and "logger=csv" in caplog.text
    close_logger(logger)
