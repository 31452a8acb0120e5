"""Crash-safe writes: a temporary sibling, fsync, then one rename (standard library only).

Everything exittrain writes for a later run to read (Lightning checkpoints, exported drafters, the
regeneration cache, metrics JSON) follows one recipe:

1. write under a hidden temporary name in the destination's own directory: the same filesystem,
   so step 3 is a rename and never a copy (a temporary file in ``/tmp`` may sit on another
   filesystem, where a "move" copies bytes into the final name);
2. flush and fsync the data, so a rename that the filesystem journal persists never points at
   data still in memory (power loss, kernel crash);
3. ``os.replace`` onto the final name: atomic on POSIX, so a reader sees the old file or the new
   one, never a mix;
4. fsync the directory, so the rename itself is durable.

A process killed at any moment leaves the previous file in place, plus at worst a hidden
``.NAME.*.tmp`` file that no reader opens (their names never match the final name). A write that
raises removes its temporary file.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

__all__ = ["atomic_open", "fsync_dir", "fsync_tree", "remove_stale_temps", "temp_sibling"]


def temp_sibling(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A fresh hidden name beside ``path``: ``.<name>.<random>.<kind>`` (not created)."""
    path = Path(path)
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.{kind}")


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, making renames and creations inside it durable (a no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems (and Windows) cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file under ``root``, then every directory bottom-up (before renaming ``root`` into place)."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path`` durably.

    ``mode`` is ``"wb"`` or ``"w"``. The file gets the usual permissions (0666 less the umask),
    not ``mkstemp``'s private 0600. If the body raises, ``path`` is untouched and the temporary
    file is removed; the exception propagates.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r}: atomic_open writes whole files, use 'wb' or 'w'")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def remove_stale_temps(path: str | os.PathLike) -> list[Path]:
    """Delete the hidden temporaries (:func:`temp_sibling` names) that killed writers of ``path`` left.

    Call it right after a successful write of ``path``, and only from the one process that writes
    ``path`` (a concurrent writer's temporary would vanish under it). Returns the removed paths.
    """
    path = Path(path)
    pattern = re.compile(rf"^\.{re.escape(path.name)}\.[0-9a-f]{{12}}\.(tmp|old)$")
    removed = []
    for p in path.parent.iterdir():
        if pattern.match(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
            removed.append(p)
    return removed
