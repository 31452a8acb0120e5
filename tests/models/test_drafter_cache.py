"""The drafter's context K/V API: a cache built incrementally with ``project_context`` and
``ContextKV.extend`` drafts the same block as the training forward (tiny targets, CPU)."""

from __future__ import annotations

import pytest
import torch

from exittrain.models import new_drafter
from exittrain.models.drafter.layers import ContextKV
from tests.models.helpers import VOCAB, tiny_target

S = 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def _drafter(target, **kw):
    d = new_drafter(
        target, block_size=S, num_layers=2, num_heads=4, num_key_value_heads=2, seed=0, layer_ids=[0, 1], **kw
    )
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return d


def _inputs(d, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, d.config.feature_size, generator=g), torch.randint(2, VOCAB, (1, T), generator=g)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("copy", [[], [2, 1]])
def test_incremental_cache_equals_the_training_forward(target, window, copy):
    d = _drafter(target, context_window=window, copy_ngrams=copy)
    feats, ids = _inputs(d)
    T = feats.shape[1]
    with torch.no_grad():
        full = d.forward_anchors(feats, ids, torch.arange(1, T)[None])  # (T-1, K, V): anchors 1..T-1
        cache, drafted = None, []
        for a in range(1, T):  # one committed position per round, as a decoder grows its cache
            new = d.project_context(feats[:, a - 1 : a], torch.tensor([[a - 1]]))
            cache = new if cache is None else cache.extend(new)
            drafted.append(
                d.draft_block(ids[0, a : a + 1], torch.tensor([a]), cache, context_ids=ids[:, :a])
            )
    assert cache.length == T - 1 and cache.keys[0].shape == (1, 2, T - 1, d.config.head_dim)
    torch.testing.assert_close(torch.cat(drafted), full, atol=2e-5, rtol=1e-5)
    # the check can fail: a cache that lost its first position drafts another block (without a window)
    if window is None:
        short = ContextKV(tuple(k[:, :, 1:] for k in cache.keys), tuple(v[:, :, 1:] for v in cache.values))
        other = d.draft_block(ids[0, T - 1 :], torch.tensor([T - 1]), short, context_ids=ids[:, : T - 1])
        assert (other - full[-1:]).abs().max() > 1e-3


def test_forward_is_draft_block_on_a_fresh_cache(target):
    d = _drafter(target)
    feats, ids = _inputs(d, T=9, seed=1)
    with torch.no_grad():
        direct = d(feats[:, :-1].expand(2, -1, -1), ids[0, -1:].expand(2))
        kv = d.project_context(feats[:, :-1], torch.arange(8)[None] + 100)  # absolute positions shift nothing
        cached = d.draft_block(ids[0, -1:].expand(2), torch.tensor([108, 108]), kv)  # batch-1 cache, 2 roots
    torch.testing.assert_close(cached, direct, atol=2e-5, rtol=1e-5)


def test_crop_and_last(target):
    d = _drafter(target)
    feats, _ = _inputs(d, T=6)
    kv = d.project_context(feats, torch.arange(6)[None])
    assert kv.crop(4).length == 4 and kv.last(2).length == 2 and kv.last(10) is kv
    torch.testing.assert_close(kv.last(2).keys[1], kv.keys[1][:, :, 4:])
    with pytest.raises(ValueError, match="batch 1 or N"):
        two = ContextKV(tuple(torch.cat([k, k]) for k in kv.keys), tuple(torch.cat([v, v]) for v in kv.values))
        d.draft_block(torch.tensor([3, 4, 5]), torch.tensor([6, 6, 6]), two)  # a cache of 2 rows for 3 roots
