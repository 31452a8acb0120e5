"""The drafter's n-gram copy branch: the context lookup and the mixture, against their loop twins,
and the sampled block cross-entropy with the branch against its twin and the full loss."""

from __future__ import annotations

import pytest
import torch

from exittrain.core import (
    block_cross_entropy,
    check_ngrams,
    mix_copy,
    mix_copy_reference,
    mix_soft_labels,
    ngram_lookup,
    ngram_lookup_reference,
    sample_vocabulary,
    sampled_block_cross_entropy,
    sampled_block_cross_entropy_reference,
)


def test_lookup_copies_what_followed_the_latest_match_and_stops_at_the_root():
    #                    0  1  2  3  4  5  6  7  8
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 1, 5, 6]])
    # root x_9 = 6: its 2-gram (5, 6) last ended at e = 6, so the copies are x_7, x_8, x_9; x_10 is unknown
    copy, order = ngram_lookup(ids, torch.tensor([[9]]), [3, 2], horizon=4)
    assert order.tolist() == [[1]]  # the 3-gram (1, 5, 6) never occurred before; n = 2 (index 1) matched
    assert copy.tolist() == [[[1, 5, 6, -1]]]
    # a 3-gram match wins over the 2-gram: root x_6 = 6 after (9, 5): no 3-gram, (5, 6) ends at e = 1
    copy, order = ngram_lookup(ids, torch.tensor([[6]]), [3, 2], horizon=4)
    assert order.tolist() == [[1]] and copy.tolist() == [[[7, 8, 9, 5]]]
    copy, order = ngram_lookup(ids, torch.tensor([[0, 2]]), [1], horizon=2)
    assert order.tolist() == [[-1, -1]] and copy.tolist() == [[[-1, -1], [-1, -1]]]  # nothing before


def test_earliest_lookup_copies_what_followed_the_first_match():
    #                    0  1  2  3  4  5  6  7  8  9
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 1, 5, 6]])
    # root x_9 = 6: (5, 6) ended at e = 1 first (and at 6 last): the copies are x_2 .. x_5
    copy, order = ngram_lookup(ids, torch.tensor([[9]]), [3, 2], horizon=4, earliest=True)
    assert order.tolist() == [[1]] and copy.tolist() == [[[7, 8, 9, 5]]]
    # with one earlier occurrence, earliest and latest agree
    assert torch.equal(ngram_lookup(ids, torch.tensor([[6]]), [2], 4, earliest=True)[0],
                       ngram_lookup(ids, torch.tensor([[6]]), [2], 4)[0])


@pytest.mark.parametrize("earliest", [False, True])
def test_lookup_matches_its_loop_twin_with_padding(earliest):
    g = torch.Generator().manual_seed(0)
    for trial in range(40):
        L, T, A, K = 3, 30, 7, 5
        ids = torch.randint(0, 4, (L, T), generator=g)  # a small vocabulary: many matches
        ids[0, :4] = -1  # left padding never matches and is never copied
        ids[1, 10] = -1
        anchors = torch.randint(0, T, (L, A), generator=g)
        for ngrams in ([3, 2], [1], [2, 1], [4]):
            fast = ngram_lookup(ids, anchors, ngrams, K, earliest=earliest)
            slow = ngram_lookup_reference(ids, anchors, ngrams, K, earliest=earliest)
            assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1]), (trial, ngrams)


@pytest.mark.parametrize("earliest", [False, True])
def test_lookup_never_reads_past_the_root(earliest):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 3, (2, 40), generator=g)
    anchors = torch.tensor([[5, 17, 30], [8, 20, 33]])
    base = ngram_lookup(ids, anchors, [2, 1], 6, earliest=earliest)
    for l in range(2):  # noqa: E741
        for a in anchors[l].tolist():
            changed = ids.clone()
            changed[l, a + 1 :] = (changed[l, a + 1 :] + 1) % 3  # the labels and everything after
            got = ngram_lookup(changed, anchors, [2, 1], 6, earliest=earliest)
            row = anchors[l].tolist().index(a)
            assert torch.equal(got[0][l, row], base[0][l, row]) and got[1][l, row] == base[1][l, row]


def test_check_ngrams_names_the_key():
    assert check_ngrams([3, 2]) == [3, 2] and check_ngrams([]) == []
    for bad in ([0], [2, 2], [1.5], [True]):
        with pytest.raises(ValueError, match="copy_ngrams"):
            check_ngrams(bad)


def test_mix_copy_matches_its_twin_sums_to_one_and_leaves_copyless_rows():
    g = torch.Generator().manual_seed(2)
    logq = torch.log_softmax(torch.randn(4, 3, 10, generator=g, dtype=torch.float64), -1)
    index = torch.tensor([[1, -1, 9], [0, 0, -1], [-1, -1, -1], [5, 2, 3]])
    gate = torch.randn(4, 3, generator=g, dtype=torch.float64)
    mixed = mix_copy(logq, index, gate)
    torch.testing.assert_close(mixed, mix_copy_reference(logq, index, gate))
    torch.testing.assert_close(mixed.exp().sum(-1), torch.ones(4, 3, dtype=torch.float64))
    assert torch.equal(mixed[index < 0], logq[index < 0])
    # the copy token gets at least the gate's share
    g_copy = torch.sigmoid(gate[0, 0])
    assert float(mixed[0, 0, 1].exp()) >= float(g_copy)


def test_mix_copy_gradients_reach_the_gate_and_the_drafter():
    logq = torch.log_softmax(torch.randn(2, 2, 6, dtype=torch.float64), -1).requires_grad_(True)
    gate = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[3, -1], [0, 5]])
    loss = -mix_copy(logq, index, gate)[..., 3].sum()  # label 3 everywhere: the copy is right once
    g_logq, g_gate = torch.autograd.grad(loss, (logq, gate))
    assert float(g_gate[0, 0]) < 0 < float(g_gate[1, 0])  # raise the gate where it copies the label, lower it elsewhere
    assert float(g_gate[0, 1]) == 0.0  # no copy token: the gate takes no part
    assert g_logq.abs().sum() > 0


def _case(seed: int, N: int = 3, K: int = 4, V: int = 40, H: int = 6):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    copy_ids = torch.randint(0, V, (N, K), generator=g)
    copy_ids[0, 0] = labels[0, 0]  # a right copy
    copy_ids[1, :2] = -1  # no copy there
    gate = torch.randn(N, K, generator=g, dtype=torch.float64, requires_grad=True)
    return hidden, weight, labels, copy_ids, gate


@pytest.mark.parametrize("soft", [False, True])
def test_sampled_block_ce_with_copy_matches_its_twin_and_the_full_mixed_loss(soft):
    hidden, weight, labels, copy_ids, gate = _case(3)
    probs = None
    if soft:
        g = torch.Generator().manual_seed(4)
        top_ids = torch.randint(0, 40, (3, 4, 5), generator=g)
        top_ids[0, 1, 0] = copy_ids[0, 1]  # a soft label the copy proposes
        labels, probs = mix_soft_labels(labels, top_ids, torch.randn(3, 4, 5, generator=g), 0.8)
    args = dict(gamma=0.8, label_probs=probs, copy_ids=copy_ids, copy_gate_logits=gate)
    fast = sampled_block_cross_entropy(hidden, weight, labels, 6, torch.Generator().manual_seed(5), **args)
    wanted = torch.cat([labels.reshape(-1), copy_ids[copy_ids >= 0]])
    cand, corr, index = sample_vocabulary(wanted, weight.shape[0], 6, torch.Generator().manual_seed(5))
    assert torch.equal(cand[index], wanted)  # labels and copy tokens are all candidates
    slow = sampled_block_cross_entropy_reference(hidden, weight, labels, cand, corr, **args)
    torch.testing.assert_close(fast, slow)
    for a, b in zip(torch.autograd.grad(fast, (hidden, gate)), torch.autograd.grad(slow, (hidden, gate))):
        torch.testing.assert_close(a, b)
    # every token sampled: the full loss over the mixed log-probabilities
    everything = sampled_block_cross_entropy(hidden, weight, labels, 10_000, **args)
    mixed = mix_copy(torch.log_softmax(hidden @ weight.T, -1), copy_ids, gate)
    torch.testing.assert_close(everything, block_cross_entropy(mixed, labels, gamma=0.8, label_probs=probs))
    plain = sampled_block_cross_entropy(hidden, weight, labels, 10_000, gamma=0.8, label_probs=probs)
    assert abs(float(everything.detach()) - float(plain.detach())) > 1e-3  # the branch takes part


def test_sampled_block_ce_rejects_half_a_copy_branch():
    hidden, weight, labels, copy_ids, gate = _case(6)
    with pytest.raises(ValueError, match="copy_gate_logits"):
        sampled_block_cross_entropy(hidden, weight, labels, 6, copy_ids=copy_ids)
    with pytest.raises(ValueError, match="copy_ids"):
        sampled_block_cross_entropy(hidden, weight, labels, 6, copy_ids=copy_ids[:, :2], copy_gate_logits=gate)
