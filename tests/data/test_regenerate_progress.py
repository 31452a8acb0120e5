"""Regeneration's progress: log lines per batch under a redirected stdout, tqdm's bar on a terminal."""

from __future__ import annotations

import logging
import re

import pytest

from exittrain import progress
from exittrain.data.generation import GenerationConfig
from exittrain.data.regenerate import regenerate
from tests.data.helpers import CountingTarget, tiny_llama

PROMPTS = ["Hi there", "What is 2+2?", "Name three colours.", "Why is the sky blue?", "Hello"]
GEN = GenerationConfig(max_new_tokens=4, batch_size=2)  # 3 batches: 2 + 2 + 1
LINE = re.compile(r"^regenerate \(tiny\) batch (\d)/3 \(\d+%\) answers=(\d+) tok_s=\S+ elapsed=\S+ eta=\S+$")


@pytest.fixture(autouse=True)
def _single_thread(one_thread):
    yield


def _lines(caplog) -> list[tuple[int, int]]:
    """(batches done, answers) of each regeneration line."""
    texts = [r.getMessage() for r in caplog.records if r.name == "exittrain"]
    matches = [LINE.match(t) for t in texts if t.startswith("regenerate (tiny)")]
    assert all(matches), texts
    return [(int(m.group(1)), int(m.group(2))) for m in matches]


def _run(tok, cache, **kwargs):
    target = CountingTarget(tiny_llama(tok, seed=0, eos_boost=5.0), tok, **kwargs)
    return regenerate(PROMPTS, target, target_name="tiny", cache_dir=cache, gen=GEN, progress=True)


def test_logs_a_line_per_batch_off_a_terminal_and_counts_a_resume_from_its_start(
    tmp_path, smollm2_tokenizer, monkeypatch, caplog
):
    monkeypatch.setattr(progress, "interactive", lambda stream=None: False)
    caplog.set_level(logging.INFO, logger="exittrain")
    with pytest.raises(RuntimeError, match="simulated interruption"):
        _run(smollm2_tokenizer, tmp_path, fail_after=1)
    assert _lines(caplog) == [(1, 2)]
    caplog.clear()
    _run(smollm2_tokenizer, tmp_path)
    assert _lines(caplog) == [(2, 2), (3, 3)], "the resumed run: batches of the whole entry, answers of this run"


def test_no_log_lines_on_a_terminal(tmp_path, smollm2_tokenizer, monkeypatch, caplog):
    monkeypatch.setattr(progress, "interactive", lambda stream=None: True)
    caplog.set_level(logging.INFO, logger="exittrain")
    _run(smollm2_tokenizer, tmp_path)
    assert _lines(caplog) == []
