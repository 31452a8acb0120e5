"""The training step's clocks wait for the device: ``exittrain.timing.device_now`` and ``StageTimer``.

CUDA runs kernels asynchronously: a clock read right after a launch measures the launch, not the work.
The tests queue ~0.2 s of device work (``torch.cuda._sleep``, a kernel that spins for a number of
cycles; 4e8 cycles take 0.2 s at 2 GHz, longer at lower clocks) and check that the clock returns only
once the stream is idle. On the CPU (``EXITTRAIN_GPU_TESTS_ON=cpu``) work runs as it is called and
the clocks only read ``time.perf_counter``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from exittrain.timing import StageTimer, device_now

pytestmark = pytest.mark.gpu

SLEEP_CYCLES = 400_000_000
MIN_WAIT_S = 0.05  # well under the 0.2 s the sleep takes on any current GPU, far above a launch


def queue_work(device: torch.device) -> Callable[[], bool]:
    """Queue device work without waiting for it; returns a function telling whether it has finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # nothing else is queued
        torch.cuda._sleep(SLEEP_CYCLES)
        return torch.cuda.current_stream(device).query
    x = torch.randn(64, 64)
    x @ x  # done when it returns
    return lambda: True


def test_device_now_waits_for_queued_work(device):
    finished = queue_work(device)
    finished_at_launch = finished()
    start = time.perf_counter()
    device_now(device)
    waited = time.perf_counter() - start
    assert finished(), "device_now returned while the device was still working"
    if device.type == "cuda":
        assert not finished_at_launch, "the queued work ended before it could be timed: raise SLEEP_CYCLES"
        assert waited > MIN_WAIT_S, f"device_now waited {waited:.3f} s for ~0.2 s of queued work"


def test_a_stage_timer_lap_holds_the_device_time_of_its_part(device):
    timer = StageTimer(device, ("work", "idle"))
    finished = queue_work(device)
    timer.lap("work")
    assert finished()
    timer.lap("idle")
    assert timer.ms["work"] >= 0 and timer.ms["idle"] >= 0
    if device.type == "cuda":
        assert timer.ms["work"] > 1e3 * MIN_WAIT_S and timer.ms["idle"] < timer.ms["work"], timer.ms
