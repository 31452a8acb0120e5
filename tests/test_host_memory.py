"""keep_freed_host_memory: applies on glibc, can be switched off, never raises."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = "from exittrain.host_memory import keep_freed_host_memory as k; print(k())"


def _run(env_value: str | None) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != "EXITTRAIN_KEEP_FREED_MEMORY"}
    if env_value is not None:
        env["EXITTRAIN_KEEP_FREED_MEMORY"] = env_value
    # a child process: the setting is process-wide and must not leak into the test session
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True).stdout


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_applies_on_glibc_and_is_switched_off_by_the_environment():
    assert _run(None).strip() == "True"
    assert _run("0").strip() == "False"
