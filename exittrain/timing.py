"""Wall-clock laps for the training step's parts, in ms (torch and the standard library only)."""

from __future__ import annotations

import time

import torch

__all__ = ["StageTimer", "device_now"]


def device_now(device: torch.device) -> float:
    """``time.perf_counter()`` after the device's queued work: on CUDA it synchronises first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


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
