"""Fixtures of the Lightning tests: one tiny frozen target, single-threaded torch (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def target(tiny_llama_target):
    return tiny_llama_target
