import math

import pytest
import torch

from exittrain.core import (
    WEIGHT_TYPES,
    block_cross_entropy,
    block_cross_entropy_reference,
    build_tree,
    exit_law,
    exit_node_loss,
    exit_node_loss_reference,
    mix_soft_labels,
)


def setup_case(seed, N=4, K=3, V=7, B=9):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, K, V, generator=g, dtype=torch.float64, requires_grad=True)
    tree = build_tree(torch.log_softmax(logits.detach(), -1), B)
    probs = torch.softmax(torch.randn(N, B + 1, V, generator=g, dtype=torch.float64) * 2, -1)
    return logits, tree, probs


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 1e-4, 0.1])
def test_node_loss_matches_loop_twin_on_values_and_gradients(weight_type, alpha):
    logits, tree, probs = setup_case(3)
    law = exit_law(tree, probs, alpha)
    fast = exit_node_loss(logits, tree, law, weight_type, probs)
    (grad_fast,) = torch.autograd.grad(fast, logits)
    slow = exit_node_loss_reference(logits, tree, law, weight_type, probs)
    (grad_slow,) = torch.autograd.grad(slow, logits)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(grad_fast, grad_slow)
    assert float(fast.detach()) > 0


def test_missing_label_is_the_omitted_target_mass():
    """Each row's soft label mass equals sum over rows v at that depth of P(v) rho(v)."""
    from exittrain.core.losses import soft_labels

    logits, tree, probs = setup_case(4, N=2, K=4, V=6, B=12)
    law = exit_law(tree, probs)
    label = soft_labels(tree, law, "missing", 6, probs)  # (N, K, V)
    for k in range(4):
        at_depth = (tree.positions == k) & tree.valid_with_root
        expected = (law.exit_mass * at_depth).sum(-1)
        torch.testing.assert_close(label[:, k].sum(-1), expected)
    children = tree.child_token_mask(6)
    assert float(label[0, 0][children[0, 0]].abs().max()) < 1e-12  # children of the root omitted


def test_block_cross_entropy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 11, generator=g)
    labels = torch.randint(0, 11, (5, 4), generator=g)
    ce = -torch.log_softmax(logits, -1).gather(2, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(block_cross_entropy(logits, labels), ce.mean())
    w = 0.5 ** torch.arange(4.0)
    torch.testing.assert_close(block_cross_entropy(logits, labels, gamma=0.5), (ce * w).sum() / (5 * w.sum()))
    mask = torch.rand(5, 4, generator=g) > 0.5
    torch.testing.assert_close(block_cross_entropy(logits, labels, label_mask=mask), ce[mask].mean())
    with pytest.raises(ValueError, match="gamma"):
        block_cross_entropy(logits, labels, gamma=0.0)
    with pytest.raises(ValueError, match="exp"):  # a length scale passed as the base
        block_cross_entropy(logits, labels, gamma=7.0)
    torch.testing.assert_close(block_cross_entropy(logits, labels, gamma=1.0), ce.mean())
    with pytest.raises(ValueError, match="labels"):
        block_cross_entropy(logits, labels[:, :2])


def test_bad_weight_type_and_missing_probs():
    logits, tree, probs = setup_case(1)
    law = exit_law(tree, probs)
    with pytest.raises(ValueError, match="weight_type"):
        exit_node_loss(logits, tree, law, "tokens")
    with pytest.raises(ValueError, match="missing"):
        exit_node_loss(logits, tree, law, "missing")


def _sampled_case(seed, N=3, K=4, H=6, V=40):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, K, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    return hidden, weight, labels


@pytest.mark.parametrize("gamma", [None, 0.7])
def test_sampled_block_ce_equals_full_ce_when_every_token_is_sampled(gamma):
    from exittrain.core import sampled_block_cross_entropy

    hidden, weight, labels = _sampled_case(0)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[0, 2:] = False
    full = block_cross_entropy(hidden @ weight.T, labels, gamma=gamma, label_mask=mask)
    (grad_full,) = torch.autograd.grad(full, hidden)
    g = torch.Generator().manual_seed(1)
    sampled = sampled_block_cross_entropy(hidden, weight, labels, 10_000, g, gamma=gamma, label_mask=mask)
    (grad_sampled,) = torch.autograd.grad(sampled, hidden)
    torch.testing.assert_close(sampled, full)
    torch.testing.assert_close(grad_sampled, grad_full)


def test_sampled_block_ce_matches_loop_twin_on_the_same_candidates():
    from exittrain.core import sample_vocabulary, sampled_block_cross_entropy, sampled_block_cross_entropy_reference

    hidden, weight, labels = _sampled_case(2)
    bias = torch.zeros(weight.shape[0], dtype=weight.dtype)
    fast = sampled_block_cross_entropy(
        hidden, weight, labels, 7, torch.Generator().manual_seed(5), gamma=0.8, lm_head_bias=bias
    )
    (grad_fast,) = torch.autograd.grad(fast, hidden)
    cand, corr, index = sample_vocabulary(labels, weight.shape[0], 7, torch.Generator().manual_seed(5))
    assert torch.equal(cand[index], labels)  # every label is a candidate, at its index
    U = int(torch.unique(labels).numel())
    assert cand.numel() == U + 7 and int(torch.unique(cand).numel()) == U + 7  # distinct negatives
    torch.testing.assert_close(corr[U:], torch.full((7,), math.log((weight.shape[0] - U) / 7)))
    slow = sampled_block_cross_entropy_reference(hidden, weight, labels, cand, corr, gamma=0.8)
    (grad_slow,) = torch.autograd.grad(slow, hidden)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(grad_fast, grad_slow)


def test_sampled_partition_is_unbiased_and_the_loss_consistent():
    """E[sum_C exp(corrected logit)] = Z (Monte Carlo), and the loss approaches the full CE as m grows."""
    from exittrain.core import sampled_block_cross_entropy

    hidden, weight, labels = _sampled_case(3, N=1, K=1, V=60)
    hidden = hidden.detach()
    logit_label = (hidden[0, 0] @ weight[labels[0, 0]]).item()
    z_full = torch.logsumexp(hidden[0, 0] @ weight.T, 0).exp().item()
    g = torch.Generator().manual_seed(0)
    draws = [sampled_block_cross_entropy(hidden, weight, labels, 10, g).item() for _ in range(4000)]
    z_hat = torch.tensor(draws, dtype=torch.float64).add(logit_label).exp()
    assert abs(z_hat.mean().item() / z_full - 1) < 0.05
    full = block_cross_entropy(hidden @ weight.T, labels).item()
    gaps = []
    for m in (5, 20, 50):
        g = torch.Generator().manual_seed(1)
        mean = sum(sampled_block_cross_entropy(hidden, weight, labels, m, g).item() for _ in range(300)) / 300
        gaps.append(abs(mean - full))
    assert gaps[0] > gaps[1] > gaps[2]


def test_sampled_block_ce_rejects_bad_shapes():
    from exittrain.core import sampled_block_cross_entropy

    hidden, weight, labels = _sampled_case(4)
    with pytest.raises(ValueError, match="lm_head_weight"):
        sampled_block_cross_entropy(hidden, weight[:, :3], labels, 5)
    with pytest.raises(ValueError, match="labels"):
        sampled_block_cross_entropy(hidden, weight, labels[:, :2], 5)
    with pytest.raises(ValueError, match="num_negatives"):
        sampled_block_cross_entropy(hidden, weight, labels, -1)


def _soft_case(seed, N=3, K=4, V=30, S=5):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, K, V, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (N, K), generator=g)
    top_ids = torch.randint(0, V, (N, K, S), generator=g)
    top_logp = torch.log_softmax(torch.randn(N, K, S, generator=g), -1) - 0.1  # a top-S mass below 1
    top_logp[0, 1, 2:] = -torch.inf  # empty slots
    top_logp[1, 0] = -torch.inf  # a position without any
    return logits, labels, top_ids, top_logp


def test_mix_soft_labels_are_distributions_with_the_answer_first():
    _, labels, top_ids, top_logp = _soft_case(0)
    ids, probs = mix_soft_labels(labels, top_ids, top_logp, 0.75)
    assert ids.shape == probs.shape == (3, 4, 6)
    assert torch.equal(ids[..., 0], labels) and torch.equal(ids[..., 1:], top_ids)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 4))
    torch.testing.assert_close(probs[..., 0][probs[..., 1:].sum(-1) > 0], torch.full((11,), 0.25))
    assert float(probs[1, 0, 0]) == 1.0 and float(probs[1, 0, 1:].abs().sum()) == 0.0  # no top-S: the answer alone
    assert float(probs[0, 1, 3:].abs().sum()) == 0.0  # empty slots get nothing
    # renormalised target mass: proportional to exp(logp) over the filled slots
    torch.testing.assert_close(probs[2, 3, 1:] / 0.75, torch.softmax(top_logp[2, 3].float(), -1))
    hard_ids, hard_probs = mix_soft_labels(labels, top_ids, top_logp, 0.0)
    torch.testing.assert_close(hard_probs[..., 0], torch.ones(3, 4))
    with pytest.raises(ValueError, match="weight"):
        mix_soft_labels(labels, top_ids, top_logp, 1.5)
    with pytest.raises(ValueError, match="top_ids"):
        mix_soft_labels(labels, top_ids[:, :2], top_logp, 0.5)


@pytest.mark.parametrize("gamma", [None, 0.6])
def test_soft_block_ce_matches_its_loop_twin_and_the_hard_loss(gamma):
    logits, labels, top_ids, top_logp = _soft_case(1)
    mask = torch.ones_like(labels, dtype=torch.bool)
    mask[2, 1:] = False
    ids, probs = mix_soft_labels(labels, top_ids, top_logp, 0.6)
    fast = block_cross_entropy(logits, ids, gamma=gamma, label_mask=mask, label_probs=probs)
    slow = block_cross_entropy_reference(logits, ids, gamma=gamma, label_mask=mask, label_probs=probs)
    (g_fast,) = torch.autograd.grad(fast, logits)
    (g_slow,) = torch.autograd.grad(slow, logits)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(g_fast, g_slow)
    # weight 0 is the hard loss; the loop twin also matches it without soft labels
    ids0, probs0 = mix_soft_labels(labels, top_ids, top_logp, 0.0)
    hard = block_cross_entropy(logits, labels, gamma=gamma, label_mask=mask)
    torch.testing.assert_close(
        block_cross_entropy(logits, ids0, gamma=gamma, label_mask=mask, label_probs=probs0), hard
    )
    torch.testing.assert_close(block_cross_entropy_reference(logits, labels, gamma=gamma, label_mask=mask), hard)
    # soft labels move the optimum: the gradient of a position is q - pi
    q = torch.softmax(logits.detach()[0, 0], -1)
    pi = torch.zeros(30, dtype=torch.float64).index_add_(0, ids[0, 0], probs[0, 0].double())
    (g_one,) = torch.autograd.grad(block_cross_entropy(logits[:1, :1], ids[:1, :1], label_probs=probs[:1, :1]), logits)
    torch.testing.assert_close(g_one[0, 0], q - pi)


def test_soft_sampled_block_ce_matches_its_loop_twin_and_the_full_soft_loss():
    from exittrain.core import sample_vocabulary, sampled_block_cross_entropy, sampled_block_cross_entropy_reference

    hidden, weight, labels = _sampled_case(5)
    _, _, top_ids, top_logp = _soft_case(6, N=3, K=4, V=40, S=5)
    ids, probs = mix_soft_labels(labels, top_ids, top_logp, 0.8)
    fast = sampled_block_cross_entropy(
        hidden, weight, ids, 6, torch.Generator().manual_seed(2), gamma=0.8, label_probs=probs
    )
    cand, corr, index = sample_vocabulary(ids, weight.shape[0], 6, torch.Generator().manual_seed(2))
    assert torch.equal(cand[index], ids)  # every soft label id is a candidate
    slow = sampled_block_cross_entropy_reference(hidden, weight, ids, cand, corr, gamma=0.8, label_probs=probs)
    (g_fast,) = torch.autograd.grad(fast, hidden)
    (g_slow,) = torch.autograd.grad(slow, hidden)
    torch.testing.assert_close(fast, slow)
    torch.testing.assert_close(g_fast, g_slow)
    everything = sampled_block_cross_entropy(hidden, weight, ids, 10_000, label_probs=probs)
    full = block_cross_entropy(hidden @ weight.T, ids, label_probs=probs)
    torch.testing.assert_close(everything, full)
    with pytest.raises(ValueError, match="label_probs"):
        sampled_block_cross_entropy(hidden, weight, ids, 6, label_probs=probs[..., :2])
    with pytest.raises(ValueError, match="label_probs"):
        block_cross_entropy(hidden @ weight.T, ids)
