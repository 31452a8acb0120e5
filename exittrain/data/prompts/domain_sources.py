"""The default prompt sources of each domain: what a library caller that passes no sources gets.

``load_domain("code")`` and ``ExitTrainDataModule(domain="code")`` read :data:`DOMAIN_SOURCES`, plain
Python values: the data layer reads no Hydra config. The data configs (``conf/data/*.yaml``) list
the same sources as ``train_sources`` and ``eval_sources``, which is what a run trains and evaluates
on; ``tests/data/test_domain_sources.py`` checks that each config and this table agree, so a change to
one that forgets the other fails there. Specs follow :mod:`exittrain.data.prompts.source_spec`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DOMAIN_SOURCES", "HUB_SOURCES", "DomainSources"]


@dataclass(frozen=True)
class DomainSources:
    """The default train and evaluation sources of one domain (spec strings or mappings)."""

    train: tuple[str | Mapping[str, Any], ...]
    eval: tuple[str | Mapping[str, Any], ...]


DOMAIN_SOURCES: dict[str, DomainSources] = {
    "code": DomainSources(
        train=("pkg:codeio", "pkg:codeio_stub"),  # CodeI/O tasks: as described, and as function stubs
        eval=("pkg:humaneval",),
    ),
    "dialogue": DomainSources(
        train=("pkg:sharegpt_dummy", "pkg:ifbench?optional=1"),  # ifbench: skipped when not installed
        eval=("pkg:mt_bench",),
    ),
    "math": DomainSources(
        # gsm_symbolic seeds problem i with seed + i: the evaluation seed is far from the training one
        train=("pkg:gsm_symbolic?limit=5000&seed=1",),
        eval=("pkg:gsm_symbolic?limit=500&seed=1000000",),
    ),
}
"""The default sources of each domain, packaged and offline (the same lists as ``conf/data/<domain>.yaml``)."""

HUB_SOURCES: dict[str, DomainSources] = {
    "dialogue": DomainSources(
        train=("hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt",),
        eval=("hf:HuggingFaceH4/mt_bench_prompts:train:prompt.0",),
    ),
    "code": DomainSources(
        train=("hf:google-research-datasets/mbpp:full:train:text",),
        eval=("hf:openai/openai_humaneval:test:prompt",),
    ),
    "math": DomainSources(
        train=("hf:openai/gsm8k:main:train:question",),
        eval=("hf:openai/gsm8k:main:test:question", "hf:HuggingFaceH4/MATH-500:test:problem"),
    ),
}
"""Hub datasets for users with a network, read by the same loader: put them in a data config's lists
or on the command line (``data.train_sources='[hf:openai/gsm8k:main:train:question]'``)."""
