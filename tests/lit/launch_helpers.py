"""Launching a multi-process run from a test: a clean environment and one process group to kill on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def clean_env() -> dict[str, str]:
    """This environment without launcher variables (a stale MASTER_PORT or SLURM job would hijack the run)."""
    launcher = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    env = {k: v for k, v in os.environ.items() if k not in launcher and not k.startswith(("SLURM_", "PL_"))}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def run_group(cmd: list[str], cwd: Path, label: str, timeout_s: float, tail: int = 4000) -> str:
    """Run ``cmd`` in its own process group under :func:`clean_env`; returns its output. On timeout the
    whole group (a launcher and every rank it started) is killed and the test fails with the output's
    tail; a non-zero exit fails it likewise."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{label} timed out after {timeout_s} s:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-tail:]
    return output
