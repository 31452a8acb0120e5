"""Fixtures of the ``gpu`` marker's tests (``make test-gpu``): the device under test, CUDA against the CPU.

``EXITTRAIN_GPU_TESTS_ON=cpu`` makes the CPU the device under test, and tests/conftest.py then keeps
these tests on a host without CUDA: every code path, fixture and subprocess runs there, while the
comparisons become CPU against CPU and pass trivially. Unset, the device is CUDA (and the tests skip
where there is none).
"""

from __future__ import annotations

import os

import pytest
import torch

GPU_TESTS_ON = "EXITTRAIN_GPU_TESTS_ON"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """The device under test: ``cuda``, or the CPU under ``EXITTRAIN_GPU_TESTS_ON=cpu``."""
    value = os.environ.get(GPU_TESTS_ON, "")
    if value not in ("", "cpu"):
        raise pytest.UsageError(f"{GPU_TESTS_ON}={value!r}: leave it unset (CUDA) or set it to cpu")
    return torch.device("cpu" if value == "cpu" else "cuda")


@pytest.fixture
def fp32_matmuls():
    """fp32 products in full fp32 while a test runs (no TF32 on CUDA), whatever the process set before."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)
