"""`fit` as a library function: the run itself, from a composed ``fit`` config.

:func:`fit` takes a composed ``fit`` config (conf/fit.yaml with its groups and a recipe) and
runs, in order:

1. the checks (:func:`exittrain.settings.check_fit_config`): which stages run, and every setting
   the run reads, before anything loads;
2. the target, the drafter (fresh, or ``warm_start``) and the data, regenerated on rank 0
   (:mod:`exittrain.build`);
3. per stage (``pretrain``: block cross-entropy, the warm start; ``exittrain``: block CE plus
   the exit-guided node loss): its module, callbacks, logger and trainer, the training, and a
   held-out evaluation (:mod:`exittrain.heldout`);
4. the exported drafter, the tree example and ``metrics.json`` (:class:`~exittrain.run_dir.RunDir`).

With several processes every rank trains; global rank 0 alone regenerates, evaluates and writes,
and the other ranks return the summary without tables once training ends.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from exittrain import progress
from exittrain.build import (
    TargetArg,
    build_callbacks,
    build_datamodule,
    build_drafter,
    build_module,
    build_target,
    prepare_data,
)
from exittrain.decoding.draft_vocab import count_answer_tokens, save_token_counts
from exittrain.export import export_beside
from exittrain.heldout.decode_eval import evaluate_prompts, format_table, summarize
from exittrain.heldout.heldout_law import format_differences, held_out_law
from exittrain.heldout.tree_example import tree_example
from exittrain.lit import full_drafter, save_drafter
from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.lit.run_logging import close_logger, global_rank, log_table, make_logger, seed_everything
from exittrain.lit.train_steps import scalar_metrics, train_steps
from exittrain.models.dflash_format import load_dflash
from exittrain.run_dir import STAGE_LABELS, RunDir
from exittrain.settings import check_fit_config

__all__ = ["fit", "FitRun", "setup_run", "train_stage", "evaluate_held_out", "finish_run"]


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
    run_dir = RunDir(cfg.paths.output_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    checked = check_fit_config(cfg)  # every setting, before anything loads
    stages, settings = checked.stages, checked.eval
    started = time.perf_counter()

    target = build_target(cfg, target)
    drafter = build_drafter(cfg, target)
    datamodule = build_datamodule(cfg, target, drafter.config.target_layer_ids, stages)
    prepare_data(datamodule, wait_s=cfg.data_wait_s)
    eval_prompts = datamodule.eval_prompts(max(cfg.eval.num_prompts, cfg.callbacks.decode_eval.num_prompts))
    run = FitRun(
        cfg=cfg, stages=stages, settings=settings, run_dir=run_dir, target=target, drafter=drafter,
        datamodule=datamodule, eval_prompts=eval_prompts, started=started, full=drafter,
    )
    run.law = held_out_law(target, eval_prompts[: cfg.eval.num_prompts], checked.analytic,
                           max_new_tokens=settings["max_new_tokens"], seed=settings["seed"])
    run.summary = {"recipe": cfg.recipe_name, "stages": stages, "target": target.name, "tables": {}}
    run.timings["regeneration_and_setup_s"] = time.perf_counter() - started
    return run


def evaluate_held_out(run: FitRun, label: str, drafter=None) -> list[dict]:
    """Decode the held-out prompts with ``drafter`` (default ``run.full``); records the table and
    writes ``eval_<label>.json``.

    Global rank 0's work: the other ranks go on to the next stage and wait for rank 0 in its first
    collective (the evaluation must finish within the process group's timeout, 30 min by default)."""
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
    cfg = run.cfg
    label = STAGE_LABELS[stage]
    logger = make_logger(cfg, f"{cfg.recipe_name}-{stage}")
    try:
        if stage == "exittrain" and "warm_start" not in run.summary["tables"] and global_rank() == 0:
            log_table(logger, "final/warm_start", evaluate_held_out(run, "warm_start"))
        module = build_module(run.cfg, stage, run.drafter, run.target)
        callbacks = build_callbacks(cfg, stage, run.eval_prompts, run.run_dir.path, cfg.stages[stage].get("eval_every"))
        t0 = time.perf_counter()
        trainer = train_steps(
            module,
            run.datamodule,
            steps=cfg.stages[stage].max_steps,
            trainer_cfg=cfg.trainer,
            ckpt_path=cfg.ckpt_path if (cfg.ckpt_path is not None and stage == run.stages[0]) else None,
            callbacks=callbacks,
            logger=logger if logger is not None else False,
            plugins=[AtomicCheckpointIO()],  # temp file + fsync + rename: a kill never tears a checkpoint
            **({} if progress.interactive() else {"enable_progress_bar": False}),  # log lines, not a bar
        )
        # trainer=fsdp left the drafter sharded (the next stage trains it so): every rank gathers it,
        # rank 0 gets a full copy and the others None; unsharded this is the drafter itself, no copy
        run.full = full_drafter(run.drafter, run.target)
        run.timings[f"{stage}_s"] = time.perf_counter() - t0
        run.summary[f"{stage}_metrics"] = scalar_metrics(trainer)
        if global_rank() == 0:
            log_table(logger, f"final/{label}", evaluate_held_out(run, label))
    finally:
        close_logger(logger)


def finish_run(run: FitRun) -> dict:
    """Rank 0: export the drafter, write the tree example and ``metrics.json``, print the tables."""
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
    run = setup_run(cfg, target)
    for stage in run.stages:
        train_stage(run, stage)
    if global_rank() != 0:
        return run.summary  # this rank trained its share; rank 0 exports, evaluates and writes
    return finish_run(run)

