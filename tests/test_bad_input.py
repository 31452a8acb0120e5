"""Bad input at every boundary: a ValueError naming the file, row or key and the fix; nothing dropped silently.

The matrix: prompt files (JSON Lines, JSON arrays, Parquet) with malformed, blank, non-UTF-8, empty
and over-long rows; over-long prompts in regeneration and in the DataModule; a tokenizer without a
chat template; a drafter saved for another target; out-of-range settings, directly and through the
Hydra config; corrupt, truncated, empty or missing files (``ckpt_path`` checkpoints, saved drafters'
safetensors and config.json, the regeneration cache's tensors); and a non-finite loss during a
Lightning fit (a RuntimeError: not bad input, but the same rule of naming where and what).
Everything is tiny, offline and CPU-only.
"""

from __future__ import annotations

import json
import logging

import lightning.pytorch as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException

from exittrain import build, settings
from exittrain import fit as fit_lib
from exittrain.configs import CONF_DIR, RECIPES_DIR, register_recipes
from exittrain.core import build_tree
from exittrain.data import chat_prompt_ids
from exittrain.data.datamodule import ExitTrainDataModule
from exittrain.data.generation import GenerationConfig
from exittrain.data.prompts.prompt_sets import load_domain, load_prompts
from exittrain.data.regen_cache import cache_path, read_meta
from exittrain.data.regenerate import regenerate
from exittrain.evaluate import run_eval
from exittrain.lit import ExitTrainModule
from exittrain.lit.module import check_module_args
from exittrain.models import DrafterConfig, TargetModel, load_drafter, new_drafter
from exittrain.objective import STAGES
from tests.data.helpers import tiny_llama
from tests.lit.helpers import loader, make_module
from tests.lit.helpers import trainer as make_trainer

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
]

GOOD = [json.dumps({"p": "first good prompt"}).encode(), json.dumps({"p": "second good prompt"}).encode()]


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target


def word_tokenizer(*, chat_template: bool = True, name: str = "tiny-words"):
    """A word-level fast tokenizer built in memory (no download); optionally with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", "assistant", "user"] + [f"w{i}" for i in range(40)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", name_or_path=name
    )
    if chat_template:
        tok.chat_template = (
            "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}"
        )
    return tok


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{(start + i) % 40}" for i in range(n))


# ----------------------------------------------------------------------------------------------
# prompt files: bad rows are counted and reported; a file with no good row is an error


BAD_JSONL_LINES = {
    "malformed": b'{"p": "unterminated',
    "blank_line": b"   \t",
    "non_utf8": b'{"p": "caf\xe9 latin-1"}',
    "empty": json.dumps({"p": "  \n "}).encode(),
    "too_long": json.dumps({"p": "x" * 81}).encode(),
}


@pytest.mark.parametrize("reason", sorted(BAD_JSONL_LINES))
def test_jsonl_bad_rows_are_counted_and_reported_with_file_and_line(tmp_path, caplog, reason):
    bad = BAD_JSONL_LINES[reason]
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"\n".join([GOOD[0], bad, bad + b" ", GOOD[1]]) + b"\n")  # bad rows on lines 2 and 3
    with caplog.at_level(logging.WARNING, logger="exittrain.data.prompts.prompt_sets"):
        prompts, stats = load_prompts(f"jsonl:{path}:p", max_chars=80)
    assert prompts == ["first good prompt", "second good prompt"]
    assert stats.rows == 4 and stats.kept == 2 and stats.n_rejected == 2
    assert stats.rejected[reason] == 2 and stats.example_rows[reason] == [2, 3]
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(path) in warning and f"{reason}=2 (rows [2, 3])" in warning


@pytest.mark.parametrize("reason", sorted(BAD_JSONL_LINES))
def test_jsonl_with_only_bad_rows_is_an_error_naming_the_file(tmp_path, reason):
    path = tmp_path / f"all_{reason}.jsonl"
    path.write_bytes(b"\n".join([BAD_JSONL_LINES[reason]] * 3) + b"\n")
    with pytest.raises(ValueError) as err:
        load_prompts(f"jsonl:{path}:p", max_chars=80)
    message = str(err.value)
    assert str(path) in message and f"{reason}=3" in message and "fix the file or the limits" in message


def test_empty_prompt_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.jsonl:p yielded no usable prompt.*0 rows.*fix the file"):
        load_prompts(f"jsonl:{path}:p")


def test_over_long_rows_by_token_count_are_counted(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"p": text}) + "\n" for text in (words(3), words(20), words(4, 5))))
    prompts, stats = load_prompts(f"jsonl:{path}:p", max_tokens=5, tokenizer=word_tokenizer())
    assert prompts == [words(3), words(4, 5)]
    assert stats.rejected["too_long"] == 1 and stats.example_rows["too_long"] == [2]


def test_utf8_byte_order_mark_is_not_a_bad_row(tmp_path):
    """Windows editors write a BOM; it used to turn a valid first row (or a whole JSON array) into 'malformed'."""
    bom = b"\xef\xbb\xbf"
    lines = tmp_path / "bom.jsonl"
    lines.write_bytes(bom + b"\n".join(GOOD) + b"\n")
    prompts, stats = load_prompts(f"jsonl:{lines}:p")
    assert prompts == ["first good prompt", "second good prompt"] and stats.n_rejected == 0
    array = tmp_path / "bom.json"
    array.write_bytes(bom + b"[" + b",".join(GOOD) + b"]")
    prompts, stats = load_prompts(f"json:{array}:p")
    assert prompts == ["first good prompt", "second good prompt"] and stats.n_rejected == 0


def test_parquet_bad_rows_are_counted_and_reported(tmp_path, caplog):
    path = tmp_path / "prompts.parquet"
    texts = [b"first good prompt", None, b"", b"\xff\xfe not utf-8", b"y" * 81, b"second good prompt"]
    pq.write_table(pa.table({"p": pa.array(texts, type=pa.binary())}), path)
    with caplog.at_level(logging.WARNING, logger="exittrain.data.prompts.prompt_sets"):
        prompts, stats = load_prompts(f"parquet:{path}:p", max_chars=80)
    assert prompts == ["first good prompt", "second good prompt"]
    assert {k: v for k, v in stats.rejected.items() if v} == {"not_string": 1, "empty": 1, "non_utf8": 1, "too_long": 1}
    assert stats.example_rows["non_utf8"] == [3]  # 0-based row index for Parquet
    warning = next(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert str(path) in warning and "non_utf8=1 (rows [3])" in warning


def test_parquet_with_only_bad_rows_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"p": pa.array([None, b"\xff", b"   "], type=pa.binary())}), path)
    with pytest.raises(ValueError) as err:
        load_prompts(f"parquet:{path}:p")
    message = str(err.value)
    assert str(path) in message and "not_string=1" in message and "non_utf8=1" in message and "empty=1" in message
    assert "fix the file" in message


def test_corrupt_parquet_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "corrupt.parquet"
    path.write_bytes(b"PAR1 this is not a parquet file at all")
    with pytest.raises(ValueError, match=r"could not read Parquet file .*corrupt\.parquet.*re-export the file"):
        load_prompts(f"parquet:{path}:p")


def test_bad_rows_reach_the_domain_report(tmp_path):
    """load_domain (the DataModule's entry) keeps every source's rejection counts for the run's stats."""
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_bytes(b"\n".join([GOOD[0], b"{broken", BAD_JSONL_LINES["non_utf8"], GOOD[1]]) + b"\n")
    evals.write_text(json.dumps({"p": "an evaluation prompt"}) + "\n")
    report = load_domain("custom", train=[f"jsonl:{train}:p"], eval=[f"jsonl:{evals}:p"]).to_dict()
    (stats,) = report["train_stats"]
    assert stats["rejected"]["malformed"] == 1 and stats["rejected"]["non_utf8"] == 1 and stats["kept"] == 2


# ----------------------------------------------------------------------------------------------
# over-long prompts in regeneration and in the DataModule


def _tiny_pair():
    tok = word_tokenizer()
    return tiny_llama(tok), tok


def test_regeneration_counts_over_long_prompts_and_refuses_when_all_are(tmp_path, caplog):
    model, tok = _tiny_pair()
    prompts = [words(2), words(30), words(3, 7), words(40)]
    gen = GenerationConfig(max_new_tokens=2, batch_size=4, max_prompt_tokens=10)
    with caplog.at_level(logging.WARNING, logger="exittrain.data.regenerate"):
        ds = regenerate(prompts, (model, tok), target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False)
    assert ds["prompt_index"] == [0, 2]
    assert read_meta(cache_path(tmp_path, "tiny", "", prompts, gen))["rejected_too_long"] == 2
    assert "2 of 4 prompts exceed max_prompt_tokens=10" in caplog.text and "[1, 3]" in caplog.text

    with pytest.raises(ValueError) as err:
        regenerate(prompts[1::2], (model, tok), target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False)
    message = str(err.value)
    assert "every one of the 2 prompts exceeds max_prompt_tokens=10" in message and "'tiny'" in message
    assert "raise generation.max_prompt_tokens" in message and "data.generation.max_prompt_tokens" in message


def test_datamodule_drops_prompts_that_fill_max_length_and_refuses_when_all_do(tmp_path, caplog):
    model, tok = _tiny_pair()
    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"p": words(n, 3 * n)}) + "\n" for n in (1, 2, 9, 10, 11)))
    evals.write_text(json.dumps({"p": words(3, 30)}) + "\n")

    def datamodule(max_length: int) -> ExitTrainDataModule:
        return ExitTrainDataModule(
            domain="custom",
            train_sources=[f"jsonl:{train}:p"],
            eval_sources=[f"jsonl:{evals}:p"],
            target=lambda: (model, tok),
            tokenizer=tok,
            target_name="tiny",
            cache_dir=tmp_path / "cache",
            max_length=max_length,
            val_fraction=0.0,
            generation={"max_new_tokens": 2, "batch_size": 8},
            progress=False,
        )

    dm = datamodule(max_length=8)  # templated prompts: "user <words> assistant" = n + 2 tokens
    dm.prepare_data()
    with caplog.at_level(logging.WARNING, logger="exittrain.data.datamodule"):
        dm.setup("fit")
    assert len(dm.train_set) == 2  # n = 1, 2
    assert dm.stats["truncation"]["truncated"] == 3 and dm.stats["truncation"]["dropped_no_response"] == 3
    assert "max_length=8 truncates 3 of 5 rows of " in caplog.text  # then the entry's name
    assert "; 3 of them keep no response token and are dropped" in caplog.text

    dm = datamodule(max_length=2)
    dm.prepare_data()  # the same cache entry: max_length is applied at setup
    with pytest.raises(ValueError, match=r"every prompt in .*cache.* is at least max_length=2 tokens; raise max_len"):
        dm.setup("fit")


# ----------------------------------------------------------------------------------------------
# a tokenizer without a chat template


def test_tokenizer_without_chat_template_is_an_error_naming_it_and_the_fix(tmp_path):
    tok = word_tokenizer(chat_template=False, name="org/base-model")
    with pytest.raises(ValueError) as err:
        chat_prompt_ids(tok, "hello")
    message = str(err.value)
    assert "'org/base-model' has no chat template" in message and "set tokenizer.chat_template" in message
    with pytest.raises(ValueError, match="'org/base-model' has no chat template"):
        regenerate([words(3)], (tiny_llama(tok), tok), target_name="base", cache_dir=tmp_path, progress=False)


# ----------------------------------------------------------------------------------------------
# a drafter saved for another target


def other_target(*, name: str = "tiny-llama", vocab: int = 64, hidden: int = 32, layers: int = 3) -> TargetModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        attn_implementation="sdpa",
    )
    return TargetModel(LlamaForCausalLM(config), None, name=name)


@pytest.mark.parametrize(
    "changed, field",
    [
        ({"name": "tiny-qwen"}, "target_name"),
        ({"vocab": 80}, "target_vocab_size=64"),
        ({"hidden": 48}, "target_hidden_size=32"),
        ({"layers": 4}, "target_num_layers=3"),
    ],
)
def test_drafter_for_another_target_names_both_targets_and_the_field(tmp_path, target, changed, field):
    new_drafter(target, block_size=4, num_layers=1, seed=0).save_pretrained(tmp_path / "drafter")
    other = other_target(**changed)
    with pytest.raises(ValueError) as err:
        load_drafter(tmp_path / "drafter", other)
    message = str(err.value)
    assert f"target {target.name!r}" in message and f"target {other.name!r}" in message and field in message
    assert "load the target it was trained for" in message


# ----------------------------------------------------------------------------------------------
# settings out of range: directly, and through the Hydra config the CLI composes

BAD_MODULE_ARGS = [
    ({"budget": 0}, "budget=0: need an int >= 1"),
    ({"alpha": -0.1}, "alpha=-0.1: need a float in [0, 1]"),
    ({"alpha": 1.5}, "alpha=1.5: need a float in [0, 1]"),
    ({"alpha": float("nan")}, "alpha=nan: need a float in [0, 1]"),
    ({"lambda_tok": -1.0}, "lambda_tok=-1.0: need a float >= 0"),
    ({"lambda_exit": -0.5}, "lambda_exit=-0.5: need a float >= 0"),
    ({"weight_type": "nope"}, "weight_type='nope': must be one of ('flow', 'exit', 'missing')"),
    ({"stage": "finetune"}, "stage='finetune': must be one of ('pretrain', 'exittrain')"),
]


@pytest.mark.parametrize("bad, message", BAD_MODULE_ARGS)
def test_module_settings_out_of_range_name_the_key_and_the_range(target, bad, message):
    drafter = new_drafter(target, block_size=4, num_layers=1, seed=0)
    with pytest.raises(ValueError) as err:
        ExitTrainModule(drafter, target, **bad)
    assert message in str(err.value)
    with pytest.raises(ValueError) as err:
        check_module_args(**bad)  # the same check without a drafter or target (the CLI runs it first)
    assert message in str(err.value)


def test_unknown_module_argument_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown ExitTrainModule arguments \['alpah'\]; the known ones .*'alpha'"):
        check_module_args(alpah=0.1)


@pytest.mark.parametrize("block_size", [1, 0, -3])
def test_block_size_below_two_names_the_key_and_the_fix(target, block_size):
    with pytest.raises(ValueError, match=rf"block_size={block_size}: need an int >= 2 .*set block_size to K \+ 1"):
        new_drafter(target, block_size=block_size)
    with pytest.raises(ValueError, match=rf"block_size={block_size}: need an int >= 2"):
        DrafterConfig(block_size=block_size)


@pytest.mark.parametrize("budget", [0, -1, 2.5])
def test_tree_budget_below_one_is_an_error(budget):
    logq = torch.log_softmax(torch.randn(1, 3, 8), dim=-1)
    with pytest.raises(ValueError, match=rf"budget must be an integer >= 1 \(number of draft nodes\), got {budget}"):
        build_tree(logq, budget)


def compose_fit(*overrides: str):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("fit", overrides=["+recipe=code", *overrides])


@pytest.mark.parametrize(
    "override, message",
    [
        ("tree.budget_train=0", "budget=0: need an int >= 1"),
        ("objective.alpha=2", "alpha=2: need a float in [0, 1]"),
        ("objective.alpha=-1", "alpha=-1: need a float in [0, 1]"),
        ("objective.lambda_tok=-1", "lambda_tok=-1: need a float >= 0"),
        ("objective.lambda_exit=-0.1", "lambda_exit=-0.1: need a float >= 0"),
        ("objective.weight_type=nope", "weight_type='nope': must be one of"),
        ("+stages.exittrain.alpha=3", "stage 'exittrain' (objective.* with stages.exittrain.* overrides): alpha=3"),
        ("stages.exittrain.eval_every=-1", "stages.exittrain.eval_every=-1: need an int >= 0"),
    ],
)
def test_bad_config_values_fail_before_the_target_loads(monkeypatch, tmp_path, override, message):
    """`fit` validates every stage's module arguments before loading the target or regenerating."""
    cfg = compose_fit(override, f"paths.output_dir={tmp_path}")

    def no_target():
        raise AssertionError("fit built an object before validating the objective")

    with pytest.raises(ValueError) as err:
        fit_lib.fit(cfg, target=no_target)  # the target is the first object fit builds
    assert message in str(err.value)


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
@pytest.mark.parametrize("extra", [[], ["debug=smoke"]])
def test_every_shipped_config_passes_the_early_check(recipe, extra):
    """The early check must not refuse a valid run: every recipe, with and without debug=smoke."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=[f"+recipe={recipe}", *extra])
    assert settings.check_objective(cfg, list(STAGES)) is None  # a bad value would raise ValueError


@pytest.mark.parametrize("eval_every, expect", [(None, 150), (20, 20), (0, 0)])
def test_stage_eval_every_sets_the_decode_check_and_the_checkpoint_interval(tmp_path, eval_every, expect):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from exittrain.lit import DecodeEvalCallback

    cfg = compose_fit(f"paths.output_dir={tmp_path}")
    callbacks = build.build_callbacks(cfg, "exittrain", [[1, 2, 3]], tmp_path, eval_every)
    decode = next(c for c in callbacks if isinstance(c, DecodeEvalCallback))
    ckpt = next(c for c in callbacks if isinstance(c, ModelCheckpoint))
    assert decode.every_n_steps == expect and ckpt._every_n_train_steps == expect
    assert settings.module_overrides(cfg, "exittrain") == {"lr": 1.0e-4, "anchors_per_seq": 8}  # not eval_every


def test_bad_drafter_settings_fail_before_the_regeneration(tmp_path, target):
    """`fit drafter.block_size=1` stops as soon as the target is there, before any data work."""
    cache = tmp_path / "cache"
    cfg = compose_fit("drafter.block_size=1", f"paths.output_dir={tmp_path / 'run'}", f"paths.cache_dir={cache}")
    built = []

    def tiny_target():
        built.append("target")
        return target  # the tiny target stands in for the embedded one

    with pytest.raises(ValueError, match=r"block_size=1: need an int >= 2 .*set block_size to K \+ 1"):
        fit_lib.fit(cfg, target=tiny_target)
    assert built == ["target"]
    assert not cache.exists(), "fit started the data step before building the drafter"


@pytest.mark.parametrize(
    "override, message",
    [
        ("+recipe=nope", r"Could not find 'recipe/nope'\s+Available options in 'recipe':\s+code\s+dialogue\s+math"),
        ("objective=nope", r"Could not find 'objective/nope'\s+Available options in 'objective':\s+exittrain"),
        ("data=nope", r"Could not find 'data/nope'\s+Available options in 'data':\s+code\s+dialogue\s+math"),
        ("tree=nope", r"Could not find 'tree/nope'\s+Available options in 'tree':\s+default"),
        ("objective.alpah=0.1", r"Could not override 'objective.alpah'"),
    ],
)
def test_unknown_recipe_group_option_or_key_is_a_composition_error(override, message):
    """Hydra names the group and lists its options; tests/test_cli.py checks the non-zero exit of the CLI."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        with pytest.raises(ConfigCompositionException, match=message):
            compose("fit", overrides=[override])


# ----------------------------------------------------------------------------------------------
# NaN or inf in the loss: the fit stops, naming the step and the batch


class PoisonWeights(pl.Callback):
    """Sets every drafter weight to NaN just before training batch ``at``."""

    def __init__(self, at: int):
        self.at = at

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == self.at:
            with torch.no_grad():
                for p in pl_module.drafter.parameters():
                    p.fill_(float("nan"))


@pytest.mark.parametrize("stage", ["pretrain", "exittrain"])
def test_nan_loss_stops_the_fit_naming_step_and_batch(target, stage):
    module = make_module(target, stage=stage, analytic_every=0)
    trainer = make_trainer(6, callbacks=[PoisonWeights(at=2)])
    with pytest.raises(RuntimeError, match=r"non-finite training loss nan at global step 2, batch index 2"):
        trainer.fit(module, loader(12))
    assert trainer.global_step == 2  # steps 0 and 1 trained; the poisoned batch was never stepped on


def test_inf_loss_stops_the_fit_naming_step_and_batch(target):
    module = make_module(target, stage="exittrain")
    compute = module.compute_losses

    def inf_at_step_one(batch, generator, **kwargs):
        values, times = compute(batch, generator, **kwargs)
        if module.global_step == 1:
            values["loss"] = values["loss"] + float("inf")
        return values, times

    module.compute_losses = inf_at_step_one
    trainer = make_trainer(4)
    with pytest.raises(RuntimeError) as err:
        trainer.fit(module, loader(8))
    message = str(err.value)
    assert "non-finite training loss inf at global step 1, batch index 1" in message
    assert "check this batch's data" in message


# ----------------------------------------------------------------------------------------------
# bad files: checkpoints (ckpt_path), saved drafters (warm_start= / drafter=), cache tensors

CKPT_FIX = "point ckpt_path at another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt"
DRAFTER_FIX = "point warm_start= (fit) or drafter= (eval) at another drafter folder saved by exittrain"


def assert_no_unsafe_advice(err: pytest.ExceptionInfo) -> None:
    """Neither our message nor the printed traceback (with its chained context) repeats torch's
    advice to retry with ``weights_only`` off (its message starts "Weights only load failed")."""
    import traceback

    printed = "".join(traceback.format_exception(err.value))
    assert "weights_only" not in str(err.value)
    assert "Weights only load failed" not in printed and "weights_only=False" not in printed


@pytest.fixture(scope="module")
def last_ckpt(tmp_path_factory, target):
    """A real Lightning checkpoint of one ExitTrain step (``last.ckpt``, stage recorded in its hyper-parameters)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folder = tmp_path_factory.mktemp("ckpt")
    trainer = make_trainer(1, callbacks=[ModelCheckpoint(dirpath=folder, save_last=True)], checkpointing=True)
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the module-scoped fixture runs outside one_thread
    try:
        trainer.fit(make_module(target, stage="exittrain"), loader(2))
    finally:
        torch.set_num_threads(before)
    return folder / "last.ckpt"


def ckpt_config(path, tmp_path):
    return compose_fit(f"ckpt_path={path}", f"paths.output_dir={tmp_path}")


def test_a_good_checkpoint_resumes_its_stage(tmp_path, last_ckpt):
    """The control for the corrupt cases below: the intact file resumes the stage it recorded."""
    assert settings.plan_stages(ckpt_config(last_ckpt, tmp_path)) == ["exittrain"]


def _truncated_half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _truncated_tail(data: bytes) -> bytes:
    return data[:-64]  # the zip's central directory (at the end) is cut


def _random(data: bytes) -> bytes:
    import random

    return random.Random(0).randbytes(4096)


BAD_CKPTS = {
    "truncated_half": (_truncated_half, "is corrupt or truncated ("),
    "truncated_tail": (_truncated_tail, "is corrupt or truncated ("),
    "random_bytes": (_random, "is corrupt or not a PyTorch checkpoint (its pickle is unreadable)"),
    "text": (lambda data: b"hello, not a checkpoint\n", "is corrupt or truncated ("),
    "empty": (lambda data: b"", "is empty (0 bytes"),
}


@pytest.mark.parametrize("case", sorted(BAD_CKPTS))
def test_corrupt_ckpt_path_names_the_file_the_fault_and_the_fix(tmp_path, last_ckpt, case):
    make, fault = BAD_CKPTS[case]
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(make(last_ckpt.read_bytes()))
    with pytest.raises(ValueError) as err:
        settings.plan_stages(ckpt_config(bad, tmp_path))
    message = str(err.value)
    assert message.startswith(f"ckpt_path checkpoint {bad} {fault}"), message
    assert CKPT_FIX in message and "or leave ckpt_path unset to re-run the stage from its start" in message
    assert_no_unsafe_advice(err)


@pytest.mark.parametrize("kind", ["missing", "folder", "tensor"])
def test_ckpt_path_that_is_missing_a_folder_or_not_a_dict(tmp_path, kind):
    path = tmp_path / "given.ckpt"
    if kind == "folder":
        path.mkdir()
    elif kind == "tensor":
        torch.save(torch.zeros(3), path)  # loads safely, but is no Lightning checkpoint
    fault = {"missing": "does not exist", "folder": "is a folder, not a file", "tensor": "holds a Tensor, not a"}[kind]
    with pytest.raises(ValueError) as err:
        settings.plan_stages(ckpt_config(path, tmp_path))
    message = str(err.value)
    assert message.startswith(f"ckpt_path checkpoint {path} {fault}"), message
    assert CKPT_FIX in message


def test_a_corrupt_ckpt_path_fails_before_the_target_loads(monkeypatch, tmp_path, last_ckpt):
    """`fit` reads the whole checkpoint first: a bad one fails in our words, never later in Lightning's load."""
    bad = tmp_path / "torn.ckpt"
    bad.write_bytes(_truncated_tail(last_ckpt.read_bytes()))

    def no_target():
        raise AssertionError("fit built an object before checking ckpt_path")

    with pytest.raises(ValueError, match=r"ckpt_path checkpoint .*torn\.ckpt is corrupt or truncated"):
        fit_lib.fit(ckpt_config(bad, tmp_path), target=no_target)


def test_drafter_from_a_corrupt_checkpoint_names_the_file_and_the_fix(tmp_path, target, last_ckpt):
    bad = tmp_path / "torn.ckpt"
    bad.write_bytes(_truncated_half(last_ckpt.read_bytes()))
    with pytest.raises(ValueError) as err:
        ExitTrainModule.drafter_from_checkpoint(bad, target)
    message = str(err.value)
    assert message.startswith(f"checkpoint {bad} is corrupt or truncated"), message
    assert "pass another checkpoint written by exittrain" in message and "or re-run the stage" in message
    assert_no_unsafe_advice(err)
    assert ExitTrainModule.drafter_from_checkpoint(last_ckpt, target).config.block_size >= 2  # the intact file loads


BAD_SAFETENSORS = {
    "truncated": (lambda data: data[:-100], "incomplete metadata, file not fully covered"),
    "empty": (lambda data: b"", "header too small"),
    "random_bytes": (_random, "header too large"),
}


@pytest.mark.parametrize("case", sorted(BAD_SAFETENSORS))
def test_saved_drafter_with_corrupt_weights_names_the_file_and_the_fix(tmp_path, target, case):
    from exittrain.lit import save_drafter

    folder = save_drafter(new_drafter(target, block_size=4, num_layers=1, seed=0), tmp_path / "drafter")
    weights = folder / "model.safetensors"
    make, cause = BAD_SAFETENSORS[case]
    weights.write_bytes(make(weights.read_bytes()))
    with pytest.raises(ValueError) as err:
        load_drafter(folder, target)
    message = str(err.value)
    assert message.startswith(f"drafter weights {weights} is corrupt or truncated (SafetensorError: "), message
    assert cause in message and DRAFTER_FIX in message and "exittrain.lit.save_drafter(drafter, path)" in message


@pytest.mark.parametrize(
    "text, fault",
    [
        ('{"block_size": 4, "hidden', "is not valid JSON (Unterminated string starting at: line 1 column 19 (char 18)"),
        ("", "is not valid JSON (Expecting value: line 1 column 1 (char 0)"),
        ("[1, 2]", "holds a JSON list, not an object"),
    ],
)
def test_saved_drafter_with_a_bad_config_json_names_the_file_and_the_fix(tmp_path, target, text, fault):
    from exittrain.lit import save_drafter

    folder = save_drafter(new_drafter(target, block_size=4, num_layers=1, seed=0), tmp_path / "drafter")
    config = folder / "config.json"
    config.write_text(text)
    with pytest.raises(ValueError) as err:
        load_drafter(folder, target)
    message = str(err.value)
    assert message.startswith(f"drafter config {config} {fault}"), message
    assert DRAFTER_FIX in message


@pytest.mark.parametrize("kind", ["features", "top_logprobs"])
def test_corrupt_cache_tensors_name_the_file_and_say_to_delete_the_entry(tmp_path, kind):
    from safetensors.torch import save_file

    from exittrain.data.regen_cache import features_file, load_features, load_top_logprobs, top_logprobs_file

    entry = tmp_path / "tiny-0123456789abcdef0123"
    entry.mkdir()
    name, load, what = {
        "features": (features_file([1, 2]), lambda: load_features(entry, [1, 2]), "feature cache file"),
        "top_logprobs": (top_logprobs_file(4), lambda: load_top_logprobs(entry, 4), "soft-label cache file"),
    }[kind]
    tensors = (
        {"0": torch.zeros(5, 8)} if kind == "features" else {"0.ids": torch.zeros(3, 4), "0.logp": torch.zeros(3, 4)}
    )
    save_file(tensors, str(entry / name))
    assert load() is not None  # the intact file loads
    (entry / name).write_bytes((entry / name).read_bytes()[:-16])
    with pytest.raises(ValueError) as err:
        load()
    message = str(err.value)
    assert message.startswith(f"{what} {entry / name} is corrupt or truncated (SafetensorError: "), message
    assert f"delete the cache entry folder {entry} (or that shard of an unfinished entry) to regenerate it" in message


@pytest.mark.parametrize("kind", ["missing", "empty folder", "a file"])
def test_a_local_warm_start_that_is_no_drafter_folder_fails_before_the_target_loads(tmp_path, kind):
    path = tmp_path / "warm"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "a file":
        path.write_text("not a drafter")
    with pytest.raises(ValueError) as err:
        settings.plan_stages(compose_fit(f"warm_start={path}", f"paths.output_dir={tmp_path}"))
    what = "does not exist" if kind == "missing" else "is not a saved drafter folder (no config.json in it)"
    assert str(err.value) == (
        f"warm_start={path} {what}: pass RUN_DIR/warmstart_drafter or RUN_DIR/drafter of an earlier fit run"
    )


def test_a_hub_id_as_warm_start_is_left_to_the_loader(tmp_path):
    cfg = compose_fit("warm_start=some-org/some-drafter", f"paths.output_dir={tmp_path}")
    assert settings.plan_stages(cfg) == ["exittrain"]


def test_eval_of_a_folder_that_is_no_drafter_names_it_before_the_target_loads(tmp_path):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("eval", overrides=["+recipe=code", f"drafter_path={tmp_path}", f"paths.output_dir={tmp_path}"])
    def no_target():
        raise AssertionError("eval loaded the target before checking the drafter folder")

    with pytest.raises(ValueError) as err:
        run_eval(cfg, target=no_target)
    assert str(err.value) == (
        f"drafter={tmp_path} is not a saved drafter folder (no config.json in it): "
        "pass drafter=RUN_DIR/drafter of a fit run"
    )
