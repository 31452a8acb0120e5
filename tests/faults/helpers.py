"""A disk that fills, for the fault tests: a file whose writes raise ENOSPC past a byte budget."""

from __future__ import annotations

import errno
import os
import traceback


class FillingFile:
    """A writable file that takes ``room`` bytes, then raises ``OSError(ENOSPC)`` like a full disk.

    Wraps a real file (what ``os.fdopen`` returned): the bytes that fit are written to it."""

    def __init__(self, f, room: int) -> None:
        self._f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self._f.write(data)

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def fill_disk_after(monkeypatch, room: int) -> None:
    """Every file ``os.fdopen`` opens (what ``exittrain.atomic.atomic_open`` writes) fills after ``room`` bytes."""
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda fd, *args, **kwargs: FillingFile(real(fd, *args, **kwargs), room))


def printed(err: BaseException) -> str:
    """The traceback Python prints for ``err`` (its cause and context chain included)."""
    return "".join(traceback.format_exception(err))


# the text safetensors' writer (Rust) raises on a full disk
SAFETENSORS_FULL = (
    'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
)
