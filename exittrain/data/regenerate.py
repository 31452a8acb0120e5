"""Self-distillation data: the frozen target answers every training prompt itself.

:func:`regenerate` is the run: it answers the prompts in batches (:mod:`exittrain.data.generation`:
the chat template, one batch, what is kept while the target answers) and writes the answers, and
optionally the target's features and top-k log-probabilities, to the cache
(:mod:`exittrain.data.regen_cache`: the row format, the key, the folders and files). This module
is also the public face of both: import their names from here, but for the chat template of a
prompt, :func:`~exittrain.data.generation.chat_prompt_ids`, which the package exports
(``from exittrain.data import chat_prompt_ids``).

Prompts whose templated length exceeds ``GenerationConfig.max_prompt_tokens`` are not answered; they
are counted in the cache metadata (``rejected_too_long``) and logged.

Batches are formed from prompts sorted by templated length (less padding); batch composition is
part of the key because padding can change fp results, so ``batch_size`` is too. Each finished
batch is saved as a shard under ``<entry>.partial/``; an interrupted run leaves finished shards
behind and the next call with the same key generates only the missing batches.

Limits: one process writes a given key at a time (Lightning's ``prepare_data`` runs on one rank per
node); sampling (``do_sample=True``) is reproducible on resume because each batch reseeds torch
with ``seed + batch index``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch
from tqdm.auto import tqdm

from exittrain import progress as progress_log
from exittrain.data.generation import (
    GENERATION_DTYPES,
    MIN_SHARED_PREFIX,
    Answer,
    GenerationConfig,
    answering_model,
    chat_prompt_ids,
    eos_token_ids,
    generate_batch,
    padding_token_id,
    shared_prefix_length,
    split_response,
)
from exittrain.data.regen_cache import (
    CACHE_VERSION,
    FEATURES,
    META_FILE,
    cache_key,
    cache_path,
    features_file,
    load_features,
    load_top_logprobs,
    make_row,
    merge_shards,
    prompts_digest,
    read_meta,
    safetensors_files,
    save_atomic,
    top_logprobs_file,
)

__all__ = [
    # the run
    "TargetProvider",
    "regenerate",
    # how the target answers (exittrain.data.generation)
    "GENERATION_DTYPES",
    "MIN_SHARED_PREFIX",
    "Answer",
    "GenerationConfig",
    "answering_model",
    "eos_token_ids",
    "generate_batch",
    "padding_token_id",
    "shared_prefix_length",
    "split_response",
    # the cache (exittrain.data.regen_cache)
    "CACHE_VERSION",
    "FEATURES",
    "META_FILE",
    "cache_key",
    "cache_path",
    "features_file",
    "load_features",
    "load_top_logprobs",
    "make_row",
    "prompts_digest",
    "read_meta",
    "top_logprobs_file",
]

logger = logging.getLogger(__name__)

TargetProvider = Callable[[], tuple[Any, Any]]
"""A zero-argument callable returning ``(model, tokenizer)``: a Hugging Face causal LM and its tokenizer."""


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
) -> datasets.Dataset:
    """The target's own answers to ``prompts``, from the cache or generated now.

    Args:
        prompts: prompt texts; row ``prompt_index`` refers to a position in this list.
        target: ``(model, tokenizer)`` or a callable returning them. A callable is called only when
            something must be generated, so a cache hit never loads the model. The model is used
            as it is (device, dtype); it should be in eval mode, fp32 on a CPU by default.
        target_name: identifies the target in the cache key (e.g. its hub id or path).
        cache_dir: folder of cached datasets.
        gen: generation settings (:class:`GenerationConfig` or a mapping of its fields).
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

    Returns:
        A ``datasets.Dataset`` with :data:`FEATURES`, rows sorted by ``prompt_index``. Prompts
        rejected as too long have no row.
    """
    gen = GenerationConfig.coerce(gen).resolved(device)
    if not prompts:
        raise ValueError("regenerate got no prompts; check the prompt sources")
    layers = [int(x) for x in feature_layers or []]
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers={layers} repeats a layer id; give each target layer once")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    final = cache_path(cache_dir, target_name, prompt_set, prompts, gen)
    if final.is_dir():
        logger.info("regenerated data found in cache: %s", final)
        return datasets.load_from_disk(str(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(final.name + ".partial")
    partial.mkdir(exist_ok=True)
    # temporary folders of a killed write (of a shard or of the entry): one process writes a key at a time
    for stale in [*final.parent.glob(f"{final.name}.tmp-*"), *partial.glob("shard_*.tmp-*")]:
        shutil.rmtree(stale, ignore_errors=True)

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

    def shard_dir(b: int) -> Path:
        return partial / f"shard_{b:05d}"

    todo = [b for b in range(len(batches)) if not shard_dir(b).is_dir()]
    if len(todo) < len(batches):
        logger.info("resuming regeneration: %d of %d batches already done", len(batches) - len(todo), len(batches))

    was_training = model.training
    model.eval()
    answerer = answering_model(model, gen.dtype)
    # no bar draws into a redirected stdout (a log file, SLURM): log lines there instead, one per batch
    # while batches take 30 s or more, else one every 30 s or every 1/50 of the batches
    as_lines = progress and not progress_log.interactive()
    bar = tqdm(
        total=len(batches),
        initial=len(batches) - len(todo),
        desc=f"regenerate ({target_name})",
        unit="batch",
        disable=not progress or as_lines,
    )
    ticker = progress_log.Ticker(
        f"regenerate ({target_name})",
        len(batches),
        unit="batch",
        every=max(1, len(batches) // 50),
        start=len(batches) - len(todo),
    )
    answered = 0
    new_tokens, t0 = 0, time.perf_counter()
    try:
        for b in todo:
            idx = batches[b]
            if gen.do_sample:
                torch.manual_seed(gen.seed + b)
            answers = generate_batch(
                answerer, tokenizer, [templated[i] for i in idx], gen, pad_token_id, eos_ids, layers, top_logprobs
            )
            rows = [
                make_row(i, prompts[i], templated[i], a.response, a.finished, tokenizer) for i, a in zip(idx, answers)
            ]
            features = {i: a.features for i, a in zip(idx, answers) if a.features is not None}
            top = {i: (a.top_ids, a.top_logprobs) for i, a in zip(idx, answers) if a.top_ids is not None}
            shard = datasets.Dataset.from_list(rows, features=FEATURES)
            save_atomic(shard, shard_dir(b), tensor_files=safetensors_files(features, layers, top, top_logprobs))
            new_tokens += sum(len(a.response) for a in answers)
            bar.update(1)
            tok_s = new_tokens / max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{tok_s:.0f}")
            answered += len(answers)
            if as_lines:
                ticker.advance(answers=answered, tok_s=tok_s)
    finally:
        bar.close()
        model.train(was_training)
        del answerer

    shards = [datasets.load_from_disk(str(shard_dir(b))) for b in range(len(batches))]
    for b, shard in enumerate(shards):
        assert shard["prompt_index"] == batches[b], f"shard {b} in {partial} does not match its batch"
    ds = datasets.concatenate_datasets(shards)
    shard_dirs = [shard_dir(b) for b in range(len(batches))]
    feature_rows = (
        merge_shards(shard_dirs, lambda d: load_features(d, layers), f"features of layers {layers}", "features")
        if layers
        else None
    )
    top_rows = (
        merge_shards(
            shard_dirs, lambda d: load_top_logprobs(d, top_logprobs), f"top-{top_logprobs} log-probabilities", "them"
        )
        if top_logprobs
        else None
    )
    index = ds["prompt_index"]
    ds = ds.select(sorted(range(len(ds)), key=index.__getitem__))
    meta = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": prompt_set,
        "n_prompts": len(prompts),
        "prompts_sha256": prompts_digest(prompts),
        "generation": gen.to_dict(),
        "rows": len(ds),
        "rejected_too_long": len(too_long),
        "unfinished": int(len(ds) - sum(ds["finished"])),
        "pad_token_id": int(pad_token_id),
        "eos_token_ids": eos_ids,
        "feature_layers": layers if feature_rows else [],
        "top_logprobs": top_logprobs if top_rows else 0,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"datasets": datasets.__version__, "torch": torch.__version__},
    }
    save_atomic(ds, final, meta, tensor_files=safetensors_files(feature_rows, layers, top_rows, top_logprobs))
    shutil.rmtree(partial, ignore_errors=True)
    logger.info(
        "regenerated %d responses (%d hit max_new_tokens=%d, %d prompts too long) -> %s",
        len(ds),
        meta["unfinished"],
        gen.max_new_tokens,
        len(too_long),
        final,
    )
    return datasets.load_from_disk(str(final))
