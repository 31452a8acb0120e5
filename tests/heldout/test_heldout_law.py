"""The analytic tau of fit's and eval's tables: what HeldOutLaw measures, how it is paired and shown."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.heldout import measures as hl
from exittrain.heldout.decode_eval import format_table
from exittrain.heldout.heldout_law import HeldOutLaw, check_analytic_settings, format_differences
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16]]


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)
    drafters = [new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=s).eval() for s in (0, 1)]
    return target, drafters


def _table(label: str) -> list[dict]:
    return [{"label": label, "budget": 6, "temperature": 0.0, "prompts": 3, "tau": 2.0, "ci95": [1.5, 2.5],
             "tokens_per_s": 10.0}]


def test_it_measures_the_exit_law_at_shared_anchors_without_touching_the_global_rng(models):
    target, (first, second) = models
    law = HeldOutLaw(target, PROMPTS, [0.6, 1.0], anchors_per_answer=3, max_new_tokens=10, seed=2)
    torch.manual_seed(123)
    want_next = torch.rand(3)
    torch.manual_seed(123)
    a = law.measure(first, [6])
    assert torch.equal(torch.rand(3), want_next)  # sampling the answers left the global generator alone
    b = law.measure(second, [6])
    assert set(a) == {(6, 0.6), (6, 1.0)}
    for T in (0.6, 1.0):
        rows, anchors = law._rows_at(T), law.anchors(T, 3)
        assert sum(x.numel() for x in anchors) > 0
        direct = hl.analytic_block_lengths(first, target, rows, [2], anchors, 6, T)
        for got, want in zip(a[(6, T)], direct):
            assert torch.equal(got, want)
        for x, y in zip(a[(6, T)], b[(6, T)]):
            assert x.shape == y.shape  # the same anchors for both drafters
    # the answers at 0.6 and 1.0 are samples at those temperatures: not the same text
    assert any(not torch.equal(r[0], s[0]) for r, s in zip(law._rows_at(0.6), law._rows_at(1.0)))
    # a second law with the same seed samples the same answers
    again = HeldOutLaw(target, PROMPTS, [1.0], anchors_per_answer=3, max_new_tokens=10, seed=2)
    assert all(torch.equal(r[0], s[0]) for r, s in zip(again._rows_at(1.0), law._rows_at(1.0)))

    warm, trained = _table("warm_start"), _table("exittrain")
    law.attach(warm, a)
    law.attach(trained, b, reference=a)
    cell = trained[0]["analytic"]["1"]
    assert cell["tau"] == pytest.approx(float(torch.cat(b[(6, 1.0)]).mean()))
    want = float((torch.cat(b[(6, 1.0)]) - torch.cat(a[(6, 1.0)])).mean())
    assert cell["vs_warm_start"]["delta"] == pytest.approx(want)
    low, high = cell["vs_warm_start"]["ci95"]
    assert low <= want <= high
    assert "vs_warm_start" not in warm[0]["analytic"]["1"]
    text = format_table(warm + trained)
    assert "E[tau] T=0.6 (95% CI)" in text and "E[tau] T=1 (95% CI)" in text
    assert f"{cell['tau']:.2f} (" in text
    lines = format_differences(warm + trained)
    assert len(lines) == 2 and lines[0].startswith("exittrain - warm_start, expected tau at B=6 T=0.6")


def test_a_table_without_analytic_entries_keeps_its_columns():
    header = format_table(_table("x")).splitlines()[0]
    assert "E[tau]" not in header and "tau_oracle" in header


@pytest.mark.parametrize("temperatures, anchors, match", [
    ([0.0], 4, "analytic_temperatures"),
    ([-1], 4, "analytic_temperatures"),
    (["hot"], 4, "analytic_temperatures"),
    ([1.0], 0, "analytic_anchors"),
    ([1.0], 2.5, "analytic_anchors"),
])
def test_bad_settings_name_the_key(temperatures, anchors, match):
    with pytest.raises(ValueError, match=match):
        check_analytic_settings(temperatures, anchors)


def test_no_prompts_is_an_error(models):
    target, _ = models
    with pytest.raises(ValueError, match="eval.num_prompts"):
        HeldOutLaw(target, [], [1.0], anchors_per_answer=2, max_new_tokens=4)
