"""Prompt source specs: the grammar round-trips, hub specs parse, bad specs name the fix."""

from __future__ import annotations

import pytest

from exittrain.data.prompts.domain_sources import HUB_SOURCES
from exittrain.data.prompts.source_spec import PromptSource


@pytest.mark.parametrize(
    "spec, expected",
    [
        (
            "hf:HuggingFaceH4/ultrachat_200k:train_sft:prompt",
            PromptSource("hf", "HuggingFaceH4/ultrachat_200k", field="prompt", split="train_sft"),
        ),
        (
            "hf:openai/gsm8k:main:train:question?limit=100&seed=3",
            PromptSource("hf", "openai/gsm8k", field="question", split="train", name="main", limit=100, seed=3),
        ),
        ("jsonl:/data/x.jsonl:text", PromptSource("json", "/data/x.jsonl", field="text")),
        ("parquet:rel/x.parquet:a.b", PromptSource("parquet", "rel/x.parquet", field="a.b")),
        ("pkg:ifbench?optional=1", PromptSource("pkg", "ifbench", optional=True)),
    ],
)
def test_spec_parsing_round_trips(spec, expected):
    src = PromptSource.parse(spec)
    assert src == expected
    assert PromptSource.parse(str(src)) == src
    assert (
        PromptSource.parse(
            {
                "kind": src.kind,
                "path": src.path,
                "field": src.field,
                "split": src.split,
                "name": src.name,
                "limit": src.limit,
                "seed": src.seed,
                "optional": src.optional,
            }
        )
        == src
    )


def test_every_hub_recipe_spec_parses():
    for sources in HUB_SOURCES.values():
        for spec in sources.train + sources.eval:
            assert PromptSource.parse(spec).kind == "hf"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nokind", "no 'KIND:' prefix"),
        ("csv:x.csv:text", "unknown kind 'csv'"),
        ("hf:repo:text", "hf:REPO:SPLIT:FIELD"),
        ("jsonl:x.jsonl", "must be json:PATH:FIELD"),
        ("pkg:nothing", "unknown builtin prompt set pkg:nothing"),
        ("pkg:codeio?limit=0", "limit=0 must be positive"),
        ("pkg:codeio?size=3", "unknown option 'size'"),
    ],
)
def test_bad_specs_raise_value_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        PromptSource.parse(spec)
