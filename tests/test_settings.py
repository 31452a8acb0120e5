"""Every constrained setting fails up front (exittrain/settings.py): before the target loads, naming its key.

Each case composes the real ``fit`` (or ``eval``) config with one bad value and runs the command
with a target builder that fails the test if called: the ValueError must come from the checks,
name the key, and never reach the target, the regeneration or the first stage.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from exittrain import settings
from exittrain.configs import CONF_DIR, register_recipes
from exittrain.evaluate import run_eval
from exittrain.fit import fit


def compose_config(name: str, *overrides: str):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=["+recipe=code", *overrides])


def no_target():
    raise AssertionError("the run loaded the target before checking its settings")


# (override, what the message must contain: the key and its value)
FIT_CASES = [
    ("eval.temperatures=[-0.5]", "eval.temperatures=[-0.5]"),
    ("eval.temperatures=[]", "eval.temperatures=[]"),
    ("eval.budgets=[0]", "eval.budgets=[0]"),
    ("eval.budgets=[]", "eval.budgets=[]"),
    ("eval.num_prompts=0", "eval.num_prompts=0"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens=0"),
    ("eval.verifier=nope", "eval.verifier='nope'"),
    ("eval.baseline=3", "eval.baseline=3"),
    ("eval.oracle=maybe", "eval.oracle='maybe'"),
    ("eval.decode=fast", "eval.decode='fast'"),
    ("eval.vllm=maybe", "eval.vllm='maybe'"),
    ("eval.temperatures=[0.6,0.6]", "list each temperature once"),
    ("eval.verifier=greedy", "eval.verifier=greedy with eval.temperatures=[0.0, 0.6]"),
    ("stages.pretrain.max_steps=-1", "stages.pretrain.max_steps=-1"),
    ("stages.exittrain.eval_every=-1", "stages.exittrain.eval_every=-1"),
    ("objective.alpha=2", "alpha=2"),
    ("stages.exittrain.lr=-1", "stages.exittrain"),
    ("callbacks.decode_eval.num_prompts=0", "callbacks.decode_eval: num_prompts=0"),
    ("callbacks.decode_eval.every_n_steps=-2", "every_n_train_steps=-2"),  # the checkpoint follows it
    ("callbacks.decode_eval.temperature=-1", "callbacks.decode_eval: temperature=-1"),
    ("callbacks.decode_eval.verifier=nope", "callbacks.decode_eval: verifier='nope'"),
    ("callbacks.decode_eval.max_new_tokens=0", "callbacks.decode_eval: max_new_tokens=0"),
    ("callbacks.decode_eval.budget=0", "callbacks.decode_eval: budget=0"),
    ("~eval.verifier", "['eval.verifier'] missing from the config: conf/eval/default.yaml sets them"),
    ("~eval.vllm", "['eval.vllm'] missing from the config"),
    ("~eval.temperatures", "['eval.temperatures'] missing from the config"),
    ("eval.drafter_temperature=0", "eval.drafter_temperature=0: the drafter temperature divides"),
    ("eval.drafter_temperature=-0.5", "eval.drafter_temperature=-0.5"),
    ("eval.drafter_temperature=inf", "eval.drafter_temperature=inf"),
    ("eval.drafter_temperature=warm", "eval.drafter_temperature='warm'"),
    ("~eval.drafter_temperature", "['eval.drafter_temperature'] missing from the config: conf/eval/default.yaml"),
    ("~stages.exittrain.eval_every", "['stages.exittrain.eval_every'] missing from the config: conf/fit.yaml"),
    ("callbacks.checkpoint.mode=sideways", "callbacks.checkpoint"),
    ("+callbacks.extra._target_=exittrain.no_such_callback", "callbacks.extra cannot be built"),
    ("data_wait_s=-5", "data_wait_s=-5"),
    ("data.max_length=1", "data: max_length=1"),
    ("data.batch_size=0", "data: batch_size=0"),
    ("data.val_fraction=1.5", "data: val_fraction=1.5"),
    ("data.max_train_prompts=0", "data: max_train_prompts=0"),
    ("data.exclude_seed=0", "data: "),  # the same seed as data.seed leaves nothing to train on
    ("+data.no_such_setting=1", "data: unknown data settings ['no_such_setting']"),
    ("data.generation.max_new_tokens=0", "data: "),
]


@pytest.mark.parametrize("override, message", FIT_CASES)
def test_a_bad_fit_setting_fails_before_the_target_loads(tmp_path, override, message):
    cfg = compose_config("fit", override, f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError) as err:
        fit(cfg, target=no_target)
    assert message in str(err.value)


EVAL_CASES = [
    ("eval.temperatures=[-0.5]", "eval.temperatures=[-0.5]"),
    ("eval.budgets=[0]", "eval.budgets=[0]"),
    ("eval.verifier=nope", "eval.verifier='nope'"),
    ("eval.temperatures=[0.0,0.0]", "list each temperature once"),
    ("eval.decode=fast", "eval.decode='fast'"),
    ("eval.drafter_temperature=0", "eval.drafter_temperature=0"),
    ("data.max_length=1", "data: max_length=1"),
]


@pytest.mark.parametrize("override, message", EVAL_CASES)
def test_a_bad_eval_setting_fails_before_the_target_loads(tmp_path, override, message):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")  # a drafter folder as far as the check reads it
    cfg = compose_config("eval", override, f"drafter_path={drafter}", f"paths.output_dir={tmp_path / 'out'}")
    with pytest.raises(ValueError) as err:
        run_eval(cfg, target=no_target)
    assert message in str(err.value)


def test_decode_auto_with_a_drafter_temperature_fails_before_the_target_loads(tmp_path):
    """eval.decode=auto's probe drafts from the drafter as trained: t_d != 1 with it names both keys and the fix."""
    cfg = compose_config("fit", "eval.decode=auto", "eval.drafter_temperature=0.7", f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"eval.decode=auto with eval.drafter_temperature=0.7: .*eval.decode=fixed"):
        fit(cfg, target=no_target)
    fixed = compose_config("fit", "eval.drafter_temperature=0.7", f"paths.output_dir={tmp_path}")
    assert settings.check_fit_config(fixed).eval["drafter_temperature"] == 0.7  # fixed measures at it


@pytest.mark.parametrize("extra", [[], ["debug=smoke"], ["warm_start=null", "stages.pretrain.max_steps=0"]])
def test_the_shipped_settings_pass_and_give_the_plan(tmp_path, extra):
    """Negative control: the checks refuse nothing that ships, and return what the run reads."""
    cfg = compose_config("fit", f"paths.output_dir={tmp_path}", *extra)
    checked = settings.check_fit_config(cfg)
    assert checked.stages == [s for s in ("pretrain", "exittrain") if cfg.stages[s].max_steps > 0]
    assert checked.eval["budgets"] == list(cfg.eval.budgets) and checked.eval["seed"] == cfg.seed
    assert checked.eval["decode"] == "fixed"  # the plain decoder: the CPU's decode probe only when asked for
    assert checked.eval["drafter_temperature"] == 1.0  # the drafter as trained
    assert checked.eval["temperatures"] == [float(t) for t in cfg.eval.temperatures]


# trainer=fsdp (Lightning's ModelParallelStrategy) refuses 16-mixed when its Trainer is built, after the
# target and the data: the precision is checked up front instead
@pytest.mark.parametrize("override, message", [
    ("trainer.precision=16-mixed", "trainer.precision='16-mixed': trainer=fsdp"),
    ("trainer.precision=16", "trainer.precision=16: trainer=fsdp"),  # Lightning's old name of 16-mixed
    ("trainer.precision=64-true", "trainer.precision='64-true': trainer=fsdp"),
])
def test_fsdp_with_a_precision_its_strategy_refuses_fails_before_the_target_loads(tmp_path, override, message):
    cfg = compose_config("fit", "trainer=fsdp", override, f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError) as err:
        fit(cfg, target=no_target)
    assert message in str(err.value)
    assert "trainer.precision=auto" in str(err.value) and "trainer.precision=32-true" in str(err.value)  # the fix


def test_a_precision_lightning_does_not_know_fails_before_the_target_loads(tmp_path):
    cfg = compose_config("fit", "trainer.precision=bf16_mixed", f"paths.output_dir={tmp_path}")
    with pytest.raises(ValueError, match=r"trainer\.precision='bf16_mixed' is not a Lightning precision"):
        fit(cfg, target=no_target)


@pytest.mark.parametrize("trainer, value", [("fsdp", "auto"), ("fsdp", "32-true"), ("fsdp", "bf16-mixed"),
                                            ("gpu", "16-mixed"), ("ddp", "16-mixed"), ("cpu", "32-true")])
def test_precisions_every_strategy_takes_pass_the_checks(tmp_path, trainer, value):
    """Negative control: fsdp's accepted precisions, and 16-mixed under the strategies that take it."""
    cfg = compose_config("fit", f"trainer={trainer}", f"trainer.precision={value}", f"paths.output_dir={tmp_path}")
    settings.check_trainer_precision(cfg)
    assert settings.check_fit_config(cfg).stages
