"""Lossless greedy decoding on the embedded SmolLM2-135M-Instruct target, real prompts."""

import pytest
import torch

from exittrain.core import block_cross_entropy
from exittrain.data import chat_prompt_ids, load_domain
from exittrain.decoding import SpeculativeDecoder
from exittrain.models import load_target, new_drafter

pytestmark = pytest.mark.real_model
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    return load_target(None)


@pytest.fixture(scope="module")
def prompts(target):
    code, dialogue = load_domain("code"), load_domain("dialogue")
    texts = code.eval[:3] + dialogue.eval[:2]
    return [chat_prompt_ids(target.tokenizer, t) for t in texts]


@pytest.fixture(scope="module")
def greedy(target, prompts):
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=target.eos_token_ids, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def trained_drafter(target, prompts, greedy, steps=30):
    """A drafter fitted for a few steps on the target's own answers, so rounds accept long paths."""
    drafter = new_drafter(target, block_size=6, num_layers=1, seed=0, context_window=64)
    seqs = [p + g for p, g in zip(prompts, greedy)]
    T = min(len(s) for s in seqs)
    ids = torch.tensor([s[-T:] for s in seqs])
    feats = target.sequence_features(ids, drafter.config.target_layer_ids)
    K = drafter.config.block_size - 1
    anchors = torch.arange(T - NEW_TOKENS // 2 - 1, T - K).expand(len(seqs), -1)
    labels = torch.stack([ids.gather(1, anchors + k) for k in range(1, K + 1)], -1).reshape(-1, K)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(steps):
        loss = block_cross_entropy(drafter.forward_anchors(feats, ids, anchors), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def drafters(target, prompts, greedy):
    return {"fresh": new_drafter(target, block_size=6, num_layers=1, seed=0),
            "trained": trained_drafter(target, prompts, greedy)}


def test_greedy_equals_hf_generate_fresh_and_trained_drafter(target, prompts, greedy, drafters):
    taus, longest = {}, {}
    for name, drafter in drafters.items():
        decoder = SpeculativeDecoder(target, drafter, budget=8, verifier="tev")
        results = [decoder.generate(p, NEW_TOKENS, temperature=0.0) for p in prompts]
        for result, expected in zip(results, greedy):
            assert result.tokens == expected
        rounds = [r.block_length for res in results for r in res.rounds]
        taus[name], longest[name] = sum(rounds) / len(rounds), max(rounds)
    # the trained drafter gets draft tokens accepted, so cache compaction of accepted paths is exercised
    assert taus["trained"] > taus["fresh"] and longest["trained"] >= 2, (taus, longest)


def test_copy_tail_on_real_prompts_stays_greedy_and_grafts(target, prompts, greedy, drafters):
    """Real answers restate their prompts: the tail grafts in some rounds, and the text is greedy's."""
    decoder = SpeculativeDecoder(target, drafters["trained"], budget=8, verifier="tev", copy_tail=8)
    results = [decoder.generate(p, NEW_TOKENS, temperature=0.0) for p in prompts]
    assert [r.tokens for r in results] == greedy
    grafted = [r for res in results for r in res.rounds if r.tree_nodes > 8]
    assert grafted, "no round grafted a copy chain on five real prompts"
    assert all(r.tree_nodes <= 16 for res in results for r in res.rounds)
