"""The regeneration cache checked on load: a checksum of every file, and token ids inside the target's vocabulary.

Every folder :func:`exittrain.data.regen_cache.save_atomic` writes (a finished batch's shard, a
complete entry) carries :data:`CHECKSUM_FILE`, written with it: ``{"algorithm": "crc32", "files":
{relative path: {"bytes": size, "crc32": hex}}}`` over every other file in the folder (the Arrow
data, ``state.json``, ``dataset_info.json``, the metadata, the safetensors files of features and
soft labels).

:func:`verify_entry` is what a run calls before it reads an entry: every listed file must exist
with its size and checksum (a changed byte anywhere, a file cut short or replaced), and with a
``vocab_size`` every token id of the rows must lie in ``[0, vocab_size)`` (a damaged cache whose
ids stay in range is caught by the checksum; one written for another target by the range). A
failure is a ``ValueError`` naming the entry, the file and how to regenerate it. An entry written
before the checksums existed is read with a warning, its token range still checked.

Why crc32: the checksum guards against damage (a bad sector, a copy cut short, an edit by hand),
not against an adversary, and zlib's crc32 is the fastest checksum of the standard library on the
hosts measured (ahead of sha1, sha256, md5 and blake2b; its cost beside a run's load is in
docs/training.md, "Several jobs on one cache, and when a check fires"). The files are read through
a memory map, so a folder the page cache already holds costs the hash alone. Standard library and
pyarrow only.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import zlib
from pathlib import Path
from typing import Any

__all__ = ["CHECKSUM_FILE", "file_crc32", "verify_checksums", "verify_entry", "write_checksums"]

logger = logging.getLogger(__name__)

CHECKSUM_FILE = "exittrain_checksums.json"


def file_crc32(path: str | os.PathLike) -> str:
    """zlib's crc32 of the file's bytes, as 8 hex digits."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return f"{0:08x}"
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return f"{zlib.crc32(data):08x}"


def _files(folder: Path) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE
    )


def write_checksums(folder: str | os.PathLike) -> dict[str, Any]:
    """Write :data:`CHECKSUM_FILE` into ``folder`` over every other file in it (before the folder is
    renamed into place); returns its content."""
    folder = Path(folder)
    files = {n: {"bytes": (folder / n).stat().st_size, "crc32": file_crc32(folder / n)} for n in _files(folder)}
    content = {"algorithm": "crc32", "files": files}
    with open(folder / CHECKSUM_FILE, "w") as f:
        json.dump(content, f, indent=1, sort_keys=True)
    return content


def verify_checksums(folder: str | os.PathLike, *, what: str, fix: str) -> bool:
    """Check every file :data:`CHECKSUM_FILE` lists in ``folder``: present, its size, its crc32.

    ``what`` names the folder in messages ("cache entry", "batch shard"), ``fix`` says how to
    regenerate it. Returns False when the folder has no checksum file (written before they existed);
    raises ``ValueError`` naming the folder and the file on any mismatch or an unreadable list.
    """
    folder = Path(folder)
    listing = folder / CHECKSUM_FILE
    if not listing.is_file():
        return False
    try:
        files = json.loads(listing.read_text())["files"]
        expected = {str(name): (int(v["bytes"]), str(v["crc32"])) for name, v in files.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{what} {folder}: its checksum list {CHECKSUM_FILE} is damaged ({e}): {fix}") from e
    for name, (size, crc) in expected.items():
        file = folder / name
        if not file.is_file():
            raise ValueError(f"{what} {folder}: its file {name} is missing: {fix}")
        got = file.stat().st_size
        if got != size:
            raise ValueError(
                f"{what} {folder}: its file {name} holds {got} bytes, {size} when written (cut short or replaced): "
                f"{fix}"
            )
        if file_crc32(file) != crc:
            raise ValueError(
                f"{what} {folder}: its file {name} does not match the checksum written with it (changed on disk: "
                f"a bad sector, an interrupted copy or an edit): {fix}"
            )
    return True


def verify_entry(path: str | os.PathLike, *, vocab_size: int | None = None) -> None:
    """Check the complete cache entry at ``path`` before a run reads it (see the module docstring).

    ``vocab_size``: the target's vocabulary (rows of its embedding); every token id of the rows'
    ``input_ids`` must be below it (None: the range is not checked). Raises ``ValueError`` naming
    the entry, the file and the fix: delete the entry folder, and the next run regenerates it.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    path = Path(path)
    fix = f"delete the cache entry folder {path}; the next run (fit or prepare, same settings) regenerates it"
    if not verify_checksums(path, what="cache entry", fix=fix):
        logger.warning(
            "cache entry %s has no %s (written before exittrain kept checksums): it is read unchecked except for "
            "its token range; delete it to regenerate it with checksums",
            path,
            CHECKSUM_FILE,
        )
    if vocab_size is None:
        return
    for file in sorted(path.glob("data-*.arrow")):
        with pa.memory_map(str(file)) as source:
            table = pa.ipc.open_stream(source).read_all()
        ids = table.column("input_ids").combine_chunks()
        values = pc.list_flatten(ids)
        if len(values) == 0:
            continue
        bounds = pc.min_max(values)
        low, high = bounds["min"].as_py(), bounds["max"].as_py()
        if low >= 0 and high < vocab_size:
            continue
        bad = pc.or_(pc.less(values, 0), pc.greater_equal(values, vocab_size))
        first = pc.index(bad, True).as_py()
        row = pc.list_parent_indices(ids)[first].as_py()
        prompt_index = table.column("prompt_index")[row].as_py()
        raise ValueError(
            f"cache entry {path}: its file {file.name} holds token id {values[first].as_py()} (row {row}, "
            f"prompt_index {prompt_index}; ids span [{low}, {high}]) outside the target's vocabulary "
            f"[0, {vocab_size}): the entry is damaged or was written for another target. Fix: {fix}"
        )
