"""Every up-front check of a composed ``fit`` or ``eval`` config, before anything heavy loads.

A bad setting must fail in seconds, naming its key and the fix, and not after the regeneration
and the first stage (minutes here, hours on a GPU run). :func:`check_fit_config` and
:func:`check_eval_config` read every setting the run reads later and return what the run needs:

- the stage plan (:func:`plan_stages`): which stages run, from a ``warm_start`` or a ``ckpt_path``;
- every stage's module arguments (``objective.*`` with ``stages.<stage>.*``, :func:`check_objective`);
- the held-out table (``eval.*``, :func:`eval_settings`);
- the callbacks (``callbacks.*``, :func:`check_callbacks`): each one built once with stand-in
  run-time arguments, so its own constructor checks its values;
- the data (``data.*``, :func:`check_data`): the DataModule's own argument check, without a
  tokenizer;
- the trainer's precision (``trainer.precision``, :func:`check_trainer_precision`): a Lightning
  value, and one the strategy accepts (``trainer=fsdp`` refuses ``16-mixed``);
- the drafter folder of ``eval`` (:func:`require_drafter_folder`).

Nothing here loads a model, a tokenizer or data.

The composed YAML is the one source of every default read here (conf/eval/default.yaml for
``eval.*``): no key is given a fallback value in code, and a key the config lacks fails with a
ValueError naming it (:func:`require_keys`), not with a second default that could drift from the
YAML's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, ListConfig, OmegaConf

from exittrain.core import VERIFIERS
from exittrain.data.corpus import check_corpus_settings
from exittrain.data.prompts.prompt_plan import PromptPlan
from exittrain.data.split import check_loader_settings
from exittrain.heldout.decode_eval import check_eval_drafter_temperature
from exittrain.heldout.evaluator import DECODE_MODES
from exittrain.heldout.serving_track import VLLM_MODES
from exittrain.lit.module import check_module_args
from exittrain.lit.sharding import is_model_parallel
from exittrain.objective import STAGES
from exittrain.precision import AUTO, check_sharded_precision, lightning_precision
from exittrain.safe_io import load_checkpoint

__all__ = [
    "STAGE_KEYS",
    "FitSettings",
    "EvalSettings",
    "check_fit_config",
    "require_keys",
    "vllm_mode",
    "check_eval_config",
    "plan_stages",
    "module_overrides",
    "stage_module_args",
    "check_objective",
    "eval_settings",
    "check_callbacks",
    "check_data",
    "check_trainer_precision",
    "require_drafter_folder",
]

# keys of stages.<stage> that configure the stage itself; every other key overrides the objective
STAGE_KEYS = ("max_steps", "eval_every")
# the eval.* keys eval_settings reads, each set by conf/eval/default.yaml
EVAL_KEYS = ("num_prompts", "max_new_tokens", "budgets", "temperatures", "verifier", "baseline", "oracle", "decode",
             "drafter_temperature")
# what to do about a ckpt_path that cannot be resumed from (exittrain.safe_io adds the file and the cause)
CKPT_FIX = (
    "point ckpt_path at another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt of an "
    "earlier run), or leave ckpt_path unset to re-run the stage from its start"
)


@dataclass(frozen=True)
class FitSettings:
    """What :func:`check_fit_config` found: the stages to run, the keyword arguments of
    :func:`~exittrain.heldout.decode_eval.evaluate_prompts` and ``eval.vllm`` (:func:`vllm_mode`)."""

    stages: list[str]
    eval: dict
    vllm: str


@dataclass(frozen=True)
class EvalSettings:
    """What :func:`check_eval_config` found: the drafter folders (in the order given; the first is the
    reference the others are paired against) and the decoding settings."""

    drafter_paths: list[Path]
    eval: dict


def check_fit_config(cfg: DictConfig) -> FitSettings:
    """Check every setting ``fit`` reads (ValueError naming the key); returns the plan."""
    stages = plan_stages(cfg)
    settings = eval_settings(cfg)
    check_objective(cfg, stages)
    check_callbacks(cfg)
    check_data(cfg)
    check_trainer_precision(cfg)
    _check_int(cfg.data_wait_s, "data_wait_s", 0, "seconds ranks > 0 wait for rank 0's data", number=True)
    return FitSettings(stages=stages, eval=settings, vllm=vllm_mode(cfg))


def check_eval_config(cfg: DictConfig) -> EvalSettings:
    """Check every setting ``eval`` reads, the drafter folders first (ValueError naming the key)."""
    paths = _eval_drafter_paths(cfg.drafter_path)
    settings = eval_settings(cfg)
    check_data(cfg)
    return EvalSettings(drafter_paths=paths, eval=settings)


def _eval_drafter_paths(value: Any) -> list[Path]:
    """``drafter_path`` (``drafter=PATH`` or ``drafter=[A,B,...]`` on the command line) as a list of saved
    drafter folders, each checked: ValueError naming the key (``drafter``, or ``drafter[i]`` in a list)
    and a folder that is missing or holds no saved drafter, or an empty list."""
    if not isinstance(value, (list, tuple, ListConfig)):
        require_drafter_folder("drafter", str(value), "pass drafter=RUN_DIR/drafter of a fit run")
        return [Path(str(value))]
    fix = "pass saved drafter folders of fit runs: drafter=[RUN_A/drafter,RUN_B/drafter] (the first is the reference)"
    if not value:
        raise ValueError(f"drafter=[]: name at least one saved drafter folder; {fix}")
    for i, path in enumerate(value):
        require_drafter_folder(f"drafter[{i}]", str(path), fix)
    return [Path(str(p)) for p in value]


def require_keys(node: DictConfig, where: str, keys: tuple[str, ...], source: str) -> None:
    """ValueError naming every ``<where>.<key>`` of ``keys`` that ``node`` lacks: the YAML ``source``
    sets them all, and the code gives none of them a default of its own."""
    missing = [f"{where}.{k}" for k in keys if k not in node]
    if missing:
        raise ValueError(f"{missing} missing from the config: {source} sets them; compose the config with it "
                         f"(python -m exittrain ...) or add {missing[0]}=VALUE")


def _check_int(value: Any, key: str, low: int, what: str, *, number: bool = False) -> None:
    """ValueError ``key=value: need ...`` unless ``value`` is an int (a finite number with ``number``) >= ``low``."""
    kinds = (int, float) if number else (int,)
    ok = isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value) and value >= low
    if not ok:
        raise ValueError(f"{key}={value!r}: need {'a number' if number else 'an integer'} >= {low} ({what})")


# ----------------------------------------------------------------------------------------------
# the stage plan


def _check_stage_settings(cfg: DictConfig) -> None:
    unknown = set(cfg.stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages has unknown entries {sorted(unknown)}; use {list(STAGES)}")
    for name in STAGES:
        require_keys(cfg.stages[name], f"stages.{name}", STAGE_KEYS, "conf/fit.yaml")
        steps = cfg.stages[name].max_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
            raise ValueError(f"stages.{name}.max_steps={steps!r} must be an integer >= 0")
        every = cfg.stages[name].eval_every
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ValueError(
                f"stages.{name}.eval_every={every!r}: need an int >= 0 (a decode check and a checkpoint every N "
                "steps; 0 = one decode check at the stage's end and no periodic checkpoint) or null (the "
                "callbacks' own settings)"
            )


def _resumed_stage(ckpt_path: str) -> str:
    """The stage recorded in a checkpoint; the whole file is read here, so a bad file fails now, in
    our words, and not in Lightning's own load after the target and the data are ready."""
    saved = load_checkpoint(ckpt_path, what="ckpt_path checkpoint", fix=CKPT_FIX).get("hyper_parameters", {})
    stage = saved.get("stage")
    if stage not in STAGES:
        raise ValueError(f"ckpt_path={ckpt_path} records no known stage (got {stage!r})")
    return stage


def plan_stages(cfg: DictConfig) -> list[str]:
    """The stages to run, in order: those with ``max_steps > 0``, without ``pretrain`` when a
    ``warm_start`` is given, and from the stage a ``ckpt_path`` recorded on."""
    _check_stage_settings(cfg)
    stages = [s for s in STAGES if cfg.stages[s].max_steps > 0]
    if cfg.warm_start is not None:
        _check_warm_start(str(cfg.warm_start))
        if "pretrain" in stages:
            stages.remove("pretrain")
    if cfg.ckpt_path is not None:
        first = STAGES.index(_resumed_stage(cfg.ckpt_path))
        stages = [s for s in stages if STAGES.index(s) >= first]
    return stages


def require_drafter_folder(key: str, value: str, fix: str) -> None:
    """ValueError ``<key>=<value> <fault>: <fix>`` unless ``value`` is a saved drafter folder (has a config.json)."""
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "is not a saved drafter folder (no config.json in it)"
        raise ValueError(f"{key}={value} {what}: {fix}")


def _check_warm_start(warm_start: str) -> None:
    """A local ``warm_start`` must be a saved drafter folder (checked before the target loads).

    A hub id (``org/name``, not a local path) is left to the loader."""
    path = Path(warm_start).expanduser()
    local = path.exists() or path.is_absolute() or warm_start.startswith((".", "~")) or warm_start.count("/") != 1
    if local:
        require_drafter_folder(
            "warm_start", warm_start, "pass RUN_DIR/warmstart_drafter or RUN_DIR/drafter of an earlier fit run"
        )


# ----------------------------------------------------------------------------------------------
# the objective of each stage


def module_overrides(cfg: DictConfig, stage: str) -> dict:
    """``stages.<stage>`` minus the keys of the stage itself: what overrides the objective there."""
    return {k: v for k, v in cfg.stages[stage].items() if k not in STAGE_KEYS}


def stage_module_args(cfg: DictConfig, stage: str) -> dict:
    """The module arguments of ``stage`` as set in the config: ``objective.*`` with the stage's overrides."""
    objective = OmegaConf.to_container(cfg.objective, resolve=True)
    base = {k: v for k, v in objective.items() if not k.startswith("_")}  # drop _target_ / _partial_
    return {**base, **module_overrides(cfg, stage), "stage": stage}


def check_objective(cfg: DictConfig, stages: list[str]) -> None:
    """Validate the module arguments of every stage to run (``objective`` plus ``stages.<stage>``).

    The module of a later stage is built only after the earlier stages trained, so without this
    check a bad ``objective.alpha`` would fail minutes into a run.
    """
    for stage in stages:
        try:
            check_module_args(**stage_module_args(cfg, stage))
        except ValueError as e:
            raise ValueError(f"stage {stage!r} (objective.* with stages.{stage}.* overrides): {e}") from e


# ----------------------------------------------------------------------------------------------
# the held-out table


def eval_settings(cfg: DictConfig) -> dict:
    """The keyword arguments of :func:`~exittrain.heldout.decode_eval.evaluate_prompts` from
    ``cfg.eval``, every value checked (ValueError naming ``eval.<key>``).

    ``eval.decode`` (``fixed`` | ``auto``) is one of them; the evaluator reads it
    (:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`). ``eval.drafter_temperature`` (a finite
    number > 0; 1.0 the drafter as trained) divides the drafter's logits before every tree is built;
    ``eval.decode=auto`` takes 1.0 only (its probe drafts from the drafter as trained).
    ``eval.vllm`` (``auto`` | ``true`` | ``false``) is checked here (:func:`vllm_mode`), so that a typo
    fails before anything loads, but is not an argument of ``evaluate_prompts``: fit takes it from
    :attr:`FitSettings.vllm`.

    The values come from conf/eval/default.yaml alone (the one source of their defaults, which the
    tests compare with the code's; a dataclass beside it would be a second copy): a missing key is a
    ValueError naming it."""
    e = cfg.eval
    require_keys(e, "eval", EVAL_KEYS, "conf/eval/default.yaml")
    _check_int(e.num_prompts, "eval.num_prompts", 1, "held-out prompts to decode")
    _check_int(e.max_new_tokens, "eval.max_new_tokens", 1, "tokens decoded per prompt")
    budgets, temperatures = list(e.budgets), list(e.temperatures)
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"eval.budgets={budgets}: need a non-empty list of integers >= 1 (draft nodes per round)")
    if not temperatures or any(
        isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0 for t in temperatures
    ):
        raise ValueError(f"eval.temperatures={temperatures}: need a non-empty list of numbers >= 0 (0 = greedy)")
    if len(set(map(float, temperatures))) != len(temperatures):
        raise ValueError(f"eval.temperatures={temperatures}: list each temperature once")
    if e.verifier == "greedy" and any(t > 0 for t in temperatures):
        raise ValueError(f"eval.verifier=greedy with eval.temperatures={temperatures}: the greedy verifier decodes at "
                         "T = 0 only; use eval.verifier=tev (exact at every temperature) or eval.temperatures=[0.0]")
    if e.verifier not in VERIFIERS:
        raise ValueError(f"eval.verifier={e.verifier!r}: use one of {sorted(VERIFIERS)}")
    for key in ("baseline", "oracle"):
        if not isinstance(e[key], bool):
            raise ValueError(f"eval.{key}={e[key]!r}: need true or false")
    decode = e.decode
    if decode not in DECODE_MODES:
        raise ValueError(f"eval.decode={decode!r}: use auto (probe this host's fastest budget, draft vocabulary and "
                         "copy tail for the speed columns) or fixed (decode at eval.budgets only)")
    drafter_temperature = check_eval_drafter_temperature(e.drafter_temperature, auto=decode == "auto")
    vllm_mode(cfg)
    return dict(
        budgets=budgets,
        temperatures=[float(t) for t in temperatures],
        max_new_tokens=int(e.max_new_tokens),
        verifier=e.verifier,
        baseline=bool(e.baseline),
        oracle=bool(e.oracle),
        seed=int(cfg.seed),
        decode=decode,
        drafter_temperature=drafter_temperature,
    )


def vllm_mode(cfg: DictConfig) -> str:
    """``eval.vllm`` lower-cased, one of ``auto`` | ``true`` | ``false`` (Hydra reads true/false as
    booleans); ValueError naming the key otherwise or when it is missing. The one reading of the key:
    :func:`eval_settings` checks it and fit runs vLLM by it (:attr:`FitSettings.vllm`)."""
    require_keys(cfg.eval, "eval", ("vllm",), "conf/eval/default.yaml")
    mode = str(cfg.eval.vllm).lower()
    if mode not in VLLM_MODES:
        raise ValueError(f"eval.vllm={cfg.eval.vllm!r}: use auto (vLLM's acceptance when .venv-vllm exists), "
                         "true (required) or false (off)")
    return mode


# ----------------------------------------------------------------------------------------------
# callbacks and data


def check_callbacks(cfg: DictConfig) -> None:
    """Build every ``callbacks.*`` node once, with stand-in run-time arguments, so that each
    constructor checks its own values now (ValueError naming ``callbacks.<name>``)."""
    for name, node in cfg.callbacks.items():
        if node is None:
            continue
        node = OmegaConf.to_container(node, resolve=True)
        try:
            if name == "decode_eval":
                _check_int(node.pop("num_prompts"), "num_prompts", 1, "held-out prompts of the decode check")
                instantiate(node)(prompts=list)  # prompts: a function, called only once training runs
            else:
                instantiate(node)
        except ValueError as e:
            raise ValueError(f"callbacks.{name}: {e}") from e
        except Exception as e:  # a missing class, an unknown argument: Hydra's own error, with the key
            raise ValueError(f"callbacks.{name} cannot be built ({type(e).__name__}: {e}); fix or remove it") from e


def check_data(cfg: DictConfig) -> None:
    """``data.*`` checked as the DataModule will read it (no tokenizer, no target, no prompts read):
    unknown keys, the prompt sample, the generation settings, the corpus rows' sources and count, and the
    loader's sizes."""
    # cache_dir is left out: a path, nothing to check, and it may name Hydra's run-time folders,
    # which a config composed outside a Hydra run cannot resolve
    data = {}
    for key in cfg.data:
        if key != "cache_dir":
            value = cfg.data[key]  # resolved in place: its interpolations see the whole config
            data[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    generation = data.get("generation")
    if isinstance(generation, dict) and generation.get("dtype") == AUTO:
        # valid as it is; resolving it would time this host and remember the choice in a cache folder
        data["generation"] = {**generation, "dtype": None}
    try:
        PromptPlan.from_data_args(data)
        check_corpus_settings(data.get("corpus_sources"), data.get("max_corpus_rows"))
        check_loader_settings(**{k: data[k] for k in ("max_length", "batch_size", "val_fraction") if k in data})
    except (ValueError, TypeError) as e:
        raise ValueError(f"data: {e}") from e


# ----------------------------------------------------------------------------------------------
# the trainer's precision


def check_trainer_precision(cfg: DictConfig) -> None:
    """``trainer.precision`` as the Trainer will take it: ``auto`` or a Lightning value
    (:func:`exittrain.precision.lightning_precision`), and under a ``ModelParallelStrategy``
    (``trainer=fsdp``) one that strategy accepts, so ``16-mixed`` stops here and not when the first
    stage builds its Trainer (:func:`exittrain.precision.check_sharded_precision`). ``auto`` is
    decided later, on the run's device (:func:`exittrain.lit.trainer.build_trainer`); an unset
    precision is Lightning's ``32-true``, which every strategy takes."""
    precision = cfg.trainer.get("precision")
    if precision is None:
        return
    if precision != AUTO:
        lightning_precision(precision)
    try:
        sharded = is_model_parallel(cfg.trainer.get("strategy"))
    except Exception as e:  # a _target_ that does not import: Hydra's error, with the key
        raise ValueError(f"trainer.strategy cannot be resolved ({type(e).__name__}: {e}); fix its _target_, or pick "
                         "trainer=ddp or trainer=fsdp") from e
    if sharded:
        check_sharded_precision(precision)  # auto passes
