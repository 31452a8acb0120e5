"""The one Hydra entry point: `fit` and `eval` (see exittrain/__main__.py for the command word).

Objects are built with ``hydra.utils.instantiate`` from the config groups in conf/; every group
file mirrors one constructor and runtime objects (the target, the drafter, the prompts) are
passed at the call site. Recipes live in the top-level recipes/ folder, which Hydra cannot see
by itself: they are registered in the ConfigStore as the ``recipe`` group before Hydra starts,
so ``+recipe=code`` works exactly as typed. Every output goes to Hydra's run directory.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from exittrain import progress
from exittrain.host_memory import keep_freed_host_memory
from exittrain.lit.callbacks import write_json_atomic

log = logging.getLogger("exittrain")

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
RECIPES_DIR = REPO_ROOT / "recipes"
STAGE_ORDER = ("pretrain", "exittrain")
# keys of stages.<stage> that configure the stage itself; every other key overrides the objective
STAGE_KEYS = ("max_steps", "eval_every")
# what to do about a ckpt_path that cannot be resumed from (exittrain.safe_io adds the file and the cause)
CKPT_FIX = (
    "point ckpt_path at another checkpoint written by exittrain (RUN_DIR/checkpoints/<stage>/last.ckpt of an "
    "earlier run), or leave ckpt_path unset to re-run the stage from its start"
)


def register_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Store every recipes/*.yaml as option NAME of the ``recipe`` group (package _global_)."""
    cs = ConfigStore.instance()
    names = []
    for path in sorted(recipes_dir.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
        names.append(path.stem)
    return names


# ----------------------------------------------------------------------------------------------
# shared pieces


def _output_dir(cfg: DictConfig) -> Path:
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _eval_settings(cfg: DictConfig) -> dict:
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


def _global_rank() -> int:
    """This process's global rank, as Lightning's ``rank_zero_only`` (and so every logger) sees it.

    Lightning reads it from the launcher's environment at import (``RANK`` under torchrun,
    ``LOCAL_RANK`` in the processes its own launcher starts on one node, ``SLURM_PROCID`` under
    srun; 0 in a plain process) and sets it to the strategy's global rank when a Trainer is
    built. It is therefore right before the first Trainer exists too, where ``run_fit`` needs it
    (the logger, the data, a given warm start's evaluation).
    """
    from lightning.pytorch.utilities import rank_zero_only

    return rank_zero_only.rank


def _make_logger(cfg: DictConfig, run_name: str):
    """The configured logger for one stage; W&B gets max/last summaries for block length."""
    if cfg.get("logger") is None:
        return None
    kwargs = {}
    if "WandbLogger" in str(cfg.logger.get("_target_", "")):
        kwargs["name"] = run_name
        os.environ.setdefault("WANDB_SILENT", "true")
    logger = instantiate(cfg.logger, **kwargs)
    # The W&B run exists on global rank 0 only: on the other ranks `experiment` is Lightning's
    # dummy, whose `config` is a method, so `config.update` would raise AttributeError there.
    if "WandbLogger" in type(logger).__name__ and _global_rank() == 0:
        exp = logger.experiment
        exp.define_metric("val/block_length", summary="max")
        exp.define_metric("val/analytic_block_length", summary="max")
        exp.define_metric("val/greedy_block_length", summary="max")
        exp.define_metric("train/analytic_block_length", summary="last")
        exp.config.update(OmegaConf.to_container(cfg, resolve=True), allow_val_change=True)
    return logger


def _close_logger(logger) -> None:
    if logger is not None and "WandbLogger" in type(logger).__name__:
        import wandb

        wandb.finish()


def _log_table(logger, name: str, table: list[dict]) -> None:
    if logger is None:
        return
    flat = {}
    for row in table:
        key = f"{name}/B{row['budget']}_T{row['temperature']:g}"
        flat[f"{key}/tau"] = row["tau"]
        for extra in ("tau_oracle", "speedup", "tokens_per_s"):
            if extra in row:
                flat[f"{key}/{extra}"] = row[extra]
    logger.log_metrics(flat)


def _write_tree_example(target, drafter, prompt: list[int], budget: int, out: Path) -> None:
    """One real draft tree with its exit law, for `report`'s tree plot."""
    from exittrain.eval.tree_example import save_tree_example, tree_example

    save_tree_example(tree_example(target, drafter, prompt, budget=budget), out / "tree_example.json")


# ----------------------------------------------------------------------------------------------
# fit


def _stages_to_run(cfg: DictConfig) -> list[str]:
    unknown = set(cfg.stages) - set(STAGE_ORDER)
    if unknown:
        raise ValueError(f"stages has unknown entries {sorted(unknown)}; use {list(STAGE_ORDER)}")
    for name in STAGE_ORDER:
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
    stages = [s for s in STAGE_ORDER if cfg.stages[s].max_steps > 0]
    if cfg.warm_start is not None:
        _check_warm_start(str(cfg.warm_start))
    if cfg.warm_start is not None and "pretrain" in stages:
        stages.remove("pretrain")
    if cfg.ckpt_path is not None:
        from exittrain.safe_io import load_checkpoint

        # the whole file is read here, so a bad file fails now, in our words, and not later in
        # Lightning's own load (trainer.fit(ckpt_path=...)) after the target and the data are ready
        saved = load_checkpoint(cfg.ckpt_path, what="ckpt_path checkpoint", fix=CKPT_FIX).get("hyper_parameters", {})
        stage = saved.get("stage")
        if stage not in STAGE_ORDER:
            raise ValueError(f"ckpt_path={cfg.ckpt_path} records no known stage (got {stage!r})")
        stages = [s for s in stages if STAGE_ORDER.index(s) >= STAGE_ORDER.index(stage)]
    return stages


def _require_drafter_folder(key: str, value: str, fix: str) -> None:
    """ValueError ``<key>=<value> <fault>: <fix>`` unless ``value`` is a saved drafter folder (has a config.json)."""
    path = Path(value).expanduser()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "is not a saved drafter folder (no config.json in it)"
        raise ValueError(f"{key}={value} {what}: {fix}")


def _check_warm_start(warm_start: str) -> None:
    """A local ``warm_start`` must be a saved drafter folder; checked before the target loads.

    A hub id (``org/name``, not a local path) is left to the loader."""
    path = Path(warm_start).expanduser()
    local = path.exists() or path.is_absolute() or warm_start.startswith((".", "~")) or warm_start.count("/") != 1
    if local:
        _require_drafter_folder(
            "warm_start", warm_start, "pass RUN_DIR/warmstart_drafter or RUN_DIR/drafter of an earlier fit run"
        )


def _check_objective(cfg: DictConfig, stages: list[str]) -> None:
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


def module_overrides(cfg: DictConfig, stage: str) -> dict:
    """``stages.<stage>`` minus the keys of the stage itself: what overrides the objective there."""
    return {k: v for k, v in cfg.stages[stage].items() if k not in STAGE_KEYS}


def stage_module_args(cfg: DictConfig, stage: str) -> dict:
    """The module arguments of ``stage`` as set in the config: ``objective.*`` with the stage's overrides."""
    objective = OmegaConf.to_container(cfg.objective, resolve=True)
    base = {k: v for k, v in objective.items() if not k.startswith("_")}  # drop _target_ / _partial_
    return {**base, **module_overrides(cfg, stage), "stage": stage}


def fit_datamodule(cfg: DictConfig, target, drafter_layers: list[int], stages: list[str]):
    """The run's DataModule (``cfg.data``), asking the regeneration to keep what training reads.

    With the feature cache on, the regeneration keeps the target features of ``drafter_layers``
    as it answers (no training row then needs a target forward of its own); when one of
    ``stages`` trains on soft labels, also the target's top-k next-token log-probabilities.
    """
    args = [stage_module_args(cfg, stage) for stage in stages]
    top_k = max((a.get("soft_label_top_k", 0) for a in args if a.get("soft_label_weight", 0) > 0), default=0)
    return instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer),
        tokenizer=target.tokenizer,
        target_name=target.name,
        feature_layers=list(drafter_layers) if cfg.objective.feature_cache else None,
        top_logprobs=top_k,
        device=str(target.device),
    )


def _build_callbacks(
    cfg: DictConfig, stage: str, eval_prompts: list[list[int]], out: Path, eval_every: int | None = None
) -> list:
    """The stage's callbacks; ``eval_every`` (``stages.<stage>.eval_every``), when set, replaces the
    decode check's ``every_n_steps`` and the checkpoint's ``every_n_train_steps`` for this stage.

    Progress (unless ``trainer.enable_progress_bar`` is false): the stage's bar on a terminal, else
    progress lines in the log (:class:`~exittrain.lit.ProgressLogCallback`; no bar draws into a file),
    and then :func:`run_fit` switches Lightning's own bar off."""
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
    callbacks.append(ExportDrafterCallback(out, name="drafter" if stage == "exittrain" else "warmstart_drafter"))
    callbacks.append(MetricsFileCallback(out / f"metrics_{stage}.json"))
    if cfg.trainer.get("enable_progress_bar", True):  # Lightning refuses a bar when it is switched off
        callbacks.append(stage_progress_bar(stage) if progress.interactive() else ProgressLogCallback(stage))
    return callbacks


def _prepare_data(datamodule, *, wait_s: float, poll_s: float = 10.0) -> None:
    """Regenerate the data on global rank 0; every other rank waits for the complete cache entry.

    Under Lightning's own launcher ranks >= 1 start inside ``trainer.fit``, after rank 0 got
    here, and find the entry at once. torchrun and srun start every rank together: only one
    process may write a cache key (two would race on its shards and its final rename, see
    exittrain/data/regenerate.py), so the others poll for the folder with the entry's final name,
    which exists only once complete, for up to ``wait_s`` seconds (``data_wait_s``). Rank 0 is
    the writer rather than each node's local rank 0 for the same reason: ``data.cache_dir`` must
    then be on a file system every node sees, like ``hydra.run.dir``.
    """
    rank = _global_rank()
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


def run_fit(cfg: DictConfig) -> dict:
    """Regenerate data, warm start (pretrain), ExitTrain, then the final block-length table.

    With several processes every rank trains; global rank 0 alone regenerates, evaluates and
    writes, and the other ranks return the summary without tables once training ends.
    """
    import lightning as L

    from exittrain.eval.decode_eval import evaluate_prompts, format_table, summarize
    from exittrain.lit import full_drafter, save_drafter
    from exittrain.lit.checkpoint_io import AtomicCheckpointIO
    from exittrain.lit.trainer import build_trainer
    from exittrain.models import load_drafter

    out = _output_dir(cfg)
    L.seed_everything(cfg.seed, workers=True)
    stages = _stages_to_run(cfg)
    settings = _eval_settings(cfg)
    _check_objective(cfg, stages)
    started = time.perf_counter()

    target = instantiate(cfg.target)
    # the drafter before the data: bad drafter.* settings or a warm start saved for another target
    # fail in seconds, not after the regeneration
    if cfg.warm_start is not None:
        drafter = load_drafter(cfg.warm_start, target)
    else:
        drafter = instantiate(cfg.drafter)(target)
    datamodule = fit_datamodule(cfg, target, drafter.config.target_layer_ids, stages)
    _prepare_data(datamodule, wait_s=cfg.data_wait_s)
    eval_prompts = datamodule.eval_prompts(max(cfg.eval.num_prompts, cfg.callbacks.decode_eval.num_prompts))

    # what rank 0 evaluates and saves: the drafter itself, or after a trainer=fsdp stage its gathered copy
    full = drafter
    summary: dict = {"recipe": cfg.recipe_name, "stages": stages, "target": target.name, "tables": {}}
    timings: dict[str, float] = {"regeneration_and_setup_s": time.perf_counter() - started}

    # The held-out evaluations and every file below are global rank 0's work, like the
    # callbacks' writes; ranks >= 1 go on to the next stage and wait for rank 0 in its first
    # collective (the evaluation must finish within the process group's timeout, 30 min by default).
    ar_cache: dict = {}  # one autoregressive baseline per prompt serves both tables (the same denominator)

    def evaluate(label: str) -> list[dict]:
        t0 = time.perf_counter()
        rows = evaluate_prompts(
            target, full, eval_prompts[: cfg.eval.num_prompts], label=label, ar_cache=ar_cache, **settings
        )
        table = summarize(rows)
        summary["tables"][label] = table
        write_json_atomic(out / f"eval_{label}.json", rows)
        timings[f"eval_{label}_s"] = time.perf_counter() - t0
        return table

    previous = None  # the last stage's module
    for stage in stages:
        label = "warm_start" if stage == "pretrain" else "exittrain"
        logger = _make_logger(cfg, f"{cfg.recipe_name}-{stage}")
        try:
            if stage == "exittrain" and "warm_start" not in summary["tables"] and _global_rank() == 0:
                _log_table(logger, "final/warm_start", evaluate("warm_start"))  # a given or resumed warm start
            overrides = module_overrides(cfg, stage)
            module = instantiate(cfg.objective)(drafter=drafter, target=target, stage=stage, **overrides)
            if previous is not None and previous.hparams.feature_cache and module.hparams.feature_cache:
                module.share_feature_cache(previous)  # the same rows: the ExitTrain stage reuses pretrain's features
            previous = module
            trainer = build_trainer(
                cfg.trainer,
                max_steps=cfg.stages[stage].max_steps,
                callbacks=_build_callbacks(cfg, stage, eval_prompts, out, cfg.stages[stage].get("eval_every")),
                logger=logger if logger is not None else False,
                plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename: a kill never tears a checkpoint
                **({} if progress.interactive() else {"enable_progress_bar": False}),  # log lines, not a bar
            )
            t0 = time.perf_counter()
            ckpt = cfg.ckpt_path if (cfg.ckpt_path is not None and stage == stages[0]) else None
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
            # trainer=fsdp left the drafter sharded (the next stage trains it so): every rank gathers it,
            # rank 0 gets a full copy and the others None; unsharded this is the drafter itself, no copy
            full = full_drafter(drafter, target)
            timings[f"{stage}_s"] = time.perf_counter() - t0
            summary[f"{stage}_metrics"] = {
                k: float(v) for k, v in trainer.callback_metrics.items() if getattr(v, "numel", lambda: 1)() == 1
            }
            if _global_rank() == 0:
                _log_table(logger, f"final/{label}", evaluate(label))
        finally:
            _close_logger(logger)
    if _global_rank() != 0:
        return summary  # this rank trained its share; rank 0 exports, evaluates and writes
    save_drafter(full, out / "drafter")
    from exittrain.export import export_beside

    summary["drafter_dflash"] = export_beside(full, out)  # the served format, beside drafter/ (or why not)
    _write_tree_example(target, full, eval_prompts[0], max(settings["budgets"]), out)

    timings["total_s"] = time.perf_counter() - started
    summary["timings"] = timings
    summary["drafter"] = str(out / "drafter")
    write_json_atomic(out / "metrics.json", summary)
    tables = [row for label in summary["tables"] for row in summary["tables"][label]]
    print("\nHeld-out decoding (tau = tokens per round, bonus included):\n" + format_table(tables))
    print(f"\nRun directory: {out}\nDrafter: {out / 'drafter'}  (python -m exittrain eval drafter={out / 'drafter'})")
    return summary


# ----------------------------------------------------------------------------------------------
# eval


def run_eval(cfg: DictConfig) -> dict:
    """Decode the recipe's held-out prompts with a saved drafter; write results.json/csv."""
    import csv

    from exittrain.eval.decode_eval import evaluate_prompts, format_table, summarize
    from exittrain.models import load_drafter

    path = Path(str(cfg.drafter_path))
    _require_drafter_folder("drafter", str(path), "pass drafter=RUN_DIR/drafter of a fit run")
    out = _output_dir(cfg)
    settings = _eval_settings(cfg)
    target = instantiate(cfg.target)
    drafter = load_drafter(path, target)
    datamodule = instantiate(cfg.data)(
        target=lambda: (target.model, target.tokenizer), tokenizer=target.tokenizer, target_name=target.name
    )
    prompts = datamodule.eval_prompts(cfg.eval.num_prompts)
    limit = getattr(target.config, "max_position_embeddings", None)
    for i, p in enumerate(prompts):
        if limit is not None and len(p) + settings["max_new_tokens"] + max(settings["budgets"]) + 1 > limit:
            raise ValueError(
                f"eval prompt {i} has {len(p)} tokens: with eval.max_new_tokens={settings['max_new_tokens']} it "
                f"exceeds the target's {limit} positions; lower eval.max_new_tokens"
            )
    logger = _make_logger(cfg, f"{cfg.recipe_name}-eval")
    try:
        rows = evaluate_prompts(target, drafter, prompts, label=cfg.recipe_name, **settings)
        table = summarize(rows)
        _log_table(logger, "eval", table)
    finally:
        _close_logger(logger)
    write_json_atomic(out / "results.json", {"rows": rows, "summary": table, "drafter": str(path)})
    _write_tree_example(target, drafter, prompts[0], max(settings["budgets"]), out)
    with open(out / "results.csv", "w", newline="") as f:
        flat = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
        writer = csv.DictWriter(f, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
    print(f"\n{cfg.recipe_name}: held-out decoding with {path}\n" + format_table(table))
    print(f"\nResults: {out / 'results.json'}, {out / 'results.csv'}")
    return {"rows": rows, "summary": table}


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name=None)
def _hydra_main(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    keep_freed_host_memory()  # CPU steps reuse their freed activations instead of faulting in new pages
    command = HydraConfig.get().job.config_name
    if command == "fit":
        run_fit(cfg)
    elif command == "eval":
        run_eval(cfg)
    else:
        raise ValueError(f"unknown command config {command!r}; use fit or eval")


def hydra_entry() -> None:
    register_recipes()
    _hydra_main()
