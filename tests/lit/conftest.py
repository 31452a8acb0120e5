"""Fixtures of the Lightning tests: one tiny frozen target, single-threaded torch."""

from __future__ import annotations

import pytest
import torch

from tests.models.helpers import tiny_target


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run fastest on one thread; on a shared 2-core box, more threads spin and stall."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")
