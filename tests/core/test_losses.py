import pytest
import torch

from exittrain.core import (
    WEIGHT_TYPES,
    block_cross_entropy,
    build_tree,
    exit_law,
    exit_node_loss,
    exit_node_loss_reference,
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
    with pytest.raises(ValueError, match="labels"):
        block_cross_entropy(logits, labels[:, :2])


def test_bad_weight_type_and_missing_probs():
    logits, tree, probs = setup_case(1)
    law = exit_law(tree, probs)
    with pytest.raises(ValueError, match="weight_type"):
        exit_node_loss(logits, tree, law, "tokens")
    with pytest.raises(ValueError, match="missing"):
        exit_node_loss(logits, tree, law, "missing")
