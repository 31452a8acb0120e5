"""The cache entry of answered conversations brought from elsewhere: rows, one teacher-forced target
pass, and the save.

Where :func:`exittrain.data.regenerate.regenerate` has the target answer prompts, a brought entry
takes the answers as given (an SGLang or vLLM regeneration, a chat data set:
:mod:`exittrain.data.conversations`) and asks the target only for what training reads beside them:
its features at every position and its top-S next-token log-probabilities over the answer, from one
batched teacher-forced pass over each row (:func:`exittrain.data.teacher_forced.teacher_forced`).
The entry has the layout of a regenerated one (:mod:`exittrain.data.regen_cache`: rows of
``FEATURES``, ``features-<layers>.safetensors``, ``top-logprobs-<S>.safetensors``, the metadata
file), so the DataModule, the split and the feature store read it unchanged.

Soft labels cover the answer (the last assistant turn) only: the earlier assistant turns of a
multi-turn row are in its loss mask but before ``n_prompt_tokens``, where the collator serves id 0
and ``-inf`` (:mod:`exittrain.data.collate`), and the block cross-entropy trains those positions on
their hard answer tokens (:func:`exittrain.core.mix_soft_labels` keeps the answer token alone at a
position whose soft slots are all empty).

The key (:func:`brought_cache_key`) hashes the target name, the description of the sources and of
how the conversations were chosen, every conversation's turns, and the dtype the target runs the
pass in (``generation.dtype``, which changes the stored features and log-probabilities), and the
length rows are cut to before the pass when one is given (``max_tokens``); no other
generation setting keys it, since nothing is generated. The metadata is regenerate's, plus
``"brought": true``, the rows read and rejected per reason, and each source's counts.

Limits: the pass is neither split across processes (``generation.shard`` and the launcher's
ranks are ignored: every process that runs it writes the whole entry, and the first rename wins)
nor resumable (an interrupted write leaves no entry, and the next call runs the whole pass again).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from exittrain import progress as progress_log
from exittrain.data.answerers import ProcessShard
from exittrain.data.conversations import (
    Conversation,
    RenderedConversation,
    conversation_row,
    conversations_digest,
    render_conversation,
)
from exittrain.data.generation import GenerationConfig, answering_model, eos_token_ids, padding_token_id
from exittrain.data.prompts.prompt_sets import REJECT_REASONS, LoadStats
from exittrain.data.regen_cache import CACHE_VERSION, FEATURES, read_meta, safetensors_files, save_atomic
from exittrain.data.regenerate import RegenReport

__all__ = ["TEACHER_FORCED_BATCH", "brought_cache_key", "brought_cache_path", "write_brought_entry"]

logger = logging.getLogger(__name__)

TEACHER_FORCED_BATCH = 8
"""Rows per batch of the teacher-forced pass."""


def brought_cache_key(
    target_name: str,
    description: str,
    conversations: Sequence[Conversation],
    dtype: str | None,
    max_tokens: int | None = None,
) -> str:
    """Hex key of a brought entry (module docstring). ``dtype`` must be resolved (not ``auto``);
    ``max_tokens`` (rows cut before the pass, :func:`write_brought_entry`) keys it when given."""
    if dtype == "auto":
        raise ValueError("brought_cache_key needs a resolved dtype: call GenerationConfig.resolved(device) first")
    payload = {
        "version": CACHE_VERSION,
        "brought": True,
        "target": target_name,
        "description": description,
        "n_conversations": len(conversations),
        "conversations_sha256": conversations_digest(conversations),
        "dtype": dtype,
    }
    if max_tokens is not None:  # left out when None: the keys of whole-row entries stay as they were
        payload["max_tokens"] = max_tokens
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def brought_cache_path(
    cache_dir: str | os.PathLike,
    target_name: str,
    description: str,
    conversations: Sequence[Conversation],
    dtype: str | None,
    max_tokens: int | None = None,
) -> Path:
    """Folder of the brought entry, ``<target>-brought-<key>`` (it may not exist yet)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name.split("/")[-1])[:40] or "target"
    key = brought_cache_key(target_name, description, conversations, dtype, max_tokens)
    return Path(cache_dir) / f"{slug}-brought-{key}"


def _source_counts(source_stats: Sequence[LoadStats]) -> dict[str, Any]:
    rejected = dict.fromkeys(REJECT_REASONS, 0)
    for s in source_stats:
        for reason, n in s.rejected.items():
            rejected[reason] += n
    return {
        "rows_read": sum(s.rows for s in source_stats),
        "rejected": rejected,
        "dropped_by_limit": sum(s.dropped_by_limit for s in source_stats),
        "sources": [s.to_dict() for s in source_stats],
    }


def write_brought_entry(
    conversations: Sequence[Conversation],
    target: tuple[Any, Any] | Any,
    *,
    target_name: str,
    cache_dir: str | os.PathLike,
    description: str,
    gen: GenerationConfig | Mapping[str, Any] | None = None,
    source_stats: Sequence[LoadStats] = (),
    removed: Mapping[str, int] | None = None,
    progress: bool = True,
    feature_layers: Sequence[int] | None = None,
    top_logprobs: int = 0,
    device: str | torch.device = "cpu",
    batch_size: int = TEACHER_FORCED_BATCH,
    report_to: Callable[[RegenReport], Any] | None = None,
    max_tokens: int | None = None,
) -> datasets.Dataset:
    """The brought entry of ``conversations``, from the cache or written now (module docstring).

    Args:
        conversations: the chosen conversations; row ``prompt_index`` i is ``conversations[i]``.
        target: ``(model, tokenizer)`` or a callable returning them, called only when the entry is
            missing (a cache hit loads no model).
        target_name, cache_dir: the target's name in the key, the cache folder.
        description: where the conversations came from and how they were chosen (part of the key).
        gen: generation settings; only ``dtype`` applies (the dtype of the teacher-forced pass).
        source_stats: the :class:`LoadStats` of every source read, for the metadata.
        removed: other counts of conversations left out before this call (``overlap_removed``...),
            for the metadata.
        progress: log the pass's progress.
        feature_layers, top_logprobs: what the pass keeps beside the rows, as in
            :func:`exittrain.data.regenerate.regenerate` (a cache hit never adds them).
        device: decides ``gen.dtype="auto"``.
        batch_size: rows per batch of the pass.
        report_to: called with the :class:`~exittrain.data.regenerate.RegenReport` of the call (as
            ``regenerate`` reports it to ``prepare``): the entry is always complete after it, one
            "shard" that did everything; ``answers`` counts the rows the pass read.
        max_tokens: cut every row to its first ``max_tokens`` tokens (at least its prompt and one answer
            token) before the pass, and mark a cut row unfinished: training reads no token past
            ``data.max_length``, and labelling the rest of a long row would cost the pass for nothing.
            None keeps rows whole. It keys the entry (:func:`brought_cache_key`).

    Returns:
        The entry's ``datasets.Dataset`` (:data:`~exittrain.data.regen_cache.FEATURES`), one row per
        conversation, sorted by ``prompt_index``.

    Raises:
        ValueError: no conversations, bad ``feature_layers`` / ``top_logprobs``, or a conversation the
            target's chat template cannot render (:func:`~exittrain.data.conversations.render_conversation`).
    """
    gen = GenerationConfig.coerce(gen).resolved(device, remember_in=cache_dir)
    if not conversations:
        raise ValueError("write_brought_entry got no conversations; check data.train_sources")
    layers = [int(x) for x in feature_layers or []]
    if len(set(layers)) != len(layers):
        raise ValueError(f"feature_layers={layers} repeats a layer id; give each target layer once")
    if not isinstance(top_logprobs, int) or top_logprobs < 0:
        raise ValueError(f"top_logprobs={top_logprobs!r} must be an int >= 0 (0 keeps none)")
    final = brought_cache_path(cache_dir, target_name, description, conversations, gen.dtype, max_tokens)
    whole = ProcessShard(0, 1, "one process")  # the pass is not split across processes
    if final.is_dir():
        logger.info("brought conversations found in cache: %s", final)
        if report_to is not None:
            report_to(RegenReport(final, complete=True, cache_hit=True, shard=whole, meta=read_meta(final)))
        return datasets.load_from_disk(str(final))
    final.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    model, tokenizer = target() if callable(target) else target
    eos_ids = eos_token_ids(model, tokenizer)
    pad_token_id = padding_token_id(tokenizer)
    depth = len(model.get_decoder().layers)
    if any(not 0 <= x < depth for x in layers):
        raise ValueError(f"feature_layers={layers} must be layer ids in [0, {depth}) of target {target_name!r}")

    whole_rows = [render_conversation(tokenizer, conv, eos_ids) for conv in conversations]
    rendered = whole_rows if max_tokens is None else [_cut(r, max_tokens) for r in whole_rows]
    rows = [conversation_row(i, conv, r, tokenizer) for i, (conv, r) in enumerate(zip(conversations, rendered))]

    features: dict[int, torch.Tensor] = {}
    top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    if layers or top_logprobs:
        features, top = _teacher_forced_pass(model, rendered, gen, layers, top_logprobs, batch_size, progress)

    ds = datasets.Dataset.from_list(rows, features=FEATURES)
    meta = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": description,
        "n_prompts": len(conversations),
        "prompts_sha256": conversations_digest(conversations),
        "generation": gen.to_dict(),
        "rows": len(ds),
        "rejected_too_long": 0,
        "unfinished": int(len(ds) - sum(ds["finished"])),
        "pad_token_id": int(pad_token_id),
        "eos_token_ids": eos_ids,
        "feature_layers": layers,
        "top_logprobs": top_logprobs,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"datasets": datasets.__version__, "torch": torch.__version__},
        "brought": True,
        "teacher_forced": {"dtype": gen.dtype, "batch_size": batch_size},
        "max_tokens": max_tokens,
        "cut_rows": sum(len(r.input_ids) < len(w.input_ids) for r, w in zip(rendered, whole_rows)),
        "removed": dict(removed or {}),
        "multi_turn_rows": sum(1 for conv in conversations if sum(r == "assistant" for r, _ in conv.turns) > 1),
        **_source_counts(source_stats),
    }
    save_atomic(ds, final, meta, tensor_files=safetensors_files(features, layers, top, top_logprobs))
    if report_to is not None:
        report_to(
            RegenReport(
                final, complete=True, cache_hit=False, shard=whole, answers=len(ds), unfinished=meta["unfinished"],
                seconds=time.perf_counter() - t0, meta=meta,
            )
        )
    logger.info(
        "brought %d conversations (%d multi-turn, %d answers without an end-of-turn id) -> %s",
        len(ds),
        meta["multi_turn_rows"],
        meta["unfinished"],
        final,
    )
    return datasets.load_from_disk(str(final))


def _cut(rendered: RenderedConversation, max_tokens: int) -> RenderedConversation:
    """``rendered`` without its tokens past ``max_tokens`` (keeping its prompt and one answer token), unfinished
    when anything was cut."""
    n = max(max_tokens, rendered.n_prompt_tokens + 1)
    if len(rendered.input_ids) <= n:
        return rendered
    return RenderedConversation(rendered.input_ids[:n], rendered.loss_mask[:n], rendered.n_prompt_tokens, False)


def _teacher_forced_pass(
    model: Any,
    rendered: Sequence[Any],
    gen: GenerationConfig,
    layers: list[int],
    top_logprobs: int,
    batch_size: int,
    progress: bool,
) -> tuple[dict[int, torch.Tensor], dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """``prompt_index -> (n, F) bf16`` features and ``prompt_index -> (ids (r, S), log-probabilities (r, S))``
    of every row, from the target in ``gen.dtype`` (as the regeneration answers in it)."""
    from exittrain.data.teacher_forced import teacher_forced  # the target's pass over given rows

    features: dict[int, torch.Tensor] = {}
    top: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    was_training = model.training
    model.eval()
    scorer = answering_model(model, gen.dtype)
    order = sorted(range(len(rendered)), key=lambda i: -len(rendered[i].input_ids))  # less padding per batch
    # a line every 30 s or 2% of the rows: the longest rows go first, so the first batches are the slowest
    ticker = progress_log.Ticker("teacher-forced pass", len(order), unit="row", every=max(1, len(order) // 50),
                                 every_s=30.0)
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            got = teacher_forced(
                scorer,
                [(rendered[i].input_ids, rendered[i].n_prompt_tokens) for i in chunk],
                feature_layers=tuple(layers),
                top_logprobs=top_logprobs,
                batch_size=batch_size,
            )
            for i, tf in zip(chunk, got, strict=True):
                if layers:
                    features[i] = tf.features
                if top_logprobs:
                    top[i] = (tf.top_ids, tf.top_logprobs)
            if progress:
                ticker.update(start + len(chunk))
    finally:
        model.train(was_training)
        del scorer
    return features, top
