"""The held-out greedy block-length benchmark: feature slicing on a tiny target, and a run on the
embedded target."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.eval import bench_heldout
from exittrain.eval.bench import BENCHES
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target


def test_heldout_bench_is_registered():
    assert BENCHES["heldout"] == "exittrain.eval.bench_heldout"


def test_greedy_block_lengths_read_the_drafters_own_layers_from_a_superset():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)  # all generation reads of it
    drafter = new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=0)
    rows = bench_heldout.answer_with_features(target, [[5, 6, 7], [8, 9, 10, 11]], [0, 2], max_new_tokens=9, batch=2)
    own = bench_heldout.answer_with_features(target, [[5, 6, 7], [8, 9, 10, 11]], [2], max_new_tokens=9, batch=2)
    got, acc = bench_heldout.greedy_block_lengths(drafter, rows, [0, 2], budget=4)
    want, acc_own = bench_heldout.greedy_block_lengths(drafter, own, [2], budget=4)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want)) and torch.equal(acc, acc_own)
    K = 3
    for (ids, n_prompt, _), lengths in zip(rows, got):
        assert lengths.shape == (ids.shape[0] - K - n_prompt + 1,)  # every answer anchor, the last prompt token first
        assert lengths.min() >= 1 and lengths.max() <= K + 1


@pytest.mark.slow
@pytest.mark.real_model
def test_heldout_bench_on_the_embedded_target(tmp_path):
    from exittrain.lit import save_drafter
    from exittrain.models import load_target

    drafter = new_drafter(load_target(None), seed=0)
    save_drafter(drafter, tmp_path / "drafter")
    result = bench_heldout.run([str(tmp_path / "drafter")], prompts=2, skip=8, max_new_tokens=12, budget=4,
                               domain="code", batch=2)
    row = result["rows"][0]
    assert result["prompts"] == 2 and row["anchors"] == 2 * (12 - 7 + 1)
    # an untrained drafter: the root's own block, rarely more
    assert 1.0 <= row["greedy_block_length"] < 1.5 and row["ci95"][0] <= row["greedy_block_length"] <= row["ci95"][1]
    assert "| greedy tau |" in bench_heldout.to_markdown(result)
