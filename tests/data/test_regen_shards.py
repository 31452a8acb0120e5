"""Regeneration in shards: every batch answered once across processes, the merge, resuming one shard,
engine rejections, the shard's source, and the vLLM path's seam (a fake engine, no vLLM)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

from exittrain.data import vllm_backend
from exittrain.data.answerers import HFAnswerer, ProcessShard, process_shard
from exittrain.data.generation import Answer, GenerationConfig, chat_prompt_ids
from exittrain.data.regen_cache import cache_path, load_features, load_top_logprobs, read_meta
from exittrain.data.regenerate import regenerate
from tests.data.helpers import CountingTarget, tiny_llama

PROMPTS = ["Hi there", "What is 2+2?", "Write a poem about the sea.", "Name three colours.", "Why is the sky blue?"]
GEN = GenerationConfig(max_new_tokens=8, batch_size=2)  # 3 batches: 2 + 2 + 1
LAYERS, TOP = [1, 0], 4
regen = importlib.import_module("exittrain.data.regenerate")  # the module: the package exports its function


@pytest.fixture(autouse=True)
def _single_thread(one_thread, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)  # a test run under a launcher must not shard these runs
    yield


def _target(tokenizer, **kwargs):
    return CountingTarget(tiny_llama(tokenizer, seed=0, eos_boost=5.0), tokenizer, **kwargs)


def _run(tok, cache, gen=GEN, target=None, reports=None, **kwargs):
    target = target if target is not None else _target(tok)
    out = regenerate(
        PROMPTS, target, target_name="tiny", cache_dir=cache, gen=gen, progress=False, feature_layers=LAYERS,
        top_logprobs=TOP, report_to=None if reports is None else reports.append, **kwargs,
    )
    return out, target


def _entry(cache, gen=GEN):
    return cache_path(cache, "tiny", "", PROMPTS, gen)


def _assert_same_entry(path, reference_path):
    from datasets import load_from_disk

    rows, reference = load_from_disk(str(path)), load_from_disk(str(reference_path))
    assert [dict(r) for r in rows] == [dict(r) for r in reference]
    features, reference_features = load_features(path, LAYERS), load_features(reference_path, LAYERS)
    top, reference_top = load_top_logprobs(path, TOP), load_top_logprobs(reference_path, TOP)
    assert sorted(features) == sorted(reference_features) == sorted(top) == sorted(reference_top)
    for i in reference_features:  # the same batches on the same model: the same numbers
        assert torch.equal(features[i], reference_features[i])
        assert torch.equal(top[i][0], reference_top[i][0]) and torch.equal(top[i][1], reference_top[i][1])


def _shard(label):
    return GenerationConfig(max_new_tokens=8, batch_size=2, shard=label)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2_tokenizer):
    """One process answering every batch: the entry every sharded run must equal."""
    cache = tmp_path_factory.mktemp("one_process")
    torch.set_num_threads(1)
    _run(smollm2_tokenizer, cache)
    return _entry(cache)


def test_two_shards_answer_every_batch_once_and_merge_the_one_process_entry(tmp_path, smollm2_tokenizer, reference):
    tok = smollm2_tokenizer
    reports = []
    first, target0 = _run(tok, tmp_path, gen=_shard("0/2"), reports=reports)
    final = _entry(tmp_path)  # the shard is not keyed: both shards write the one-process entry
    assert first is None and not final.exists(), "a shard alone made an entry"
    partial = final.with_name(final.name + ".partial")
    assert sorted(os.listdir(partial)) == ["shard_00000", "shard_00002"]
    assert target0.generate_calls == 2
    status = reports[0].status()
    assert not reports[0].complete and (reports[0].batches_present, reports[0].batches) == (2, 3)
    assert status.startswith("shard 0/2 done: 2 of 3 batches present; the process that completes the last batch merges")

    second, target1 = _run(tok, tmp_path, gen=_shard("1/2"), reports=reports)
    assert target1.generate_calls == 1 and second is not None and reports[1].complete
    assert not partial.exists() and final.is_dir()
    assert sorted(second["prompt_index"]) == list(range(len(PROMPTS)))  # every prompt, exactly once
    _assert_same_entry(final, reference)
    meta = read_meta(final)
    assert meta["generation"]["shard"] is None and meta["backend"] == "hf" and meta["rejected_by_engine"] == []
    throughput = meta["throughput"]
    assert {k: (v["batches"], v["answers"]) for k, v in throughput.items()} == {"0/2": (2, 3), "1/2": (1, 2)}
    assert all(v["seconds"] > 0 and v["tokens_per_s"] > 0 for v in throughput.values())

    # a later call of either shard (or of one process) finds the entry and answers nothing
    third, target2 = _run(tok, tmp_path, gen=_shard("0/2"), reports=reports)
    assert third is not None and reports[2].cache_hit and target2.provided == 0


def test_a_killed_shard_resumes_alone_and_answers_only_its_missing_batches(tmp_path, smollm2_tokenizer, reference):
    tok = smollm2_tokenizer
    with pytest.raises(RuntimeError, match="simulated interruption"):
        _run(tok, tmp_path, gen=_shard("0/2"), target=_target(tok, fail_after=1))
    final = _entry(tmp_path)
    partial = final.with_name(final.name + ".partial")
    assert sorted(os.listdir(partial)) == ["shard_00000"]
    # another shard's write in progress (a temporary folder) survives shard 0's restart; its own stale one does not
    mine, theirs = partial / "shard_00002.tmp-dead0001", partial / "shard_00001.tmp-live0002"
    entry_tmp = final.with_name(final.name + ".tmp-live0003")
    for folder in (mine, theirs, entry_tmp):
        folder.mkdir()

    resumed, target = _run(tok, tmp_path, gen=_shard("0/2"))
    assert resumed is None and target.generate_calls == 1  # batch 2 only
    assert not mine.exists() and theirs.exists() and entry_tmp.exists()
    theirs.rmdir()
    _, other = _run(tok, tmp_path, gen=_shard("1/2"))
    assert other.generate_calls == 1
    _assert_same_entry(final, reference)


class RejectingAnswerer:
    """The HF answerer, but the engine rejects the prompts whose templated ids are in ``rejected``."""

    def __init__(self, inner: HFAnswerer, rejected: list[list[int]]):
        self.inner, self.rejected = inner, rejected

    def answer(self, prompt_ids, batch_index):
        answers = self.inner.answer(prompt_ids, batch_index)
        return [
            Answer([], False, error=f"prompt of {len(ids)} tokens exceeds the engine's context")
            if list(ids) in self.rejected else a
            for ids, a in zip(prompt_ids, answers)
        ]

    def close(self):
        self.inner.close()

    def describe(self):
        return {"backend": "rejecting"}


def test_engine_rejections_have_no_row_and_are_named_in_the_metadata(tmp_path, smollm2_tokenizer, monkeypatch,
                                                                     reference):
    tok = smollm2_tokenizer
    bad = [chat_prompt_ids(tok, PROMPTS[i]) for i in (1, 4)]
    real_open = regen.open_answerer  # the name the run calls: regenerate imports it from answerers
    monkeypatch.setattr(regen, "open_answerer", lambda gen, **kw: RejectingAnswerer(real_open(gen, **kw), bad))
    reports = []
    for label in ("0/2", "1/2"):  # the rejections of both shards reach the merge
        _run(tok, tmp_path, gen=_shard(label), reports=reports)
    meta = read_meta(_entry(tmp_path))
    reasons = [(r["prompt_index"], r["reason"]) for r in meta["rejected_by_engine"]]
    assert reasons == [(1, f"prompt of {len(bad[0])} tokens exceeds the engine's context"),
                       (4, f"prompt of {len(bad[1])} tokens exceeds the engine's context")]
    assert meta["rows"] == 3 and sum(len(r.rejected_by_engine) for r in reports) == 2

    from datasets import load_from_disk

    rows = [dict(r) for r in load_from_disk(str(_entry(tmp_path)))]
    expected = [dict(r) for r in load_from_disk(str(reference)) if r["prompt_index"] not in (1, 4)]
    assert rows == expected
    assert sorted(load_features(_entry(tmp_path), LAYERS)) == [0, 2, 3]


def test_the_shard_comes_from_the_setting_then_torchrun_then_srun():
    gen = GenerationConfig()
    assert process_shard(gen, {}) == ProcessShard(0, 1, "one process")
    assert process_shard(gen, {"RANK": "1", "WORLD_SIZE": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}).label == "1/4"
    assert process_shard(gen, {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}).source == "SLURM_PROCID/SLURM_NTASKS"
    assert process_shard(gen, {"WORLD_SIZE": "2"}).label == "0/1"  # Lightning's own children: no RANK
    shard = process_shard(GenerationConfig(shard="2/3"), {"RANK": "0", "WORLD_SIZE": "2"})
    assert (shard.label, shard.source) == ("2/3", "data.generation.shard")
    assert [b for b in range(7) if shard.owns(b)] == [2, 5]


@pytest.mark.parametrize("bad", ["2/2", "1", "a/b", "-1/2", "0/0", "1/2/3"])
def test_bad_shard_strings_raise_naming_the_setting(bad, tmp_path):
    with pytest.raises(ValueError, match=r"data.generation.shard=.*write I/N with 0 <= I < N"):
        regenerate(PROMPTS, lambda: None, target_name="tiny", cache_dir=tmp_path, gen={"shard": bad})


def test_bad_launcher_variables_raise_naming_them():
    with pytest.raises(ValueError, match=r"RANK='3' and WORLD_SIZE='2' do not name a process of the launch"):
        process_shard(GenerationConfig(), {"RANK": "3", "WORLD_SIZE": "2"})


def test_vllm_answers_get_their_features_from_a_teacher_forced_pass(tmp_path, smollm2_tokenizer, monkeypatch,
                                                                     reference):
    """backend=vllm through the seam, with a fake engine (HF generate without features): the entry keys
    the engine's version, and the features of its answers equal those kept while answering."""
    tok = smollm2_tokenizer
    opened = []

    def fake_open(gen, *, target_name, tokenizer, model, top_logprobs, eos_ids):
        opened.append((gen.engine_version, top_logprobs))
        hf = GenerationConfig(**{**gen.to_dict(), "backend": "hf", "engine_version": None})
        return HFAnswerer(model, tokenizer, hf, eos_ids=eos_ids, top_logprobs=top_logprobs)

    monkeypatch.setattr(vllm_backend, "open_answerer", fake_open)
    monkeypatch.setattr(vllm_backend, "resolve_engine", lambda gen: GenerationConfig(
        **{**gen.to_dict(), "engine_version": "0.0-test"}))
    gen = GenerationConfig(max_new_tokens=8, batch_size=2, backend="vllm")
    _run(tok, tmp_path, gen=gen)
    resolved = GenerationConfig(**{**gen.to_dict(), "engine_version": "0.0-test"})
    path = cache_path(tmp_path, "tiny", "", PROMPTS, resolved)
    assert opened == [("0.0-test", TOP)]
    meta = read_meta(path)
    assert (meta["backend"], meta["engine_version"]) == ("vllm", "0.0-test")
    from datasets import load_from_disk

    assert [dict(r) for r in load_from_disk(str(path))] == [dict(r) for r in load_from_disk(str(reference))]
    features, expected = load_features(path, LAYERS), load_features(reference, LAYERS)
    for i, kept in expected.items():  # layers in the order asked ([1, 0]), bf16 rounding apart
        error = ((features[i].float() - kept.float()).norm(dim=-1) / kept.float().norm(dim=-1)).max()
        assert features[i].shape == kept.shape and float(error) < 1e-2
    top, expected_top = load_top_logprobs(path, TOP), load_top_logprobs(reference, TOP)
    assert all(torch.equal(top[i][0], expected_top[i][0]) for i in expected_top)
