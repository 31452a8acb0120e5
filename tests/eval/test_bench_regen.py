"""The regeneration benchmark: registered, and its three arms run on the embedded target."""

from __future__ import annotations

import pytest

from exittrain.eval import bench_regen
from exittrain.eval.bench import BENCHES


def test_regen_bench_is_registered():
    assert BENCHES["regen"] == "exittrain.eval.bench_regen"


@pytest.mark.slow
@pytest.mark.real_model
def test_regen_bench_compares_fp32_and_bf16_answers(tmp_path):
    result = bench_regen.run(prompts=4, max_new_tokens=6, batch=2, domain="code")
    arms = [r["arm"] for r in result["rows"]]
    assert arms == ["float32", "bfloat16", "bfloat16 + features"]
    for row in result["rows"]:
        assert row["seconds"] > 0 and row["new_tok_per_s"] > 0
    for row in result["rows"][1:]:
        assert 0.0 <= row["same_answer"] <= 1.0 and row["speedup"] > 0
        # a bf16 copy of the same target: its greedy answers are the fp32 target's picks almost everywhere
        assert row["fp32_next_token_agreement"] >= 0.8
    # keeping features changes no answer
    assert result["rows"][1]["answers_sha256"] == result["rows"][2]["answers_sha256"]
    markdown = bench_regen.to_markdown(result)
    assert "| bfloat16 + features |" in markdown and "4 code prompts" in markdown
