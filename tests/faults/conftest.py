"""Fixtures of the fault tests: the embedded tokenizer (shared with tests/data) and a cache's runs."""

from __future__ import annotations

from tests.data.conftest import smollm2_tokenizer  # noqa: F401  (a fixture, found by pytest under this name)
