"""Training-time tree scoring against per-anchor forwards of each path (tiny random Llama / Qwen2 /
Qwen3, fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from exittrain.models import TargetModel
from tests.models.helpers import VOCAB, last_logits, path_tokens, random_trees, tiny_target

ATOL = 2e-5
KINDS = ["llama", "qwen2", "qwen3"]


@pytest.fixture(scope="module", params=KINDS)
def target(request) -> TargetModel:
    return tiny_target(request.param)


def _sequences(L: int, T: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (L, T), generator=g)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_score_trees_exact_matches_per_anchor_forwards(target, chunk_size):
    L, T, K, B = 2, 14, 3, 5
    seqs = _sequences(L, T, seed=11)
    anchors = torch.tensor([[0, 4, 10], [2, 7, 13]])
    A = anchors.shape[1]
    trees = random_trees(L * A, k=K, budget=B, seed=12)
    scores = target.score_trees(seqs, anchors, trees, mode="exact", chunk_size=chunk_size, layers=[0, 2])
    assert scores.logits.shape == (L * A, B + 1, VOCAB)
    for l in range(L):
        for a in range(A):
            n, pos = l * A + a, int(anchors[l, a])
            for row in range(B + 1):
                ids = seqs[l, : pos + 1].tolist() + path_tokens(trees, n, row)
                torch.testing.assert_close(scores.logits[n, row], last_logits(target, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(scores.features, target.sequence_features(seqs, [0, 2]), atol=ATOL, rtol=0)
    assert scores.features.shape == (L, T, 64)


@pytest.mark.parametrize("chunk_size", [None, 4])
def test_score_trees_windowed_matches_truncated_forwards(target, chunk_size):
    L, T, K, B, W = 2, 12, 3, 4, 4
    seqs = _sequences(L, T, seed=21)
    anchors = torch.tensor([[1, 6, 11], [0, 4, 9]])
    A = anchors.shape[1]
    trees = random_trees(L * A, k=K, budget=B, seed=22)
    scores = target.score_trees(seqs, anchors, trees, mode="windowed", window=W, chunk_size=chunk_size)
    assert scores.features is None
    for l in range(L):
        for a in range(A):
            n, pos = l * A + a, int(anchors[l, a])
            for row in range(B + 1):
                ids = seqs[l, max(0, pos - W) : pos + 1].tolist() + path_tokens(trees, n, row)
                torch.testing.assert_close(scores.logits[n, row], last_logits(target, ids), atol=1e-4, rtol=0)
    # an anchor with a long prefix really is truncated: exact differs from windowed there
    exact = target.score_trees(seqs, anchors, trees, mode="exact").logits
    assert (exact[2] - scores.logits[2]).abs().max() > 1e-3


def test_score_trees_validates_input(target):
    seqs = _sequences(1, 6, seed=1)
    trees = random_trees(2, k=2, budget=3)
    with pytest.raises(ValueError, match="L\\*A"):
        target.score_trees(seqs, torch.tensor([[1]]), trees)
    with pytest.raises(ValueError, match="anchors_LA"):
        target.score_trees(seqs, torch.tensor([[1, 6]]), trees)
    with pytest.raises(ValueError, match="mode"):
        target.score_trees(seqs, torch.tensor([[1, 2]]), trees, mode="fast")
    with pytest.raises(ValueError, match="layers"):
        target.score_trees(seqs, torch.tensor([[1, 2]]), trees, layers=[3])


def test_scoring_leaves_target_weights_untouched():
    target = tiny_target("llama")
    before = {k: v.clone() for k, v in target.model.state_dict().items()}
    seqs = _sequences(1, 8, seed=3)
    target.score_trees(seqs, torch.tensor([[2, 5]]), random_trees(2, k=2, budget=3), layers=[1])
    assert all(torch.equal(before[k], v) for k, v in target.model.state_dict().items())
    assert all(p.grad is None for p in target.model.parameters())
