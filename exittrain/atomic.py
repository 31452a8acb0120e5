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

A write that fails on the file system (a full disk, a quota, a read-only mount) raises the
:class:`OSError` of :func:`write_failure`: it names the final path, what the file is to the run,
the cause, the bytes the write needed when known, the free space left there, and the fix; the
original error is its ``__cause__``. :func:`atomic_open` keeps the first error its file raised,
so a library that trips over the failed write afterwards (torch's archive writer reports
``unexpected pos``) cannot replace it. :func:`write_errors_named` gives any block of writes the
same message.

:class:`FileLock` is an exclusive advisory lock (``flock``) on a small file beside the work it
guards: the kernel releases it when its process exits, however it exits, so a lock file nobody
holds marks work whose owner is gone (used by the regeneration cache's claims).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "FileLock",
    "WriteError",
    "atomic_open",
    "fsync_dir",
    "fsync_tree",
    "remove_stale_temps",
    "temp_sibling",
    "write_errors_named",
    "write_failure",
    "write_folder_atomic",
]

# errnos that mean "this file system has no room for the write"
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# a library that writes in its own code (safetensors' Rust writer) reports the OS error as text only:
# "... (os error 28)" or "IoError(Os { code: 28, kind: StorageFull, ... })"
_OS_ERROR_TEXT = re.compile(r"os error (\d+)|Os \{ code: (\d+)")


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _free_bytes(path: Path) -> int | None:
    """Free bytes for an unprivileged user on the file system of ``path`` (its nearest existing parent)."""
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def os_errno(err: BaseException) -> int | None:
    """The OS error number of ``err``: its ``errno``, or the ``os error N`` a library quoted in its text."""
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno
    found = _OS_ERROR_TEXT.search(str(err))
    return int(found.group(1) or found.group(2)) if found else None


class WriteError(OSError):
    """A write that failed on the file system, in our words (:func:`write_failure`); an ``OSError``."""


def write_failure(
    path: str | os.PathLike,
    err: BaseException,
    *,
    what: str,
    fix: str,
    needed: int | None = None,
    written: int | None = None,
) -> WriteError:
    """The error to raise for a write of ``path`` that failed with ``err`` (raise it ``from err``).

    A :class:`WriteError` (an ``OSError``) with ``err``'s errno whose text names ``what`` and
    ``path``, the cause in words (``err``'s own), the bytes written before it failed (``written``)
    and needed (``needed``) when the caller knows them, the free space left on that file system,
    then ``fix``. For a full disk or quota the fix starts with "free space on that disk"; ``fix``
    says what else (another folder, and that finished work is kept).
    """
    path = Path(path)
    code = os_errno(err)
    free = _free_bytes(path.parent)
    room = f"; {_bytes(free)} free there" if free is not None else ""
    need = f"; the write needed about {_bytes(needed)}" if needed else ""
    need = (f" after {_bytes(written)} were written" if written else "") + need
    if isinstance(err, OSError) and err.strerror:
        reason = err.strerror
    else:
        reason = os.strerror(code) if code is not None else f"{type(err).__name__}: {err}"
    if code in _NO_ROOM:
        cause = f"the disk is full ({reason}){need}{room}"
        advice = f"free space on that disk, or {fix}"
    else:
        cause = f"the write failed ({reason}){need}{room}"
        advice = fix
    return WriteError(code if code is not None else errno.EIO, f"cannot write {what} {path}: {cause}. Fix: {advice}")


@contextlib.contextmanager
def write_errors_named(
    path: str | os.PathLike, *, what: str, fix: str, needed: int | None = None
) -> Iterator[None]:
    """Raise :func:`write_failure` for an ``OSError`` (or a library error quoting one) raised inside.

    Errors that are no ``OSError`` and quote no OS error number pass through unchanged, and so does
    a :class:`WriteError` of an inner block (it names its own file).
    """
    try:
        yield
    except Exception as e:
        if isinstance(e, WriteError) or not (isinstance(e, OSError) or os_errno(e) is not None):
            raise
        raise write_failure(path, e, what=what, fix=fix, needed=needed) from e


class _RecordingFile:
    """A writable file that remembers the first ``OSError`` its writes raised (see :func:`atomic_open`)."""

    def __init__(self, f: IO) -> None:
        self._f = f
        self.error: OSError | None = None
        self.written = 0

    def write(self, data: Any) -> int:
        try:
            n = self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise
        self.written += len(data)
        return n

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


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
def atomic_open(
    path: str | os.PathLike,
    mode: str = "wb",
    *,
    what: str = "file",
    fix: str = "write to a folder on a disk with room and permission, then run again",
    needed: int | None = None,
) -> Iterator[IO]:
    """Open a temporary sibling of ``path`` for writing; on a clean exit it replaces ``path`` durably.

    ``mode`` is ``"wb"`` or ``"w"``. The file gets the usual permissions (0666 less the umask),
    not ``mkstemp``'s private 0600. If the body raises, ``path`` is untouched and the temporary
    file is removed. A failure of the file system (opening, a write, flush, fsync, the rename)
    raises :func:`write_failure`'s ``OSError`` naming ``what``, ``path`` and ``fix`` (``needed``:
    the bytes the write needs, when known), from the first ``OSError`` a write of the file raised
    even when the body then raised something else about it; other exceptions propagate as they are.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"mode={mode!r}: atomic_open writes whole files, use 'wb' or 'w'")
    path = Path(path)
    tmp = temp_sibling(path)
    recorder = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, mode) as f:
            recorder = _RecordingFile(f)
            yield recorder
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except Exception as e:
        first = recorder.error if recorder is not None and recorder.error is not None else e
        if isinstance(first, OSError) and not isinstance(first, WriteError):
            # the first failed write is the cause; what a library raised after it (torch: "unexpected
            # pos") would only describe its own state, so it is not chained in
            written = recorder.written if recorder is not None else None
            raise write_failure(path, first, what=what, fix=fix, needed=needed, written=written) from first
        raise
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def write_folder_atomic(
    path: str | os.PathLike,
    write: Callable[[Path], Any],
    *,
    what: str,
    fix: str,
    needed: int | None = None,
) -> Any:
    """``write(tmp)`` fills a fresh temporary sibling folder, which then replaces the folder ``path``.

    An existing folder is first renamed aside and deleted only after the new one is in place: a
    crash leaves the old complete folder, the new complete one, or (in the instant between two
    renames) the old one under a hidden ``.<name>.*.old`` name, never a half-written folder. The
    new files are fsynced before the renames; hidden ``.tmp`` / ``.old`` folders of killed writes
    are removed after a successful one. A failure of the file system raises :func:`write_failure`'s
    error for ``path`` (``what``, ``fix``, ``needed``). Only one process may write ``path`` at a
    time. Returns what ``write`` returned.
    """
    path = Path(path)
    with write_errors_named(path, what=what, fix=fix, needed=needed):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_sibling(path, "tmp")
        tmp.mkdir()
        old = None
        try:
            result = write(tmp)
            fsync_tree(tmp)
            if path.exists():
                old = temp_sibling(path, "old")
                os.replace(path, old)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if old is not None and not path.exists():
                os.replace(old, path)  # the new folder never arrived: put the previous one back
            elif old is not None:
                shutil.rmtree(old, ignore_errors=True)
    remove_stale_temps(path)
    return result


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


class FileLock:
    """An exclusive, non-blocking ``flock`` on ``path`` (created when absent), recording its holder.

    :meth:`acquire` returns False when another open file holds the lock (another process, or another
    :class:`FileLock` of this one). The holder writes ``pid host time`` into the file, for messages
    (:meth:`holder`). The lock is released by :meth:`release`, or by the kernel when the process
    exits, so a lock file that nobody holds means its last holder is gone. Locks on network file
    systems depend on their ``flock`` support (NFSv4 and Lustre with ``-o flock`` have it).

    An acquired lock whose file was removed meanwhile (a folder deleted under it) is dropped and
    :meth:`acquire` returns False; ``FileNotFoundError`` when the folder of ``path`` is gone.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> bool:
        import fcntl

        if self._fd is not None:
            return True
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            same = False
        if not same:  # the file was removed (or replaced) between the open and the lock
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def holder(self) -> str:
        """``"pid P on HOST since TIME"`` of the last process that held the lock, or ``"an unknown process"``."""
        try:
            pid, host, since = self.path.read_text().split()
        except (OSError, ValueError):
            return "an unknown process"
        return f"pid {pid} on {host} since {since}"

    def __enter__(self) -> FileLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
