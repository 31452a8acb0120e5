"""Hydra configs compose the way users type them: every recipe, the sweep, debug=smoke, eval."""

import subprocess
import sys

import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir

from exittrain.bench.registry import BENCHES
from exittrain.configs import CONF_DIR, RECIPES_DIR, register_recipes
from exittrain.models.target_loading import resolve_device

RECIPES = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "exittrain", *args], capture_output=True, text=True, timeout=120)


def test_all_three_recipes_exist():
    assert RECIPES == ["code", "dialogue", "math"]


# a subprocess each (the imports dominate): the fast tier types one recipe, the slow tier the other two;
# test_debug_smoke_wins_over_every_recipe composes all three in process
@pytest.mark.parametrize("recipe", [r if r == "code" else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES])
def test_recipe_resolves_as_typed_on_the_command_line(recipe):
    proc = run_cli("fit", f"+recipe={recipe}", "--cfg", "job", "--resolve")  # recipe_name is ${data.domain}
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["data"]["domain"] == recipe and cfg["recipe_name"] == recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_debug_smoke_wins_over_every_recipe(recipe):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = compose("fit", overrides=[f"+recipe={recipe}"])
        smoke = compose("fit", overrides=[f"+recipe={recipe}", "debug=smoke"])
    assert smoke.data.domain == recipe
    assert smoke.data.max_train_prompts < base.data.max_train_prompts
    assert smoke.stages.pretrain.max_steps < base.stages.pretrain.max_steps
    assert smoke.eval.num_prompts < base.eval.num_prompts


def test_sweep_over_the_three_recipes():
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parsed = OverridesParser.create().parse_overrides(["+recipe=dialogue,code,math"])
        jobs = [f"+recipe={v}" for v in parsed[0].sweep_iterator()]
        domains = [compose("fit", overrides=[j]).data.domain for j in jobs]
    assert domains == ["dialogue", "code", "math"]


def test_unknown_recipe_is_a_clear_error():
    proc = run_cli("fit", "+recipe=poetry", "--cfg", "job")
    assert proc.returncode != 0
    assert "recipe" in proc.stderr and "poetry" in proc.stderr


def test_eval_takes_drafter_path():
    proc = run_cli("eval", "+recipe=math", "drafter=/tmp/some/drafter", "--cfg", "job")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["drafter_path"] == "/tmp/some/drafter" and cfg["data"]["domain"] == "math"


def test_unknown_command_prints_usage():
    proc = run_cli("train")
    assert proc.returncode == 2 and "usage" in proc.stderr
    assert "bench {" + ",".join(BENCHES) + "}" in proc.stderr  # every benchmark, from the registry


@pytest.mark.parametrize("target", ["hub", "qwen3_8b"])
def test_gpu_targets_compose_to_a_device_chosen_at_load_time(target):
    """The hub targets compose to ``device: auto``, resolved when the target loads, so that each DDP rank
    (torchrun's LOCAL_RANK, srun's SLURM_LOCALID) takes its own GPU and a CPU host the CPU: the
    resolution per rank is tested in tests/models/test_families.py (resolve_device)."""
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("fit", overrides=["+recipe=code", f"target={target}", "target.name_or_path=org/model"])
    assert cfg.target.device == "auto"
    assert resolve_device(cfg.target.device) == (
        torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    )


def test_every_hydra_command_has_its_config_and_its_library_function():
    """__main__'s Hydra words, cli's dispatch table and conf/<command>.yaml agree; each target is a function."""
    import importlib

    from exittrain import cli
    from exittrain.__main__ import HYDRA_COMMANDS, PLAIN_COMMANDS

    assert set(HYDRA_COMMANDS) == set(cli.COMMANDS) and not set(HYDRA_COMMANDS) & set(PLAIN_COMMANDS)
    for where in {**cli.COMMANDS, **PLAIN_COMMANDS}.values():
        module, name = where.split(":")
        assert callable(getattr(importlib.import_module(module), name)), where
    for command in HYDRA_COMMANDS:
        assert (CONF_DIR / f"{command}.yaml").is_file(), command
    with pytest.raises(ValueError, match=r"unknown command config 'train'; use one of \['eval', 'fit', 'prepare'\]"):
        cli.run_command("train", None)
