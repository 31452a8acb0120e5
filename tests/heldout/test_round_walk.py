"""The walked rounds against the real decodes (their slow reference twins), the serving track's
chain and the tree track's best-first tree: equal block lengths, prompt for prompt, on tiny targets
with drafters that accept (with and without the copy branch), and on the embedded SmolLM2 target
with the code recipe's drafter."""

from __future__ import annotations

import pytest
import torch

from exittrain.decoding import SpeculativeDecoder, autoregressive_generate
from exittrain.decoding.chain_decoder import ChainDecoder, decode_after_prefill
from exittrain.heldout.decode_eval import evaluate_prompts, summarize
from exittrain.heldout.round_walk import walked_rounds
from exittrain.heldout.serving_track import chain_rows, summarize_chain
from tests.heldout.helpers import trained_drafter

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def answers(target, prompts):
    torch.set_num_threads(1)
    return [autoregressive_generate(target, p, NEW_TOKENS).tokens for p in prompts]


@pytest.fixture(scope="module", params=[[], [3, 2]], ids=["plain", "copy_branch"])
def drafter(request, target, prompts, answers):
    torch.set_num_threads(1)
    return trained_drafter(target, prompts, answers, new_tokens=NEW_TOKENS, copy_ngrams=request.param)


def test_the_walk_gives_the_decoded_rounds_exactly(one_thread, target, drafter, prompts, answers):
    decoder = ChainDecoder(target, drafter, verifier="greedy")
    eos = set(target.eos_token_ids)
    past_the_stop = accepted = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens, rounds = decode_after_prefill(decoder, prompt, answer[0], NEW_TOKENS, target.eos_token_ids)
        decoded = [r.block_length for r in rounds]
        assert tokens == answer  # the walk's premise: the decode outputs the target's greedy answer
        assert walked_rounds(target, drafter, prompt, answer, max_new_tokens=NEW_TOKENS) == decoded
        # negative control: the walk one position late (rounds rooted from y[1]) differs
        late = walked_rounds(target, drafter, prompt + answer[:1], answer[1:], max_new_tokens=NEW_TOKENS - 1)
        assert late != decoded
        past_the_stop += sum(decoded) > len(answer) - 1  # the last round accepted past y's end: scored by the target
        accepted += sum(r.accept_length for r in rounds)
    # the data covers what the walk must get right: long acceptances, answers cut by EOS and by
    # the token limit, and a last round whose acceptance y alone cannot tell
    assert accepted >= 30 and past_the_stop >= 1
    assert any(a[-1] in eos for a in answers) and any(len(a) == NEW_TOKENS for a in answers)


@pytest.mark.parametrize("budget, drafter_temperature", [(3, 1.0), (12, 1.0), (12, 0.3), (3, 3.0)])
def test_the_walked_tree_gives_the_plain_decoders_rounds_exactly(one_thread, target, drafter, prompts, answers,
                                                                 budget, drafter_temperature):
    """The tree track's walk: SpeculativeDecoder.generate(prompt) roots its first round at the
    prompt's last token, so its rounds are the walk of prompt[-1:] + answer after prompt[:-1]. At a
    drafter temperature t_d != 1 both build their trees from log_softmax(logits / t_d), and their
    rounds differ from t_d = 1's on some prompt (the negative control of the option)."""
    eos = set(target.eos_token_ids)
    past_the_stop = accepted = differs = moved_by_t_d = 0
    for prompt, answer in zip(prompts, answers, strict=True):
        result = SpeculativeDecoder(target, drafter, budget=budget,
                                    drafter_temperature=drafter_temperature).generate(prompt, NEW_TOKENS)
        decoded = [r.block_length for r in result.rounds]
        assert result.tokens == answer
        walked = walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer, max_new_tokens=NEW_TOKENS + 1,
                               shape="ddtree", budget=budget, drafter_temperature=drafter_temperature)
        assert walked == decoded
        if drafter_temperature != 1.0:
            moved_by_t_d += walked != walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer,
                                                    max_new_tokens=NEW_TOKENS + 1, shape="ddtree", budget=budget)
            continue  # the controls below are t_d = 1's
        # negative control: rooted one position late (at the answer's first token, as after a prefill)
        late = walked_rounds(target, drafter, prompt, answer, max_new_tokens=NEW_TOKENS, shape="ddtree", budget=budget)
        differs += late != decoded
        past_the_stop += sum(decoded) > len(answer)
        accepted += sum(r.accept_length for r in result.rounds)
    if drafter_temperature != 1.0:
        assert moved_by_t_d >= 1
        return
    assert accepted >= 30 and past_the_stop >= 1 and differs >= len(prompts) // 2
    assert any(a[-1] in eos for a in answers)
    with pytest.raises(ValueError, match="needs its budget"):
        walked_rounds(target, drafter, prompts[0], answers[0], max_new_tokens=NEW_TOKENS, shape="ddtree")
    with pytest.raises(ValueError, match="shape='fan'"):
        walked_rounds(target, drafter, prompts[0], answers[0], max_new_tokens=NEW_TOKENS, shape="fan", budget=4)


def test_the_tree_and_chain_walks_of_one_answer_share_one_causal_pass(one_thread, target, drafter, prompts, answers,
                                                                      monkeypatch):
    """The tree track walks prompt[-1:] + answer after prompt[:-1], the chain track answer after
    prompt: the same tokens, so one target pass serves both (and every other drafter); another
    answer runs its own. The shared pass gives the rounds a fresh pass gives."""
    from exittrain.heldout.sequence_passes import SequencePasses

    prompt, answer = prompts[0], answers[0]
    expected = (walked_rounds(target, drafter, prompt, answer, max_new_tokens=NEW_TOKENS),
                walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer, max_new_tokens=NEW_TOKENS + 1,
                              shape="ddtree", budget=4))
    passes = SequencePasses(target)
    calls, real = [], target.sequence_prefix
    monkeypatch.setattr(target, "sequence_prefix",
                        lambda ids_LT, *a, **k: calls.append(ids_LT.shape[1]) or real(ids_LT, *a, **k))
    chain = walked_rounds(target, drafter, prompt, answer, max_new_tokens=NEW_TOKENS, passes=passes)
    tree = walked_rounds(target, drafter, prompt[:-1], prompt[-1:] + answer, max_new_tokens=NEW_TOKENS + 1,
                         shape="ddtree", budget=4, passes=passes)
    # the prompt's pass (kept for other answers to it), then the answer's continuing it; the tree walk runs none
    assert calls[0] == len(prompt) and len(calls) == 2 and (chain, tree) == expected
    walked_rounds(target, drafter, prompts[1], answers[1], max_new_tokens=NEW_TOKENS, passes=passes)
    assert len(calls) == 4 and len(passes) == 4 and calls[2] == len(prompts[1])


def test_evaluate_prompts_walks_all_but_the_live_prompt(one_thread, target, drafter, prompts):
    """The tree track at eval's settings without speed columns: walked rows equal the decoded ones,
    the live prompt is checked and lossless; a walk that disagrees with its decode is flagged."""
    settings = dict(budgets=[4], temperatures=[0.0], max_new_tokens=NEW_TOKENS, progress=False, speed=False)
    reference = evaluate_prompts(target, drafter, prompts, ar_cache={}, **settings)
    cache: dict = {}  # its own: the walked prompts' answers come batched, the live one's from the baseline
    walked = evaluate_prompts(target, drafter, prompts, ar_cache=cache, live=1, **settings)
    assert cache[0.0, 0].seconds > 0 and all(cache[0.0, i].seconds == 0 for i in range(1, len(prompts)))
    assert [r["block_lengths"] for r in walked] == [r["block_lengths"] for r in reference]
    assert [r["decoded"] for r in walked] == [True] + [False] * (len(prompts) - 1)
    assert walked[0]["walk_matches_decode"] and walked[0]["matches_target"]
    (summary,), (reference_summary,) = summarize(walked), summarize(reference)
    assert summary["tau"] == reference_summary["tau"] and summary["tau"] > 1.5
    assert summary["lossless"] and summary["walk_exact"] and summary["live"] == 1
    assert reference_summary["live"] == len(prompts) and "walk_exact" not in reference_summary
    with pytest.raises(ValueError, match="speed columns time real decodes"):
        evaluate_prompts(target, drafter, prompts, live=1, **{**settings, "speed": True})
    with pytest.raises(ValueError, match="live=-1"):
        evaluate_prompts(target, drafter, prompts, live=-1, **settings)


def test_batched_greedy_answers_equal_the_one_prompt_baselines(one_thread, target, drafter, prompts, answers):
    """The walk's answers (batched, padded, EOS where the decoders stop) are the baseline's tokens; the live
    prompts and the cached ones are left alone; a speed evaluation refuses a cache they filled."""
    from exittrain.heldout.answers import walk_answers

    kept = autoregressive_generate(target, prompts[3], NEW_TOKENS)
    cache = {(0.0, 3): kept}
    walk_answers(target, prompts, cache, [0.0], live=2, max_new_tokens=NEW_TOKENS)
    assert sorted(i for _, i in cache) == list(range(2, len(prompts))) and cache[0.0, 3] is kept
    assert [cache[0.0, i].tokens for i in range(2, len(prompts))] == answers[2:]
    assert any(len(a) < NEW_TOKENS for a in answers[2:])  # an answer ended by EOS is among them
    settings = dict(budgets=[4], temperatures=[0.0], max_new_tokens=NEW_TOKENS, progress=False)
    with pytest.raises(ValueError, match="batched greedy answer"):
        evaluate_prompts(target, drafter, prompts, ar_cache=cache, speed=True, **settings)


def test_a_tree_walk_that_disagrees_with_its_decode_is_flagged(one_thread, target, drafter, prompts, monkeypatch,
                                                               caplog):
    import exittrain.heldout.decode_eval as decode_eval

    monkeypatch.setattr(decode_eval, "walked_rounds", lambda *a, **k: [1])
    rows = evaluate_prompts(target, drafter, prompts[:2], budgets=[4], max_new_tokens=NEW_TOKENS, progress=False,
                            speed=False, live=1, label="x")
    assert rows[0]["walk_matches_decode"] is False and summarize(rows)[0]["walk_exact"] is False
    assert "differ from the decoded" in caplog.text


def test_accept_lengths_depth_by_depth_equal_the_whole_chains(one_thread, target, drafter, prompts, answers):
    """chain_accept_lengths (the head only where the chain still matches) against its twin: every
    anchor's whole greedy chain (anchor_trees, as the decoder drafts it) followed along y."""
    from exittrain.core import followed_depth
    from exittrain.heldout.round_walk import anchor_trees, chain_accept_lengths

    K = drafter.config.num_draft_tokens
    layers = list(drafter.config.target_layer_ids)
    seen = torch.zeros(K + 1, dtype=torch.long)
    for prompt, answer in zip(prompts, answers, strict=True):
        ids_T = torch.tensor(prompt + answer)
        features_TF = target.sequence_features(ids_T[None], layers)[0].float()
        anchors_P = torch.arange(len(prompt), len(ids_T))
        labels_PK = torch.cat([ids_T, ids_T.new_full((K,), -1)]).unfold(0, K, 1)[anchors_P + 1]
        fast = chain_accept_lengths(drafter, features_TF[None], ids_T[None], anchors_P, labels_PK)
        trees = anchor_trees(drafter, features_TF[None], ids_T[None], anchors_P, K, shape="chain")
        assert torch.equal(fast, followed_depth(trees, labels_PK))
        seen += torch.bincount(fast, minlength=K + 1)
    assert (seen > 0).sum() >= 4  # the comparison saw short and long acceptances


def test_the_walk_stops_where_the_decoder_does(target, drafter, prompts, answers):
    prompt, answer = prompts[1], answers[1]
    assert walked_rounds(target, drafter, prompt, answer, max_new_tokens=1) == []
    assert walked_rounds(target, drafter, prompt, [1] + answer[1:], max_new_tokens=NEW_TOKENS) == []  # EOS first
    assert walked_rounds(target, drafter, prompt, [], max_new_tokens=NEW_TOKENS) == []
    with pytest.raises(ValueError, match="max_new_tokens=24: pass the target's whole answer"):
        walked_rounds(target, drafter, prompt, [t for t in answer if t != 1][:5], max_new_tokens=NEW_TOKENS)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        walked_rounds(target, drafter, prompt, answer, max_new_tokens=0)


def test_chain_rows_walk_all_but_the_live_prompt(one_thread, target, drafter, prompts):
    cache: dict = {}
    reference = chain_rows(target, drafter, prompts, max_new_tokens=NEW_TOKENS, ar_cache=cache, live=None)
    walked = chain_rows(target, drafter, prompts, max_new_tokens=NEW_TOKENS, ar_cache=cache)
    assert [r["block_lengths"] for r in walked] == [r["block_lengths"] for r in reference]
    assert [r["new_tokens"] for r in walked] == [r["new_tokens"] for r in reference]
    assert [r["decoded"] for r in walked] == [True] + [False] * (len(prompts) - 1)
    assert walked[0]["walk_matches_decode"] and walked[0]["matches_target"]
    summary, reference_summary = summarize_chain(walked)[0.0], summarize_chain(reference)[0.0]
    assert summary["chain_tau"] == reference_summary["chain_tau"] and summary["chain_tau"] > 1.5
    assert summary["chain_lossless"] and summary["chain_walk_exact"] and summary["chain_live"] == 1
    assert reference_summary["chain_live"] == len(prompts) and "chain_walk_exact" not in reference_summary
    with pytest.raises(ValueError, match="live=-1"):
        chain_rows(target, drafter, prompts, max_new_tokens=NEW_TOKENS, ar_cache=cache, live=-1)


def test_a_walk_that_disagrees_with_the_live_decode_is_flagged(one_thread, target, drafter, prompts, monkeypatch,
                                                              caplog):
    import exittrain.heldout.round_walk as round_walk

    cache: dict = {}
    monkeypatch.setattr(round_walk, "walked_rounds", lambda *a, **k: [1])
    rows = chain_rows(target, drafter, prompts[:2], max_new_tokens=NEW_TOKENS, ar_cache=cache, label="x")
    assert rows[0]["walk_matches_decode"] is False and summarize_chain(rows)[0.0]["chain_walk_exact"] is False
    assert "differ from the decoded" in caplog.text


@pytest.mark.real_model
@pytest.mark.slow  # about 40 s on a 2-core host: four decodes of 32 tokens and their autoregressive baselines
def test_the_walk_on_the_embedded_target_with_the_code_recipes_drafter(one_thread):
    """SmolLM2-135M and a drafter of conf/drafter/block.yaml's shape (K = 7, the copy branch, the
    target's last layer as its start; random otherwise, yet it accepts whole chains where the
    copy branch finds the text): the chain's and the tree's walks equal their decodes on real code prompts."""
    from exittrain.data import chat_prompt_ids, load_domain
    from exittrain.models import load_target, new_drafter

    target = load_target(None)
    drafter = new_drafter(target, block_size=8, num_layers=2, init_from_layers="auto", copy_ngrams=[3, 2],
                          copy_gate_init=0.7, seed=0)
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in load_domain("code").eval[:2]]
    rows = chain_rows(target, drafter, prompts, max_new_tokens=32, live=len(prompts))
    assert all(r["walk_matches_decode"] and r["matches_target"] for r in rows)
    tree = evaluate_prompts(target, drafter, prompts, budgets=[16], max_new_tokens=32, progress=False, speed=False,
                            live=len(prompts))  # the recipe's tree track, walked and decoded
    assert all(r["walk_matches_decode"] and r["matches_target"] for r in tree)
    assert sum(len(r["block_lengths"]) for r in rows) < sum(r["new_tokens"] - 1 for r in rows)  # some drafts accepted


@pytest.mark.real_model
@pytest.mark.slow  # about 30 s on a 2-core host: eight one-prompt answers of 32 tokens and one batch
def test_batched_greedy_answers_equal_the_one_prompt_ones_on_the_embedded_target(one_thread):
    """The walk's answers come from padded batches with a shared chat prefix; on real code prompts of
    different lengths they are the one-prompt autoregressive baseline's tokens, prompt for prompt."""
    from exittrain.data import chat_prompt_ids, load_domain
    from exittrain.heldout.answers import walk_answers
    from exittrain.models import load_target

    target = load_target(None)
    prompts = [chat_prompt_ids(target.tokenizer, t) for t in load_domain("code").eval[20:28]]
    assert len({len(p) for p in prompts}) > 1  # the batch is padded
    cache: dict = {}
    walk_answers(target, prompts, cache, [0.0], live=0, max_new_tokens=32)
    for i, prompt in enumerate(prompts):
        assert cache[0.0, i].tokens == autoregressive_generate(target, prompt, 32).tokens, f"prompt {i}"
