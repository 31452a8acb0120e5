"""Fixtures shared by every test folder: single-threaded torch and one tiny frozen Llama target; tests
marked ``gpu`` skip, with the reason, where CUDA is not available."""

from __future__ import annotations

import os

import pytest
import torch

from tests.models.helpers import tiny_target


def pytest_collection_modifyitems(config, items):
    """Skip every ``gpu``-marked test on a host without CUDA (they run under ``make test-gpu``)."""
    if torch.cuda.is_available() or os.environ.get("EXITTRAIN_GPU_TESTS_ON") == "cpu":  # tests/gpu/conftest.py
        return
    skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False): run make test-gpu on a GPU host")
    for item in items:
        # the marker itself, not item.keywords: keywords also hold node names, so a folder, module or
        # parameter id named "gpu" would skip tests that are not marked
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread; on a shared 2-core box, more threads spin and stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_llama_target():
    """A tiny random Llama target (one per test module; folders alias it as ``target``)."""
    return tiny_target("llama")
