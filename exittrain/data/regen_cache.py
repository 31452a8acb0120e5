"""The regeneration cache: its key, its folders and files, and atomic writes.

A result row (:data:`FEATURES`, :func:`make_row`) holds:

- ``input_ids``: prompt ids followed by response ids, ``(n_prompt_tokens + n_response_tokens,)``;
- ``loss_mask``: 0 over the prompt, 1 over the response (its EOS included when it ended with one);
- ``prompt``, ``response`` (decoded without special tokens), ``prompt_index`` (position in the
  prompt list), ``n_prompt_tokens``, ``n_response_tokens``, ``finished`` (ended with EOS rather than
  at ``max_new_tokens``).

Cache layout under ``cache_dir`` (a ``datasets`` Arrow dataset written with ``save_to_disk``)::

    <name>-<key>/              complete; read with datasets.load_from_disk (+ meta.json, + features-*.safetensors)
    <name>-<key>.partial/      in progress: shard_00000/, shard_00001/, ... one per finished batch
                               (each with its batch's record, :func:`batch_record`)

``key`` hashes the target name, the prompt-set description, the prompt list and the generation
settings (:func:`cache_key`). Each shard and the final dataset are written to a temporary folder
and renamed into place (:func:`save_atomic`), so a folder with the final name is always complete.

Beside a dataset (an entry or a shard) may lie ``features-<layers>.safetensors`` (``prompt_index ->
(n, F)`` bf16, n the row's length; :func:`load_features`) and ``top-logprobs-<S>.safetensors``
(``prompt_index -> (r, S)`` ids and log-probabilities, r the row's response length;
:func:`load_top_logprobs`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from exittrain.atomic import fsync_dir, fsync_tree
from exittrain.data.generation import GenerationConfig
from exittrain.precision import AUTO

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
META_FILE = "exittrain_meta.json"

FEATURES = datasets.Features(
    {
        "prompt_index": datasets.Value("int64"),
        "prompt": datasets.Value("string"),
        "response": datasets.Value("string"),
        "input_ids": datasets.List(datasets.Value("int32")),
        "loss_mask": datasets.List(datasets.Value("int8")),
        "n_prompt_tokens": datasets.Value("int32"),
        "n_response_tokens": datasets.Value("int32"),
        "finished": datasets.Value("bool"),
    }
)


def make_row(
    prompt_index: int, prompt: str, prompt_ids: list[int], response_ids: list[int], finished: bool, tokenizer: Any
) -> dict[str, Any]:
    """One dataset row (see the module docstring)."""
    return {
        "prompt_index": prompt_index,
        "prompt": prompt,
        "response": tokenizer.decode(response_ids, skip_special_tokens=True),
        "input_ids": prompt_ids + response_ids,
        "loss_mask": [0] * len(prompt_ids) + [1] * len(response_ids),
        "n_prompt_tokens": len(prompt_ids),
        "n_response_tokens": len(response_ids),
        "finished": finished,
    }


def prompts_digest(prompts: Sequence[str]) -> str:
    """sha256 of the prompt list (order matters)."""
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.encode("utf-8"))
        h.update(b"\0")
    return h.hexdigest()


_KEY_DEFAULTS_BEFORE = {("dtype", None), ("share_prefix", False), ("backend", "hf"), ("engine_version", None)}
# where a process answers and which part of the entry it writes do not change the answers
_NOT_KEYED = frozenset({"server_url", "engine_python", "shard"})


def cache_key(target_name: str, prompt_set: str, prompts: Sequence[str], gen: GenerationConfig) -> str:
    """Hex key of a regenerated dataset: target, prompt-set description, prompt list, settings.

    ``gen.dtype`` must be resolved (:meth:`GenerationConfig.resolved`): ``auto`` answers differently
    on different hosts, so it cannot key an entry."""
    if gen.dtype == AUTO:
        raise ValueError("cache_key needs a resolved GenerationConfig: call gen.resolved(device) first (dtype='auto')")
    payload = {
        "version": CACHE_VERSION,
        "target": target_name,
        "prompt_set": prompt_set,
        "n_prompts": len(prompts),
        "prompts_sha256": prompts_digest(prompts),
        # fields at the value that matches what came before them (the target's own dtype, no prefix
        # sharing) are left out, so entries written before the fields existed keep their keys
        "generation": {
            k: v for k, v in gen.to_dict().items() if (k, v) not in _KEY_DEFAULTS_BEFORE and k not in _NOT_KEYED
        },
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def cache_path(
    cache_dir: str | os.PathLike, target_name: str, prompt_set: str, prompts: Sequence[str], gen: GenerationConfig
) -> Path:
    """Folder of the complete regenerated dataset (it may not exist yet)."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", target_name.split("/")[-1])[:40] or "target"
    return Path(cache_dir) / f"{slug}-{cache_key(target_name, prompt_set, prompts, gen)}"


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The metadata written beside a complete regenerated dataset."""
    with open(Path(path) / META_FILE) as f:
        return json.load(f)


@contextlib.contextmanager
def _quiet_datasets_bars():
    """Hide datasets' per-save progress bars (one per shard would drown the regeneration bar)."""
    was_enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_enabled:
            datasets.enable_progress_bars()


def features_file(layers: Sequence[int]) -> str:
    """File name of the features of target ``layers`` inside a cache entry (or a shard of one)."""
    return f"features-{'_'.join(str(int(x)) for x in layers)}.safetensors"


def load_features(path: str | os.PathLike, layers: Sequence[int]) -> dict[int, torch.Tensor] | None:
    """The features of ``layers`` saved beside the dataset at ``path``: ``prompt_index -> (n, F)``
    bf16, where n is the row's ``len(input_ids)``; None when the entry has none for these layers.
    A corrupt or truncated file raises ValueError naming it and saying to delete ``path``."""
    from exittrain.safe_io import load_safetensors

    file = Path(path) / features_file(layers)
    if not file.is_file():
        return None
    # a cache entry (or a shard of one) is a unit: deleting the folder makes the next run write it again
    fix = f"delete the cache entry folder {Path(path)} (or that shard of an unfinished entry) to regenerate it"
    tensors = load_safetensors(file, what="feature cache file", fix=fix)
    return {int(k): v for k, v in tensors.items()}


def top_logprobs_file(k: int) -> str:
    """File name of the top-``k`` next-token log-probabilities inside a cache entry (or a shard of one)."""
    return f"top-logprobs-{int(k)}.safetensors"


def load_top_logprobs(path: str | os.PathLike, k: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]] | None:
    """The top-``k`` log-probabilities saved beside the dataset at ``path``: ``prompt_index ->
    (ids (r, k) int32, log-probabilities (r, k) float32)``, r the row's response length (row j: the
    distribution of response token j); None when the entry has none for this ``k``. A corrupt or
    truncated file raises ValueError naming it and saying to delete ``path``."""
    from exittrain.safe_io import load_safetensors

    file = Path(path) / top_logprobs_file(k)
    if not file.is_file():
        return None
    fix = f"delete the cache entry folder {Path(path)} (or that shard of an unfinished entry) to regenerate it"
    tensors = load_safetensors(file, what="soft-label cache file", fix=fix)
    return {
        int(key[: -len(".ids")]): (t, tensors[key[: -len(".ids")] + ".logp"])
        for key, t in tensors.items()
        if key.endswith(".ids")
    }


def safetensors_files(
    features: Mapping[int, torch.Tensor] | None,
    layers: Sequence[int],
    top: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None,
    k: int,
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, str]]]:
    """The safetensors files of a cache entry or shard: ``file name -> (tensors, metadata)``."""
    files = {}
    if features:
        tensors = {str(i): t.contiguous() for i, t in features.items()}
        files[features_file(layers)] = (tensors, {"layers": ",".join(map(str, layers))})
    if top:
        tensors = {}
        for i, (ids, logp) in top.items():
            tensors[f"{i}.ids"], tensors[f"{i}.logp"] = ids.contiguous(), logp.contiguous()
        files[top_logprobs_file(k)] = (tensors, {"k": str(k)})
    return files


def save_atomic(
    ds: datasets.Dataset,
    final: Path,
    meta: dict[str, Any] | None = None,
    *,
    tensor_files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]] | None = None,
) -> None:
    """Write ``ds`` (and ``meta``, and every safetensors file of ``tensor_files``: name -> (tensors,
    metadata), as :func:`safetensors_files` builds them) to a temporary sibling folder, then rename
    it to ``final``.

    A folder named ``final`` is therefore always complete: readers test ``final.is_dir()``, and a
    write that fails or is killed leaves only ``<final>.tmp-*``, which no reader opens (a failed
    write removes it; a killed one leaves it to the next regeneration of the key, which deletes it). The
    files are fsynced before the rename, so a power loss cannot leave a complete-looking folder of
    unwritten data either.
    """
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with _quiet_datasets_bars():
            ds.save_to_disk(str(tmp))
        if meta is not None:
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=2, sort_keys=True)
        if tensor_files:
            from safetensors.torch import save_file

            for name, (tensors, metadata) in tensor_files.items():
                save_file(tensors, str(tmp / name), metadata=metadata)
        fsync_tree(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            # another writer finished first; its copy is equivalent (the finally removes ours)
        fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def batch_dir(partial: Path, batch: int) -> Path:
    """The folder of finished batch ``batch`` inside an entry's ``<entry>.partial/`` folder."""
    return partial / f"shard_{batch:05d}"


def batch_record(
    writer: str, rejected: Mapping[int, str], answers: int, new_tokens: int, seconds: float
) -> dict[str, Any]:
    """What a batch's folder records beside its rows (its :data:`META_FILE`): which process shard
    ``"I/N"`` wrote it, the prompts the engine rejected (``[{prompt_index, reason}]``: they have no
    row), how many answers and new tokens, and the seconds the answering took."""
    return {
        "writer": writer,
        "rejected_by_engine": [{"prompt_index": int(i), "reason": str(r)} for i, r in sorted(rejected.items())],
        "answers": int(answers),
        "new_tokens": int(new_tokens),
        "seconds": float(seconds),
    }


def read_batch_record(folder: Path) -> dict[str, Any]:
    """The record of a finished batch's folder (:func:`batch_record`); an empty record (no rejections,
    writer unknown) for a folder written before batches kept one."""
    file = folder / META_FILE
    if not file.is_file():
        return {"writer": "unknown", "rejected_by_engine": [], "answers": 0, "new_tokens": 0, "seconds": 0.0}
    with open(file) as f:
        return json.load(f)


def merge_batch_records(records: Sequence[Mapping[str, Any]]) -> tuple[list[dict], dict[str, dict]]:
    """The entry's ``rejected_by_engine`` (sorted by prompt index) and its ``throughput`` per process
    shard (``"I/N" -> {batches, answers, new_tokens, seconds, tokens_per_s}``; seconds: the answering
    time that shard's batches took, summed) from the records of its batches."""
    rejected: list[dict] = []
    per_writer: dict[str, dict] = {}
    for record in records:
        rejected.extend(record.get("rejected_by_engine", []))
        row = per_writer.setdefault(
            record.get("writer", "unknown"), {"batches": 0, "answers": 0, "new_tokens": 0, "seconds": 0.0}
        )
        row["batches"] += 1
        for key in ("answers", "new_tokens", "seconds"):
            row[key] += record.get(key, 0)
    for row in per_writer.values():
        row["tokens_per_s"] = row["new_tokens"] / row["seconds"] if row["seconds"] > 0 else None
    return sorted(rejected, key=lambda r: r["prompt_index"]), dict(sorted(per_writer.items()))


def merge_shards(shards: Sequence[Path], load: Callable[[Path], dict | None], what: str, short: str) -> dict | None:
    """The union of ``load(shard)`` over the shards of one entry; None, with a warning, when a shard kept
    none (a shard of an interrupted run that kept no ``what``, or kept it for other settings)."""
    rows: dict = {}
    for b, shard in enumerate(shards):
        part = load(shard)
        if part is None:
            logger.warning("batch %d in %s kept no %s; the entry is saved without %s", b, shard.parent, what, short)
            return None
        rows.update(part)
    return rows
