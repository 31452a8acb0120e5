"""`fit` as a library function: the run itself, from a composed ``fit`` config.

:func:`fit` takes a composed ``fit`` config (conf/fit.yaml with its groups and a recipe) and
runs, in order:

1. the checks (:func:`exittrain.settings.check_fit_config`): which stages run, and every setting
   the run reads, before anything loads;
2. the target, the drafter (fresh, or ``warm_start``) and the data (:mod:`exittrain.build`), every
   rank answering its shard of the prompts (:func:`~exittrain.build.prepare_data`; ``python -m
   exittrain prepare`` runs this step alone);
3. per stage (``pretrain``: block cross-entropy, the warm start; ``exittrain``: block CE plus
   the exit-guided node loss): its module, callbacks, logger and trainer, the training, and a
   held-out evaluation (:mod:`exittrain.heldout`);
4. the exported drafter, the tree example and ``metrics.json`` (:class:`~exittrain.run_dir.RunDir`).
   Its ``choices`` say how the settings a host decides were chosen (:func:`exittrain.build.run_choices`): the
   answers' dtype and the trainer's precision, at ``auto`` on a CPU this host type's recorded choice.

Every drafter row of the final table has two tracks: the tree track (tau of the recipe's draft tree
at ``eval.budgets``) and the serving track (:mod:`exittrain.heldout.serving_track`: the greedy chain
of K nodes a serving engine verifies, and with ``eval.vllm`` vLLM's own acceptance length of the
DFlash export). ``+serve=dflash`` (conf/serve/dflash.yaml) trains what the DFlash format holds and
makes ``drafter_dflash/`` the run's primary drafter (``metrics.json``: ``primary_drafter``).

With several processes every rank answers its shard of the data and trains; global rank 0 alone
evaluates and writes, and the other ranks return the summary without tables once training ends.
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
    run_choices,
)
from exittrain.export import export_beside
from exittrain.heldout.evaluator import HeldOutEvaluator, format_report
from exittrain.heldout.serving_track import check_servable, check_serve_config, target_folder, vllm_enabled
from exittrain.heldout.tree_example import tree_example
from exittrain.lit import full_drafter, save_drafter
from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.lit.run_logging import close_logger, global_rank, log_table, make_logger, seed_everything
from exittrain.lit.train_steps import scalar_metrics, train_steps
from exittrain.models.dflash_format import load_dflash
from exittrain.run_dir import STAGE_LABELS, RunDir, write_json_atomic
from exittrain.settings import check_fit_config
from exittrain.vllm_interpreter import default_vllm_python

__all__ = ["fit", "FitRun", "setup_run", "train_stage", "evaluate_held_out", "finish_run",
           "served_summary"]


@dataclass
class FitRun:
    """What the stages of one fit share: the built objects, the held-out prompts and what is recorded.

    ``full`` is what rank 0 evaluates and saves: the drafter itself, or after a ``trainer=fsdp``
    stage its gathered copy. ``evaluator`` measures every drafter row of the final table on the
    held-out prompts (:class:`~exittrain.heldout.evaluator.HeldOutEvaluator`, the one ``eval`` uses
    too). ``serve``: the checked ``+serve=dflash`` settings (or
    None); ``vllm_python``: the vLLM interpreter the finish runs (None: ``eval.vllm`` is off or found none);
    ``vllm_required``: ``eval.vllm=true``, where a failed vLLM run fails the fit (once metrics.json is written).
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
    evaluator: HeldOutEvaluator | None = None
    serve: dict | None = None
    vllm_python: str | None = None
    vllm_required: bool = False
    lab: Any = None
    token_counts: Any = None

    def answer_token_counts(self):
        """The answer tokens by frequency (the draft vocabulary's source), counted once per run by the
        CPU decode lab (``lab``, given at ``eval.decode=auto`` only)."""
        if self.token_counts is None:
            self.token_counts = self.lab.count_answer_tokens(self.datamodule.answer_token_rows())
        return self.token_counts


def _require_lab(settings: dict, lab) -> None:
    """ValueError, naming the fix, where ``eval.decode=auto`` is asked for without the CPU decode lab."""
    if settings["decode"] == "auto" and lab is None:
        raise ValueError(
            "eval.decode=auto needs the CPU decode lab, which fit does not import: pass "
            "fit(cfg, lab=DecodeLab()) (exittrain.cpu_decode.decode_lab; python -m exittrain fit passes it when "
            "the config asks for eval.decode=auto), or set eval.decode=fixed"
        )


def setup_run(cfg: DictConfig, target: TargetArg = None, lab=None) -> FitRun:
    """Validate the config, then build the target, the drafter and the data (each rank answers its shard).

    ``lab``: the CPU decode lab (:class:`exittrain.cpu_decode.decode_lab.DecodeLab`, or an object with
    its ``auto_probe``, ``count_answer_tokens`` and ``save_token_counts``), required by and read only
    at ``eval.decode=auto``; ValueError without it."""
    run_dir = RunDir(cfg.paths.output_dir)
    run_dir.path.mkdir(parents=True, exist_ok=True)
    seed_everything(cfg.seed)
    checked = check_fit_config(cfg)  # every setting, before anything loads
    _require_lab(checked.eval, lab)
    serve = check_serve_config(cfg)
    vllm_python = default_vllm_python()
    vllm_mode = checked.vllm  # eval.vllm as exittrain.settings.vllm_mode reads it
    vllm_python = vllm_python if vllm_enabled(vllm_mode, vllm_python) else None
    stages, settings = checked.stages, checked.eval
    started = time.perf_counter()

    target = build_target(cfg, target)
    drafter = build_drafter(cfg, target)
    if serve is not None:
        check_servable(drafter.config)  # a layer id the format refuses fails now, not after training
    datamodule = build_datamodule(cfg, target, drafter.config.target_layer_ids, stages)
    prepare_data(datamodule, wait_s=cfg.data_wait_s)
    eval_prompts = datamodule.eval_prompts(max(cfg.eval.num_prompts, cfg.callbacks.decode_eval.num_prompts))
    run = FitRun(
        cfg=cfg, stages=stages, settings=settings, run_dir=run_dir, target=target, drafter=drafter,
        datamodule=datamodule, eval_prompts=eval_prompts, started=started, full=drafter, serve=serve,
        vllm_python=vllm_python, vllm_required=vllm_mode == "true", lab=lab,
    )
    auto = None
    if settings["decode"] == "auto":  # the CPU's decode probe, asked for: it tries a draft vocabulary of the answers
        auto = lab.auto_probe(target, settings["verifier"], run.answer_token_counts())
    run.evaluator = HeldOutEvaluator(target, eval_prompts[: cfg.eval.num_prompts], settings, auto=auto)
    run.summary = {"recipe": cfg.recipe_name, "stages": stages, "target": target.name, "tables": {}, "serve": serve,
                   "choices": run_choices(cfg, datamodule)}
    run.timings["regeneration_and_setup_s"] = time.perf_counter() - started
    return run


def evaluate_held_out(run: FitRun, label: str, drafter=None) -> list[dict]:
    """Measure ``drafter`` (default ``run.full``) on the held-out prompts (``run.evaluator``,
    :meth:`~exittrain.heldout.evaluator.HeldOutEvaluator.measure`); records the table and writes
    ``eval_<label>.json`` and ``chain_<label>.json``.

    Global rank 0's work: the other ranks go on to the next stage and wait for rank 0 in its first
    collective (the evaluation must finish within the process group's timeout, 30 min by default)."""
    t0 = time.perf_counter()
    table, rows, chain = run.evaluator.measure(run.full if drafter is None else drafter, label)
    write_json_atomic(run.run_dir.path / f"chain_{label}.json", chain)  # not eval_*.json: another row layout
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
        callbacks = build_callbacks(cfg, stage, run.eval_prompts, run.run_dir.path, cfg.stages[stage].eval_every)
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
        del trainer, module  # training is over: the trainer, its loaders and the module go before the evaluation
        if stage == run.stages[-1]:  # the rows' features and soft labels: only training reads them
            run.datamodule.release_store()
        if global_rank() == 0:
            log_table(logger, f"final/{label}", evaluate_held_out(run, label))
    finally:
        close_logger(logger)


def attach_vllm(run: FitRun, dflash_dir: str, label: str) -> dict:
    """vLLM's acceptance of the DFlash export in ``dflash_dir`` on the held-out prompts, added to the
    ``label`` rows of the table (``vllm``) and logged under ``final/<label>`` by the run's logger; a
    mismatch of vLLM's outputs with and without speculation is printed as a failure."""
    table = run.summary["tables"][label]
    target_dir = target_folder(run.target, run.cfg.target.get("name_or_path"))
    result = run.evaluator.measure_vllm(table, run.vllm_python, target_dir, dflash_dir,
                                        workdir=run.run_dir.path / "vllm")
    logger = make_logger(run.cfg, f"{run.cfg.recipe_name}-serve")
    try:
        log_table(logger, f"final/{label}", table)
    finally:
        close_logger(logger)
    return result


def primary_drafter(run: FitRun, exported: dict, drafter_dir, served_label: str) -> dict:
    """``metrics.json``'s ``primary_drafter``: the folder a user ships. ``+serve=dflash``: the DFlash
    export (its table rows: ``label``); otherwise, or when the export was refused (printed with the
    reason), ``drafter/`` and the ExitTrain rows."""
    if (run.serve or {}).get("primary") == "dflash":
        if exported["path"]:
            return {"format": "dflash", "path": exported["path"], "label": served_label}
        print(f"WARNING: serve.primary=dflash but no drafter_dflash/ was written ({exported.get('why')}); "
              "the primary drafter is drafter/")
    return {"format": "exittrain", "path": str(drafter_dir), "label": "exittrain"}


def served_summary(tables: dict[str, list[dict]], label: str, exported: dict) -> dict:
    """``metrics.json``'s ``served`` block: what an engine runs of the run's drafter (``label``'s rows:
    the DFlash export, or at the default, where nothing is dropped, the drafter itself), per
    temperature its chain tau at K and its tree tau at each budget, pooled, with their 95% intervals."""
    by_temperature: dict[str, dict] = {}
    for row in tables.get(label, []):
        cell = by_temperature.setdefault(f"{row['temperature']:g}", {})
        if "chain_tau" in row:
            cell.update(chain_tau=row["chain_tau"], chain_ci95=row["chain_ci95"], chain_K=row["chain_K"])
        if "tau" in row:
            cell.setdefault("tree", {})[str(row["budget"])] = {"tau": row["tau"], "ci95": row["ci95"]}
        if "vllm" in row:
            cell["vllm_tau"] = row["vllm"]["vllm_tau"]
    return {"label": label, "dflash_path": exported.get("path"), "dropped": exported.get("dropped") or [],
            "by_temperature": by_temperature}


def finish_run(run: FitRun) -> dict:
    """Rank 0: export the drafter, write the tree example and ``metrics.json``, print the tables."""
    out = run.run_dir
    drafter_dir = out.drafter_path("exittrain")
    save_drafter(run.full, drafter_dir)
    if run.settings["decode"] == "auto":  # the answer tokens by frequency, a CPU decoder's draft vocabulary
        run.lab.save_token_counts(drafter_dir, run.answer_token_counts(), source=str(run.datamodule.cache_path))
    exported = export_beside(run.full, out.path, run.target)  # the served format, beside drafter/ (or why not)
    run.summary["drafter_dflash"] = exported
    served_label = "exittrain"  # with nothing dropped, the export is these weights: its rows are the drafter's
    if exported["path"] and exported["dropped"]:
        # what a serving engine keeps of the drafter (no copy branch): its own rows, chain and tree
        evaluate_held_out(run, "served", load_dflash(exported["path"], run.target))
        served_label = "served"
    vllm_error = None
    if exported["path"] and run.vllm_python is not None:
        try:
            attach_vllm(run, exported["path"], served_label)
        except (RuntimeError, ValueError, OSError) as e:  # vLLM's failure must not lose the run's summary
            vllm_error = f"{type(e).__name__}: {e}"
            run.summary["vllm_error"] = vllm_error
            print(f"\nWARNING: vLLM could not measure the DFlash export ({vllm_error.splitlines()[0]}); "
                  f"its logs are in {out.path / 'vllm'}")
    run.summary["primary_drafter"] = primary_drafter(run, exported, drafter_dir, served_label)
    run.summary["served"] = served_summary(run.summary["tables"], served_label, exported)
    budget = max(run.settings["budgets"])
    out.write_tree_example(tree_example(run.target, run.full, run.eval_prompts[0], budget=budget,
                                        shape=run.cfg.tree.shape))  # what the run trained on
    run.timings["total_s"] = time.perf_counter() - run.started
    run.summary["timings"] = run.timings
    run.summary["drafter"] = str(drafter_dir)
    out.write_fit_summary(run.summary)
    # what an engine serves first: the served drafter's rows, then the others in the order measured
    order = [served_label, *(label for label in run.summary["tables"] if label != served_label)]
    tables = [row for label in order for row in run.summary["tables"].get(label, [])]
    print("\nHeld-out decoding, pooled as a decode counts it (tau = tokens / rounds, bonus included; chain tau = the "
          f"greedy chain of K a serving engine verifies; first row: {served_label}, what an engine serves; "
          "docs/metrics.md):\n" + format_report(tables))
    if any(not r["vllm"]["vllm_matches_plain"] for r in tables if "vllm" in r):
        print("\nFAILED: vLLM's greedy outputs with speculation differ from those without (see vllm/ in the run)")
    print(f"\nRun directory: {out.path}\nDrafter: {drafter_dir}  (python -m exittrain eval drafter={drafter_dir})")
    if vllm_error is not None and run.vllm_required:
        raise RuntimeError(f"eval.vllm=true and vLLM failed (metrics.json is written): {vllm_error}")
    return run.summary


def fit(cfg: DictConfig, *, target: TargetArg = None, lab=None) -> dict:
    """Regenerate the data, warm start (pretrain), ExitTrain, then the final block-length tables.

    ``target``: a built :class:`~exittrain.models.TargetModel`, or a function that returns one
    (called once the config is validated), instead of building ``cfg.target``. ``lab``: the CPU
    decode lab (:class:`exittrain.cpu_decode.decode_lab.DecodeLab`), which ``eval.decode=auto`` needs
    (ValueError before anything loads without it) and nothing else reads: its probe picks the speed
    columns' decoder, and ``draft_vocab.json`` (the answer tokens by frequency) is written beside the
    drafter then only. ``python -m exittrain fit`` passes it when the config asks for it. Returns
    the summary that ``metrics.json`` holds; on ranks other than 0 it has no tables and nothing is
    written.
    """
    run = setup_run(cfg, target, lab)
    for stage in run.stages:
        train_stage(run, stage)
    if global_rank() != 0:
        return run.summary  # this rank trained its share; rank 0 exports, evaluates and writes
    return finish_run(run)

