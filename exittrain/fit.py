"""`fit` as a library function: the stage plan, the objects each stage needs, and the run loop.

:func:`fit` takes a composed ``fit`` config (conf/fit.yaml with its groups and a recipe) and
runs, in order:

1. the plan (:func:`plan_stages`, :func:`check_objective`): which stages run, and every stage's
   module arguments checked, before anything is built;
2. the target (``cfg.target``, or the ``target`` argument: a built one, or a function that builds
   it), the drafter (fresh, or ``warm_start``) and the data (:func:`fit_datamodule`,
   :func:`prepare_data`);
3. per stage (``pretrain``: block cross-entropy, the warm start; ``exittrain``: block CE plus
   the exit-guided node loss): its module, callbacks, logger and trainer, the training, and a
   held-out evaluation;
4. the exported drafter, the tree example and ``metrics.json`` (:class:`~exittrain.run_dir.RunDir`).

With several processes every rank trains; global rank 0 alone regenerates, evaluates and writes,
and the other ranks return the summary without tables once training ends. Objects are built
with ``hydra.utils.instantiate``; each config group mirrors one constructor, and the runtime
objects (the target, the drafter, the prompts) are passed at the call site.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from exittrain import progress
from exittrain.objective import STAGES
from exittrain.run_dir import DRAFTER_DIRS, STAGE_LABELS, RunDir

__all__ = [
    "fit",
    "plan_stages",
    "check_objective",
    "module_overrides",
    "stage_module_args",
    "analytic_settings",
    "eval_settings",
    "require_drafter_folder",
    "build_target",
    "build_drafter",
    "fit_datamodule",
    "prepare_data",
    "build_callbacks",
    "build_module",
    "FitRun",
    "setup_run",
    "train_stage",
    "evaluate_held_out",
    "finish_run",
]

log = logging.getLogger("exittrain")

# keys of stages.<stage> that configure the stage itself; every other key overrides the objective
STAGE_KEYS = ("max_steps", "eval_every")
# what to do about a ckpt_path that cannot be resumed from (exittrain.safe_io adds the file and the cause)
CKPT_FIX = (
    "point ckpt_path at another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt of an "
    "earlier run), or leave ckpt_path unset to re-run the stage from its start"
)

TargetArg = Any  # a TargetModel, a function returning one, or None (build cfg.target)


# ----------------------------------------------------------------------------------------------
# the plan: validated before anything is built


def _check_stage_settings(cfg: DictConfig) -> None:
    unknown = set(cfg.stages) - set(STAGES)
    if unknown:
        raise ValueError(f"stages has unknown entries {sorted(unknown)}; use {list(STAGES)}")
    for name in STAGES:
        steps = cfg.stages[name].max_steps
        if not isinstance(steps, int) or steps < 0:
            raise ValueError(f"stages.{name}.max_steps={steps!r} must be an integer >= 0")
        every = cfg.stages[name].get("eval_every")
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 0):
            raise ValueError(
                f"stages.{name}.eval_every={every!r}: need an int >= 0 (a decode check and a checkpoint every N "
                "steps; 0 = one decode check at the stage's end and no periodic checkpoint) or null (the "
                "callbacks' own settings)"
            )


def _resumed_stage(ckpt_path: str) -> str:
    """The stage recorded in a checkpoint; the whole file is read here, so a bad file fails now, in
    our words, and not in Lightning's own load after the target and the data are ready."""
    from exittrain.safe_io import load_checkpoint

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

    Called before the target loads: the module of a later stage is built only after the earlier
    stages trained, so without this check a bad ``objective.alpha`` would fail minutes into a run.
    """
    from exittrain.lit.module import check_module_args

    for stage in stages:
        try:
            check_module_args(**stage_module_args(cfg, stage))
        except ValueError as e:
            raise ValueError(f"stage {stage!r} (objective.* with stages.{stage}.* overrides): {e}") from e


def eval_settings(cfg: DictConfig) -> dict:
    """The keyword arguments of :func:`~exittrain.eval.decode_eval.evaluate_prompts` from ``cfg.eval``."""
    e = cfg.eval
    if e.num_prompts < 1:
        raise ValueError(f"eval.num_prompts={e.num_prompts} must be >= 1")
    return dict(
        budgets=list(e.budgets),
        temperatures=list(e.temperatures),
        max_new_tokens=int(e.max_new_tokens),
        verifier=e.verifier,
        baseline=bool(e.baseline),
        oracle=bool(e.oracle),
        seed=int(cfg.seed),
    )


def analytic_settings(cfg: DictConfig) -> tuple[list[float], int]:
    """``(eval.analytic_temperatures, eval.analytic_anchors)``, checked (ValueError naming the key)."""
    from exittrain.eval.analytic_table import check_analytic_settings

    temperatures = list(cfg.eval.get("analytic_temperatures") or [])
    anchors = cfg.eval.get("analytic_anchors", 16)
    check_analytic_settings(temperatures, anchors)
    return temperatures, anchors


def held_out_law(cfg: DictConfig, target, prompts: list[list[int]]):
    """The :class:`~exittrain.eval.analytic_table.HeldOutLaw` of ``cfg.eval.analytic_temperatures``
    on ``prompts`` (None when the list is empty): analytic tau beside the decoded tau."""
    from exittrain.eval.analytic_table import HeldOutLaw

    temperatures, anchors = analytic_settings(cfg)
    if not temperatures:
        return None
    return HeldOutLaw(target, prompts, temperatures, anchors_per_answer=anchors,
                      max_new_tokens=int(cfg.eval.max_new_tokens), seed=int(cfg.seed))


# ----------------------------------------------------------------------------------------------
# construction


def build_target(cfg: DictConfig, target: TargetArg = None):
    """``target`` when given (a built target, or a function that builds one), else ``cfg.target`` built."""
    if target is None:
        return instantiate(cfg.target)
    return target() if callable(target) else target


def build_drafter(cfg: DictConfig, target):
    """The drafter to train: ``warm_start`` loaded, else a fresh one from ``cfg.drafter``.

    Built before the data, so bad ``drafter.*`` settings or a warm start saved for another target
    fail in seconds, not after the regeneration."""
    from exittrain.models import load_drafter

    if cfg.warm_start is not None:
        return load_drafter(cfg.warm_start, target)
    return instantiate(cfg.drafter)(target)


def fit_datamodule(cfg: DictConfig, target, drafter_layers: list[int], stages: list[str]):
    """The run's DataModule (``cfg.data``), asking the regeneration to keep what training reads.

    With the feature cache on, the regeneration keeps the target features of ``drafter_layers``
    as it answers (no training row then needs a target forward of its own); when one of
    ``stages`` trains on soft labels, also the target's top-k next-token log-probabilities. The
    DataModule's store holds them in host memory with the feature cache on, and reads them per
    batch from the cache entry with it off (the setting for data larger than host memory).
    """
    args = [stage_module_args(cfg, stage) for stage in stages]
    top_k = max((a.get("soft_label_top_k", 0) for a in args if a.get("soft_label_weight", 0) > 0), default=0)
    return instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer),
        tokenizer=target.tokenizer,
        target_name=target.name,
        feature_layers=list(drafter_layers) if cfg.objective.feature_cache else None,
        top_logprobs=top_k,
        feature_store="memory" if cfg.objective.feature_cache else "disk",
        device=str(target.device),
    )


def prepare_data(datamodule, *, wait_s: float, poll_s: float = 10.0) -> None:
    """Regenerate the data on global rank 0; every other rank waits for the complete cache entry.

    Under Lightning's own launcher ranks >= 1 start inside ``trainer.fit``, after rank 0 got
    here, and find the entry at once. torchrun and srun start every rank together: only one
    process may write a cache key (two would race on its shards and its final rename, see
    exittrain/data/regenerate.py), so the others poll for the folder with the entry's final name,
    which exists only once complete, for up to ``wait_s`` seconds (``data_wait_s``). Rank 0 is
    the writer rather than each node's local rank 0 for the same reason: ``data.cache_dir`` must
    then be on a file system every node sees, like ``hydra.run.dir``.
    """
    from exittrain.lit.run_logging import global_rank

    rank = global_rank()
    if rank == 0:
        datamodule.prepare_data()  # regeneration (cached) before any training, with its progress bar
        return
    path = datamodule.cache_path
    deadline = time.monotonic() + wait_s
    if not path.is_dir():
        log.info("rank %d: waiting up to %g s for global rank 0 to regenerate %s", rank, wait_s, path)
    while not path.is_dir():
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"rank {rank}: no regenerated data at {path} after data_wait_s={wait_s:g} s; global rank 0 writes it. "
                "Fill the cache first with one process and the same data.* and target (docs/multi_gpu.md, "
                "Launching), or raise data_wait_s; with several nodes, data.cache_dir must be on a shared file system"
            )
        time.sleep(poll_s)


def build_callbacks(
    cfg: DictConfig, stage: str, eval_prompts: list[list[int]], out: Path, eval_every: int | None = None
) -> list:
    """The stage's callbacks; ``eval_every`` (``stages.<stage>.eval_every``), when set, replaces the
    decode check's ``every_n_steps`` and the checkpoint's ``every_n_train_steps`` for this stage.

    Progress (unless ``trainer.enable_progress_bar`` is false): the stage's bar on a terminal, else
    progress lines in the log (:class:`~exittrain.lit.ProgressLogCallback`; no bar draws into a file),
    and then :func:`train_stage` switches Lightning's own bar off."""
    from exittrain.lit import ExportDrafterCallback, MetricsFileCallback, ProgressLogCallback, stage_progress_bar

    callbacks = []
    for name, node in cfg.callbacks.items():
        if node is None:
            continue
        if name == "decode_eval":
            node = OmegaConf.to_container(node, resolve=True)
            n = node.pop("num_prompts")
            if eval_every is not None:
                node["every_n_steps"] = eval_every
            callbacks.append(instantiate(node)(prompts=eval_prompts[:n]))
        elif name == "checkpoint":
            extra = {} if eval_every is None else {"every_n_train_steps": eval_every}
            callbacks.append(instantiate(node, dirpath=str(out / "checkpoints" / stage), **extra))
        else:
            callbacks.append(instantiate(node))
    callbacks.append(ExportDrafterCallback(out, name=DRAFTER_DIRS[stage]))
    callbacks.append(MetricsFileCallback(out, stage))
    if cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar when it is switched off
        callbacks.append(stage_progress_bar(stage) if progress.interactive() else ProgressLogCallback(stage))
    return callbacks


def build_module(cfg: DictConfig, stage: str, drafter, target):
    """The stage's LightningModule: ``cfg.objective`` with the stage's overrides."""
    return instantiate(cfg.objective)(drafter=drafter, target=target, stage=stage, **module_overrides(cfg, stage))


# ----------------------------------------------------------------------------------------------
# the run loop


@dataclass
class FitRun:
    """What the stages of one fit share: the built objects, the held-out prompts and what is recorded.

    ``full`` is what rank 0 evaluates and saves: the drafter itself, or after a ``trainer=fsdp``
    stage its gathered copy. ``ar_cache`` holds one autoregressive baseline per prompt, so both
    held-out tables share their denominator. ``law`` (or None) gives the analytic tau at
    ``eval.analytic_temperatures``; ``analytic`` keeps each table's per-anchor values, for the
    paired differences against the warm start.
    """

    cfg: DictConfig
    stages: list[str]
    settings: dict
    run_dir: RunDir
    target: Any
    drafter: Any
    datamodule: Any
    eval_prompts: list[list[int]]
    started: float
    full: Any = None
    summary: dict = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    ar_cache: dict = field(default_factory=dict)
    law: Any = None
    analytic: dict = field(default_factory=dict)


def setup_run(cfg: DictConfig, target: TargetArg = None) -> FitRun:
    """Validate the config, then build the target, the drafter and the data (regenerated on rank 0)."""
    from exittrain.lit.run_logging import seed_everything

    run_dir = RunDir(cfg.paths.output_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    stages = plan_stages(cfg)
    settings = eval_settings(cfg)
    analytic_settings(cfg)  # checked before anything loads
    check_objective(cfg, stages)
    started = time.perf_counter()

    target = build_target(cfg, target)
    drafter = build_drafter(cfg, target)
    datamodule = fit_datamodule(cfg, target, drafter.config.target_layer_ids, stages)
    prepare_data(datamodule, wait_s=cfg.data_wait_s)
    eval_prompts = datamodule.eval_prompts(max(cfg.eval.num_prompts, cfg.callbacks.decode_eval.num_prompts))
    run = FitRun(
        cfg=cfg, stages=stages, settings=settings, run_dir=run_dir, target=target, drafter=drafter,
        datamodule=datamodule, eval_prompts=eval_prompts, started=started, full=drafter,
    )
    run.law = held_out_law(cfg, target, eval_prompts[: cfg.eval.num_prompts])
    run.summary = {"recipe": cfg.recipe_name, "stages": stages, "target": target.name, "tables": {}}
    run.timings["regeneration_and_setup_s"] = time.perf_counter() - started
    return run


def evaluate_held_out(run: FitRun, label: str, drafter=None) -> list[dict]:
    """Decode the held-out prompts with ``drafter`` (default ``run.full``); records the table and
    writes ``eval_<label>.json``.

    Global rank 0's work: the other ranks go on to the next stage and wait for rank 0 in its first
    collective (the evaluation must finish within the process group's timeout, 30 min by default)."""
    from exittrain.eval.decode_eval import evaluate_prompts, summarize

    t0 = time.perf_counter()
    prompts = run.eval_prompts[: run.cfg.eval.num_prompts]
    drafter = run.full if drafter is None else drafter
    rows = evaluate_prompts(run.target, drafter, prompts, label=label, ar_cache=run.ar_cache, **run.settings)
    table = summarize(rows)
    if run.law is not None:
        run.analytic[label] = run.law.measure(drafter, run.settings["budgets"])
        run.law.attach(table, run.analytic[label], None if label == "warm_start" else run.analytic.get("warm_start"))
    run.summary["tables"][label] = table
    run.run_dir.write_eval_rows(label, rows)
    run.timings[f"eval_{label}_s"] = time.perf_counter() - t0
    return table




def train_stage(run: FitRun, stage: str) -> None:
    """One stage: (on rank 0, a given or resumed warm start's evaluation first), training, evaluation."""
    from exittrain.lit import full_drafter
    from exittrain.lit.checkpoint_io import AtomicCheckpointIO
    from exittrain.lit.run_logging import close_logger, global_rank, log_table, make_logger
    from exittrain.lit.trainer import build_trainer

    cfg = run.cfg
    label = STAGE_LABELS[stage]
    logger = make_logger(cfg, f"{cfg.recipe_name}-{stage}")
    try:
        if stage == "exittrain" and "warm_start" not in run.summary["tables"] and global_rank() == 0:
            log_table(logger, "final/warm_start", evaluate_held_out(run, "warm_start"))
        module = build_module(run.cfg, stage, run.drafter, run.target)
        callbacks = build_callbacks(cfg, stage, run.eval_prompts, run.run_dir.path, cfg.stages[stage].get("eval_every"))
        trainer = build_trainer(
            cfg.trainer,
            max_steps=cfg.stages[stage].max_steps,
            callbacks=callbacks,
            logger=logger if logger is not None else False,
            plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename: a kill never tears a checkpoint
            **({} if progress.interactive() else {"enable_progress_bar": False}),  # log lines, not a bar
        )
        t0 = time.perf_counter()
        ckpt = cfg.ckpt_path if (cfg.ckpt_path is not None and stage == run.stages[0]) else None
        trainer.fit(module, datamodule=run.datamodule, ckpt_path=ckpt)
        # trainer=fsdp left the drafter sharded (the next stage trains it so): every rank gathers it,
        # rank 0 gets a full copy and the others None; unsharded this is the drafter itself, no copy
        run.full = full_drafter(run.drafter, run.target)
        run.timings[f"{stage}_s"] = time.perf_counter() - t0
        run.summary[f"{stage}_metrics"] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
        }
        if global_rank() == 0:
            log_table(logger, f"final/{label}", evaluate_held_out(run, label))
    finally:
        close_logger(logger)


def finish_run(run: FitRun) -> dict:
    """Rank 0: export the drafter, write the tree example and ``metrics.json``, print the tables."""
    from exittrain.decoding.draft_vocab import count_answer_tokens, save_token_counts
    from exittrain.eval.analytic_table import format_differences
    from exittrain.eval.decode_eval import format_table
    from exittrain.eval.tree_example import tree_example
    from exittrain.export import export_beside
    from exittrain.lit import save_drafter

    out = run.run_dir
    drafter_dir = out.drafter_path("exittrain")
    save_drafter(run.full, drafter_dir)
    # the answer tokens by frequency, from which a decoder takes its draft vocabulary
    save_token_counts(drafter_dir, count_answer_tokens(run.datamodule.answer_token_rows()),
                      source=str(run.datamodule.cache_path))
    exported = export_beside(run.full, out.path, run.target)  # the served format, beside drafter/ (or why not)
    run.summary["drafter_dflash"] = exported
    if exported["path"] and exported["dropped"]:
        # what a serving engine keeps of the drafter (no copy branch): its tau beside the full drafter's
        from exittrain.models.dflash_format import load_dflash

        evaluate_held_out(run, "served", load_dflash(exported["path"], run.target))
    budget = max(run.settings["budgets"])
    out.write_tree_example(tree_example(run.target, run.full, run.eval_prompts[0], budget=budget))
    run.timings["total_s"] = time.perf_counter() - run.started
    run.summary["timings"] = run.timings
    run.summary["drafter"] = str(drafter_dir)
    out.write_fit_summary(run.summary)
    tables = [row for table in run.summary["tables"].values() for row in table]
    print("\nHeld-out decoding (tau = tokens per round, bonus included):\n" + format_table(tables))
    differences = format_differences(tables)
    if differences:
        print("\n" + "\n".join(differences))
    print(f"\nRun directory: {out.path}\nDrafter: {drafter_dir}  (python -m exittrain eval drafter={drafter_dir})")
    return run.summary


def fit(cfg: DictConfig, *, target: TargetArg = None) -> dict:
    """Regenerate the data, warm start (pretrain), ExitTrain, then the final block-length tables.

    ``target``: a built :class:`~exittrain.models.TargetModel`, or a function that returns one
    (called once the config is validated), instead of building ``cfg.target``. Returns the summary
    that ``metrics.json`` holds; on ranks other than 0 it has no tables and nothing is written.
    """
    from exittrain.lit.run_logging import global_rank

    run = setup_run(cfg, target)
    for stage in run.stages:
        train_stage(run, stage)
    if global_rank() != 0:
        return run.summary  # this rank trained its share; rank 0 exports, evaluates and writes
    return finish_run(run)

