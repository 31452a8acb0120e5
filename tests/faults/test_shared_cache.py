"""Two runs on one cache: each batch answered once, a run uses what another finished, and the folders
of runs that are gone are told from those of runs at work (claims: exittrain.data.regen_cache)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from exittrain.atomic import FileLock
from exittrain.data import regen_cache
from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import batch_dir, cache_path, claim_file
from exittrain.data.regenerate import regenerate
from tests.data.helpers import CountingTarget, tiny_llama

PROMPTS = ["Hi there", "What is 2+2?", "Write a poem about the sea.", "Name three colours.", "Why is the sky blue?"]
GEN = GenerationConfig(max_new_tokens=6, batch_size=2)  # 3 batches: 2 + 2 + 1


@pytest.fixture(autouse=True)
def _quick(one_thread, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)  # one process per run, whatever launched the tests
    monkeypatch.setattr(regen_cache, "CLAIM_POLL_S", 0.02)


def _run(tok, cache, target=None):
    target = target or CountingTarget(tiny_llama(tok, seed=0, eos_boost=5.0), tok)
    return regenerate(PROMPTS, target, target_name="tiny", cache_dir=cache, gen=GEN, progress=False), target


def _rows(ds):
    return [dict(r) for r in ds]


def _wait_for(condition, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, smollm2_tokenizer):
    """The entry one run alone writes."""
    torch.set_num_threads(1)
    ds, _ = _run(smollm2_tokenizer, tmp_path_factory.mktemp("alone"))
    return _rows(ds)


def test_two_runs_on_one_cache_answer_each_batch_once_and_both_use_the_entry(tmp_path, smollm2_tokenizer, reference):
    """The interleaving: run A claims batch 0 and is answering it when run B starts; B answers batches
    1 and 2, then waits for batch 0; A finishes it, finds 1 and 2 done, and one of them merges."""
    tok = smollm2_tokenizer
    entry = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    partial = entry.with_name(entry.name + ".partial")
    b_result, b_error = {}, []
    b_target = CountingTarget(tiny_llama(tok, seed=0, eos_boost=5.0), tok)

    def run_b():
        try:
            b_result["ds"], _ = _run(tok, tmp_path, b_target)
        except BaseException as e:  # noqa: BLE001 (handed to the main thread's assertion)
            b_error.append(e)

    a_target = CountingTarget(tiny_llama(tok, seed=0, eos_boost=5.0), tok)
    a_generate, b_thread = a_target.model.generate, threading.Thread(target=run_b)

    def a_generate_batch(*args, **kwargs):
        if not b_thread.is_alive() and not b_result and not b_error:  # A's first batch: B runs meanwhile
            b_thread.start()
            _wait_for(lambda: batch_dir(partial, 1).is_dir() and batch_dir(partial, 2).is_dir() or b_error,
                      "run B to answer the batches A does not hold")
        return a_generate(*args, **kwargs)

    a_target.model.generate = a_generate_batch
    a_ds, _ = _run(tok, tmp_path, a_target)
    b_thread.join(timeout=120)
    assert not b_error, b_error
    assert (a_target.generate_calls, b_target.generate_calls) == (1, 2), "each batch answered once"
    assert _rows(a_ds) == _rows(b_result["ds"]) == reference
    assert sorted(os.listdir(tmp_path)) == [entry.name], "no partial, temporary or lock files left"


def test_a_claim_nobody_holds_is_stale_and_one_held_is_left_to_its_run(tmp_path, smollm2_tokenizer, reference):
    tok = smollm2_tokenizer
    entry = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    partial = entry.with_name(entry.name + ".partial")
    partial.mkdir(parents=True)
    # batch 0: a killed run's claim (nobody holds it) and its half-written folder; batch 1: a live claim
    claim_file(partial, 0).write_text("999999 gone-host 2026-01-01T00:00:00+0000\n")
    dead = partial / f"{batch_dir(partial, 0).name}.tmp-dead0001"
    live = partial / f"{batch_dir(partial, 1).name}.tmp-live0002"
    dead.mkdir(), live.mkdir()
    holder = FileLock(claim_file(partial, 1))
    assert holder.acquire()
    result, errors = {}, []

    def run():
        try:
            result["ds"], result["target"] = _run(tok, tmp_path)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    _wait_for(lambda: batch_dir(partial, 0).is_dir() and batch_dir(partial, 2).is_dir() or errors, "batches 0 and 2")
    assert not dead.exists(), "the folder of a run that is gone is removed"
    assert live.exists() and not batch_dir(partial, 1).exists(), "a held batch is left to its run"
    assert thread.is_alive(), "the run waits for the held batch"
    holder.release()  # the holder dies: its claim is stale now, and the waiting run answers the batch
    thread.join(timeout=120)
    assert not errors, errors
    assert result["target"].generate_calls == 3 and _rows(result["ds"]) == reference
    assert sorted(os.listdir(tmp_path)) == [entry.name]


def test_a_partial_folder_left_beside_a_complete_entry_is_removed_unless_a_claim_in_it_is_held(
    tmp_path, smollm2_tokenizer
):
    tok = smollm2_tokenizer
    _run(tok, tmp_path)
    entry = cache_path(tmp_path, "tiny", "", PROMPTS, GEN)
    partial = entry.with_name(entry.name + ".partial")
    (partial / "shard_00001.tmp-race0001").mkdir(parents=True)  # what an earlier race left
    holder = FileLock(claim_file(partial, 1))
    assert holder.acquire()
    _, target = _run(tok, tmp_path)
    assert target.provided == 0 and partial.is_dir(), "a run still holding a claim keeps the folder"
    holder.release()
    _, target = _run(tok, tmp_path)
    assert target.provided == 0 and not partial.exists(), "nobody holds a claim: the stale folder goes"
