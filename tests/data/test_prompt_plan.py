"""The prompt plan: which training and evaluation prompts a run uses and the cache key of their answers."""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest

from exittrain.data import chat_prompt_ids
from exittrain.data.generation import GenerationConfig
from exittrain.data.prompts.prompt_plan import (
    CORPUS_ARGS,
    LOADER_ARGS,
    PromptPlan,
    check_sample_settings,
    choose_train_prompts,
    prompt_set_description,
)
from exittrain.data.prompts.prompt_sets import DomainPrompts, LoadStats
from exittrain.data.regen_cache import cache_key
from exittrain.models.target_loading import EMBEDDED_TARGET_NAME

CODE_RECIPE = dict(  # conf/data/code.yaml at seed 0, without the host-dependent dtype "auto"
    domain="code",
    train_sources=["pkg:codeio", "pkg:codeio_stub"],
    eval_sources=["pkg:humaneval"],
    max_train_prompts=360,
    seed=0,
    generation={"max_new_tokens": 96, "batch_size": 32, "dtype": "bfloat16"},
)


def _domain(n: int, tasks: list[str] | None = None) -> DomainPrompts:
    train = [f"prompt {i}" for i in range(n)]
    stats = LoadStats("jsonl:t.jsonl:text", task_keys=dict(zip(train, tasks, strict=True)) if tasks else {})
    return DomainPrompts("custom", train, ["an eval prompt"], [stats], [LoadStats("jsonl:e.jsonl:text")])


def test_the_code_recipe_keeps_the_cache_key_of_entries_written_before_the_plan():
    """The key the DataModule gave the code recipe before the prompt plan existed (computed at the commit
    before it, with exittrain.data.datamodule's own code): a different key would orphan every cached entry."""
    plan = PromptPlan(**CODE_RECIPE, cache_dir="/cache")
    assert plan.target_name == EMBEDDED_TARGET_NAME and len(plan.train) == 360
    assert plan.prompt_set == (
        "domain=code;train=pkg:codeio+pkg:codeio_stub;eval=pkg:humaneval;max_chars=6000;max_train=360;seed=0"
    )
    assert plan.cache_key == "f566b03ac044ebb422ee"
    assert plan.cache_path.as_posix() == "/cache/SmolLM2-135M-Instruct-Q4_1-f566b03ac044ebb422ee"
    target_dtype = GenerationConfig(max_new_tokens=96, batch_size=32)  # dtype None: the target as loaded
    assert cache_key(plan.target_name, plan.prompt_set, plan.train, target_dtype) == "fb80c7b1076854a280b0"


def test_prompt_set_description_names_exclude_seed_only_when_set():
    dp = _domain(3)
    plain = prompt_set_description(dp, max_prompt_chars=100, max_train_prompts=2, seed=4)
    assert plain == "domain=custom;train=jsonl:t.jsonl:text;eval=jsonl:e.jsonl:text;max_chars=100;max_train=2;seed=4"
    excluded = prompt_set_description(dp, max_prompt_chars=100, max_train_prompts=2, seed=4, exclude_seed=3)
    assert excluded == plain + ";exclude_seed=3"
    sized = prompt_set_description(dp, max_prompt_chars=100, max_train_prompts=2, seed=4, exclude_seed=3,
                                   exclude_size=9)
    assert sized == excluded + ";exclude_size=9"


def test_fresh_rows_leave_out_a_larger_warm_start_sample_with_exclude_size():
    """A warm start drew 10 of 20 prompts under seed 0; fresh rows of 4 under seed 1 must miss all 10. Left
    out by the fresh run's own sample size (4), seed 0's first draws, they do not: exclude_size does."""
    dp = _domain(20)
    warm = set(choose_train_prompts(dp, max_train_prompts=10, seed=0))
    by_own_size = choose_train_prompts(dp, max_train_prompts=4, seed=1, exclude_seed=0)
    assert warm & set(by_own_size), "the negative control: this draw overlaps the warm start without exclude_size"
    fresh = choose_train_prompts(dp, max_train_prompts=4, seed=1, exclude_seed=0, exclude_size=10)
    assert len(fresh) == 4 and not warm & set(fresh)


def test_choose_train_prompts_samples_and_leaves_out_another_seeds_tasks():
    dp = _domain(8)
    assert choose_train_prompts(dp, max_train_prompts=None, seed=0) == dp.train
    assert choose_train_prompts(dp, max_train_prompts=20, seed=0) == dp.train
    sample = choose_train_prompts(dp, max_train_prompts=3, seed=0)
    assert len(sample) == 3 and sample == [p for p in dp.train if p in sample], "a sample keeps the source order"
    assert sample == choose_train_prompts(dp, max_train_prompts=3, seed=0)
    fresh = choose_train_prompts(dp, max_train_prompts=3, seed=1, exclude_seed=0)
    assert len(fresh) == 3 and not set(fresh) & set(sample)
    # tasks in two forms: the rows of a task in seed 0's sample are left out in both forms
    dp = _domain(8, tasks=["a", "a", "b", "b", "c", "c", "d", "d"])
    seen = {dp.train_tasks()[dp.train.index(p)] for p in choose_train_prompts(dp, max_train_prompts=2, seed=0)}
    fresh = choose_train_prompts(dp, max_train_prompts=2, seed=1, exclude_seed=0)
    assert fresh and not seen & {dp.train_tasks()[dp.train.index(p)] for p in fresh}
    assert dp.train == [f"prompt {i}" for i in range(8)], "the prompts given are left as they are"


def test_bad_sample_settings_raise_naming_the_setting():
    check_sample_settings(None, 0, None)
    check_sample_settings(5, 0, 1)
    with pytest.raises(ValueError, match="max_train_prompts=0 must be positive"):
        check_sample_settings(0, 0, None)
    with pytest.raises(ValueError, match="exclude_seed=0.*set max_train_prompts"):
        choose_train_prompts(_domain(3), max_train_prompts=None, seed=1, exclude_seed=0)
    with pytest.raises(ValueError, match="exclude_seed=2.*seed other than 2"):
        PromptPlan("code", max_train_prompts=5, seed=2, exclude_seed=2)
    with pytest.raises(ValueError, match="max_train_prompts=-1"):
        PromptPlan("code", max_train_prompts=-1)
    with pytest.raises(ValueError, match="exclude_size=5.*needs exclude_seed"):
        PromptPlan("code", max_train_prompts=5, seed=1, exclude_size=5)
    with pytest.raises(ValueError, match="exclude_size=0"):
        check_sample_settings(5, 1, 0, 0)


def test_from_data_args_takes_a_data_config_and_names_an_unknown_setting():
    data = {
        "_target_": "exittrain.data.ExitTrainDataModule",
        "_partial_": True,
        **CODE_RECIPE,
        "cache_dir": "/cache",
        "max_length": 640,
        "batch_size": 8,
        "val_fraction": 0.03,
    }
    plan = PromptPlan.from_data_args(data, target_name="org/model", device="cpu")
    assert (plan.target_name, plan.cache_dir.as_posix(), plan.max_train_prompts) == ("org/model", "/cache", 360)
    assert plan.generation == GenerationConfig(max_new_tokens=96, batch_size=32, dtype="bfloat16")
    assert plan._prompts is None, "the sources are read on first use only"
    with pytest.raises(ValueError, match=r"unknown data settings \['max_train'\]"):
        PromptPlan.from_data_args({"domain": "code", "max_train": 3})
    with pytest.raises(ValueError, match="unknown generation settings"):
        PromptPlan.from_data_args({"generation": {"max_tokens": 3}})


def test_every_datamodule_argument_is_the_plans_or_the_loaders_with_the_same_default():
    from exittrain.data.datamodule import ExitTrainDataModule

    module = inspect.signature(ExitTrainDataModule).parameters
    plan = inspect.signature(PromptPlan).parameters
    assert set(module) == set(plan) | LOADER_ARGS | CORPUS_ARGS and not set(plan) & (LOADER_ARGS | CORPUS_ARGS)
    assert {k: p.default for k, p in plan.items()} == {k: module[k].default for k in plan}


def test_the_plan_is_what_the_datamodule_uses(tmp_path, smollm2_tokenizer):
    from exittrain.data.datamodule import ExitTrainDataModule

    train, evals = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"text": f"Question {i}?"}) + "\n" for i in range(6)))
    evals.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("Tell me a story.", "What is a prime?")))
    args = dict(
        domain="custom",
        train_sources=[f"jsonl:{train}:text"],
        eval_sources=[f"jsonl:{evals}:text"],
        target_name="tiny",
        cache_dir=tmp_path / "cache",
        max_train_prompts=4,
        seed=3,
        generation={"max_new_tokens": 4, "system_prompt": "Be brief."},
    )
    plan = PromptPlan(**args)
    dm = ExitTrainDataModule(**args, tokenizer=smollm2_tokenizer)
    assert dm.cache_path == plan.cache_path and dm.prompts().train == plan.train and len(plan.train) == 4
    assert plan.eval_texts() == ["Tell me a story.", "What is a prime?"] and plan.eval_texts(1) == plan.eval_texts()[:1]
    ids = plan.eval_ids(smollm2_tokenizer, 1)
    assert ids == dm.eval_prompts(1) == [chat_prompt_ids(smollm2_tokenizer, "Tell me a story.", "Be brief.")]


def test_exclude_seed_leaves_out_every_task_of_the_other_seeds_sample():
    # 10 CodeI/O tasks in two forms; the warm start (seed 0) samples 6 prompts, the fresh run (seed 1)
    # must see none of their tasks, in either form, and still sample up to 6 of the rest
    train = ["pkg:codeio?limit=10&seed=3", "pkg:codeio_stub?limit=10&seed=3"]
    common = dict(train_sources=train, eval_sources=["pkg:humaneval"], target_name="tiny", max_train_prompts=6)
    warm = PromptPlan("custom", **common)
    fresh = PromptPlan("custom", seed=1, exclude_seed=0, **common)
    warm_tasks = set(warm.prompts().train_tasks())
    fresh_tasks = fresh.prompts().train_tasks()
    assert len(fresh.prompts().train) == 6 and len(warm.prompts().train) == 6
    assert warm_tasks and not warm_tasks & set(fresh_tasks), "a fresh prompt shares a task with the warm start"
    # the negative control: the same seed without the exclusion overlaps the warm start's tasks
    same = PromptPlan("custom", seed=1, **common)
    assert warm_tasks & set(same.prompts().train_tasks())
    assert "exclude_seed=0" in fresh.prompt_set
    assert "exclude_seed" not in warm.prompt_set  # the default keeps old cache keys
    with pytest.raises(ValueError, match="exclude_seed=1.*seed other than 1"):
        PromptPlan("custom", seed=1, exclude_seed=1, **common)
    with pytest.raises(ValueError, match="exclude_seed=0.*set max_train_prompts"):
        PromptPlan("custom", seed=1, exclude_seed=0, **{**common, "max_train_prompts": None})


def test_the_plan_and_the_package_import_no_lightning():
    """A command that only prepares the data (the plan, the split, the target provider) never loads Lightning."""
    code = (
        "import sys, exittrain.data, exittrain.data.prompts.prompt_plan, exittrain.data.split, "
        "exittrain.data.target_provider; "
        "assert not {'lightning', 'pytorch_lightning'} & set(sys.modules), 'Lightning was imported'; "
        "from exittrain.data import ExitTrainDataModule; assert 'lightning' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
