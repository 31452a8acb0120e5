"""Losslessness and agreement of the four verifiers (docs/algorithm.md sections 4 and 6)."""

import math

import pytest
import torch

from exittrain.core import (
    VERIFIERS,
    DraftTree,
    build_tree,
    exit_law,
    sample_categorical,
    verify_greedy,
    verify_tev,
    warp_probs,
)

from .helpers import random_logprobs, random_tree_and_probs

SAMPLERS = ("predraw", "sequential", "tev")
N_SAMPLES = 60_000


def exact_joint_law(tree, probs):
    """(B+1, V) exact P(exit = v, bonus = y) = P(v) p_v(y) [y not a child of v], for one tree."""
    law = exit_law(tree, probs)
    children = tree.child_token_mask(probs.shape[-1])[0]
    return (law.reach[0].unsqueeze(-1) * probs[0]).masked_fill(children, 0.0)


def chi_square_critical(df, z=3.719):  # z for a 1e-4 upper tail, Wilson-Hilferty approximation
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts, expected_p, n):
    support = expected_p > 0
    assert counts[~support].sum() == 0, "a zero-probability (exit, bonus) pair was drawn"
    expected = expected_p[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def draw_joint(verdict, V):
    return torch.bincount(verdict.exit_node * V + verdict.bonus)


CASES = [  # (seed, K, V, B, concentration, warp)
    (0, 3, 6, 8, 1.5, {}),
    (1, 3, 6, 12, 3.0, {"temperature": 0.7}),
    (2, 2, 5, 7, 2.0, {"top_k": 4}),
    (3, 3, 6, 10, 2.0, {"temperature": 1.3, "top_p": 0.8}),
]


@pytest.mark.parametrize("verifier", SAMPLERS)
@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_sampling_verifiers_match_exact_joint_law(verifier, case):
    seed, K, V, B, conc, warp = case
    g = torch.Generator().manual_seed(100 + seed)
    tree, logits = random_tree_and_probs(1, K, V, B, g, conc)
    probs = warp_probs(logits, **{"temperature": 1.0, **warp})
    joint = exact_joint_law(tree, probs)
    torch.testing.assert_close(joint.sum(), torch.tensor(1.0, dtype=joint.dtype))

    trees, batch_logits = tree.expand(N_SAMPLES), logits.expand(N_SAMPLES, -1, -1)
    verdict = VERIFIERS[verifier](trees, batch_logits, generator=torch.Generator().manual_seed(seed), **warp)
    assert_draws_follow_the_law(verdict, tree, probs, joint, V, N_SAMPLES)


def assert_draws_follow_the_law(verdict, tree, probs, joint, V: int, samples: int) -> None:
    """``samples`` verdicts of one tree: the (exit node, bonus) pairs follow ``joint`` (chi-square) and the
    mean block length is sum_v P(v) (the exit law's expectation) within 4.5 standard errors."""
    counts = draw_joint(verdict, V).cpu()
    counts = torch.nn.functional.pad(counts, (0, joint.numel() - counts.numel())).double()
    stat, df = chi_square(counts, joint.flatten(), samples)
    assert stat < chi_square_critical(df), f"chi2 {stat:.1f} with {df} dof"
    law = exit_law(tree, probs)
    lengths = (tree.positions[0] + 1).double()
    mean = float((law.exit_mass[0] * lengths).sum())
    sd = math.sqrt(float((law.exit_mass[0] * (lengths - mean) ** 2).sum()))
    assert mean == pytest.approx(float(law.expected_block_length[0]))
    observed = float(verdict.block_length.double().mean())
    assert abs(observed - mean) < 4.5 * sd / math.sqrt(samples) + 1e-9

    # the verdict is self-consistent: accepted tokens are the exit node's path
    for n in range(5):
        row, path = int(verdict.exit_node[n]), []
        while row:
            path.append(int(tree.tokens[0, row - 1]))
            row = int(tree.parents[0, row - 1])
        assert verdict.output_tokens(n) == path[::-1] + [int(verdict.bonus[n])]


@pytest.mark.parametrize("verifier", SAMPLERS)
def test_an_empty_tree_is_a_plain_step(verifier):
    """No node: the exit is the root, nothing is accepted, and the bonus follows the root's warped
    distribution (a decoding step). The exit law agrees: all mass exits at the root."""
    V, warp = 5, {"temperature": 0.8, "top_k": 4}
    logits = torch.randn(1, 1, V, generator=torch.Generator().manual_seed(4))
    probs = warp_probs(logits, **warp)
    tree = DraftTree.empty(N_SAMPLES)
    assert tree.budget == 0 and tree.positions.shape == (N_SAMPLES, 1) and tree.ancestor_mask.shape == (N_SAMPLES, 1, 1)
    verdict = VERIFIERS[verifier](tree, logits.expand(N_SAMPLES, -1, -1), generator=torch.Generator().manual_seed(0),
                                  **warp)
    assert int(verdict.exit_node.abs().sum()) == 0 and int(verdict.accept_length.abs().sum()) == 0
    assert verdict.accepted_tokens.shape == (N_SAMPLES, 0)
    counts = torch.bincount(verdict.bonus, minlength=V).double()
    stat, df = chi_square(counts, probs[0, 0], N_SAMPLES)
    assert stat < chi_square_critical(df), f"chi2 {stat:.1f} with {df} dof"
    law = exit_law(DraftTree.empty(1), probs)
    assert float(law.expected_block_length[0]) == pytest.approx(1.0)
    greedy = verify_greedy(DraftTree.empty(1), logits)
    assert int(greedy.bonus[0]) == int(logits[0, 0].argmax()) and int(greedy.accept_length[0]) == 0


def test_chi_square_catches_a_wrong_bonus_law():
    """Negative control: TEV without masking the exit node's children is not lossless."""
    g = torch.Generator().manual_seed(100)
    tree, logits = random_tree_and_probs(1, 3, 6, 8, g, 1.5)
    probs = warp_probs(logits)
    law = exit_law(tree, probs)
    gen = torch.Generator().manual_seed(0)
    exit_node = sample_categorical(law.exit_mass.expand(N_SAMPLES, -1), gen)
    bonus = sample_categorical(probs[0, exit_node], gen)  # bug: children not masked
    counts = torch.bincount(exit_node * 6 + bonus, minlength=probs[0].numel()).double()
    joint = exact_joint_law(tree, probs).flatten()
    with pytest.raises(AssertionError, match="zero-probability"):
        chi_square(counts, joint, N_SAMPLES)
    support = joint > 0
    stat, df = chi_square(counts * support, joint, int((counts * support).sum()))
    assert stat > chi_square_critical(df)


def greedy_walk(tree, logits, n):
    row, depth = 0, 0
    while True:
        y = int(logits[n, row].argmax())
        nxt = [j + 1 for j in range(tree.budget) if tree.valid[n, j] and tree.parents[n, j] == row
               and tree.tokens[n, j] == y]
        if not nxt:
            return row, depth, y
        row, depth = nxt[0], depth + 1


def test_greedy_is_deterministic_and_all_samplers_agree_at_temperature_zero():
    g = torch.Generator().manual_seed(9)
    # a target that mostly agrees with the drafter, so paths are long
    lp = random_logprobs(64, 4, 6, g)
    tree = build_tree(lp, 16)
    logits = torch.randn(64, 17, 6, generator=g)
    for n in range(64):
        for j in range(16):
            if (n + j) % 2 and tree.valid[n, j]:
                logits[n, int(tree.parents[n, j]), int(tree.tokens[n, j])] += 6.0
    ref = verify_greedy(tree, logits)
    again = verify_greedy(tree, logits)
    assert torch.equal(ref.exit_node, again.exit_node) and torch.equal(ref.bonus, again.bonus)
    assert ref.accept_length.max() >= 2
    for n in range(64):
        row, depth, bonus = greedy_walk(tree, logits, n)
        assert (int(ref.exit_node[n]), int(ref.accept_length[n]), int(ref.bonus[n])) == (row, depth, bonus)
    for name in SAMPLERS:
        out = VERIFIERS[name](tree, logits, temperature=0.0, generator=torch.Generator().manual_seed(1))
        for field in ("exit_node", "accept_length", "bonus", "accepted_tokens", "accepted_rows"):
            assert torch.equal(getattr(out, field), getattr(ref, field)), (name, field)


def test_warps():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    torch.testing.assert_close(warp_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    assert torch.equal(warp_probs(logits, 0.0), torch.tensor([[1.0, 0, 0, 0, 0]]))
    k2 = warp_probs(logits, 1.0, top_k=2)  # ties at the boundary are kept: 3 tokens
    assert (k2 > 0).sum() == 3
    torch.testing.assert_close(k2[0, :3], torch.softmax(logits[0, :3], -1))
    p = torch.softmax(logits, -1)[0]
    nucleus = warp_probs(logits, 1.0, top_p=float(p[0]) + 1e-3)  # needs the first two tokens
    assert (nucleus > 0).sum() == 2
    assert (warp_probs(logits, 1.0, top_p=1e-6) > 0).sum() == 1
    # temperature first, then top-k, then top-p
    # T=2 then top-4 leaves logits [1, .5, .5, 0] -> probs [.39, .24, .24, .14]; the mass before
    # each token is [0, .39, .62, .86], so top-p 0.5 keeps two (the tie goes to the lower id)
    combined = warp_probs(logits, 2.0, top_k=4, top_p=0.5)
    assert (combined > 0).tolist() == [[True, True, False, False, False]]
    torch.testing.assert_close(combined[0, :2], torch.softmax(logits[0, :2] / 2.0, -1))
    for bad in ({"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            warp_probs(logits, **{"temperature": 1.0, **bad})


def test_bad_logits_shape_and_nan():
    g = torch.Generator().manual_seed(0)
    tree, logits = random_tree_and_probs(2, 3, 5, 6, g)
    for fn in VERIFIERS.values():
        with pytest.raises(ValueError, match=r"\(2, 7, V\)"):
            fn(tree, logits[:, :5])
        with pytest.raises(ValueError, match="NaN"):
            fn(tree, torch.full_like(logits, float("nan")))


def test_no_host_sync_in_tev_tree_build_and_exit_law(monkeypatch):
    """The fast paths never read a tensor value on the host (validate=False)."""
    g = torch.Generator().manual_seed(0)
    lp = random_logprobs(4, 5, 50, g)

    def forbidden(*args, **kwargs):
        raise AssertionError("host synchronisation")

    for attr in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, attr, forbidden)
    tree = build_tree(lp, 16, validate=False)
    logits = torch.randn(4, 17, 50, generator=g)
    law = exit_law(tree, torch.softmax(logits, -1), validate=False)
    verdict = verify_tev(tree, logits, generator=g, validate=False)
    monkeypatch.undo()
    assert verdict.exit_node.shape == (4,) and law.reach.shape == (4, 17)


@pytest.mark.parametrize("warp", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.6}, {"top_k": 3},
                                  {"top_p": 0.7}])
def test_fast_warped_edges_equal_edges_of_warped_probs(warp):
    from exittrain.core.exit_law import edge_probabilities
    from exittrain.core.verify import warped_edge_probabilities

    g = torch.Generator().manual_seed(4)
    tree, logits = random_tree_and_probs(5, 3, 8, 12, g, 2.0)
    kwargs = {"temperature": 1.0, **warp}
    expected = edge_probabilities(tree, warp_probs(logits, **kwargs))
    torch.testing.assert_close(warped_edge_probabilities(tree, logits, **kwargs), expected)


def test_predraw_with_given_draws_follows_the_known_text_then_draws():
    """given_NL: the draws of the first L depths are the known text's. L = 0 is plain predraw-and-follow,
    draw for draw; a text along the chain reaches at least its length and then accepts the next node
    with the target's probability of it; a text off the chain accepts nothing."""
    from exittrain.core import chain_tree, verify_predraw

    g = torch.Generator().manual_seed(0)
    V, K, draws = 6, 3, 4000
    logq = torch.log_softmax(torch.randn(1, K, V, generator=g), -1)
    logits = torch.randn(1, K + 1, V, generator=g)
    tree = chain_tree(logq)
    plain = verify_predraw(tree, logits, generator=torch.Generator().manual_seed(1))
    empty = verify_predraw(tree, logits, generator=torch.Generator().manual_seed(1),
                           given_NL=torch.zeros(1, 0, dtype=torch.long))
    assert torch.equal(plain.accept_length, empty.accept_length) and torch.equal(plain.bonus, empty.bonus)
    path = tree.tokens[0, :2][None]  # the chain's first two tokens: the known text
    p_next = float(torch.softmax(logits[0, 2], -1)[tree.tokens[0, 2]])  # row 2 draws the chain's third token
    many = chain_tree(logq.expand(draws, K, V))  # one round per tree, independent draws
    lengths = verify_predraw(many, logits.expand(draws, K + 1, V), given_NL=path.expand(draws, 2),
                             generator=torch.Generator().manual_seed(2)).accept_length
    assert int(lengths.min()) >= 2
    deeper = float((lengths >= 3).float().mean())
    assert abs(deeper - p_next) < 4 * math.sqrt(p_next * (1 - p_next) / draws) + 1e-9, (deeper, p_next)
    off = (tree.tokens[0, :1] + 1) % V
    assert int(verify_predraw(tree, logits, given_NL=off[None]).accept_length[0]) == 0
    with pytest.raises(ValueError, match="given_NL has shape"):
        verify_predraw(tree, logits, given_NL=path[0])
