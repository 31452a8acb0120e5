"""Every config file composes and builds, and the code's defaults are the YAML's.

litgpt-style (``tests/test_config_hub.py``): the tests are parametrised over every YAML file of
every group under ``conf/`` (``conf/<group>/**.yaml``) and every recipe (``recipes/*.yaml``), so a
new file is picked up without editing this module. Each file is composed into the primary
configs that load its group (``fit``; ``eval`` too when conf/eval.yaml lists the group), and the
composed config is built by :func:`build_fit` / :func:`build_eval`: what ``fit`` and ``eval``
instantiate before they train or decode, with the run-time arguments of their call sites
(:mod:`exittrain.build`, :func:`exittrain.lit.trainer.build_trainer`, the logger as
:func:`exittrain.lit.run_logging.make_logger` makes it, the DataModule as
:func:`exittrain.evaluate.run_eval` makes it). Nothing is trained, decoded or regenerated.

On a CPU host, offline:

- every config built gets ``target.device=cpu``, ``trainer.accelerator=cpu`` and
  ``trainer.devices=1`` (hub.yaml's device is the rank's GPU; ddp/fsdp/gpu ask for GPUs), and
  ``paths.output_dir=tmp_path``; Hydra's runtime is set, so ``paths.cache_dir`` resolves as in a
  run (nothing is written there: no data is regenerated);
- the target of every option but the target group's own is a tiny random Llama saved with a
  word-level chat tokenizer (:func:`tests.lit.crash_helpers.write_tiny_target`) and loaded
  through ``target=hub`` (``target.name_or_path=DIR target.dtype=float32``);
- ``target=smollm2`` loads the embedded SmolLM2-135M (``real_model``: about a second once its
  GGUF conversion is cached); ``target=qwen3_8b`` is composed only (8B weights from the hub);
- W&B is constructed offline with ``WANDB_MODE=disabled`` and never started (no ``experiment``).

:data:`CODE_DEFAULTS_DIFFER` lists, with the reason, every constructor argument whose code default
is not the YAML's value; :func:`test_code_defaults_are_the_yaml_values` fails on any other
disagreement and on a listed one that no longer differs. Lightning's own classes are not
compared: their defaults are Lightning's, and the YAML is the project's choice of them.
"""

from __future__ import annotations

import dataclasses
import inspect
import shutil
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from exittrain import progress, settings
from exittrain.build import build_callbacks, build_datamodule, build_drafter, build_module, build_target
from exittrain.configs import CONF_DIR, RECIPES_DIR, largest, register_recipes
from exittrain.data import ExitTrainDataModule, GenerationConfig
from exittrain.lit import DecodeEvalCallback, ExitTrainModule
from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.lit.run_logging import build_logger
from exittrain.lit.schedule import OptimizerSettings
from exittrain.lit.trainer import build_trainer
from exittrain.models import BlockDrafter, TargetModel
from exittrain.objective import STAGES, ObjectiveSettings
from tests.lit.crash_helpers import write_tiny_target

PRIMARIES = ("fit", "eval")
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16], [17, 18, 19, 20], [21, 22, 23]]


# ----------------------------------------------------------------------------------------------
# the options: every file of every group, found on disk


def config_options(conf_dir: Path = CONF_DIR, recipes_dir: Path = RECIPES_DIR) -> list[tuple[str, str]]:
    """``(group, option)`` of every ``conf/<group>/**.yaml`` (option: its path in the group, no
    suffix, e.g. ``shared/base``) and ``("recipe", name)`` of every ``recipes/*.yaml``."""
    options = [
        (group.name, path.relative_to(group).with_suffix("").as_posix())
        for group in sorted(p for p in conf_dir.iterdir() if p.is_dir())
        for path in sorted(group.rglob("*.yaml"))
    ]
    return options + [("recipe", path.stem) for path in sorted(recipes_dir.glob("*.yaml"))]


# Groups no primary lists in its defaults, added with ``+group=option``: the recipes (every primary),
# conf/serve (``+serve=dflash``: fit only, it sets the drafter and the tree, which eval has no group for)
# and conf/experiment (``+experiment=NAME``, fit's full-scale presets: a target, a trainer and their sizes).
APPENDED = {"fit": {"recipe", "serve", "experiment"}, "eval": {"recipe"}}


def primary_groups(primary: str, conf_dir: Path = CONF_DIR) -> set[str]:
    """The groups ``conf/<primary>.yaml`` lists in its defaults, plus those added with ``+`` (:data:`APPENDED`)."""
    defaults = OmegaConf.load(conf_dir / f"{primary}.yaml").defaults
    return {next(iter(entry)) for entry in defaults if OmegaConf.is_dict(entry)} | APPENDED.get(primary, {"recipe"})


def selection(group: str, option: str) -> str:
    """The override that picks ``option``: ``+group=NAME`` for an appended group (a recipe, serve), else
    ``group=option``."""
    return f"+{group}={option}" if group in set().union(*APPENDED.values()) else f"{group}={option}"


# Files with mandatory values (???), and what a test fills them with (tiny_dir: the tiny target's folder).
REQUIRED = {
    ("target", "hub"): lambda tiny_dir: [f"target.name_or_path={tiny_dir}"],
    ("data", "shared/base"): lambda tiny_dir: ["data.domain=code"],  # the domains' shared settings, no domain
}
# Options whose own object a test cannot build, and why; the rest of their config is built.
NOT_BUILT = {
    ("target", "qwen3_8b"): "8B weights from the hub, no network in the tests (test_qwen3_8b_is_hub_with_its_name)",
    ("target", "llama31_8b"): "8B gated weights from the hub, no network in the tests (test_the_8b_targets_are_hub)",
}
EXPENSIVE = {("target", "smollm2"): pytest.mark.real_model}  # loads the embedded SmolLM2-135M


def cases() -> list:
    out = []
    for group, option in config_options():
        for primary in PRIMARIES:
            if group in primary_groups(primary):
                mark = EXPENSIVE.get((group, option))
                out.append(pytest.param(primary, group, option, id=f"{primary}-{group}/{option}",
                                        marks=[mark] if mark else []))
    return out


# ----------------------------------------------------------------------------------------------
# composing and building


def compose_config(primary: str, *overrides: str, conf_dir: Path = CONF_DIR) -> DictConfig:
    """``primary`` with ``overrides``, Hydra's runtime set so that ``${hydra:runtime.cwd}`` resolves as in a run."""
    register_recipes()
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        cfg = compose(primary, overrides=list(overrides), return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def cpu_overrides(primary: str, out: Path) -> list[str]:
    """What every composed config gets on a CPU host (``${hydra:runtime.output_dir}`` needs a Hydra run)."""
    overrides = [f"paths.output_dir={out}", "target.device=cpu"]
    if primary == "eval":
        overrides.append(f"drafter_path={out / 'drafter'}")
    else:
        overrides += ["trainer.accelerator=cpu", "trainer.devices=1"]
    return overrides


def build_fit(cfg: DictConfig, target: TargetModel | None, out: Path) -> dict[str, Any]:
    """Everything ``fit`` builds from ``cfg`` before its first step, as its call sites build it.

    ``target``: a built target, or None to build ``cfg.target``. Returns the objects by name."""
    checked = settings.check_fit_config(cfg)
    target = build_target(cfg, target)
    drafter = build_drafter(cfg, target)
    built: dict[str, Any] = {
        "settings": checked,
        "target": target,
        "drafter": drafter,
        "data": build_datamodule(cfg, target, drafter.config.target_layer_ids, list(STAGES)),
    }
    for stage in STAGES:
        logger = build_logger(cfg, f"{cfg.recipe_name}-{stage}")
        callbacks = build_callbacks(cfg, stage, PROMPTS, out, cfg.stages[stage].eval_every)
        built[f"module/{stage}"] = build_module(cfg, stage, drafter, target)
        built[f"callbacks/{stage}"] = callbacks
        built[f"logger/{stage}"] = logger
        built[f"trainer/{stage}"] = build_trainer(  # the arguments of fit's train_stage / train_steps
            cfg.trainer,
            max_steps=cfg.stages[stage].max_steps,
            callbacks=callbacks,
            logger=logger if logger is not None else False,
            plugins=[AtomicCheckpointIO()],
            **({} if progress.interactive() else {"enable_progress_bar": False}),
        )
    return built


def build_eval(cfg: DictConfig, target: TargetModel | None, out: Path) -> dict[str, Any]:
    """Everything ``eval`` builds from ``cfg`` but the saved drafter, as exittrain.evaluate.run_eval does."""
    target = build_target(cfg, target)
    return {
        "settings": settings.eval_settings(cfg),
        "target": target,
        "data": instantiate(cfg.data)(
            target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
        ),
        "logger": build_logger(cfg, f"{cfg.recipe_name}-eval"),
    }


BUILDERS = {"fit": build_fit, "eval": build_eval}


@pytest.fixture(autouse=True)
def offline_environment(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    yield
    HydraConfig.instance().cfg = None


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny random Llama and a word-level tokenizer with a chat template, saved for ``target=hub``."""
    return write_tiny_target(tmp_path_factory.mktemp("tiny_target"))


@pytest.fixture(scope="module")
def tiny_target(tiny_dir) -> TargetModel:
    """The tiny target, loaded through ``target=hub`` as a run would load it."""
    cfg = compose_config("fit", "target=hub", f"target.name_or_path={tiny_dir}", "target.device=cpu",
                         "target.dtype=float32", "paths.output_dir=unused")
    return build_target(cfg)


def composed(primary: str, group: str, option: str, tiny_dir: Path, out: Path, *extra: str) -> DictConfig:
    fills = REQUIRED.get((group, option), lambda _: [])(tiny_dir)
    return compose_config(primary, selection(group, option), *fills, *cpu_overrides(primary, out), *extra)


# ----------------------------------------------------------------------------------------------
# every file composes and builds


@pytest.mark.parametrize("primary, group, option", cases())
def test_every_config_file_composes_and_builds(primary, group, option, tiny_dir, tiny_target, tmp_path):
    hub = ["target.dtype=float32"] if (group, option) == ("target", "hub") else []  # the tiny model's own dtype
    cfg = composed(primary, group, option, tiny_dir, tmp_path, *hub)
    own_target = group == "target" and (group, option) not in NOT_BUILT
    built = BUILDERS[primary](cfg, None if own_target else tiny_target, tmp_path)

    assert isinstance(built["target"], TargetModel) and str(built["target"].device) == "cpu"
    assert isinstance(built["data"], ExitTrainDataModule) and built["data"].domain == cfg.data.domain
    assert built["data"].max_length == cfg.data.max_length and built["data"].batch_size == cfg.data.batch_size
    if primary == "eval":
        return
    assert isinstance(built["drafter"], BlockDrafter)
    assert built["drafter"].config.block_size == cfg.drafter.block_size
    for stage in STAGES:
        module = built[f"module/{stage}"]
        assert isinstance(module, ExitTrainModule) and module.hparams["stage"] == stage
        expected = settings.stage_module_args(cfg, stage)  # objective.* with the stage's overrides
        assert {k: module.hparams[k] for k in expected} == expected
        decode = [c for c in built[f"callbacks/{stage}"] if isinstance(c, DecodeEvalCallback)]
        assert len(decode) == (cfg.callbacks.get("decode_eval") is not None)
        trainer = built[f"trainer/{stage}"]
        assert trainer.max_steps == cfg.stages[stage].max_steps
        assert trainer.gradient_clip_val == cfg.trainer.gradient_clip_val
        assert trainer.num_devices == 1 and trainer.accelerator.__class__.__name__ == "CPUAccelerator"
        assert (trainer.logger is None) == (built[f"logger/{stage}"] is None)


def test_files_with_mandatory_values_are_filled_by_the_tests(tiny_dir, tmp_path):
    """A group file with a ``???`` needs its values in REQUIRED: the parametrised build cannot guess them."""
    for group, option in config_options():
        if group == "recipe":
            continue
        cfg = compose_config("fit", selection(group, option), *cpu_overrides("fit", tmp_path))
        node = cfg.get(group)  # None for a _global_ group (debug, experiment): deltas of the others
        missing = sorted(OmegaConf.missing_keys(node)) if node is not None else []  # not cfg's: recipe_name
        # follows data.domain, so a missing domain would fail resolving logger.group first
        assert bool(missing) == ((group, option) in REQUIRED), (group, option, missing)


def test_every_group_is_loaded_by_a_primary_config():
    """So the parametrised build reaches every file; the tables above name existing files only."""
    loaded = set().union(*(primary_groups(p) for p in PRIMARIES))
    assert {group for group, _ in config_options()} <= loaded
    assert set(NOT_BUILT) | set(REQUIRED) | set(EXPENSIVE) <= set(config_options())


def test_a_broken_config_fails_the_same_build(tiny_dir, tiny_target, tmp_path):
    """Negative control: a new file in a copy of conf/ is picked up and its faults raise from build_fit."""
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    missing = "_target_: exittrain.models.no_such_drafter\n_partial_: true\n"
    (conf / "drafter" / "missing_class.yaml").write_text(missing)
    (conf / "objective" / "typo.yaml").write_text("defaults:\n  - exittrain\n  - _self_\nanchors_per_sq: 4\n")
    assert {("drafter", "missing_class"), ("objective", "typo")} <= set(config_options(conf, RECIPES_DIR))
    overrides = cpu_overrides("fit", tmp_path)
    cfg = compose_config("fit", "drafter=missing_class", *overrides, conf_dir=conf)
    with pytest.raises(InstantiationException, match="no_such_drafter"):
        build_fit(cfg, tiny_target, tmp_path)
    cfg = compose_config("fit", "objective=typo", *overrides, conf_dir=conf)
    with pytest.raises(ValueError, match=r"unknown ExitTrainModule arguments \['anchors_per_sq'\]"):
        build_fit(cfg, tiny_target, tmp_path)
    # and the untouched copy builds: the faults above are the files', not the copy's
    assert isinstance(build_fit(compose_config("fit", *overrides, conf_dir=conf), tiny_target, tmp_path)["drafter"],
                      BlockDrafter)


def test_qwen3_8b_is_hub_with_its_name(tmp_path):
    """Not instantiated: Qwen/Qwen3-8B is 16 GB of weights from the hub (no network in the tests)."""
    hub = compose_config("fit", "target=hub", "target.name_or_path=org/model", f"paths.output_dir={tmp_path}").target
    qwen = compose_config("fit", "target=qwen3_8b", f"paths.output_dir={tmp_path}").target
    assert qwen.name_or_path == "Qwen/Qwen3-8B"
    assert {**OmegaConf.to_container(hub, resolve=True), "name_or_path": "Qwen/Qwen3-8B"} == OmegaConf.to_container(
        qwen, resolve=True
    )
    assert qwen.device == "auto" and qwen.dtype == "auto" and qwen.trust_remote_code is False


@pytest.mark.parametrize(
    "option, name", [("qwen3_8b", "Qwen/Qwen3-8B"), ("llama31_8b", "meta-llama/Llama-3.1-8B-Instruct")]
)
def test_the_8b_targets_are_hub(tmp_path, option, name):
    """Each shipped 8B target is hub.yaml with its name, and nothing else (not instantiated: no network)."""
    hub = compose_config("fit", "target=hub", "target.name_or_path=org/model", f"paths.output_dir={tmp_path}").target
    target = compose_config("fit", f"target={option}", f"paths.output_dir={tmp_path}").target
    assert OmegaConf.to_container(target, resolve=True) == {**OmegaConf.to_container(hub, resolve=True),
                                                            "name_or_path": name}


# every trainer file's composed values, as each file set them in full before shared/base.yaml held the common ones
TRAINER_VALUES = {
    "cpu": {"accelerator": "cpu", "devices": 1, "log_every_n_steps": 5, "val_check_interval": None,
            "check_val_every_n_epoch": 3, "enable_model_summary": False},
    "gpu": {"accelerator": "gpu", "devices": 1, "log_every_n_steps": 10},
    "ddp": {"accelerator": "gpu", "devices": -1, "num_nodes": 1, "strategy": "ddp", "log_every_n_steps": 10},
    "fsdp": {"accelerator": "gpu", "devices": -1, "num_nodes": 1, "log_every_n_steps": 10,
             "strategy": {"_target_": "exittrain.lit.DrafterFSDPStrategy", "save_distributed_checkpoint": False}},
}
TRAINER_SHARED = {"_target_": "lightning.Trainer", "_partial_": True, "precision": "auto", "gradient_clip_val": 1.0,
                  "num_sanity_val_steps": 0}


@pytest.mark.parametrize("option", sorted(TRAINER_VALUES))
def test_trainer_files_are_deltas_of_one_base(tmp_path, option):
    """conf/trainer/shared/base.yaml holds what every trainer shares; each file composes to the values it had."""
    trainer = compose_config("fit", f"trainer={option}", f"paths.output_dir={tmp_path}").trainer
    expected = {**TRAINER_SHARED, **TRAINER_VALUES[option], "default_root_dir": str(tmp_path)}
    assert OmegaConf.to_container(trainer, resolve=True) == expected
    assert OmegaConf.load(CONF_DIR / "trainer" / f"{option}.yaml").defaults[0] == "shared/base@_here_"


def test_fit_and_eval_share_the_eval_group(tmp_path):
    """One conf/eval/default.yaml; conf/eval.yaml overrides only the eval command's own values."""
    fit = compose_config("fit", *cpu_overrides("fit", tmp_path)).eval
    ev = compose_config("eval", *cpu_overrides("eval", tmp_path)).eval
    shared = OmegaConf.load(CONF_DIR / "eval" / "default.yaml")
    assert OmegaConf.to_container(fit) == OmegaConf.to_container(shared)
    differ = {k for k in shared if fit[k] != ev[k]}
    assert differ == set(OmegaConf.load(CONF_DIR / "eval.yaml").eval) == {"num_prompts", "max_new_tokens", "oracle"}


def test_tree_settings_reach_the_objective_and_the_decode_check(tmp_path):
    """The tree group has no constructor: the objective and the callbacks read it by interpolation."""
    cfg = compose_config("fit", "tree.budget_train=5", "tree.window=9", "tree.shape=chain",
                         *cpu_overrides("fit", tmp_path))
    assert cfg.objective.budget == 5 and cfg.objective.window == 9 and cfg.callbacks.decode_eval.shape == "chain"
    assert "tree" not in compose_config("eval", *cpu_overrides("eval", tmp_path))  # eval reads no tree setting


def test_eval_budgets_and_verifier_are_the_callbacks_one_key(tmp_path):
    """eval.budgets is the one evaluation budget: the decode check and the held-out callback take its
    largest (the ${largest:...} resolver of exittrain.configs); eval.verifier is the decode check's verifier."""
    cfg = compose_config("fit", "eval.budgets=[4,32,8]", "eval.verifier=greedy", *cpu_overrides("fit", tmp_path))
    assert cfg.callbacks.decode_eval.budget == cfg.callbacks.heldout_block_length.budget == 32
    assert cfg.callbacks.decode_eval.verifier == "greedy"
    assert "budget_eval" not in cfg.tree
    smoke = compose_config("fit", "debug=smoke", *cpu_overrides("fit", tmp_path))
    assert list(smoke.eval.budgets) == [8] and smoke.callbacks.decode_eval.budget == 8
    with pytest.raises(ValueError, match=r"eval.budgets=\[\]: need a non-empty list"):
        largest([])


def test_smoke_runs_every_stage_with_one_anchor_count(tmp_path):
    """debug=smoke sets objective.anchors_per_seq once; its exittrain stage follows it."""
    cfg = compose_config("fit", "debug=smoke", "objective.anchors_per_seq=3", *cpu_overrides("fit", tmp_path))
    assert [settings.stage_module_args(cfg, s)["anchors_per_seq"] for s in STAGES] == [3, 3]


# ----------------------------------------------------------------------------------------------
# the code's defaults are the YAML's

# (constructor, argument): why its code default is not the YAML's value. Keyed by constructor, so
# one entry covers every file that sets the argument (the three domains, the targets).
CODE_DEFAULTS_DIFFER = {
    ("exittrain.models.new_drafter", "init_from_layers"): (
        "new_drafter's default is the plain randomly initialised drafter that tests/models build (12 fail with auto)"
    ),
    ("exittrain.models.new_drafter", "copy_ngrams"): "as init_from_layers: tests/models build drafters without it",
    ("exittrain.models.new_drafter", "seed"): "the YAML wires the run's ${seed}; the library default None is unseeded",
    ("exittrain.data.ExitTrainDataModule", "generation.dtype"): (
        "GenerationConfig's None (the target as loaded) keys the caches of tests/test_precision.py and "
        "tests/data/test_regenerate.py; auto must be resolved per device before it keys a cache"
    ),
    ("exittrain.data.ExitTrainDataModule", "cache_dir"): "a run-time path: ${paths.cache_dir}/regen",
    ("exittrain.data.ExitTrainDataModule", "domain"): "per domain file (the default 'code' is code.yaml's)",
    ("exittrain.data.ExitTrainDataModule", "train_sources"): "per domain file (None: the domain's config lists)",
    ("exittrain.data.ExitTrainDataModule", "eval_sources"): "per domain file (None: the domain's config lists)",
    ("exittrain.data.ExitTrainDataModule", "max_train_prompts"): "per domain file (None: every prompt)",
    ("exittrain.models.load_target", "name_or_path"): "per target file (None: the embedded SmolLM2, smollm2.yaml's)",
    ("exittrain.models.load_target", "device"): "per target file (cpu: smollm2.yaml's; hub's is the rank's GPU)",
}
# YAML keys that are no argument of their constructor: the call site consumes them.
CALL_SITE_KEYS = {
    ("exittrain.lit.DecodeEvalCallback", "num_prompts"): "build_callbacks passes that many held-out prompts",
}
# Constructors taking **settings, and the dataclasses whose fields those settings are.
SETTINGS_OF = {"exittrain.lit.ExitTrainModule": (ObjectiveSettings, OptimizerSettings)}
# Arguments that are a dataclass given as a mapping in the YAML.
NESTED = {("exittrain.data.ExitTrainDataModule", "generation"): GenerationConfig}


def code_defaults(target: str) -> dict[str, Any]:
    """``argument -> default`` of the callable ``target`` names (its settings dataclasses for ``**settings``)."""
    params = inspect.signature(get_object(target)).parameters
    out = {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()) and target in SETTINGS_OF:
        for cls in SETTINGS_OF[target]:
            out.update({f.name: f.default for f in dataclasses.fields(cls)})
    return out


def _plain(value: Any) -> Any:
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return list(value) if isinstance(value, tuple) else value


def disagreements(node: DictConfig, where: str) -> list[tuple[str, str, Any, Any, str]]:
    """``(constructor, argument, yaml, code, where)`` for every exittrain constructor under ``node``."""
    out = []
    if "_target_" in node and str(node._target_).startswith("exittrain."):
        target = str(node._target_)
        defaults = code_defaults(target)
        for key in node:
            if key.startswith("_") or OmegaConf.is_missing(node, key):
                continue
            if (target, key) in CALL_SITE_KEYS:
                continue
            assert key in defaults, f"{where}: {key} is not an argument of {target} with a default"
            value = _plain(node[key])
            if (target, key) in NESTED and isinstance(value, dict):
                fields = {f.name: f.default for f in dataclasses.fields(NESTED[target, key])}
                out += [(target, f"{key}.{k}", v, fields[k], where) for k, v in value.items() if v != fields[k]]
            elif value != _plain(defaults[key]):
                out.append((target, key, value, defaults[key], where))
    for key in node:
        if not key.startswith("_") and OmegaConf.is_dict(node._get_node(key)):
            out += disagreements(node[key], f"{where}.{key}")
    return out


def test_code_defaults_are_the_yaml_values(tiny_dir, tmp_path):
    """Every default is defined once: a YAML value equals its constructor's default, or is listed in
    CODE_DEFAULTS_DIFFER with the reason; a listed pair that no longer differs must be removed."""
    found = []
    for group, option in config_options():
        fills = REQUIRED.get((group, option), lambda _: [])(tiny_dir)  # no CPU overrides: the files' own values
        cfg = compose_config("fit", selection(group, option), *fills, f"paths.output_dir={tmp_path}")
        if group not in cfg:
            continue  # a recipe or debug=smoke (package _global_): deltas of the groups, no constructor's settings
        found += disagreements(cfg[group], f"{group}/{option}")
    unexplained = [f for f in found if (f[0], f[1]) not in CODE_DEFAULTS_DIFFER]
    assert not unexplained, "YAML value != code default (fix one, or list it with a reason):\n" + "\n".join(
        f"  {where}: {target}({key}=...) yaml={yaml!r} code={code!r}" for target, key, yaml, code, where in unexplained
    )
    stale = set(CODE_DEFAULTS_DIFFER) - {(f[0], f[1]) for f in found}
    assert not stale, f"these agree now; remove them from CODE_DEFAULTS_DIFFER: {sorted(stale)}"


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_a_recipe_names_its_domain_once(tmp_path, recipe):
    """A recipe's one choice is its data domain; recipe_name (W&B's group, the report's recipe) follows it."""
    text = (RECIPES_DIR / f"{recipe}.yaml").read_text()
    code = "\n".join(line.split("#")[0] for line in text.splitlines())
    assert code.count(recipe) == 1 and f"override /data: {recipe}" in code
    for primary in PRIMARIES:
        cfg = compose_config(primary, f"+recipe={recipe}", *cpu_overrides(primary, tmp_path))
        assert cfg.data.domain == cfg.recipe_name == recipe


# conf/experiment/NAME: (target, trainer strategy); every preset adds shared/full_scale.yaml's sizes
EXPERIMENTS = {
    "qwen3_8b_ddp": ("Qwen/Qwen3-8B", "ddp"),
    "qwen3_8b_fsdp": ("Qwen/Qwen3-8B", "exittrain.lit.DrafterFSDPStrategy"),
    "llama31_8b_ddp": ("meta-llama/Llama-3.1-8B-Instruct", "ddp"),
}


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_full_scale_presets_set_what_the_command_line_did(tmp_path, name):
    """``+recipe=code +experiment=NAME`` composes the target, the trainer and the full-scale keys that
    the README's and docs/multi_gpu.md's commands set as about ten overrides; the plan (no weights) sizes it."""
    from exittrain.plan import make_plan

    assert {p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")} == set(EXPERIMENTS)
    cfg = compose_config("fit", "+recipe=code", f"+experiment={name}", f"paths.output_dir={tmp_path}")
    name_or_path, strategy = EXPERIMENTS[name]
    assert cfg.target.name_or_path == name_or_path and cfg.target.device == "auto"
    assert (cfg.trainer.strategy if strategy == "ddp" else cfg.trainer.strategy._target_) == strategy
    assert cfg.trainer.accelerator == "gpu" and cfg.trainer.devices == 8 and cfg.trainer.num_nodes == 1
    assert cfg.data.domain == cfg.recipe_name == "code"
    assert list(cfg.data.train_sources) == ["hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt"]
    assert (cfg.data.max_train_prompts, cfg.data.max_length, cfg.data.batch_size) == (200000, 3072, 8)
    assert cfg.data.generation.max_new_tokens == 4096
    assert cfg.drafter.block_size == 16 and cfg.objective.feature_cache is False
    assert cfg.objective.budget == cfg.tree.budget_train == 32
    assert list(cfg.eval.budgets) == [64] and cfg.callbacks.decode_eval.budget == 64
    assert [cfg.stages[s].max_steps for s in STAGES] == [20000, 10000]
    assert [settings.stage_module_args(cfg, s)["anchors_per_seq"] for s in STAGES] == [32, 32]
    assert settings.check_fit_config(cfg).stages == list(STAGES)
    plan = make_plan(["+recipe=code", f"+experiment={name}", f"paths.output_dir={tmp_path}"], device_memory="80GiB")
    assert plan.world["world_size"] == 8 and plan.verdict == "fits"  # docs/multi_gpu.md: 8 x 80 GiB


def test_serve_dflash_trains_what_the_format_holds(tmp_path):
    """+serve=dflash: no copy branch, no context window, a learned mask shipped under a spare token id,
    ExitTrain on the chain of K = block_size - 1 = the engine's num_speculative_tokens, DFlash primary."""
    from exittrain.heldout.serving_track import check_serve_config

    cfg = compose_config("fit", "+recipe=code", "+serve=dflash", *cpu_overrides("fit", tmp_path))
    assert list(cfg.drafter.copy_ngrams) == [] and cfg.drafter.context_window is None
    assert cfg.drafter.learned_mask is True and cfg.drafter.mask_token_id is None  # export: spare_token_id
    assert cfg.tree.shape == "chain" and cfg.objective.tree_shape == "chain"
    assert cfg.serve.num_speculative_tokens == cfg.drafter.block_size - 1 == cfg.objective.budget == 7
    assert check_serve_config(cfg) == {"format": "dflash", "engine": "vllm", "num_speculative_tokens": 7,
                                       "primary": "dflash"}
    assert check_serve_config(compose_config("fit", *cpu_overrides("fit", tmp_path))) is None
    for override, match in [("drafter.block_size=4", "serve.num_speculative_tokens=7"),
                            ("drafter.copy_ngrams=[3]", "drafter.copy_ngrams"),
                            ("drafter.context_window=32", "drafter.context_window"),
                            ("serve.primary=elsewhere", "serve.primary")]:
        bad = compose_config("fit", "+serve=dflash", override, *cpu_overrides("fit", tmp_path))
        with pytest.raises(ValueError, match=match):
            check_serve_config(bad)
