"""The decoder is lossless: greedy equality with Hugging Face generate, and the sampling law."""

import math
from collections import Counter

import pytest
import torch

from exittrain.decoding import SpeculativeDecoder, autoregressive_generate, oracle_generate
from exittrain.models import new_drafter
from tests.models.helpers import tiny_target

PROMPT = [5, 17, 33, 2, 40, 41, 9, 12]


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", seed=3)


@pytest.fixture(scope="module", params=[None, [2, 1]], ids=["plain", "copy"])
def drafter(target, request):
    return new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0, copy_ngrams=request.param)


@pytest.fixture
def no_eos(target, monkeypatch):
    """Decode the full length (random tiny models emit EOS early); the module's target gets its
    stop ids back after the test, whether it passes or fails."""
    monkeypatch.setattr(target, "eos_token_ids", [])
    return target


def hf_greedy(target, prompt, n):
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("verifier", ["tev", "predraw", "sequential", "greedy"])
@pytest.mark.parametrize("budget", [1, 6, 20])
def test_greedy_output_equals_target_greedy(no_eos, target, drafter, verifier, budget):
    expected = hf_greedy(target, PROMPT, 30)
    decoder = SpeculativeDecoder(target, drafter, budget=budget, verifier=verifier)
    result = decoder.generate(PROMPT, max_new_tokens=30, temperature=0.0, seed=0)
    assert result.tokens == expected
    assert sum(r.block_length for r in result.rounds) >= 30
    assert all(1 <= r.block_length <= drafter.config.block_size for r in result.rounds)
    assert set(result.rounds[0].times) == {"draft", "tree", "target", "verify", "commit"}


def test_autoregressive_and_oracle_match_target_greedy(no_eos, target):
    expected = hf_greedy(target, PROMPT, 25)
    assert autoregressive_generate(target, PROMPT, 25).tokens == expected
    result, analytic = oracle_generate(target, PROMPT, budget=5, max_new_tokens=25)
    assert result.tokens == expected
    # at temperature 0 the oracle tree is the greedy chain of depth B: every round yields B + 1
    assert [r.block_length for r in result.rounds[:-1]] == [6] * (len(result.rounds) - 1)
    assert analytic[0] == pytest.approx(6.0)


def test_stops_at_eos(no_eos, target, drafter, monkeypatch):
    free = hf_greedy(target, PROMPT, 20)
    eos = free[7]
    monkeypatch.setattr(target, "eos_token_ids", [eos])
    out = SpeculativeDecoder(target, drafter, budget=8).generate(PROMPT, max_new_tokens=20)
    assert out.tokens == free[: free.index(eos) + 1]


# repeats its 2-grams, so the copy chain at the root is long from the first round
REPEATING = [5, 17, 33, 2, 40, 41, 9, 12, 5, 17, 33, 2, 40, 41, 9, 5, 17]


@pytest.mark.parametrize("verifier", ["tev", "predraw", "sequential", "greedy"])
@pytest.mark.parametrize("copy_match", [0, 1])
@pytest.mark.parametrize("earliest", [False, True], ids=["latest-chain", "two-chains"])
def test_copy_tail_output_equals_target_greedy(no_eos, target, drafter, verifier, copy_match, earliest):
    expected = hf_greedy(target, REPEATING, 30)
    decoder = SpeculativeDecoder(target, drafter, budget=3, verifier=verifier, copy_tail=6, copy_match=copy_match,
                                 copy_ngrams=(2, 1), copy_earliest=earliest)
    result = decoder.generate(REPEATING, max_new_tokens=30, seed=0)
    assert result.tokens == expected
    assert any(r.tree_nodes > 3 for r in result.rounds), "the copy tail never grafted: the test proves nothing"
    assert all(3 <= r.tree_nodes <= 3 + 6 * (2 if earliest else 1) for r in result.rounds)
    assert all(1 <= r.block_length <= r.tree_nodes + 1 for r in result.rounds)
    if copy_match == 0:  # the first round's chain (33, 2, 40, 41, 9, 5, 17) is deeper than any 3-node tree
        assert result.rounds[0].tree_nodes > 3


def test_copy_tail_reaches_past_the_drafter_horizon(no_eos, target, drafter, monkeypatch):
    """A chain that is the target's own greedy text is accepted whole, past depth K, and the rows
    deeper than K are committed right: the rounds after it still decode greedy's tokens."""
    import exittrain.core.copy_tail as copy_tail

    expected = hf_greedy(target, PROMPT, 30)
    text = PROMPT + expected

    def greedy_chain(ids_T, ngrams, length, earliest=False):  # what greedy says next, from the root on
        return text[ids_T.numel() : ids_T.numel() + length]

    monkeypatch.setattr(copy_tail, "copy_chain", greedy_chain)  # the chain the round's copy tail grafts
    decoder = SpeculativeDecoder(target, drafter, budget=2, copy_tail=10, copy_match=0)
    result = decoder.generate(PROMPT, max_new_tokens=30, seed=0)
    assert result.tokens == expected
    K = drafter.config.num_draft_tokens
    assert all(r.accept_length >= 10 > K for r in result.rounds[:-1])
    assert len(result.rounds) == 3  # 11 tokens a round: 11 + 11 + 8


def exact_three_token_law(target, prompt, temperature):
    """P(y1, y2, y3 | prompt) of the warped target, by enumeration over a small vocabulary."""
    from exittrain.core import warp_probs

    V = target.vocab_size
    law = {}
    with torch.no_grad():
        p1 = warp_probs(target.model(input_ids=torch.tensor([prompt])).logits[0, -1], temperature)
        for y1 in range(V):
            if p1[y1] < 1e-4:
                continue
            p2 = warp_probs(target.model(input_ids=torch.tensor([prompt + [y1]])).logits[0, -1], temperature)
            for y2 in range(V):
                if p1[y1] * p2[y2] < 1e-4:
                    continue
                p3 = warp_probs(target.model(input_ids=torch.tensor([prompt + [y1, y2]])).logits[0, -1], temperature)
                for y3 in range(V):
                    law[(y1, y2, y3)] = float(p1[y1] * p2[y2] * p3[y3])
    return law


@pytest.mark.parametrize(
    "n, prompt, tail",
    [(400, PROMPT, {}), (400, REPEATING, {"copy_tail": 3, "copy_match": 0, "copy_ngrams": (2, 1),
                      "draft_vocab": torch.arange(0, 64, 2)}),
     pytest.param(1500, PROMPT, {}, marks=pytest.mark.slow)],
    ids=["400", "400-copy-tail-vocab", "1500"],
)
def test_sampling_law_over_three_tokens(no_eos, target, drafter, n, prompt, tail,
                                        decoder_class=SpeculativeDecoder):
    """Spanning several rounds, the decoded 3-token prefixes follow the target's law (chi-square).

    The same 1e-4 test at two sizes: 400 draws (the fast tier) and 1500 (slow, more power), and
    with a copy tail grafted on every round's tree and a draft vocabulary of half the tokens.
    ``decoder_class``: the decoder checked (tests/cpu_decode/test_round_policy.py passes its own)."""
    temperature = 0.35  # concentrated, so a few hundred outcomes carry the mass
    law = exact_three_token_law(target, prompt, temperature)
    decoder = decoder_class(target, drafter, budget=6, verifier="tev", **tail)
    counts = Counter(tuple(decoder.generate(prompt, 3, temperature=temperature, seed=s).tokens) for s in range(n))
    # pool outcomes with small expected counts into one cell
    stat, df, other_obs, other_exp = 0.0, 0, 0, 0.0
    for key, p in law.items():
        if p * n >= 5:
            stat += (counts.get(key, 0) - p * n) ** 2 / (p * n)
            df += 1
        else:
            other_obs += counts.get(key, 0)
            other_exp += p * n
    other_obs += sum(c for k, c in counts.items() if k not in law)
    other_exp = n - sum(p * n for p in law.values() if p * n >= 5)
    stat += (other_obs - other_exp) ** 2 / max(other_exp, 1e-9)
    critical = df * (1 - 2 / (9 * df) + 3.719 * math.sqrt(2 / (9 * df))) ** 3  # 1e-4 tail
    assert df >= 5
    assert stat < critical, f"chi2 {stat:.1f} with {df} dof (critical {critical:.1f})"


def test_bad_arguments(target, drafter):
    with pytest.raises(ValueError, match="verifier"):
        SpeculativeDecoder(target, drafter, verifier="beam")
    with pytest.raises(ValueError, match="budget"):
        SpeculativeDecoder(target, drafter, budget=0)
    with pytest.raises(ValueError, match="copy_tail"):
        SpeculativeDecoder(target, drafter, copy_tail=-1)
    with pytest.raises(ValueError, match="copy_match"):
        SpeculativeDecoder(target, drafter, copy_match=1.5)
    with pytest.raises(ValueError, match="copy_ngrams"):
        SpeculativeDecoder(target, drafter, copy_tail=4, copy_ngrams=(0,))
    decoder = SpeculativeDecoder(target, drafter, budget=4)
    with pytest.raises(ValueError, match="batch size 1"):
        decoder.generate([PROMPT, PROMPT], 4)
    with pytest.raises(ValueError, match="context"):
        decoder.generate(PROMPT * 60, 100)
    with pytest.raises(ValueError, match="greedy"):
        SpeculativeDecoder(target, drafter, verifier="greedy").generate(PROMPT, 4, temperature=1.0)
