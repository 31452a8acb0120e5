"""What the benchmarks take from fit: the recipe's config and its held-out prompts, read as fit reads them."""

from __future__ import annotations

import pytest

from exittrain.bench.recipe import compose_fit_config, heldout_prompts


def test_the_fit_config_is_the_recipes_with_the_bench_paths_then_the_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("EXITTRAIN_CACHE", str(tmp_path / "cache"))
    cfg = compose_fit_config("math", tmp_path / "out", ["eval.max_new_tokens=12"])
    assert cfg.data.domain == "math" and cfg.paths.output_dir == str(tmp_path / "out")
    assert cfg.paths.cache_dir == str(tmp_path / "cache") and cfg.eval.max_new_tokens == 12


@pytest.mark.real_model
def test_heldout_prompts_are_the_datamodules_and_follow_the_configs_evaluation_sources(tmp_path):
    """The benches measure on the prompts fit evaluates (the recipe's datamodule): an override of
    data.eval_sources moves them, and asking for more than the list holds names the list."""
    from hydra.utils import instantiate

    from exittrain.data import chat_prompt_ids, load_domain
    from exittrain.models import load_target

    target = load_target(None)
    cfg = compose_fit_config("dialogue", tmp_path)
    default = heldout_prompts(cfg, target, 3, skip=2)
    datamodule = instantiate(cfg.data)(target=None, tokenizer=target.tokenizer, target_name=target.name)
    assert default == datamodule.eval_prompts(5)[2:]  # fit's and eval's loader, from an offset
    moved_cfg = compose_fit_config("dialogue", tmp_path, ["data.eval_sources=['pkg:ifbench?limit=8&seed=5']"])
    moved = heldout_prompts(moved_cfg, target, 3, skip=2)
    assert len(default) == len(moved) == 3 and default != moved
    ifbench = load_domain("dialogue", train=["pkg:sharegpt_dummy"], eval=["pkg:ifbench?limit=8&seed=5"]).eval
    assert moved == [chat_prompt_ids(target.tokenizer, t) for t in ifbench[2:5]]
    with pytest.raises(ValueError, match=r"pkg:mt_bench\) are 80; lower --skip"):
        heldout_prompts(cfg, target, 3, skip=78)
