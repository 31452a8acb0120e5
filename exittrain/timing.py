"""Wall-clock laps for the training step's parts and side-by-side timings, in ms (torch and the
standard library only)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

__all__ = ["StageTimer", "alternating_medians", "device_now"]


def device_now(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work: on CUDA it synchronises first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def alternating_medians(fns: Sequence[Callable[[], object]], repeats: int, clock: Callable[[], float] | None = None
                        ) -> list[float]:
    """The median ms of ``repeats`` timed calls of each of ``fns``, after one untimed warm-up call of each.

    The functions take turns (a, b, a, b, ...), so a load that drifts during the timing slows
    each alike, and one noisy call (a page fault, another process's burst) moves a median no
    more than one sample. ``clock`` (seconds, default ``time.perf_counter``) is injectable: tests
    script it instead of timing their host. CPU work only (no device synchronisation)."""
    clock = time.perf_counter if clock is None else clock
    for fn in fns:
        fn()
    laps: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for lap, fn in zip(laps, fns):
            start = clock()
            fn()
            lap.append(clock() - start)
    return [1e3 * statistics.median(lap) for lap in laps]


class StageTimer:
    """Laps in ms since the previous lap (or the timer's start), summed per part.

    ``parts`` start at 0, so a part that does not run reports 0. On CUDA each lap synchronises
    first, so the parts are device time and not launch time.
    """

    def __init__(self, device: torch.device, parts: tuple[str, ...] = ()):
        self.device = torch.device(device)
        self.ms: dict[str, float] = dict.fromkeys(parts, 0.0)
        self._t = device_now(self.device)

    def lap(self, part: str) -> None:
        now = device_now(self.device)
        self.ms[part] = self.ms.get(part, 0.0) + (now - self._t) * 1e3
        self._t = now
