"""Small random inputs shared by the core tests."""

import torch

from exittrain.core import build_tree


def random_logprobs(N, K, V, generator, dyadic=False):
    """(N, K, V) normalised log-probabilities; ``dyadic`` quantises to multiples of 1/8 (exact sums, ties)."""
    x = torch.randn(N, K, V, generator=generator) * 2
    if dyadic:
        x = (x * 2).round() / 2
    lp = torch.log_softmax(x, -1)
    if dyadic:
        # multiples of 1/8 add exactly in float32; renormalise is not exact, so build_tree is
        # called with validate=False on these
        lp = (lp * 8).round() / 8
    return lp


def random_tree_and_probs(N, K, V, B, generator, concentration=1.0):
    """A random tree from random drafter log-probs, and random per-row target distributions."""
    tree = build_tree(random_logprobs(N, K, V, generator), B)
    logits = torch.randn(N, B + 1, V, generator=generator, dtype=torch.float64) * concentration
    return tree, logits
