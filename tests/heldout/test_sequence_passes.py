"""The evaluator's kept causal passes (SequencePasses): one pass per token sequence and layers, reused
by every walk over it, continued from its prompt's pass, bounded in bytes and count, dropped with its owner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.heldout.sequence_passes import SequencePasses, pass_bytes
from tests.models.helpers import tiny_target


@pytest.fixture(scope="module")
def target():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)
    return target


def test_a_sequence_runs_one_pass_continued_from_its_prompts(target, monkeypatch):
    """The prompt's pass, then the row's continuing it; the same tokens again (another tensor) run
    none; other tokens run a whole pass. The features equal a whole pass's."""
    passes = SequencePasses(target)
    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    calls, real = [], target.sequence_prefix
    monkeypatch.setattr(target, "sequence_prefix",
                        lambda ids_LT, *a, **k: calls.append(ids_LT.shape[1]) or real(ids_LT, *a, **k))
    first = passes.prefix(ids, [2], shared=3)
    assert calls == [3, 8]
    same = passes.prefix(ids.clone(), [2])
    assert same is first and calls == [3, 8]
    whole = real(ids[None], [2]).features.float()
    assert torch.allclose(first.features, whole, rtol=0, atol=1e-5) and first.features.dtype == torch.float32
    other = ids.flip(0)
    fresh = passes.prefix(other, [2])
    assert calls == [3, 8, 8] and torch.equal(fresh.features, real(other[None], [2]).features.float())
    assert len(passes) == 3 and passes.nbytes == sum(pass_bytes(p) for p in (first, fresh)) + pass_bytes(
        passes.prefix(ids[:3], [2]))
    passes.clear()
    assert len(passes) == 0 and passes.nbytes == 0


def test_the_kept_passes_stay_under_the_byte_bound_and_keep_the_newest(target):
    """Passes beyond ``kept_bytes`` go, least recently used first, so a large target's passes cannot fill
    its device; a reused pass counts as recent, and the newest stays even when it alone is over."""
    rows = [torch.tensor([5, 6, 7, 8, 9, 10, 11, 12]) + i for i in range(4)]  # four passes of one size
    size = pass_bytes(target.sequence_prefix(rows[0][None], [2]))
    assert size > 0
    passes = SequencePasses(target, kept_bytes=2 * size)
    first = passes.prefix(rows[0], [2])
    passes.prefix(rows[1], [2])
    assert passes.prefix(rows[0], [2]) is first  # reused, and now the most recent
    passes.prefix(rows[2], [2])  # over the bound: rows[1], the least recently used, goes
    assert [key[0] for key in passes.keys()] == [tuple(rows[0].tolist()), tuple(rows[2].tolist())]
    assert passes.nbytes <= 2 * size
    tight = SequencePasses(target, kept_bytes=size // 2)  # not even one pass fits
    tight.prefix(rows[2], [2])
    newest = tight.prefix(rows[3], [2])
    assert tight.keys() == [(tuple(rows[3].tolist()), (2,))] and tight.prefix(rows[3], [2]) is newest
    counted = SequencePasses(target, kept=2)
    for row in rows:
        counted.prefix(row, [2])
    assert len(counted) == 2
    with pytest.raises(ValueError, match="kept=0"):
        SequencePasses(target, kept=0)


def test_two_owners_keep_their_own_passes(target):
    """Nothing is kept at module level: a second object runs its own pass."""
    ids = torch.tensor([5, 6, 7, 8, 9])
    a, b = SequencePasses(target), SequencePasses(target)
    assert a.prefix(ids, [2]) is not b.prefix(ids, [2])


def test_a_pass_continued_from_its_prompts_equals_a_whole_one(target):
    """sequence_prefix(past=...): the K/V and features of the prompt's pass followed by the rest's
    equal a whole pass's up to float rounding, and the past is left as it was; a past over other
    tokens or layers is refused."""
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    whole = target.sequence_prefix(ids, [0, 2])
    past = target.sequence_prefix(ids[:, :5], [0, 2])
    kept = [(k.clone(), v.clone()) for k, v in past.kv]
    continued = target.sequence_prefix(ids, [0, 2], past=past)
    assert continued.features.shape == whole.features.shape == (1, 8, 2 * target.hidden_size)
    assert torch.allclose(continued.features, whole.features, rtol=0, atol=1e-5)
    for (k, v), (wk, wv) in zip(continued.kv, whole.kv, strict=True):
        assert k.shape == wk.shape and torch.allclose(k, wk, rtol=0, atol=1e-5)
        assert torch.allclose(v, wv, rtol=0, atol=1e-5)
    assert all(torch.equal(k, pk) and torch.equal(v, pv) for (k, v), (pk, pv) in zip(kept, past.kv, strict=True))
    for bad, match in ((target.sequence_prefix(ids[:, 1:6], [0, 2]), "first tokens"),
                       (target.sequence_prefix(ids[:, :5], [2]), "layers"), (whole, "covers 8 tokens")):
        with pytest.raises(ValueError, match=match):
            target.sequence_prefix(ids, [0, 2], past=bad)
