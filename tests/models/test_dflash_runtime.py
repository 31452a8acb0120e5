"""An exported drafter in the reference runtime: on the embedded SmolLM2 target,
``dflash.model.dflash_generate`` at T = 0 gives exactly the target's greedy tokens, with the same
acceptance length every round as exittrain's own chain decoding (a chain tree of budget K) of the
same drafter. This also checks the layer-id convention end to end: DFlash reads Hugging Face's
``hidden_states[id + 1]``, exittrain its layer-output hooks."""

from __future__ import annotations

import time

import pytest
import torch

from exittrain.core import block_cross_entropy
from exittrain.data import chat_prompt_ids, load_domain
from exittrain.decoding.chain_decoder import ChainDecoder
from exittrain.models import load_target, new_drafter
from exittrain.models.dflash_format import export_dflash

dflash_model = pytest.importorskip("dflash.model", reason="pip install --no-deps dflash==0.1.0 (Makefile setup)")
pytestmark = [pytest.mark.real_model, pytest.mark.slow]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def target():
    return load_target(None)


def test_dflash_generate_with_an_exported_drafter_matches_greedy_and_our_chain(target, tmp_path, monkeypatch):
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)  # it times itself with cuda.synchronize
    texts = load_domain("code").eval[:2]
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in texts]
    greedy = []
    for p in prompts:
        ids = torch.tensor([p])
        out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)
        greedy.append(out[0, len(p):].tolist())
    # a drafter in the DFlash format (mask rows = the target embedding of token 0, no window, no copy
    # branch), fitted briefly on these answers so that rounds accept several tokens
    drafter = new_drafter(target, block_size=5, num_layers=1, seed=0, mask_token_id=0, learned_mask=False)
    seqs = [p + g for p, g in zip(prompts, greedy)]
    T = min(len(s) for s in seqs)
    ids = torch.tensor([s[-T:] for s in seqs])
    feats = target.sequence_features(ids, drafter.config.target_layer_ids)
    K = drafter.config.num_draft_tokens
    anchors = torch.arange(T - NEW_TOKENS, T - K).expand(len(seqs), -1)
    labels = torch.stack([ids.gather(1, anchors + k) for k in range(1, K + 1)], -1).reshape(-1, K)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    for _ in range(60):
        loss = block_cross_entropy(drafter.forward_anchors(feats, ids, anchors), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    drafter.eval()
    export_dflash(drafter, tmp_path / "dflash")
    theirs = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "dflash", dtype=torch.float32).eval()

    ours = ChainDecoder(target, drafter, budget=K, verifier="greedy")
    accepted = []
    for p, want in zip(prompts, greedy):
        stats = dflash_model.dflash_generate(
            theirs, target.model, torch.tensor([p]), NEW_TOKENS, stop_token_ids=None, temperature=0.0,
            return_stats=True,
        )
        assert stats.output_ids[0, len(p):].tolist() == want
        # dflash_generate takes the first token from its prefill and drafts from it on; start ours
        # there too (the prompt plus that token), so that round i of each verifies the same block
        mine = ours.generate(p + want[:1], NEW_TOKENS - 1, temperature=0.0)
        assert mine.tokens[: NEW_TOKENS - 1] == want[1:]
        rounds = [r.block_length for r in mine.rounds]
        n = len(stats.acceptance_lengths) - 1  # the last round of each is cut at the token limit
        assert stats.acceptance_lengths[:n] == rounds[:n]
        accepted += rounds[:n]
    assert max(accepted) >= 2, accepted  # rounds did accept drafted tokens: the comparison has teeth
