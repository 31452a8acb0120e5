"""The analytic tau of the chain a serving engine verifies: the exit law on the drafter's greedy chain against
the mean block length of our ChainDecoder (Monte Carlo, seeded), and HeldOutLaw's chain numbers beside the tree's.

A random drafter's greedy chain is almost never what a random target says (its chain tau is ~1.00), which would
let a wrong law pass. So the tiny target's LM head gets a bias of 4 toward token 7, shared by the drafter (it
reads the target's head): the chain is then 7 7 7, and the target agrees with it often but not always, at every
temperature, so the accepted length is a real random variable.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from exittrain.decoding.chain_decoder import ChainDecoder
from exittrain.heldout import measures as hl
from exittrain.heldout.heldout_law import HeldOutLaw, format_differences
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

K = 3  # block size 4
PROMPT = [5, 6, 7, 8, 9, 10]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16]]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_target("llama")
    target.tokenizer = SimpleNamespace(eos_token_id=1, pad_token_id=0)  # all generation reads of it
    plain = target.model.lm_head
    head = torch.nn.Linear(plain.in_features, plain.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(plain.weight)
        head.bias.zero_()
        head.bias[7] = 4.0
    target.model.lm_head = head
    drafters = [new_drafter(target, block_size=K + 1, num_layers=1, layer_ids=[2], seed=s).eval() for s in (0, 1)]
    return target, drafters


def first_round_lengths(decoder: ChainDecoder, prompt: torch.Tensor, temperature: float, seeds: int):
    """(seeds,) block lengths of the first round from ``prompt``, and the decoder's first tree."""
    trees, build = [], decoder._tree
    decoder._tree = lambda *args: trees.append(build(*args)) or trees[-1]
    lengths = torch.tensor([
        float(decoder.generate(prompt, max_new_tokens=1, temperature=temperature, seed=s).rounds[0].block_length)
        for s in range(seeds)
    ], dtype=torch.float64)
    return lengths, trees[0]


def analytic_chain_tau(drafter, target, prompt: torch.Tensor, temperature: float) -> float:
    rows, anchors = [(prompt, len(prompt), None)], [torch.tensor([len(prompt) - 1])]  # root: the last prompt token
    return float(hl.analytic_block_lengths(drafter, target, rows, [2], anchors, K, temperature, shape="chain")[0][0])


def test_at_temperature_zero_the_chain_tau_is_the_greedy_block_exactly(models):
    target, (drafter, _) = models
    prompt = torch.tensor(PROMPT)
    analytic = analytic_chain_tau(drafter, target, prompt, 0.0)
    lengths, tree = first_round_lengths(ChainDecoder(target, drafter, verifier="greedy"), prompt, 0.0, 1)
    chain = hl.drafter_trees(drafter, target, prompt, torch.tensor([len(PROMPT) - 1]), K, shape="chain")
    assert torch.equal(tree.tokens, chain.tokens) and torch.equal(tree.parents, chain.parents)
    assert analytic == float(lengths[0]) == 3.0  # the target's argmax follows the chain for 2 of its 3 nodes


@pytest.mark.parametrize(("temperature", "verifier"), [
    (0.6, "sequential"),
    pytest.param(1.0, "sequential", marks=pytest.mark.slow),  # ~20 s each on a busy 2-core host
    pytest.param(0.6, "tev", marks=pytest.mark.slow),
])
def test_chain_tau_is_the_mean_block_length_of_the_chain_decoder(models, temperature, verifier):
    """``sequential`` on a one-hot chain accepts x_j with probability p_j(x_j) and resamples from p_j without
    x_j: vLLM's rejection sampler for greedy (draft-probability-free) drafts. TEV is our own verifier."""
    target, (drafter, _) = models
    prompt, seeds = torch.tensor(PROMPT), 400
    analytic = analytic_chain_tau(drafter, target, prompt, temperature)
    lengths, tree = first_round_lengths(ChainDecoder(target, drafter, verifier=verifier), prompt, temperature, seeds)
    assert tree.tokens.tolist() == [[7, 7, 7]]
    se = float(lengths.std()) / seeds**0.5
    assert 1.3 < analytic < 1 + K - 0.3  # neither always rejected nor always accepted: a wrong law would show
    assert abs(float(lengths.mean()) - analytic) < 4 * se, (float(lengths.mean()), analytic, se)


def test_the_held_out_law_measures_the_chain_beside_the_tree_and_pairs_it(models):
    target, (first, second) = models
    law = HeldOutLaw(target, PROMPTS, [0.6, 1.0], anchors_per_answer=3, max_new_tokens=10, seed=2)
    trees_before = law.measure(first, [6])
    chain_a, chain_b = law.measure_chain(first), law.measure_chain(second)
    assert set(chain_a) == {(K, 0.6), (K, 1.0)}
    for T in (0.6, 1.0):
        rows, anchors = law._rows_at(T), law.anchors(T, K)
        assert sum(x.numel() for x in anchors) > 0
        direct = hl.analytic_block_lengths(first, target, rows, [2], anchors, K, T, shape="chain")
        tree = hl.analytic_block_lengths(first, target, rows, [2], anchors, 6, T)
        for got, want, tree_row, before in zip(chain_a[(K, T)], direct, tree, trees_before[(6, T)]):
            assert torch.equal(got, want)
            assert torch.equal(tree_row, before)  # measuring the chain left the tree numbers as they were
    assert float(torch.cat(chain_a[(K, 1.0)]).mean()) > 1.2  # the chain carries mass here: the pairing can fail

    def table(label):
        return [{"label": label, "budget": b, "temperature": 0.0, "prompts": 3, "tau": 2.0, "ci95": [1.5, 2.5],
                 "tokens_per_s": 10.0} for b in (6, 12)]

    warm, trained = table("warm_start"), table("exittrain")
    law.attach(warm, trees_before)
    law.attach_chain(warm, chain_a)
    law.attach_chain(trained, chain_b, chain_a)
    for row in trained:  # every row of a drafter's table carries its chain of K nodes, whatever the row's budget
        cell = row["analytic_chain"]["1"]
        assert cell["nodes"] == K and cell["tau"] == pytest.approx(float(torch.cat(chain_b[(K, 1.0)]).mean()))
        want = float((torch.cat(chain_b[(K, 1.0)]) - torch.cat(chain_a[(K, 1.0)])).mean())
        assert cell["vs_warm_start"]["delta"] == pytest.approx(want)
        assert cell["vs_warm_start"]["ci95"][0] <= want <= cell["vs_warm_start"]["ci95"][1]
    assert "vs_warm_start" not in warm[0]["analytic_chain"]["1"] and "analytic" in warm[0]
    assert warm[0]["analytic"]["1"]["tau"] == pytest.approx(float(torch.cat(trees_before[(6, 1.0)]).mean()))
    lines = format_differences(warm + trained)
    assert lines == [line for line in lines if "expected chain tau at K=3" in line] and len(lines) == 2


def test_an_unknown_shape_is_refused(models):
    target, (drafter, _) = models
    rows, anchors = [(torch.tensor(PROMPT), len(PROMPT), None)], [torch.tensor([len(PROMPT) - 1])]
    with pytest.raises(ValueError, match=r"shape='path'.*\('ddtree', 'chain'\)"):
        hl.analytic_block_lengths(drafter, target, rows, [2], anchors, K, 1.0, shape="path")
