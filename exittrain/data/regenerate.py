"""Self-distillation data: the frozen target answers every training prompt itself.

:func:`regenerate` is the run: it answers the prompts in batches (:mod:`exittrain.data.generation`:
the chat template, one batch, what is kept while the target answers) and writes the answers, and
optionally the target's features and top-k log-probabilities, to the cache
(:mod:`exittrain.data.regen_cache`: the row format, the key, the folders and files). Import each
name from the module that defines it.

Prompts whose templated length exceeds ``GenerationConfig.max_prompt_tokens`` are not answered; they
are counted in the cache metadata (``rejected_too_long``) and logged. Prompts the answering engine
rejects (``Answer.error``) get no row either; the metadata names them (``rejected_by_engine``).

Batches are formed from prompts sorted by templated length (less padding); batch composition is
part of the key because padding can change fp results, so ``batch_size`` is too. Each finished
batch is saved as a shard under ``<entry>.partial/`` with its record (the writer, rejections,
tokens, seconds); an interrupted run leaves finished shards behind and the next call with the same
key generates only the missing batches.

**Shards.** A process answering shard I of N (:func:`~exittrain.data.answerers.process_shard`: ``gen.shard``, else the
launcher's rank and world size, else 0/1) answers the batches b with ``b % N == I``. After them it
looks at the whole entry: when every batch is present it merges them into the entry (one atomic
rename; two mergers racing is harmless), else it returns None and logs how many batches are
present: the process that completes the last batch merges. A process answers a batch only while it
holds the batch's claim, and merges under the entry's lock, so runs sharing the cache never write one
batch twice nor delete each other's writes (:func:`~exittrain.data.regen_cache.claimed_batches`).
Sampling (``do_sample=True``) is reproducible across shards and resumes because each batch reseeds
torch with ``seed + batch index``.

**Answerers** (:mod:`exittrain.data.answerers`). ``gen.backend="hf"`` answers with
:func:`generate_batch` in this process; ``"vllm"`` with :mod:`exittrain.data.vllm_backend`, imported
only then, and the features, when asked, come from one teacher-forced pass of the target over the
written rows (:func:`exittrain.data.teacher_forced.teacher_forced`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm

from exittrain import progress as progress_log
from exittrain.data.answerers import Answerer, ProcessShard, open_answerer, process_shard, resolve_backend
from exittrain.data.generation import (
    GenerationConfig,
    chat_prompt_ids,
    eos_token_ids,
    padding_token_id,
)
from exittrain.data.regen_cache import (
    CACHE_VERSION,
    FEATURES,
    batch_dir,
    batch_record,
    cache_path,
    claimed_batches,
    load_features,
    load_top_logprobs,
    make_row,
    merge_batch_records,
    merge_lock,
    merge_shards,
    prompts_digest,
    read_batch_record,
    read_meta,
    remove_stale_partial,
    safetensors_files,
    save_atomic,
)
from exittrain.host_choices import HostChoice
from exittrain.precision import device_identity

__all__ = ["RegenReport", "TargetProvider", "regenerate"]

logger = logging.getLogger(__name__)

TargetProvider = Callable[[], tuple[Any, Any]]
"""A zero-argument callable returning ``(model, tokenizer)``: a Hugging Face causal LM and its tokenizer."""

# ----------------------------------------------------------------------------------------------
# What a run did
# ----------------------------------------------------------------------------------------------


@dataclass
class RegenReport:
    """What one :func:`regenerate` call did, handed to its ``report_to``.

    ``complete``: the entry exists now (``meta`` is its metadata); ``cache_hit``: it existed before
    the call, nothing was answered. Otherwise this process answered ``batches_answered`` of its
    shard's batches now (``answers`` rows, ``new_tokens``, in ``seconds`` of answering), and
    ``batches_present`` of the entry's ``batches`` are on disk after it."""

    entry: Path
    complete: bool
    cache_hit: bool
    shard: ProcessShard
    batches: int = 0
    batches_present: int = 0
    batches_answered: int = 0
    answers: int = 0
    unfinished: int = 0
    rejected_too_long: int = 0
    rejected_by_engine: list[dict] = dataclasses.field(default_factory=list)
    new_tokens: int = 0
    seconds: float = 0.0
    meta: dict | None = None

    @property
    def answers_per_s(self) -> float | None:
        return self.answers / self.seconds if self.seconds > 0 else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.new_tokens / self.seconds if self.seconds > 0 else None

    def status(self) -> str:
        """One line: the entry found, merged, or this shard done with the entry pending."""
        if self.cache_hit:
            return f"entry found in the cache, nothing answered: {self.entry}"
        if self.complete:
            return f"shard {self.shard.label} done, every batch present: merged the entry {self.entry}"
        return (
            f"shard {self.shard.label} done: {self.batches_present} of {self.batches} batches present; the process "
            f"that completes the last batch merges {self.entry}"
        )


# ----------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------


def _resolve(target: tuple[Any, Any] | TargetProvider) -> tuple[Any, Any]:
    model, tokenizer = target() if callable(target) else target
    return model, tokenizer


def regenerate(
    prompts: Sequence[str],
    target: tuple[Any, Any] | TargetProvider,
    *,
    target_name: str,
    cache_dir: str | os.PathLike,
    gen: GenerationConfig | Mapping[str, Any] | None = None,
    prompt_set: str = "",
    progress: bool = True,
    feature_layers: Sequence[int] | None = None,
    top_logprobs: int = 0,
    device: str | torch.device = "cpu",
    report_to: Callable[[RegenReport], Any] | None = None,
    dtype_choice: HostChoice | None = None,
) -> datasets.Dataset | None:
    """The target's own answers to ``prompts``, from the cache or generated now (this process's shard).

    Args:
        prompts: prompt texts; row ``prompt_index`` refers to a position in this list.
        target: ``(model, tokenizer)`` or a callable returning them. A callable is called only when
            something must be generated, so a cache hit never loads the model. The model is used
            as it is (device, dtype); it should be in eval mode, fp32 on a CPU by default.
        target_name: identifies the target in the cache key (e.g. its hub id or path).
        cache_dir: folder of cached datasets.
        gen: generation settings (:class:`GenerationConfig` or a mapping of its fields); ``gen.shard``
            picks this process's part (:func:`process_shard`).
        prompt_set: a description of where the prompts came from (source specs); part of the key.
        progress: show a tqdm bar over batches.
        feature_layers: target layer ids whose outputs to keep while generating (see
            :func:`generate_batch`); they are saved beside the dataset (:func:`load_features`), so
            training need not run the target over every row again. A cache hit never adds them: an
            entry written without them (or for other layers) is returned as it is.
        top_logprobs: keep the answering model's top-S next-token log-probabilities at every
            response position (:func:`generate_batch`; :func:`load_top_logprobs`), S > 0. Like the
            features, a cache hit never adds them.
        device: the device the target answers on; it decides ``gen.dtype="auto"`` before the cache
            is looked up (the model is not loaded for that).
        report_to: called once with the call's :class:`RegenReport` (counts, throughput, status).
        dtype_choice: how ``gen.dtype`` was chosen, from a caller that resolved ``auto`` itself;
            None: :meth:`GenerationConfig.dtype_choice` here (``auto``: this host type's recorded
            choice; a value as given: compared with that record). Kept in the entry's metadata
            (``dtype_choice``), with the host identity and torch's thread count (``host``; neither
            is part of the key).

    Returns:
        The complete entry: a ``datasets.Dataset`` with :data:`FEATURES`, rows sorted by
        ``prompt_index`` (prompts rejected as too long or by the engine have no row). None when
        this process's shard is done but other shards' batches are missing (the entry is pending).
    """
    asked = GenerationConfig.coerce(gen)
    dtype_choice = dtype_choice or asked.dtype_choice(device, remember_in=cache_dir)
    gen = resolve_backend(dataclasses.replace(asked, dtype=dtype_choice.value))
    if not prompts:
        raise ValueError("regenerate got no prompts; check the prompt sources")
    layers = [int(x) for x in feature_layers or []]
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers={layers} repeats a layer id; give each target layer once")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    shard = process_shard(gen)
    final = cache_path(cache_dir, target_name, prompt_set, prompts, gen)
    if final.is_dir():
        logger.info("regenerated data found in cache: %s", final)
        remove_stale_partial(final)
        return _finish(final, RegenReport(final, complete=True, cache_hit=True, shard=shard, meta=read_meta(final)),
                       report_to)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(exist_ok=True)

    model, tokenizer = _resolve(target)
    pad_token_id = padding_token_id(tokenizer)
    eos_ids = eos_token_ids(model, tokenizer)
    depth = len(model.get_decoder().layers)
    if any(not 0 <= x < depth for x in layers):
        raise ValueError(f"feature_layers={layers} must be layer ids in [0, {depth}) of target {target_name!r}")

    templated = [chat_prompt_ids(tokenizer, p, gen.system_prompt) for p in prompts]
    too_long = [i for i, ids in enumerate(templated) if len(ids) > gen.max_prompt_tokens]
    if too_long:
        logger.warning(
            "%d of %d prompts exceed max_prompt_tokens=%d after the chat template and are not answered "
            "(first indices %s)",
            len(too_long),
            len(prompts),
            gen.max_prompt_tokens,
            too_long[:5],
        )
    skip = set(too_long)
    order = sorted((i for i in range(len(prompts)) if i not in skip), key=lambda i: -len(templated[i]))
    if not order:
        raise ValueError(
            f"every one of the {len(prompts)} prompts exceeds max_prompt_tokens={gen.max_prompt_tokens} after the "
            f"chat template of target {target_name!r} (shortest: {min(len(t) for t in templated)} tokens); raise "
            "generation.max_prompt_tokens (data.generation.max_prompt_tokens in a fit config) or use shorter prompts"
        )
    batches = [order[s : s + gen.batch_size] for s in range(0, len(order), gen.batch_size)]
    mine = [b for b in range(len(batches)) if shard.owns(b)]

    report = RegenReport(final, complete=False, cache_hit=False, shard=shard, batches=len(batches),
                         rejected_too_long=len(too_long))
    todo = [b for b in mine if not batch_dir(partial, b).is_dir()]
    if shard.count > 1:
        logger.info("regeneration shard %s (from %s): %d of %d batches, %d to answer",
                    shard.label, shard.source, len(mine), len(batches), len(todo))
    if len(todo) < len(mine):
        logger.info("resuming regeneration: %d of %d batches already done", len(mine) - len(todo), len(mine))
    if todo:
        answerer = open_answerer(gen, model=model, tokenizer=tokenizer, target_name=target_name, eos_ids=eos_ids,
                                 feature_layers=layers, top_logprobs=top_logprobs)
        try:
            _answer_batches(answerer, prompts, templated, batches, todo, len(mine), partial, tokenizer, shard,
                            layers, top_logprobs, report, progress=progress, target_name=target_name)
        finally:
            answerer.close()

    present = [b for b in range(len(batches)) if batch_dir(partial, b).is_dir()]
    report.batches_present = len(present)
    if len(present) < len(batches):
        if final.is_dir():  # another process merged (and removed the shards) after this one's last batch
            return _complete(final, report, report_to)
        logger.info("%s", report.status())
        return _finish(final, report, report_to)

    meta = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": prompt_set,
        "n_prompts": len(prompts),
        "prompts_sha256": prompts_digest(prompts),
        "generation": {**gen.to_dict(), "shard": None},  # the entry is whole, whoever merged it
        "backend": gen.backend,
        "engine_version": gen.engine_version,
        "rejected_too_long": len(too_long),
        "pad_token_id": int(pad_token_id),
        "eos_token_ids": eos_ids,
        "versions": {"datasets": datasets.__version__, "torch": torch.__version__},
        # how the dtype was chosen, and what else of the host shapes the answers' last bits
        "dtype_choice": dtype_choice.as_dict(),
        "host": {"identity": device_identity(device), "threads": torch.get_num_threads()},
    }
    try:
        with merge_lock(final):  # one merger; the others find the entry
            if not final.is_dir():
                _merge(final, partial, batches, layers, top_logprobs, meta)
        remove_stale_partial(final)
    except Exception:
        if not final.is_dir():
            raise
        # a racing merger finished first and removed the shards this one was reading: its entry is the same
    return _complete(final, report, report_to)


def _answer_batches(
    answerer: Answerer,
    prompts: Sequence[str],
    templated: Sequence[list[int]],
    batches: Sequence[list[int]],
    todo: Sequence[int],
    n_mine: int,
    partial: Path,
    tokenizer: Any,
    shard: ProcessShard,
    layers: Sequence[int],
    top_logprobs: int,
    report: RegenReport,
    *,
    progress: bool,
    target_name: str,
) -> None:
    """Answer the batches ``todo`` and write each as a shard with its record; counts go to ``report``."""
    # no bar draws into a redirected stdout (a log file, SLURM): log lines there instead, one per batch
    # while batches take 30 s or more, else one every 30 s or every 1/50 of the batches
    as_lines = progress and not progress_log.interactive()
    done_before = n_mine - len(todo)
    bar = tqdm(
        total=n_mine,
        initial=done_before,
        desc=f"regenerate ({target_name})",
        unit="batch",
        disable=not progress or as_lines,
    )
    ticker = progress_log.Ticker(
        f"regenerate ({target_name})", n_mine, unit="batch", every=max(1, n_mine // 50), start=done_before
    )
    claims = claimed_batches(partial, todo)  # a batch another run answers is used, not answered twice
    try:
        for b in claims:
            idx = batches[b]
            t0 = time.perf_counter()
            # a batch can take a minute on a small CPU: off a terminal, a line every 20 s while it runs
            with progress_log.Heartbeat(f"regenerate ({target_name}) batch {b + 1}/{n_mine}",
                                        every_s=20.0 if as_lines else 0):
                answers = answerer.answer([templated[i] for i in idx], b)
            seconds = time.perf_counter() - t0
            if len(answers) != len(idx):
                raise RuntimeError(f"the answerer gave {len(answers)} answers for the {len(idx)} prompts of batch {b}")
            kept = [(i, a) for i, a in zip(idx, answers) if a.error is None]
            rejected = {i: a.error for i, a in zip(idx, answers) if a.error is not None}
            rows = [make_row(i, prompts[i], templated[i], a.response, a.finished, tokenizer) for i, a in kept]
            features = {i: a.features for i, a in kept if a.features is not None}
            top = {i: (a.top_ids, a.top_logprobs) for i, a in kept if a.top_ids is not None}
            tokens = sum(len(a.response) for _, a in kept)
            record = batch_record(shard.label, rejected, len(kept), tokens, seconds)
            save_atomic(
                datasets.Dataset.from_list(rows, features=FEATURES),
                batch_dir(partial, b),
                record,
                tensor_files=safetensors_files(features, layers, top, top_logprobs),
            )
            report.batches_answered += 1
            report.answers += len(kept)
            report.unfinished += sum(not a.finished for _, a in kept)
            report.rejected_by_engine += record["rejected_by_engine"]
            report.new_tokens += tokens
            report.seconds += seconds
            bar.update(1)
            bar.set_postfix(tok_s=f"{report.tokens_per_s or 0:.0f}")
            if as_lines:
                ticker.advance(answers=report.answers, tok_s=report.tokens_per_s or 0.0)
    finally:
        claims.close()  # at once, also on an error: the claim of the batch in hand goes
        bar.close()


def _merge(
    final: Path, partial: Path, batches: Sequence[list[int]], layers: Sequence[int], top_logprobs: int, meta: dict
) -> None:
    """Write the entry from every batch's shard (one atomic rename), then remove the shards."""
    dirs = [batch_dir(partial, b) for b in range(len(batches))]
    records = [read_batch_record(d) for d in dirs]
    shards = [datasets.load_from_disk(str(d)) for d in dirs]
    for b, (shard, record) in enumerate(zip(shards, records)):
        rejected = {r["prompt_index"] for r in record["rejected_by_engine"]}
        expected = [i for i in batches[b] if i not in rejected]
        assert shard["prompt_index"] == expected, f"shard {b} in {partial} does not match its batch"
    ds = datasets.concatenate_datasets(shards)
    feature_rows = (
        merge_shards(dirs, lambda d: load_features(d, layers), f"features of layers {list(layers)}", "features")
        if layers
        else None
    )
    top_rows = (
        merge_shards(
            dirs, lambda d: load_top_logprobs(d, top_logprobs), f"top-{top_logprobs} log-probabilities", "them"
        )
        if top_logprobs
        else None
    )
    index = ds["prompt_index"]
    ds = ds.select(sorted(range(len(ds)), key=index.__getitem__))
    rejected_by_engine, throughput = merge_batch_records(records)
    meta = {
        **meta,
        "rows": len(ds),
        "unfinished": int(len(ds) - sum(ds["finished"])),
        "rejected_by_engine": rejected_by_engine,
        "throughput": throughput,
        "feature_layers": list(layers) if feature_rows else [],
        "top_logprobs": top_logprobs if top_rows else 0,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    save_atomic(ds, final, meta, tensor_files=safetensors_files(feature_rows, layers, top_rows, top_logprobs))
    shutil.rmtree(partial, ignore_errors=True)
    if rejected_by_engine:
        logger.warning(
            "the answering engine rejected %d prompts (first: %s); they have no row",
            len(rejected_by_engine),
            rejected_by_engine[:3],
        )
    logger.info(
        "regenerated %d responses (%d hit max_new_tokens=%d, %d prompts too long, %d rejected by the engine) -> %s",
        len(ds),
        meta["unfinished"],
        meta["generation"]["max_new_tokens"],
        meta["rejected_too_long"],
        len(rejected_by_engine),
        final,
    )


def _complete(final: Path, report: RegenReport, report_to: Callable[[RegenReport], Any] | None) -> datasets.Dataset:
    report.complete, report.batches_present, report.meta = True, report.batches, read_meta(final)
    return _finish(final, report, report_to)


def _finish(
    final: Path, report: RegenReport, report_to: Callable[[RegenReport], Any] | None
) -> datasets.Dataset | None:
    if report_to is not None:
        report_to(report)
    return datasets.load_from_disk(str(final)) if report.complete else None
