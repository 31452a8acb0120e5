"""Progress log lines (exittrain.progress.Ticker), the terminal check, and how fit picks bar or lines."""

from __future__ import annotations

import io
import logging
import re

import pytest
from omegaconf import OmegaConf

from exittrain import progress
from exittrain.progress import Ticker, format_duration, interactive


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


class Stream:
    def __init__(self, tty):
        self.tty = tty

    def isatty(self):
        if isinstance(self.tty, Exception):
            raise self.tty
        return self.tty


def _counts(caplog, label: str = "pretrain step") -> list[int]:
    """The counts of the ticker lines in the log, in order."""
    pattern = re.compile(rf"^{re.escape(label)} (\d+)")
    return [int(m.group(1)) for r in caplog.records if r.name == "exittrain" and (m := pattern.match(r.getMessage()))]


@pytest.fixture
def info(caplog):
    caplog.set_level(logging.INFO, logger="exittrain")
    return caplog


def test_logs_every_n_steps_plus_the_first_and_the_last(info):
    clock = FakeClock()
    ticker = Ticker("pretrain", 10, every=3, every_s=0, clock=clock)
    for n in range(1, 11):
        clock.t += 1
        ticker.update(n, loss=2.0)
    assert _counts(info) == [1, 3, 6, 9, 10]
    assert all(r.levelno == logging.INFO for r in info.records)


def test_logs_every_n_seconds_when_steps_are_slow(info):
    clock = FakeClock()
    ticker = Ticker("pretrain", 10, every=0, every_s=30, clock=clock)
    for n in range(1, 11):
        clock.t += 10
        ticker.update(n)
    # 10 s per step: the first step, then 30 s after each line, and the last step
    assert _counts(info) == [1, 4, 7, 10]


def test_whichever_interval_comes_first(info):
    clock = FakeClock()
    ticker = Ticker("pretrain", 20, every=10, every_s=30, clock=clock)
    for n in range(1, 21):
        clock.t += 30 if n == 5 else 1  # step 5 is slow: 33 s after the line of step 1
        ticker.update(n)
    assert _counts(info) == [1, 5, 10, 20]


def test_always_logs_the_last_step_once(info):
    ticker = Ticker("pretrain", 5, every=1000, every_s=0, clock=FakeClock())
    lines = [ticker.update(n) for n in range(1, 6)]
    assert _counts(info) == [1, 5]
    assert lines[1:4] == [None, None, None] and lines[4].startswith("pretrain step 5/5 (100%)")
    assert ticker.update(5) is None, "a repeated count is not logged again"
    assert _counts(info) == [1, 5]


def test_eta_is_the_remaining_count_at_the_mean_rate_so_far(info):
    clock = FakeClock()
    ticker = Ticker("pretrain", 100, every=1, start=20, clock=clock)  # resumed at step 20
    assert ticker.eta(20) is None, "no progress yet: no rate"
    clock.t += 40
    # 10 steps in 40 s since the ticker was made: 4 s a step, 70 steps left
    assert ticker.eta(30) == pytest.approx(280.0)
    line = ticker.update(30, loss=2.34567, rows_s=45.06, tok_s=12345.6, skipped=None)
    assert line == "pretrain step 30/100 (30%) loss=2.346 rows_s=45.06 tok_s=12346 elapsed=0:00:40 eta=0:04:40"
    assert info.records[-1].getMessage() == line
    assert Ticker("x", None, clock=clock).line(7) == "x step 7 elapsed=0:00:00 eta=?", "no total: no percentage, no ETA"


def test_advance_counts_on_from_start(info):
    ticker = Ticker("regenerate (tiny)", 4, unit="batch", every=1, start=1, clock=FakeClock())
    for _ in range(3):
        ticker.advance(answers=2)
    assert _counts(info, "regenerate (tiny) batch") == [2, 3, 4]


def test_format_duration():
    assert format_duration(3725.9) == "1:02:05"
    assert format_duration(0) == "0:00:00"
    assert format_duration(None) == format_duration(float("inf")) == format_duration(-1) == "?"


@pytest.mark.parametrize("kwargs", [dict(every=-1), dict(every=1.5), dict(every_s=-1), dict(total=-3)])
def test_ticker_rejects_bad_intervals(kwargs):
    with pytest.raises(ValueError):
        Ticker("x", **kwargs)


def test_interactive_asks_stdout_and_survives_odd_streams(monkeypatch, tmp_path):
    assert interactive(Stream(True)) is True
    assert interactive(Stream(False)) is False
    assert interactive(Stream(ValueError("I/O operation on closed file"))) is False
    assert interactive(object()) is False, "a replacement stdout without isatty"
    closed = open(tmp_path / "f", "w")
    closed.close()
    assert interactive(closed) is False
    monkeypatch.setattr("sys.stdout", Stream(True))
    assert interactive() is True
    monkeypatch.setattr("sys.stdout", io.StringIO())
    assert interactive() is False
    monkeypatch.setattr("sys.stdout", None)
    assert interactive() is False


@pytest.mark.parametrize("tty", [True, False])
def test_fit_callbacks_use_the_bar_on_a_terminal_and_log_lines_otherwise(monkeypatch, tmp_path, tty):
    from lightning.pytorch.callbacks import ProgressBar

    from exittrain.build import build_callbacks
    from exittrain.lit import ProgressLogCallback

    monkeypatch.setattr(progress, "interactive", lambda stream=None: tty)
    cfg = OmegaConf.create({"callbacks": {}, "trainer": {}})
    kinds = [type(cb) for cb in build_callbacks(cfg, "pretrain", [], tmp_path)]
    assert any(issubclass(k, ProgressBar) for k in kinds) is tty
    assert (ProgressLogCallback in kinds) is not tty
    off = OmegaConf.create({"callbacks": {}, "trainer": {"enable_progress_bar": False}})
    kinds = [type(cb) for cb in build_callbacks(off, "pretrain", [], tmp_path)]
    assert not any(issubclass(k, (ProgressBar, ProgressLogCallback)) for k in kinds), "switched off: no progress"


def test_the_evaluation_logs_one_line_per_decode_off_a_terminal(monkeypatch, caplog):
    from exittrain.heldout.decode_eval import evaluate_prompts
    from exittrain.models import new_drafter
    from tests.models.helpers import tiny_target

    target = tiny_target("llama", seed=3)
    drafter = new_drafter(target, block_size=4, num_layers=1, hidden_size=32, seed=0)
    monkeypatch.setattr(progress, "interactive", lambda stream=None: False)
    prompts = [[5, 17, 33, 2, 40], [9, 12, 7, 3, 8]]
    with caplog.at_level(logging.INFO, logger="exittrain"):
        rows = evaluate_prompts(target, drafter, prompts, budgets=[4], temperatures=[0.0], max_new_tokens=6,
                                label="check", baseline=True)
    lines = [m for m in caplog.messages if m.startswith("eval check")]
    # the count is decodes done, not a token count of the last decode
    assert [m.split(" (")[0] for m in lines] == ["eval check decode 1/2", "eval check decode 2/2"]
    assert f"tau={rows[-1]['tau']:.4g}" in lines[-1]


def test_a_heartbeat_speaks_during_a_long_block_and_stops_with_it(info):
    import time

    with progress.Heartbeat("score trees", every_s=0.05) as beat:
        time.sleep(0.6)  # about 12 beats; the assertion asks for 2, so a loaded host still passes
    assert beat.beats >= 2
    lines = [r.getMessage() for r in info.records if r.getMessage().startswith("score trees: running")]
    assert len(lines) == beat.beats and re.search(r"elapsed=\d:\d\d:\d\d$", lines[0])
    after = beat.beats
    time.sleep(0.2)
    assert beat.beats == after  # the thread was joined on exit
    with progress.Heartbeat("short", every_s=30.0) as quiet:
        pass  # a block shorter than every_s logs nothing
    with progress.Heartbeat("off", every_s=0) as off:
        time.sleep(0.05)
    assert quiet.beats == 0 and off.beats == 0 and off._thread is None


def test_a_heartbeat_stops_when_its_block_raises(info):
    beat = progress.Heartbeat("failing", every_s=0.01)
    with pytest.raises(RuntimeError), beat:
        raise RuntimeError("boom")
    assert beat._thread is None
