"""Keep freed host memory in the process (glibc ``mallopt``): fewer page faults in CPU training loops.

glibc serves allocations above ``M_MMAP_THRESHOLD`` (128 KiB to 32 MiB, adjusted as the program
runs) with a fresh ``mmap`` and returns them to the kernel on ``free``; it also trims the heap top
above ``M_TRIM_THRESHOLD``. A CPU training step allocates and frees the same large activations
every step, so each step pays page faults to zero those pages again (kernel time). Raising both
thresholds keeps the freed blocks for reuse: on the default ``fit`` pretrain step on a 2-core CPU
the step's system time and its wall time fell (measured in
docs/notebook/2026-11-30-default-runs-without-copy-branch.md). The cost is that the process's
resident memory stays at its peak.

A no-op outside glibc (macOS, musl) and when ``EXITTRAIN_KEEP_FREED_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD = -1  # glibc malloc.h
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # allocations up to 1 GiB come from the heap and are reused after free
_TRIM_THRESHOLD = (1 << 31) - 1  # never trim the heap top (the largest value mallopt takes)


def keep_freed_host_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; returns whether it applied."""
    if os.environ.get("EXITTRAIN_KEEP_FREED_MEMORY", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False  # not glibc: another libc's mallopt takes other parameters
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
