"""The decoder's drafter cache: the same tokens and draft logits as the full re-read, projecting
only each round's new positions, inside the drafter's context window (tiny models, CPU)."""

from __future__ import annotations

import pytest
import torch

from exittrain.decoding import SpeculativeDecoder
from exittrain.decoding.drafter_context import CachedDrafterContext, FullDrafterContext
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

PROMPT = [5, 17, 33, 2, 40, 41, 9, 12, 7, 7, 30, 31]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3)


@pytest.fixture
def no_eos(target, monkeypatch):
    monkeypatch.setattr(target, "eos_token_ids", [])
    return target


def _drafter(target, **kw):
    drafter = new_drafter(target, block_size=4, num_layers=2, hidden_size=32, seed=0, **kw)
    with torch.no_grad():  # a fresh drafter's zero mask embedding drafts near-uniform blocks; spread them
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return drafter.eval()


def _record_drafts(monkeypatch):
    """Record the draft logits of every round of both context classes (calls the real ones)."""
    seen = {CachedDrafterContext: [], FullDrafterContext: []}
    for cls in seen:
        original = cls.draft

        def draft(self, root_1, original=original, log=seen[cls]):
            logits = original(self, root_1)
            log.append(logits.clone())
            return logits

        monkeypatch.setattr(cls, "draft", draft)
    return seen[CachedDrafterContext], seen[FullDrafterContext]


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("copy", [None, [2, 1]], ids=["plain", "copy"])
@pytest.mark.parametrize("budget", [1, 7])
def test_cached_and_full_reread_decode_the_same_tokens_and_draft_logits(no_eos, target, monkeypatch, window, copy,
                                                                       budget):
    drafter = _drafter(target, context_window=window, copy_ngrams=copy)
    cached_logits, full_logits = _record_drafts(monkeypatch)
    results = {}
    for cached in (True, False):
        decoder = SpeculativeDecoder(target, drafter, budget=budget, verifier="tev", drafter_cache=cached)
        results[cached] = decoder.generate(PROMPT, max_new_tokens=40, temperature=0.0)
    fast, slow = results[True], results[False]
    assert fast.tokens == slow.tokens and len(fast.tokens) == 40
    assert [r.block_length for r in fast.rounds] == [r.block_length for r in slow.rounds]
    assert len(cached_logits) == len(full_logits) == len(fast.rounds)
    for a, b in zip(cached_logits, full_logits):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    # the comparison can fail: consecutive rounds draft different blocks
    assert (cached_logits[0] - cached_logits[-1]).abs().max() > 1e-3


def test_the_cache_projects_only_new_positions_and_keeps_the_window(no_eos, target, monkeypatch):
    window = 6
    drafter = _drafter(target, context_window=window)
    projected = []
    original = drafter.project_context

    def project_context(features, positions):
        projected.append(positions.clone())
        return original(features, positions)

    monkeypatch.setattr(drafter, "project_context", project_context)
    lengths = []
    original_draft = CachedDrafterContext.draft

    def draft(self, root_1):
        lengths.append((self.kv.length, self.length))
        return original_draft(self, root_1)

    monkeypatch.setattr(CachedDrafterContext, "draft", draft)
    result = SpeculativeDecoder(target, drafter, budget=5, drafter_cache=True).generate(PROMPT, 30)
    # the prefill projects the last W prompt positions before the root, each round only what it committed
    first = projected[0][0].tolist()
    assert first == list(range(len(PROMPT) - 1 - window, len(PROMPT) - 1))
    for positions, r, (_, before) in zip(projected[1:], result.rounds, lengths[1:]):
        assert positions[0].tolist() == list(range(before - r.block_length, before))  # root + accepted path
    assert all(kv_len == min(window, committed) for kv_len, committed in lengths)
    assert len(projected) == len(result.rounds)  # the last round projects nothing

