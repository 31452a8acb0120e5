"""``python -m exittrain prepare``: fit's data step alone, one process or two shards at once.

The fast tests call :func:`exittrain.prepare.run_prepare` in this process on the tiny target; the
slow ones run the command as subprocesses on the tiny target saved to disk (tests/lit/crash_helpers.py),
two of them at the same time as the shards 0/2 (torchrun's RANK/WORLD_SIZE) and 1/2
(``data.generation.shard``).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from exittrain.configs import CONF_DIR, register_recipes
from exittrain.data.regen_cache import load_features, load_top_logprobs, read_meta
from exittrain.prepare import run_prepare, target_identity
from tests.lit.crash_helpers import subprocess_env, tiny_run_overrides, write_prompts, write_tiny_target

N_PROMPTS, BATCH = 9, 4  # 3 batches: 4 + 4 + 1


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("prepare")
    write_tiny_target(work / "target")
    write_prompts(work / "train.jsonl", N_PROMPTS, seed=0)
    write_prompts(work / "eval.jsonl", 2, seed=1)
    return work


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(var, raising=False)


def _overrides(workdir: Path, cache: Path, *more: str) -> list[str]:
    return [
        "+recipe=code", *tiny_run_overrides(workdir, cache), f"data.generation.batch_size={BATCH}",
        "data.generation.dtype=null", *more,
    ]


def _compose(name: str, overrides: list[str]):
    register_recipes()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(name, overrides=overrides)


def test_prepare_fills_the_entry_fit_reads_and_a_second_prepare_loads_nothing(workdir, tmp_path, monkeypatch, capsys):
    from exittrain.build import build_datamodule, build_drafter, build_target
    from exittrain.settings import plan_stages

    overrides = _overrides(workdir, tmp_path / "cache")
    report = run_prepare(_compose("prepare", overrides))
    out = capsys.readouterr().out
    assert report.complete and not report.cache_hit and report.answers == N_PROMPTS
    assert f"entry: {report.entry}" in out and f"counts: {N_PROMPTS} answered of {N_PROMPTS} prompts" in out
    rate = r"this run: 3 batches, 9 answers, \d+ tokens in [\d.]+ s \([\d.]+ answers/s, [\d.]+ tokens/s\)"
    assert re.search(rate, out), out

    # fit's own DataModule, from fit's config with the same overrides, names this entry
    cfg = _compose("fit", overrides)
    target = build_target(cfg)
    datamodule = build_datamodule(cfg, target, build_drafter(cfg, target).config.target_layer_ids, plan_stages(cfg))
    assert datamodule.cache_path == report.entry and report.entry.is_dir()
    meta = read_meta(report.entry)
    assert meta["feature_layers"] == list(datamodule.feature_layers) and meta["top_logprobs"] == datamodule.top_logprobs

    # the second prepare finds it without building the target
    def no_build(*args, **kwargs):
        raise AssertionError("prepare built the target for an entry that exists")

    monkeypatch.setattr("exittrain.prepare.build_target", no_build)
    again = run_prepare(_compose("prepare", overrides))
    assert again.cache_hit and again.entry == report.entry
    assert "entry found in the cache, nothing answered" in capsys.readouterr().out


def test_prepare_writes_the_corpus_rows_entry_fit_reads_beside_the_answers(workdir, tmp_path, capsys):
    from exittrain.build import build_datamodule, build_drafter, build_target
    from exittrain.settings import plan_stages

    # a copy of the tiny target whose template renders roles, so that a conversation's prefixes are prefixes
    # of it (the corpus rows' renderer checks that); fit composes the same override
    target = write_tiny_target(tmp_path / "target")
    (target / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}w4 {{ m['content'] }} w3 {% else %}w2 "
        "{{ m['content'] }} w3 {% endif %}{% endfor %}{% if add_generation_prompt %}w4{% endif %}"
    )
    corpus = ["data.corpus_sources=['corpus:gsm_symbolic?limit=6&seed=1']", "data.max_corpus_rows=4",
              f"target.name_or_path={target}"]
    overrides = _overrides(workdir, tmp_path / "cache", *corpus)
    report = run_prepare(_compose("prepare", overrides))
    out = capsys.readouterr().out
    assert report.complete and report.answers == N_PROMPTS

    cfg = _compose("fit", overrides)
    target = build_target(cfg)
    datamodule = build_datamodule(cfg, target, build_drafter(cfg, target).config.target_layer_ids, plan_stages(cfg))
    entry = datamodule.corpus_cache_path
    assert entry is not None and entry.is_dir() and f"corpus rows: {entry}" in out
    assert read_meta(entry)["rows"] == 4  # max_corpus_rows of the 6 rows read
    # without the corpus keys prepare writes no corpus entry
    plain = run_prepare(_compose("prepare", _overrides(workdir, tmp_path / "cache", corpus[-1])))
    assert plain.cache_hit and "corpus rows:" not in capsys.readouterr().out


def test_the_target_identity_is_the_loaded_targets(workdir, tmp_path):
    from exittrain.build import build_target

    cfg = _compose("prepare", _overrides(workdir, tmp_path / "cache"))
    target = build_target(cfg)
    assert target_identity(cfg) == (target.name, str(target.device))
    with open_dict(cfg):
        cfg.target.name = "renamed"
    assert target_identity(cfg)[0] == "renamed"
    cfg.target._target_ = "tests.somewhere.build"
    assert target_identity(cfg) is None  # another builder: only building it tells


def test_prepare_checks_the_data_settings_before_anything_loads(workdir, tmp_path):
    cfg = _compose("prepare", _overrides(workdir, tmp_path / "cache", "data.max_train_prompts=0"))
    with pytest.raises(ValueError, match="data: max_train_prompts=0 must be positive"):
        run_prepare(cfg, target=lambda: pytest.fail("the target was built before the settings were checked"))


# ----------------------------------------------------------------------------------------------
# the command, as subprocesses


def _command(workdir: Path, cache: Path, run_dir: Path, *more: str) -> list[str]:
    command = [sys.executable, "-m", "exittrain", "prepare", f"hydra.run.dir={run_dir}"]
    return command + _overrides(workdir, cache, *more)


def _entry_of(output: str) -> Path:
    match = re.search(r"^entry: (\S+)$", output, re.M)
    assert match, output[-3000:]
    return Path(match.group(1))


@pytest.mark.slow
def test_the_command_prints_the_entry_and_counts(workdir, tmp_path):
    proc = subprocess.run(_command(workdir, tmp_path / "cache", tmp_path / "run"), capture_output=True, text=True,
                          timeout=300, env=subprocess_env(), cwd=str(tmp_path))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    entry = _entry_of(proc.stdout)
    assert entry.is_dir() and entry.parent == tmp_path / "cache"
    assert f"counts: {N_PROMPTS} answered of {N_PROMPTS} prompts, 0 rejected too long, 0 rejected by the engine" \
        in proc.stdout
    assert "throughput of shard 0/1: 3 batches, 9 answers" in proc.stdout


@pytest.mark.slow
def test_two_shard_processes_at_once_answer_every_prompt_once_and_merge_the_one_process_entry(workdir, tmp_path):
    env = subprocess_env()
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        env.pop(var, None)
    shared = tmp_path / "shared"
    procs = [
        subprocess.Popen(_command(workdir, shared, tmp_path / "run0"), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env={**env, "RANK": "0", "WORLD_SIZE": "2"},
                         cwd=str(tmp_path)),
        subprocess.Popen(_command(workdir, shared, tmp_path / "run1", "data.generation.shard=1/2"),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=str(tmp_path)),
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-4000:]
    answered = [int(re.search(r"^this run: (\d+) batches, (\d+) answers", out, re.M).group(2)) for out in outputs]
    assert answered == [5, 4]  # shard 0/2: batches 0 and 2 (4 + 1 prompts); shard 1/2: batch 1
    merged = [out for out in outputs if "every batch present: merged the entry" in out]
    pending = [out for out in outputs if "batches present; the process that completes the last batch merges" in out]
    assert len(merged) >= 1 and len(merged) + len(pending) == 2, outputs
    entry = _entry_of(outputs[0])
    assert _entry_of(outputs[1]) == entry and entry.is_dir() and not entry.with_name(entry.name + ".partial").exists()
    meta = read_meta(entry)
    assert {k: v["batches"] for k, v in meta["throughput"].items()} == {"0/2": 2, "1/2": 1}

    one = subprocess.run(_command(workdir, tmp_path / "one", tmp_path / "run_one"), capture_output=True, text=True,
                         timeout=300, env=env, cwd=str(tmp_path))
    assert one.returncode == 0, (one.stdout + one.stderr)[-4000:]
    reference = _entry_of(one.stdout)
    assert reference.name == entry.name  # the shard is not keyed
    _assert_same_entry(entry, reference, meta)


def _assert_same_entry(path: Path, reference: Path, meta: dict) -> None:
    from datasets import load_from_disk

    rows, expected = load_from_disk(str(path)), load_from_disk(str(reference))
    assert [dict(r) for r in rows] == [dict(r) for r in expected]
    assert rows["prompt_index"] == list(range(N_PROMPTS))  # every prompt exactly once
    layers, k = meta["feature_layers"], meta["top_logprobs"]
    assert layers and k > 0, json.dumps(meta)
    features, expected_features = load_features(path, layers), load_features(reference, layers)
    top, expected_top = load_top_logprobs(path, k), load_top_logprobs(reference, k)
    for i in range(N_PROMPTS):  # the same batches, the same model, one thread each: the same numbers
        torch.testing.assert_close(features[i], expected_features[i], rtol=0, atol=0)
        assert torch.equal(top[i][0], expected_top[i][0])
        torch.testing.assert_close(top[i][1], expected_top[i][1], rtol=0, atol=0)
