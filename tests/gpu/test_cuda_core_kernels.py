"""The pure tree math of exittrain.core on the device under test: each fast path against its CPU result
and its reference twin run on the device.

Tree building and the verifiers' choices are discrete and must match exactly (ties aside: random float
inputs have none; the heap twin shares the device's ``topk``, so with dyadic inputs, which tie often,
it is compared on the device only). The exit law, losses and metrics are compared in float64 to 1e-10
(the same formulas in another summation order), in float32 to ``rel=1e-5``. The sampling verifiers
draw from the device's own generator, so their draws are checked against the exact joint law of the
exit node and the bonus token (a chi-square test, as tests/core/test_verify.py does on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from exittrain.core import (
    VERIFIERS,
    WEIGHT_TYPES,
    DraftTree,
    block_cross_entropy,
    block_cross_entropy_reference,
    build_tree,
    build_tree_reference,
    chain_tree,
    chain_tree_reference,
    exit_law,
    exit_law_reference,
    exit_node_loss,
    exit_node_loss_reference,
    followed_depth,
    followed_depth_reference,
    mix_copy,
    mix_copy_reference,
    mix_soft_labels,
    ngram_lookup,
    ngram_lookup_reference,
    sample_anchors,
    sample_anchors_reference,
    sample_vocabulary,
    sampled_block_cross_entropy,
    sampled_block_cross_entropy_reference,
    select_trees,
    tree_metrics,
    tree_metrics_reference,
    verify_greedy,
    warp_probs,
)
from exittrain.core import tree as tree_module
from exittrain.core.exit_law import edge_probabilities
from exittrain.core.verify import warped_edge_probabilities
from tests.core.helpers import random_logprobs, random_tree_and_probs
from tests.core.test_verify import assert_draws_follow_the_law, exact_joint_law

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_thread")]

TREE_FIELDS = ("tokens", "parents", "depths", "valid", "scores")
LAW_FIELDS = ("edge", "reach", "missing", "exit_mass")
F64 = dict(rtol=1e-10, atol=1e-12)
F32 = dict(rtol=1e-5, atol=1e-6)
SAMPLES = 40_000


def on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.to(device) for t in tensors]


def moved(tree: DraftTree, device: torch.device) -> DraftTree:
    """``tree`` with its tensors on ``device``."""
    return DraftTree(tokens=tree.tokens.to(device), parents=tree.parents.to(device), depths=tree.depths.to(device),
                     valid=tree.valid.to(device), max_depth=tree.max_depth, scores=tree.scores.to(device))


def assert_same_tree(got, want, where: torch.device, fields=TREE_FIELDS) -> None:
    for name in fields:
        value = getattr(got, name)
        assert value.device.type == where.type, name
        assert torch.equal(value.cpu(), getattr(want, name).cpu()), name


def gen(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


# ----------------------------------------------------------------------------------------------
# trees


@pytest.mark.parametrize("N,K,V,B", [(3, 4, 9, 10), (2, 1, 50, 8), (4, 6, 200, 64), (2, 2, 3, 40)])
def test_build_tree_on_the_device_equals_the_cpu_and_the_heap(N, K, V, B, device):
    lp = random_logprobs(N, K, V, torch.Generator().manual_seed(N * 1000 + K * 100 + V + B))
    want = build_tree(lp, B)
    (lp_d,) = on(device, lp)
    got = build_tree(lp_d, B)
    assert_same_tree(got, want, device)
    assert_same_tree(build_tree_reference(lp_d, B), got, device)
    for name in ("ancestor_mask", "positions", "sibling_rank", "num_nodes", "valid_with_root"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    assert torch.equal(got.child_token_mask(V).cpu(), want.child_token_mask(V))
    rows = torch.arange(N) % (B + 1)
    assert torch.equal(got.child_token_mask(V, rows=rows.to(device)).cpu(), want.child_token_mask(V, rows=rows))


def test_build_tree_on_the_device_equals_the_heap_on_ties(device, monkeypatch):
    """Dyadic log-probabilities tie often: the batched builder's tie-break (stable sorts) on the device
    against the heap over the same candidate lists."""
    monkeypatch.setattr(tree_module, "_check_logprobs", lambda *a, **k: None)  # dyadic rows are not normalised
    g = torch.Generator().manual_seed(77)
    for _ in range(12):
        N, K, V, B = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in ((1, 4), (1, 6), (1, 10), (1, 40)))
        (lp,) = on(device, random_logprobs(N, K, V, g, dyadic=True))
        assert_same_tree(build_tree(lp, B), build_tree_reference(lp, B), device)


def test_chain_and_followed_depth_on_the_device(device):
    g = torch.Generator().manual_seed(5)
    lp = random_logprobs(6, 5, 20, g)
    (lp_d,) = on(device, lp)
    for budget in (3, 5):
        got, want = chain_tree(lp_d, budget), chain_tree(lp, budget)
        assert_same_tree(got, want, device, fields=TREE_FIELDS[:-1])
        # the scores are a cumsum, which a device may associate differently: equal up to fp32 rounding
        torch.testing.assert_close(got.scores.cpu(), want.scores, **F32)
        # the twin's scores are those of one-hot rows (0): the structure is what it checks
        assert_same_tree(chain_tree_reference(lp_d, budget), got, device, fields=TREE_FIELDS[:-1])
    tree = build_tree(lp, 16)
    labels = torch.where(torch.rand(6, 5, generator=g) < 0.7, lp.argmax(-1), torch.randint(0, 20, (6, 5), generator=g))
    tree_d, (labels_d,) = moved(tree, device), on(device, labels)
    depth = followed_depth(tree_d, labels_d)
    assert depth.device.type == device.type
    assert torch.equal(depth.cpu(), followed_depth(tree, labels))
    assert torch.equal(depth.cpu(), followed_depth_reference(tree_d, labels_d).cpu())


# ----------------------------------------------------------------------------------------------
# exit law and metrics


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("alpha", [0.0, 1e-4, 0.3])
def test_exit_law_on_the_device_equals_the_cpu_and_the_loop(alpha, dtype, device):
    tree, logits = random_tree_and_probs(6, 4, 7, 20, torch.Generator().manual_seed(11))
    probs = torch.softmax(logits, -1).to(dtype)
    tol = F64 if dtype == torch.float64 else F32
    want = exit_law(tree, probs, alpha)
    tree_d, (probs_d,) = moved(tree, device), on(device, probs)
    got = exit_law(tree_d, probs_d, alpha)
    loop = exit_law_reference(tree_d, probs_d, alpha)
    for name in LAW_FIELDS:
        assert getattr(got, name).device.type == device.type, name
        torch.testing.assert_close(getattr(got, name).cpu(), getattr(want, name), **tol)
        torch.testing.assert_close(getattr(loop, name).cpu(), getattr(want, name), **tol)
    torch.testing.assert_close(exit_law(tree_d, probs_d, alpha, validate=False).reach.cpu(), want.reach, **tol)


def test_tree_metrics_on_the_device(device):
    g = torch.Generator().manual_seed(3)
    tree = build_tree(random_logprobs(5, 3, 7, g), 6)
    probs = torch.softmax(torch.randn(5, 7, 7, generator=g), -1)
    index = torch.tensor([4, 0, 2])
    want = tree_metrics(select_trees(tree, index), exit_law(select_trees(tree, index), probs[index]))
    probs_d, index_d = on(device, probs, index)
    sub = select_trees(moved(tree, device), index_d)
    law = exit_law(sub, probs_d[index_d])
    got, loop = tree_metrics(sub, law), tree_metrics_reference(sub, law)
    assert set(got) == set(want) == set(loop)
    for key, value in want.items():
        assert got[key].device.type == device.type, key
        assert float(got[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-6), key
        assert loop[key] == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


# ----------------------------------------------------------------------------------------------
# losses


def test_block_cross_entropy_hard_and_soft_on_the_device(device):
    g = torch.Generator().manual_seed(0)
    N, K, V, S = 5, 4, 11, 3
    logits = torch.randn(N, K, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    mask = torch.rand(N, K, generator=g) < 0.8
    top_ids = torch.randint(0, V, (N, K, S), generator=g)
    top_logp = torch.log_softmax(torch.randn(N, K, S, generator=g), -1)
    soft_ids, soft_probs = mix_soft_labels(labels, top_ids, top_logp, 0.6)
    d_ids, d_probs = mix_soft_labels(*on(device, labels, top_ids, top_logp), 0.6)
    assert torch.equal(d_ids.cpu(), soft_ids)
    torch.testing.assert_close(d_probs.cpu(), soft_probs, **F32)  # a softmax: equal up to fp32 rounding
    cases = [(labels, None, None, None), (labels, None, 0.7, mask), (soft_ids, soft_probs, 0.5, mask)]
    for ids, probs, gamma, label_mask in cases:
        kwargs = dict(gamma=gamma)
        want = block_cross_entropy(logits, ids, label_probs=probs, label_mask=label_mask, **kwargs)
        dev = dict(label_probs=None if probs is None else probs.to(device),
                   label_mask=None if label_mask is None else label_mask.to(device), **kwargs)
        logits_d, ids_d = on(device, logits, ids)
        got = block_cross_entropy(logits_d, ids_d, **dev)
        loop = block_cross_entropy_reference(logits_d, ids_d, **dev)
        assert got.device.type == device.type
        torch.testing.assert_close(got.cpu(), want, **F64)
        torch.testing.assert_close(loop.cpu(), want, **F64)


@pytest.mark.parametrize("weight_type", WEIGHT_TYPES)
@pytest.mark.parametrize("alpha", [0.0, 0.1])
def test_exit_node_loss_and_its_gradient_on_the_device(weight_type, alpha, device):
    g = torch.Generator().manual_seed(3)
    logits_cpu = torch.randn(4, 3, 7, generator=g, dtype=torch.float64)
    tree_cpu = build_tree(torch.log_softmax(logits_cpu, -1), 9)
    probs_cpu = torch.softmax(torch.randn(4, 10, 7, generator=g, dtype=torch.float64) * 2, -1)

    def case(where):
        logits, tree, probs = logits_cpu.to(where).requires_grad_(), moved(tree_cpu, where), probs_cpu.to(where)
        return logits, tree, probs, exit_law(tree, probs, alpha)

    logits, tree, probs, law = case(torch.device("cpu"))
    want = exit_node_loss(logits, tree, law, weight_type, probs)
    (want_grad,) = torch.autograd.grad(want, logits)
    logits_d, tree_d, probs_d, law_d = case(device)
    for fn in (exit_node_loss, exit_node_loss_reference):
        got = fn(logits_d, tree_d, law_d, weight_type, probs_d)
        (grad,) = torch.autograd.grad(got, logits_d)
        assert got.device.type == device.type and grad.device.type == device.type, fn.__name__
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **F64)
        torch.testing.assert_close(grad.cpu(), want_grad, **F64)


@pytest.mark.parametrize("copying", [False, True], ids=["plain", "copy"])
def test_sampled_block_cross_entropy_on_the_device(copying, device):
    """The negatives come from a CPU generator (as the objective's anchor generator), so both devices
    score the same candidate set; the loop twin scores it from the candidates directly."""
    g = torch.Generator().manual_seed(8)
    N, K, H, V, m = 3, 4, 6, 40, 9
    hidden = torch.randn(N, K, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (N, K), generator=g)
    copy_ids = torch.where(torch.rand(N, K, generator=g) < 0.5, torch.randint(0, V, (N, K), generator=g), -1)
    gates = torch.randn(N, K, generator=g, dtype=torch.float64)
    extra = dict(copy_ids=copy_ids, copy_gate_logits=gates) if copying else {}
    want = sampled_block_cross_entropy(hidden, weight, labels, m, torch.Generator().manual_seed(1), gamma=0.8, **extra)
    extra_d = {k: v.to(device) for k, v in extra.items()}
    hidden_d, weight_d, labels_d = on(device, hidden, weight, labels)
    got = sampled_block_cross_entropy(hidden_d, weight_d, labels_d, m, torch.Generator().manual_seed(1), gamma=0.8,
                                      **extra_d)
    assert got.device.type == device.type
    torch.testing.assert_close(got.cpu(), want, **F64)
    if not copying:  # the twin takes the candidate set the fast path drew
        candidates, correction, _ = sample_vocabulary(labels_d, V, m, torch.Generator().manual_seed(1))
        assert candidates.device.type == device.type
        loop = sampled_block_cross_entropy_reference(hidden_d, weight_d, labels_d, candidates, correction, gamma=0.8)
        torch.testing.assert_close(loop.cpu(), want, **F64)


# ----------------------------------------------------------------------------------------------
# anchors and the copy branch


def test_anchors_and_the_ngram_copy_branch_on_the_device(device):
    g = torch.Generator().manual_seed(2)
    L, T, A, K = 3, 30, 6, 4
    ids = torch.randint(0, 6, (L, T), generator=g)  # a small alphabet: n-grams repeat
    ids[2, 24:] = -1  # right padding never matches
    lengths = torch.tensor([30, 27, 24])
    loss_mask = torch.arange(T).expand(L, T) >= 8
    want = sample_anchors(loss_mask, lengths, A, K, torch.Generator().manual_seed(4))
    mask_d, lengths_d, ids_d = on(device, loss_mask, lengths, ids)
    got = sample_anchors(mask_d, lengths_d, A, K, torch.Generator().manual_seed(4))
    loop = sample_anchors_reference(mask_d, lengths_d, A, K, torch.Generator().manual_seed(4))
    for a, b, c in zip(got, want, loop, strict=True):
        assert a.device.type == device.type and torch.equal(a.cpu(), b) and torch.equal(c.cpu(), b)
    anchors = want[0]
    for earliest in (False, True):
        fast = ngram_lookup(ids_d, anchors.to(device), [3, 2], K, earliest=earliest)
        slow = ngram_lookup_reference(ids_d, anchors.to(device), [3, 2], K, earliest=earliest)
        cpu = ngram_lookup(ids, anchors, [3, 2], K, earliest=earliest)
        for f, s, c in zip(fast, slow, cpu, strict=True):
            assert f.device.type == device.type and torch.equal(f.cpu(), c) and torch.equal(s.cpu(), c)
    copy_index = torch.where(torch.rand(L * A, K, generator=g) < 0.6, torch.randint(0, 9, (L * A, K), generator=g), -1)
    logq = torch.log_softmax(torch.randn(L * A, K, 9, generator=g, dtype=torch.float64), -1)
    gates = torch.randn(L * A, K, generator=g, dtype=torch.float64)
    want_mix = mix_copy(logq, copy_index, gates)
    got_mix = mix_copy(*on(device, logq, copy_index, gates))
    assert got_mix.device.type == device.type
    torch.testing.assert_close(got_mix.cpu(), want_mix, **F64)
    torch.testing.assert_close(mix_copy_reference(*on(device, logq, copy_index, gates)).cpu(), want_mix, **F64)


# ----------------------------------------------------------------------------------------------
# verifiers


def test_greedy_and_every_verifier_at_temperature_zero_on_the_device_equal_the_cpu(device):
    g = torch.Generator().manual_seed(9)
    tree = build_tree(random_logprobs(64, 4, 6, g), 16)
    logits = torch.randn(64, 17, 6, generator=g)
    agree = (torch.arange(64).view(-1, 1) + torch.arange(16)) % 2 == 1  # a target that often agrees: long paths
    logits.view(64, -1).scatter_add_(1, tree.parents * 6 + tree.tokens, 6.0 * (agree & tree.valid).float())
    want = verify_greedy(tree, logits)
    assert int(want.accept_length.max()) >= 2
    tree_d, (logits_d,) = moved(tree, device), on(device, logits)
    verdicts = [verify_greedy(tree_d, logits_d), verify_greedy(tree_d, logits_d, validate=False)]
    verdicts += [VERIFIERS[name](tree_d, logits_d, temperature=0.0, generator=gen(device, 1), validate=False)
                 for name in ("predraw", "sequential", "tev")]
    for verdict in verdicts:
        for field in ("exit_node", "accept_length", "bonus", "accepted_tokens", "accepted_rows"):
            value = getattr(verdict, field)
            assert value.device.type == device.type and torch.equal(value.cpu(), getattr(want, field)), field


@pytest.mark.parametrize("warp", [{"temperature": 1.0}, {"temperature": 0.6}, {"temperature": 0.0}, {"top_k": 3},
                                  {"top_p": 0.7}], ids=["T1", "T0.6", "T0", "top_k", "top_p"])
def test_warped_edges_on_the_device(warp, device):
    """On a CPU the fast edges normalise only the rows with children; on an accelerator every row, with
    no host synchronisation: both against the edges of the fully warped distribution."""
    tree, logits = random_tree_and_probs(5, 3, 8, 12, torch.Generator().manual_seed(4), 2.0)
    kwargs = {"temperature": 1.0, **warp}
    want = edge_probabilities(tree, warp_probs(logits, **kwargs))
    tree_d, (logits_d,) = moved(tree, device), on(device, logits)
    got = warped_edge_probabilities(tree_d, logits_d, **kwargs)
    assert got.device.type == device.type
    torch.testing.assert_close(got.cpu(), want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(edge_probabilities(tree_d, warp_probs(logits_d, **kwargs)).cpu(), want, rtol=1e-9,
                               atol=1e-12)


@pytest.mark.parametrize("verifier", ["predraw", "sequential", "tev"])
def test_sampling_verifiers_on_the_device_draw_the_exact_law(verifier, device):
    """``SAMPLES`` copies of one tree verified at once with the device's generator and ``validate=False``
    (the accelerator path: no host synchronisation): the (exit node, bonus) pairs follow the exact joint
    law (chi-square at a 1e-4 tail) and the mean block length its expectation (within 4.5 standard errors)."""
    warp = {"temperature": 0.7, "top_p": 0.9}
    tree, logits = random_tree_and_probs(1, 3, 6, 10, torch.Generator().manual_seed(103), 2.0)
    probs = warp_probs(logits, **warp)
    joint = exact_joint_law(tree, probs)
    tree_d, (logits_d,) = moved(tree, device), on(device, logits)
    verdict = VERIFIERS[verifier](tree_d.expand(SAMPLES), logits_d.expand(SAMPLES, -1, -1), generator=gen(device, 7),
                                  validate=False, **warp)
    assert verdict.exit_node.device.type == device.type
    assert_draws_follow_the_law(verdict, tree, probs, joint, 6, SAMPLES)
