"""The regeneration benchmark: registered, and its five arms run on the embedded target."""

from __future__ import annotations

import pytest

from exittrain.bench import regen as bench_regen
from exittrain.bench.registry import BENCHES


def test_regen_bench_is_registered():
    assert BENCHES["regen"] == "exittrain.bench.regen"


@pytest.mark.slow
@pytest.mark.real_model
def test_regen_bench_compares_fp32_and_bf16_answers(tmp_path):
    result = bench_regen.run(prompts=4, max_new_tokens=6, batch=2, domain="code")
    arms = [r["arm"] for r in result["rows"]]
    assert arms == [
        "float32",
        "float32, shared prefix",
        "bfloat16",
        "bfloat16 + features",
        "bfloat16 + features, shared prefix",
    ]
    for row in result["rows"]:
        assert row["seconds"] > 0 and row["new_tok_per_s"] > 0
    for row in result["rows"][1:]:
        assert 0.0 <= row["same_answer"] <= 1.0 and row["speedup"] > 0
        # a bf16 copy of the same target: its greedy answers are the fp32 target's picks almost everywhere
        assert row["fp32_next_token_agreement"] >= 0.8
    by_arm = {r["arm"]: r for r in result["rows"]}
    # keeping features changes no answer; sharing the prompts' prefix changes none either
    assert by_arm["bfloat16"]["answers_sha256"] == by_arm["bfloat16 + features"]["answers_sha256"]
    assert by_arm["float32"]["answers_sha256"] == by_arm["float32, shared prefix"]["answers_sha256"]
    assert result["mean_shared_prefix_tokens"] >= 24  # the chat template's system turn at least
    markdown = bench_regen.to_markdown(result)
    assert "| bfloat16 + features |" in markdown and "4 code prompts" in markdown
