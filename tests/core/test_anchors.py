"""Anchor sampling (exittrain.core.anchors): candidates, padding, reproducibility, and the loop twin."""

from __future__ import annotations

import torch

from exittrain.core import anchor_generator, sample_anchors, sample_anchors_reference

K = 3  # drafted tokens per anchor



def brute_candidates(mask_T: torch.Tensor, length: int, k: int) -> set[int]:
    return {a for a in range(length) if a + k < length and all(bool(mask_T[a + j]) for j in range(1, k + 1))}


def test_sample_anchors_respects_horizon_mask_and_padding():
    L, T, A = 4, 20, 4
    lengths = torch.tensor([20, 14, 6, 3])
    starts = [10, 7, 3, 1]
    mask = torch.zeros(L, T, dtype=torch.bool)
    for l, (n, s) in enumerate(zip(lengths.tolist(), starts)):
        mask[l, s:n] = True
    anchors, valid = sample_anchors(mask, lengths, A, K, anchor_generator(0, 0))
    assert anchors.shape == valid.shape == (L, A) and anchors.dtype == torch.long
    for l in range(L):
        cand = brute_candidates(mask[l], int(lengths[l]), K)
        chosen = anchors[l][valid[l]].tolist()
        assert len(chosen) == min(A, len(cand)) == int(valid[l].sum())
        assert len(set(chosen)) == len(chosen), "without replacement"
        assert set(chosen) <= cand
        assert valid[l].tolist() == sorted(valid[l].tolist(), reverse=True), "valid slots come first"
        padded = anchors[l][~valid[l]].tolist()
        assert set(padded) <= (cand or {0}), "padding repeats the sequence's own candidates (or 0 if none)"
    # sequence 2: the root may be the last prompt token (a = 2, labels 3..5 are the whole response)
    assert anchors[2, 0].item() == 2 and valid[2].tolist() == [True, False, False, False]
    assert not valid[3].any() and anchors[3].eq(0).all()


def test_sample_anchors_finds_every_candidate_of_random_masks():
    g = torch.Generator().manual_seed(3)
    L, T = 6, 30
    mask = torch.rand(L, T, generator=g) < 0.8
    lengths = torch.randint(K, T + 1, (L,), generator=g)
    anchors, valid = sample_anchors(mask, lengths, T, K, anchor_generator(1, 7))
    for l in range(L):
        assert set(anchors[l][valid[l]].tolist()) == brute_candidates(mask[l], int(lengths[l]), K)


def test_sample_anchors_reproducible_per_seed_and_step():
    mask = torch.ones(2, 64, dtype=torch.bool)
    lengths = torch.tensor([64, 64])

    def draw(seed, step):
        return sample_anchors(mask, lengths, 8, K, anchor_generator(seed, step))[0]

    assert torch.equal(draw(0, 5), draw(0, 5))
    assert not torch.equal(draw(0, 5), draw(0, 6))
    assert not torch.equal(draw(0, 5), draw(1, 5))


def test_sample_anchors_equals_its_loop_twin_on_random_masks():
    g = torch.Generator().manual_seed(11)
    for trial in range(40):
        L = int(torch.randint(1, 5, (1,), generator=g))
        T = int(torch.randint(1, 40, (1,), generator=g))
        A = int(torch.randint(1, 12, (1,), generator=g))
        horizon = int(torch.randint(1, 5, (1,), generator=g))
        mask = torch.rand(L, T, generator=g) < 0.7
        lengths = torch.randint(0, T + 1, (L,), generator=g) if trial % 2 else None
        fast = sample_anchors(mask, lengths, A, horizon, anchor_generator(trial, 3))
        slow = sample_anchors_reference(mask, lengths, A, horizon, anchor_generator(trial, 3))
        assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), trial
