"""Regeneration: loss masks, EOS handling, the cache, and resuming an interrupted run."""

from __future__ import annotations

import os

import pytest
import torch

from exittrain.data import chat_prompt_ids
from exittrain.data.generation import MIN_SHARED_PREFIX, GenerationConfig, shared_prefix_length
from exittrain.data.regen_cache import (
    cache_path,
    features_file,
    load_features,
    load_top_logprobs,
    read_meta,
    top_logprobs_file,
)
from exittrain.data.regenerate import regenerate
from exittrain.models import TargetModel
from tests.data.helpers import CountingTarget, tiny_llama

PROMPTS = ["Hi there", "What is 2+2?", "Write a poem about the sea.", "Name three colours.", "Why is the sky blue?"]
GEN = GenerationConfig(max_new_tokens=8, batch_size=2)  # 3 batches: 2 + 2 + 1


def _target(tokenizer, **kwargs):
    # eos_boost=5 with seed 0 ends 3 of the 5 greedy answers with EOS before 8 tokens
    return CountingTarget(tiny_llama(tokenizer, seed=0, eos_boost=5.0), tokenizer, **kwargs)


def _rows(ds):
    return [dict(r) for r in ds]


def test_loss_mask_covers_exactly_the_response(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    target = _target(tok)
    ds = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    rows = _rows(ds)
    assert [r["prompt_index"] for r in rows] == list(range(len(PROMPTS)))
    assert {r["finished"] for r in rows} == {True, False}  # both endings are exercised
    for r in rows:
        prompt_ids = chat_prompt_ids(tok, r["prompt"])
        n_p, n_r = r["n_prompt_tokens"], r["n_response_tokens"]
        assert r["prompt"] == PROMPTS[r["prompt_index"]]
        assert r["input_ids"][:n_p] == prompt_ids and n_p == len(prompt_ids)
        assert len(r["input_ids"]) == len(r["loss_mask"]) == n_p + n_r
        assert r["loss_mask"] == [0] * n_p + [1] * n_r
        response = r["input_ids"][n_p:]
        assert 1 <= n_r <= GEN.max_new_tokens
        if r["finished"]:
            assert response[-1] == tok.eos_token_id and tok.eos_token_id not in response[:-1]
        else:
            assert n_r == GEN.max_new_tokens and tok.eos_token_id not in response
        assert r["response"] == tok.decode(response, skip_special_tokens=True)
    # the prompt ends with the assistant header of the chat template
    assert tok.decode(rows[0]["input_ids"][: rows[0]["n_prompt_tokens"]]).endswith("<|im_start|>assistant\n")


def test_second_call_is_a_cache_hit_without_loading_the_target(tmp_path, smollm2_tokenizer):
    target = _target(smollm2_tokenizer)
    first = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    assert (target.provided, target.generate_calls) == (1, 3)
    second = regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    assert (target.provided, target.generate_calls) == (1, 3)
    assert _rows(first) == _rows(second)
    path = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    meta = read_meta(path)
    assert meta["rows"] == 5 and meta["pad_token_id"] == smollm2_tokenizer.pad_token_id
    assert sorted(os.listdir(tmp_path)) == [path.name]  # no partial or temporary folders left
    # any change of target, prompts or settings is a different entry
    other = {
        cache_path(tmp_path, "tiny2", "", PROMPTS, GEN),
        cache_path(tmp_path, "tiny", "other-set", PROMPTS, GEN),
        cache_path(tmp_path, "tiny", "", PROMPTS[:-1], GEN),
        cache_path(tmp_path, "tiny", "", PROMPTS, GenerationConfig(max_new_tokens=9, batch_size=2)),
    }
    assert path not in other and len(other) == 4


def test_interrupted_run_resumes_to_the_uninterrupted_result(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    reference = regenerate(PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path / "a", gen=GEN, progress=False)

    crashing = _target(tok, fail_after=1)
    with pytest.raises(RuntimeError, match="simulated interruption"):
        regenerate(PROMPTS, crashing, target_name="tiny", cache_dir=tmp_path / "b", gen=GEN, progress=False)
    final = cache_path(tmp_path / "b", "tiny", "", PROMPTS, GEN)
    assert not final.exists()  # nothing half-written looks complete
    partial = final.with_name(final.name + ".partial")
    assert sorted(os.listdir(partial)) == ["shard_00000"]

    # temporary folders of writes killed mid-way are deleted by the next run of the key
    stale = [final.with_name(final.name + ".tmp-dead0001"), partial / "shard_00001.tmp-dead0002"]
    for folder in stale:
        folder.mkdir()
        (folder / "data.arrow").write_bytes(b"half")
    resumed_target = _target(tok)
    resumed = regenerate(PROMPTS, resumed_target, target_name="tiny", cache_dir=tmp_path / "b", gen=GEN, progress=False)
    assert resumed_target.generate_calls == 2  # only the two missing batches
    assert _rows(resumed) == _rows(reference)
    assert not partial.exists() and not any(folder.exists() for folder in stale)
    assert sorted(os.listdir(tmp_path / "b")) == [final.name]


def test_too_long_prompts_are_counted_not_answered(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompts = ["short", "word " * 100]
    limit = len(chat_prompt_ids(tok, "short")) + 5
    gen = GenerationConfig(max_new_tokens=2, batch_size=4, max_prompt_tokens=limit)
    ds = regenerate(prompts, _target(tok), target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False)
    assert ds["prompt_index"] == [0]
    assert read_meta(cache_path(tmp_path, "tiny", "", prompts, gen))["rejected_too_long"] == 1


def test_a_shared_prefix_gives_the_answers_features_and_log_probs_of_a_full_prefill(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    templated = [chat_prompt_ids(tok, p) for p in PROMPTS]
    assert shared_prefix_length(templated) >= MIN_SHARED_PREFIX  # the chat template's system turn
    runs = {}
    for share in (False, True):
        gen = GenerationConfig(max_new_tokens=8, batch_size=5, share_prefix=share)
        runs[share] = regenerate(
            PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path / str(share), gen=gen, progress=False,
            feature_layers=[0, 1], top_logprobs=4,
        )
        runs[share] = (runs[share], cache_path(tmp_path / str(share), "tiny", "", PROMPTS, gen))
    (plain, plain_path), (shared, shared_path) = runs[False], runs[True]
    assert _rows(plain) == _rows(shared)
    plain_features, shared_features = load_features(plain_path, [0, 1]), load_features(shared_path, [0, 1])
    plain_top, shared_top = load_top_logprobs(plain_path, 4), load_top_logprobs(shared_path, 4)
    for row in plain:
        i = row["prompt_index"]
        assert shared_features[i].shape == plain_features[i].shape == (len(row["input_ids"]), 2 * 32)
        assert _relative_error(shared_features[i], plain_features[i]) < 1e-2
        assert torch.equal(shared_top[i][0], plain_top[i][0])
        torch.testing.assert_close(shared_top[i][1], plain_top[i][1], atol=1e-4, rtol=0)


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).max())


def test_kept_features_equal_a_separate_forward_over_each_row(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    target = _target(tok)
    layers = [1, 0]  # kept in the order given, as the drafter concatenates them
    ds = regenerate(
        PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False, feature_layers=layers
    )
    path = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    assert read_meta(path)["feature_layers"] == layers
    stored = load_features(path, layers)
    assert load_features(path, [0, 1]) is None  # another layer order is another file
    reference = TargetModel(target.model, tok, name="tiny")
    assert {r["finished"] for r in ds} == {True, False}  # rows that stopped at EOS and rows cut at the cap
    for row in ds:
        features = stored[row["prompt_index"]]
        assert features.dtype == torch.bfloat16 and features.shape == (len(row["input_ids"]), 2 * 32)
        # left padding in the batch, the cache of each step and the extra step for the last token:
        # every position, the last included, matches one unpadded forward up to the bf16 rounding
        expected = reference.sequence_features(torch.tensor([row["input_ids"]]), layers)[0]
        assert _relative_error(features, expected) < 1e-2
        assert _relative_error(features[-1:], expected[-1:]) < 1e-2
    # the answers themselves are those of a run that keeps no features
    plain = regenerate(PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path / "plain", gen=GEN, progress=False)
    assert _rows(plain) == _rows(ds)
    assert load_features(cache_path(tmp_path / "plain", "tiny", "", PROMPTS, GEN), layers) is None


def test_kept_top_logprobs_are_the_distributions_the_answers_were_drawn_from(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    target = _target(tok)
    ds = regenerate(
        PROMPTS,
        target,
        target_name="tiny",
        cache_dir=tmp_path,
        gen=GEN,
        progress=False,
        feature_layers=[0],
        top_logprobs=4,
    )
    path = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    assert read_meta(path)["top_logprobs"] == 4 and load_top_logprobs(path, 3) is None
    stored = load_top_logprobs(path, 4)
    assert sorted(stored) == list(range(len(PROMPTS)))
    for row in ds:
        ids, logp = stored[row["prompt_index"]]
        n_p, n_r = row["n_prompt_tokens"], row["n_response_tokens"]
        assert ids.dtype == torch.int32 and logp.dtype == torch.float32 and ids.shape == logp.shape == (n_r, 4)
        response = torch.tensor(row["input_ids"][n_p:])
        assert torch.equal(ids[:, 0].long(), response)  # greedy: each response token is its row's top-1
        assert bool((logp[:, :-1] >= logp[:, 1:]).all()) and float(logp.exp().sum(-1).max()) <= 1 + 1e-5
        # a separate unpadded forward gives the same distributions at positions n_p - 1 .. n - 2
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor([row["input_ids"]])).logits[0, n_p - 1 : -1]
        expected, expected_ids = torch.log_softmax(logits.float(), -1).topk(4, -1)
        torch.testing.assert_close(logp, expected, atol=1e-4, rtol=1e-4)
        assert torch.equal(ids.long(), expected_ids)
    assert load_features(path, [0]) is not None  # both kinds of tensors live beside the dataset
    plain = regenerate(PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path / "plain", gen=GEN, progress=False)
    assert _rows(plain) == _rows(ds)  # keeping them changes no answer
    assert not (cache_path(tmp_path / "plain", "tiny", "", PROMPTS, GEN) / top_logprobs_file(4)).exists()
    with pytest.raises(ValueError, match="top_logprobs"):
        regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path / "bad", gen=GEN, top_logprobs=-1)


def test_kept_top_logprobs_of_a_sampled_answer_are_the_raw_distributions(tmp_path, smollm2_tokenizer):
    """With sampling, the kept log-probabilities are the model's own, before temperature and top-p."""
    tok = smollm2_tokenizer
    target = _target(tok)
    gen = GenerationConfig(max_new_tokens=6, batch_size=2, do_sample=True, temperature=0.5, top_p=0.9, seed=3)
    ds = regenerate(
        PROMPTS[:2], target, target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False, top_logprobs=5
    )
    stored = load_top_logprobs(cache_path(tmp_path, "tiny", "", PROMPTS[:2], gen), 5)
    for row in ds:
        n_p = row["n_prompt_tokens"]
        with torch.no_grad():
            logits = target.model(input_ids=torch.tensor([row["input_ids"]])).logits[0, n_p - 1 : -1]
        expected, _ = torch.log_softmax(logits.float(), -1).topk(5, -1)  # temperature 1, nothing cut
        torch.testing.assert_close(stored[row["prompt_index"]][1], expected, atol=1e-4, rtol=1e-4)


def test_a_resumed_run_whose_first_batches_kept_no_features_saves_none(tmp_path, smollm2_tokenizer, caplog):
    tok = smollm2_tokenizer
    with pytest.raises(RuntimeError, match="simulated interruption"):
        regenerate(PROMPTS, _target(tok, fail_after=1), target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False)
    regenerate(
        PROMPTS, _target(tok), target_name="tiny", cache_dir=tmp_path, gen=GEN, progress=False, feature_layers=[0]
    )
    path = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    assert not (path / features_file([0])).exists() and read_meta(path)["feature_layers"] == []
    assert "kept no features of layers [0]; the entry is saved without features" in caplog.text


def test_feature_layers_are_checked(tmp_path, smollm2_tokenizer):
    target = _target(smollm2_tokenizer)
    with pytest.raises(ValueError, match="repeats a layer id"):
        regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, feature_layers=[0, 0])
    with pytest.raises(ValueError, match=r"feature_layers=\[2\] must be layer ids in \[0, 2\)"):
        regenerate(PROMPTS, target, target_name="tiny", cache_dir=tmp_path, gen=GEN, feature_layers=[2])


def test_a_bf16_copy_answers_and_the_target_stays_fp32(tmp_path, smollm2_tokenizer):
    tok = smollm2_tokenizer
    model = tiny_llama(tok, seed=0, eos_boost=5.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen = GenerationConfig(max_new_tokens=8, batch_size=2, dtype="bfloat16")
    ds = regenerate(
        PROMPTS, (model, tok), target_name="tiny", cache_dir=tmp_path, gen=gen, progress=False, feature_layers=[0, 1]
    )
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    stored = load_features(cache_path(tmp_path, "tiny", "", PROMPTS, gen), [0, 1])
    fp32 = GenerationConfig(max_new_tokens=8, batch_size=2)
    regenerate(PROMPTS, (model, tok), target_name="tiny", cache_dir=tmp_path, gen=fp32, feature_layers=[0, 1])
    stored_fp32 = load_features(cache_path(tmp_path, "tiny", "", PROMPTS, fp32), [0, 1])
    reference = TargetModel(model, tok, name="tiny")
    agree = total = 0
    for row in ds:
        ids = torch.tensor([row["input_ids"]])
        # the bf16 copy's features: close to the fp32 target's, but further off than the bf16
        # rounding of the fp32 target's own (bf16 arithmetic throughout)
        expected = reference.sequence_features(ids, [0, 1])[0]
        n_p = row["n_prompt_tokens"]  # the answers may differ, the prompts do not
        error = _relative_error(stored[row["prompt_index"]][:n_p], expected[:n_p])
        rounding = _relative_error(stored_fp32[row["prompt_index"]][:n_p], expected[:n_p])
        assert 2 * rounding < error < 0.1
        assert _relative_error(stored[row["prompt_index"]], expected) < 0.1
        # its greedy answer is the fp32 target's next token at (nearly) every response position
        with torch.no_grad():
            fp32_next = model(ids).logits[0, n_p - 1 : -1].argmax(-1)
        agree += int((fp32_next == ids[0, n_p:]).sum())
        total += ids.shape[1] - n_p
    assert agree / total >= 0.9


def test_the_bf16_copy_is_released_when_the_data_step_ends(tmp_path, smollm2_tokenizer, monkeypatch):
    """The copy that answers in another dtype lives only while the answers are made: once regenerate
    returns, nothing holds it (the training stages run beside the target alone)."""
    import weakref

    from exittrain.data import answerers

    copies = []
    make_copy = answerers.answering_model

    def recorded(model, dtype):
        answering = make_copy(model, dtype)
        assert answering is not model and next(answering.parameters()).dtype == torch.bfloat16
        copies.append(weakref.ref(answering))
        return answering

    monkeypatch.setattr(answerers, "answering_model", recorded)
    model = tiny_llama(smollm2_tokenizer, seed=0, eos_boost=5.0)
    gen = GenerationConfig(max_new_tokens=8, batch_size=2, dtype="bfloat16")
    ds = regenerate(PROMPTS, (model, smollm2_tokenizer), target_name="tiny", cache_dir=tmp_path, gen=gen,
                    progress=False, feature_layers=[0, 1], top_logprobs=2)
    assert len(ds) == len(PROMPTS) and len(copies) == 1
    assert copies[0]() is None, "the bf16 copy outlived the data step (freed without waiting for a gc pass)"
