"""`prepare` as a library function: ``fit``'s data step alone, from the config ``fit`` composes.

``python -m exittrain prepare +recipe=code [overrides]`` composes conf/prepare.yaml, which is
conf/fit.yaml, so the same overrides give the same ``data.*``, target and drafter, and a later
``fit`` with those settings finds the cache entry this fills and skips its data step. It:

1. checks ``data.*`` (:func:`exittrain.settings.check_data`) and plans the stages (the soft labels
   are kept when a stage trains on them), before anything loads;
2. looks the entry up without loading the target when ``cfg.target`` is ``load_target``'s (its
   name and device follow from the config); a found entry is reported and nothing loads;
3. otherwise builds the target, the drafter and the DataModule exactly as ``fit`` does
   (:mod:`exittrain.build`), and answers this process's shard of the entry
   (``data.generation.shard=I/N``, or torchrun's / srun's rank and world size, else everything:
   :func:`exittrain.data.answerers.process_shard`); the process that completes the last batch merges;
4. prints the entry, its counts (answered, rejected as too long, rejected by the engine with the
   first few, unfinished) and this run's throughput (answers/s, tokens/s, seconds).

Several machines fill one entry by running the same command with ``shard=0/N`` .. ``N-1/N`` on a
``data.cache_dir`` they all see; a killed shard is rerun alone and answers only its missing batches.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from exittrain.build import build_datamodule, build_drafter, build_target
from exittrain.data.prompts.prompt_plan import PromptPlan
from exittrain.data.regenerate import RegenReport
from exittrain.settings import check_data, plan_stages

__all__ = ["run_prepare", "format_report", "target_identity"]

log = logging.getLogger("exittrain")

LOAD_TARGET = "exittrain.models.load_target"
SHOWN_REJECTIONS = 5


def target_identity(cfg: DictConfig) -> tuple[str, str] | None:
    """``(name, device)`` the target of ``cfg.target`` will have once loaded, read from the config
    alone, as :func:`exittrain.models.load_target` decides them: ``target.name``, else
    ``name_or_path`` as given, else the embedded target's name; ``target.device`` resolved (a
    ``device_map`` loads on the GPU where there is one). None for a target built by another function:
    then only building it tells."""
    node = cfg.target
    if node.get("_target_") != LOAD_TARGET:
        return None
    import torch

    from exittrain.models.target_loading import EMBEDDED_TARGET_NAME, resolve_device

    value = node.get("name_or_path")
    name = node.get("name") or (os.fspath(value).rstrip("/") if value is not None else EMBEDDED_TARGET_NAME)
    if node.get("device_map") is not None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = resolve_device(node.get("device", "cpu"))
    return str(name), str(device)


def _data_args(cfg: DictConfig) -> dict[str, Any]:
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    return data


def run_prepare(cfg: DictConfig, target: Any = None) -> RegenReport:
    """Fill the regeneration cache entry of ``cfg`` (a composed ``fit``/``prepare`` config), or this
    process's shard of it; prints and returns the :class:`~exittrain.data.regenerate.RegenReport`.

    ``target``: a built target, or a function building one (as ``fit`` takes it; tests pass a tiny
    one); default ``cfg.target``, built only when something must be answered."""
    check_data(cfg)
    stages = plan_stages(cfg)
    reports: list[RegenReport] = []
    identity = target_identity(cfg) if target is None else None
    # corpus rows (data.corpus_sources) have an entry of their own, named from the loaded conversations:
    # prepare then builds the target and lets the data module find or write both entries
    if identity is not None and not cfg.data.get("corpus_sources"):
        name, device = identity
        plan = PromptPlan.from_data_args(_data_args(cfg), target_name=name, device=device)
        if plan.cache_path.is_dir():

            def not_needed():
                raise RuntimeError("a found entry never builds the target")

            plan.regenerate(not_needed, progress=False, report_to=reports.append)
    if not reports:
        built = build_target(cfg, target)
        drafter = build_drafter(cfg, built)
        datamodule = build_datamodule(cfg, built, drafter.config.target_layer_ids, stages)
        del drafter  # only its layer ids matter here: they choose the features the entry keeps
        datamodule.plan.regenerate(
            lambda: (built.model, built.tokenizer),
            progress=datamodule.progress,
            feature_layers=datamodule.feature_layers,
            top_logprobs=datamodule.top_logprobs,
            report_to=reports.append,
        )
        corpus_entry = None
        if datamodule.corpus is not None:
            datamodule.corpus.write(
                lambda: (built.model, built.tokenizer),
                progress=datamodule.progress,
                feature_layers=datamodule.feature_layers,
                top_logprobs=datamodule.top_logprobs,
            )
            corpus_entry = datamodule.corpus.cache_path
    else:
        corpus_entry = None
    report = reports[0]
    text = format_report(report)
    if corpus_entry is not None:
        text += f"\ncorpus rows: {corpus_entry}"
    print(text, flush=True)
    return report


def _rate(value: float | None, unit: str) -> str:
    return "n/a" if value is None else f"{value:.1f} {unit}"


def format_report(report: RegenReport) -> str:
    """The lines ``prepare`` prints: status, entry, counts, throughput."""
    lines = [f"prepare: {report.status()}", f"entry: {report.entry}"]
    if report.complete and report.meta is not None:
        meta = report.meta
        rejected = meta.get("rejected_by_engine", [])
        cap, too_long = meta.get("generation", {}).get("max_new_tokens"), meta.get("rejected_too_long", 0)
        lines.append(
            f"counts: {meta.get('rows')} answered of {meta.get('n_prompts')} prompts, {too_long} rejected too long, "
            f"{len(rejected)} rejected by the engine, {meta.get('unfinished')} unfinished "
            f"(hit max_new_tokens={cap})"
        )
        for shard, row in meta.get("throughput", {}).items():
            lines.append(
                f"throughput of shard {shard}: {row['batches']} batches, {row['answers']} answers, "
                f"{row['new_tokens']} tokens in {row['seconds']:.1f} s ({_rate(row.get('tokens_per_s'), 'tokens/s')})"
            )
    else:
        rejected = report.rejected_by_engine
        lines.append(
            f"counts of shard {report.shard.label}: {report.answers} answered, {report.rejected_too_long} rejected "
            f"too long (whole entry), {len(rejected)} rejected by the engine, {report.unfinished} unfinished"
        )
    for row in rejected[:SHOWN_REJECTIONS]:
        lines.append(f"  rejected by the engine: prompt {row['prompt_index']}: {row['reason']}")
    if len(rejected) > SHOWN_REJECTIONS:
        lines.append(f"  ... and {len(rejected) - SHOWN_REJECTIONS} more (the entry's metadata names them all)")
    if not report.cache_hit:
        lines.append(
            f"this run: {report.batches_answered} batches, {report.answers} answers, {report.new_tokens} tokens in "
            f"{report.seconds:.1f} s ({_rate(report.answers_per_s, 'answers/s')}, "
            f"{_rate(report.tokens_per_s, 'tokens/s')})"
        )
    return "\n".join(lines)
