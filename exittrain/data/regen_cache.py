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
and renamed into place (:func:`save_atomic`), so a folder with the final name is always complete,
and each carries the checksums of its files (:mod:`exittrain.data.cache_integrity`).

**Several runs, one cache.** Runs that share ``cache_dir`` (on one machine, or the ranks and shard
jobs of one entry) coordinate through claims, exclusive ``flock`` locks on hidden files:
``<entry>.partial/.shard_NNNNN.claim`` for a batch (:func:`claimed_batches`: a process answers a
batch only while it holds its claim, and uses the shard another process finished) and
``.<entry>.merge.lock`` beside the entry for the merge (:func:`merge_lock`). The kernel drops a
lock when its process exits, so a claim nobody holds belongs to a run that is gone: its temporary
folders are removed by the next holder, and a ``.partial`` folder left beside a complete entry
is removed once no claim in it is held (:func:`remove_stale_partial`).

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
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import datasets
import torch

from exittrain.atomic import FileLock, fsync_dir, fsync_tree, write_errors_named
from exittrain.data.cache_integrity import verify_checksums, write_checksums
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
    write removes it; a killed one leaves it to the next holder of its claim, which deletes it). The
    files are fsynced before the rename, so a power loss cannot leave a complete-looking folder of
    unwritten data either. The folder's checksums are written last (:func:`write_checksums`).

    A failure of the file system (a full disk) raises :class:`exittrain.atomic.WriteError` naming
    ``final``, the bytes the folder needs, the free space and the fix.
    """
    tmp = final.with_name(f"{final.name}.tmp-{uuid.uuid4().hex[:8]}")
    needed = ds.data.nbytes + sum(t.nbytes for tensors, _ in (tensor_files or {}).values() for t in tensors.values())
    what = "cache shard" if final.parent.name.endswith(".partial") else "cache entry"
    try:
        with write_errors_named(final, what=what, fix=_write_fix(final), needed=needed):
            _write_folder(ds, tmp, meta, tensor_files)
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


def _write_folder(
    ds: datasets.Dataset,
    tmp: Path,
    meta: dict[str, Any] | None,
    tensor_files: Mapping[str, tuple[dict[str, torch.Tensor], dict[str, str]]] | None,
) -> None:
    """Every file of a cache folder into ``tmp``, its checksums last, all fsynced (:func:`save_atomic`)."""
    with _quiet_datasets_bars():
        ds.save_to_disk(str(tmp))
    if meta is not None:
        with open(tmp / META_FILE, "w") as f:
            json.dump(meta, f, indent=2, sort_keys=True)
    if tensor_files:
        from safetensors.torch import save_file

        for name, (tensors, metadata) in tensor_files.items():
            save_file(tensors, str(tmp / name), metadata=metadata)
    write_checksums(tmp)
    fsync_tree(tmp)


def _write_fix(final: Path) -> str:
    """What to do when a cache folder could not be written (the prefix "free space on that disk" comes first)."""
    partial = final.parent if final.parent.name.endswith(".partial") else final.with_name(final.name + ".partial")
    return (
        f"point data.cache_dir at a disk with room (the entry is answered afresh there). The batches already "
        f"finished in {partial} are kept: a run on the same cache answers only the missing ones"
    )


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
    writer unknown) for a folder written before batches kept one. The folder's checksums are checked
    first (:func:`~exittrain.data.cache_integrity.verify_checksums`): the merge reads only whole shards."""
    verify_checksums(
        folder, what="batch shard", fix=f"delete {folder}; the next run on this cache answers that batch again"
    )
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


# ----------------------------------------------------------------------------------------------
# several runs on one cache: claims (see the module docstring)

CLAIM_POLL_S = 2.0
"""Seconds between two looks at a batch another process holds (:func:`claimed_batches`)."""


def entry_of(partial: Path) -> Path:
    """The entry folder whose unfinished batches ``partial`` (``<entry>.partial``) holds."""
    return partial.with_name(partial.name.removesuffix(".partial"))


def claim_file(partial: Path, batch: int) -> Path:
    """The lock file of batch ``batch``'s claim, inside ``partial``."""
    return partial / f".{batch_dir(partial, batch).name}.claim"


def claimed_batches(partial: Path, todo: Sequence[int]) -> Iterator[int]:
    """Yield the batches of ``todo`` for this process to answer, each while it holds the batch's claim.

    The caller writes the batch's shard in its loop body; the claim is released when it asks for
    the next batch. A batch whose shard exists (another run finished it) is skipped, with a log
    line; a batch another process holds is left for later, and once this process has answered
    the others it waits for it (every :data:`CLAIM_POLL_S` seconds): its holder finishes it, or
    exits and this process claims it. Under a claim, the temporary folders of the batch's killed
    writes are removed (no one else can be writing them). The generator stops early when the
    entry is complete (another run merged it), after removing ``partial`` if nothing holds it.
    """
    final = entry_of(partial)
    waiting, announced = list(todo), set()
    while waiting:
        claimed = False
        for b in list(waiting):
            if final.is_dir():
                logger.info("the cache entry %s was completed by another run; this run uses it", final)
                remove_stale_partial(final)
                return
            if batch_dir(partial, b).is_dir():
                logger.info("batch %d of %s was answered by another run; this run uses it", b, final)
                waiting.remove(b)
                continue
            claim = FileLock(claim_file(partial, b))
            try:
                got = claim.acquire()
            except FileNotFoundError:  # partial was removed: its entry merged (seen at the next look), or by hand
                if not final.is_dir():
                    partial.mkdir(parents=True, exist_ok=True)
                continue
            if not got:
                if b not in announced:
                    announced.add(b)
                    logger.info("batch %d of %s is being answered by %s; this run answers the others first",
                                b, final, claim.holder())
                continue
            try:
                if final.is_dir() or batch_dir(partial, b).is_dir():
                    continue  # finished while this process waited for the lock; seen at the next look
                for stale in partial.glob(f"{batch_dir(partial, b).name}.tmp-*"):
                    logger.info("removing %s: a write of batch %d whose process is gone", stale, b)
                    shutil.rmtree(stale, ignore_errors=True)
                waiting.remove(b)
                claimed = True
                yield b
            finally:
                # the file goes with the claim (a waiter holding the old file's lock sees it gone and looks
                # again), so only a claim of a killed process stays behind, and nobody holds it
                claim.path.unlink(missing_ok=True)
                claim.release()
        if waiting and not claimed:
            time.sleep(CLAIM_POLL_S)


@contextlib.contextmanager
def merge_lock(final: Path) -> Iterator[None]:
    """Hold the entry's merge lock (``.<entry>.merge.lock`` beside it), waiting for another merger.

    The caller merges only when ``final`` is still absent once it holds the lock. Under the lock,
    the temporary entry folders of killed merges (``<entry>.tmp-*``) are removed; the lock file
    goes with the lock."""
    lock = FileLock(final.with_name(f".{final.name}.merge.lock"))
    while not lock.acquire():
        time.sleep(CLAIM_POLL_S)
    try:
        for stale in final.parent.glob(f"{final.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        yield
    finally:
        lock.path.unlink(missing_ok=True)  # as a claim's: a waiter on the old file looks again
        lock.release()


def remove_stale_partial(final: Path) -> bool:
    """Remove ``<final>.partial`` beside the complete entry ``final`` when no process holds a claim in it.

    Returns True when it was removed. A claim still held (a run that has not yet seen the complete
    entry) leaves the folder; that run finds the entry at its next look and writes nothing."""
    partial = final.with_name(final.name + ".partial")
    if not final.is_dir() or not partial.is_dir():
        return False
    claims = [FileLock(f) for f in partial.glob(".*.claim")]
    try:
        if not all(claim.acquire() for claim in claims):
            return False
        shutil.rmtree(partial, ignore_errors=True)
        logger.info("removed %s: its entry is complete and no run holds a claim in it", partial)
        return True
    finally:
        for claim in claims:
            claim.release()
