"""The drafter's head over a draft vocabulary: the subset product equals the full head masked to
the vocabulary (its reference twin), with ``F.linear`` and with a head product passed explicitly;
the gathered rows are kept by their owner's object, renewed when the weight changes and dropped
with it; and the copy branch still proposes tokens outside the vocabulary."""

from __future__ import annotations

import pytest
import torch

from exittrain.cpu_decode import row_layouts as rm
from exittrain.models import new_drafter
from exittrain.models import vocab_head as vh
from tests.models.helpers import tiny_target


@pytest.mark.parametrize("product", ["linear", "rows", "transposed"])
def test_subset_logits_equal_the_masked_full_head(monkeypatch, product):
    monkeypatch.setattr(rm, "_choose", lambda x, w: product == "transposed")
    g = torch.Generator().manual_seed(0)
    weight, hidden = torch.randn(300, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    ids = torch.tensor([0, 3, 7, 150, 299])
    got = vh.VocabRows().logits(hidden, weight, ids, None if product == "linear" else rm.head_rows)
    want = vh.vocab_logits_reference(hidden @ weight.T, ids)
    assert got.shape == (2, 5, 300)
    assert torch.equal(torch.isinf(got), torch.isinf(want)) and int(torch.isfinite(got[0, 0]).sum()) == 5
    torch.testing.assert_close(got[..., ids], want[..., ids], atol=1e-5, rtol=1e-5)


def test_gathered_rows_are_kept_by_their_owner_and_renewed_when_the_weight_changes():
    weight, ids = torch.randn(50, 8), torch.tensor([1, 4, 9])
    kept, other = vh.VocabRows(), vh.VocabRows()
    first = kept.rows(weight, ids)
    assert kept.rows(weight, ids) is first
    assert other.rows(weight, ids) is not first  # each owner keeps its own: nothing is shared at module level
    with torch.no_grad():
        weight[4] += 1.0  # an in-place update bumps the version: the kept rows are stale
    renewed = kept.rows(weight, ids)
    assert renewed is not first and torch.equal(renewed, weight[ids])
    kept.clear()
    assert kept.rows(weight, ids) is not renewed
    assert not [name for name, value in vars(vh).items() if isinstance(value, (dict, list, torch.Tensor))
                and not name.startswith("__")]  # no module-level cache


def test_each_drafter_owns_its_vocabulary_rows():
    target = tiny_target("llama")
    one, two = (new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=s).eval() for s in (0, 1))
    ids = torch.arange(0, target.vocab_size, 3)
    with torch.no_grad():
        one.head(torch.randn(1, 3, target.hidden_size), vocab_ids=ids)
    assert one._vocab_rows is not two._vocab_rows and two._vocab_rows._rows is None


def test_drafter_head_with_a_vocabulary_and_the_copy_branch():
    target = tiny_target("llama")
    drafter = new_drafter(target, block_size=4, num_layers=1, layer_ids=[2], seed=0, copy_ngrams=[1]).eval()
    hidden = torch.randn(1, 3, target.hidden_size)
    ids = torch.arange(0, target.vocab_size, 2)  # even tokens only
    copy_ids, gates = torch.tensor([[5, -1, 8]]), torch.tensor([[0.0, 0.0, 2.0]])  # 5 is odd: outside
    with torch.no_grad():
        got = drafter.head(hidden, (copy_ids, gates), vocab_ids=ids)
        full = drafter.head(hidden, None)
    probs = got.exp()
    torch.testing.assert_close(probs.sum(-1), torch.ones(1, 3), atol=1e-5, rtol=1e-5)
    assert float(probs[0, 0, 5]) == pytest.approx(0.5, abs=1e-6)  # the gate's mass, on a token the head skips
    assert torch.isinf(got[0, 1, 1::2]).all()  # no copy at depth 2: odd tokens are out
    # on the vocabulary, q is the masked head renormalised and scaled by (1 - g)
    masked = torch.log_softmax(vh.vocab_logits_reference(full, ids), -1)
    torch.testing.assert_close(got[0, 1, ids], masked[0, 1, ids], atol=1e-5, rtol=1e-5)
