"""Progress during a fit: log lines under a redirected stdout, step-counting bars on a terminal."""

from __future__ import annotations

import logging
import re

import pytest
from lightning.pytorch import Callback

from exittrain import progress
from exittrain.lit import ProgressLogCallback
from exittrain.lit.progress_callbacks import StageRichProgressBar, StageTQDMProgressBar
from tests.lit.helpers import StepLosses, loader, make_module, trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no `val_dataloader`"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
]

STEPS = 5  # 3 batches an epoch (6 rows, 2 a batch): the fit runs into a second epoch
LINE = re.compile(
    r"^pretrain step (\d+)/5 \(\d+%\) loss=(\S+) loss_tok=(\S+) rows_s=(\S+) tok_s=(\S+) elapsed=\S+ eta=\S+$"
)


def _fit(target, callbacks, **kwargs):
    module = make_module(target, stage="pretrain", analytic_every=0)
    trainer(STEPS, callbacks=callbacks, **kwargs).fit(module, loader(6))


def test_log_lines_carry_stage_step_and_loss_off_a_terminal(target, monkeypatch, caplog):
    monkeypatch.setattr(progress, "interactive", lambda stream=None: False)
    caplog.set_level(logging.INFO, logger="exittrain")
    losses = StepLosses()
    _fit(target, [ProgressLogCallback("pretrain", every_n_steps=2, every_s=0), losses])
    lines = [r.getMessage() for r in caplog.records if r.name == "exittrain" and r.getMessage().startswith("pretrain")]
    matches = [LINE.match(text) for text in lines]
    assert all(matches), lines
    assert [int(m.group(1)) for m in matches] == [1, 2, 4, 5], "first, every 2nd and the last step"
    for m in matches:
        step = int(m.group(1))
        assert float(m.group(2)) == pytest.approx(losses.losses[step - 1], rel=1e-3), "the loss of that step"
        assert float(m.group(4)) > 0 and float(m.group(5)) > float(m.group(4)), "rows/s, and more tokens than rows"
    assert lines[-1].endswith("eta=0:00:00")


def test_log_lines_stay_silent_on_a_terminal(target, monkeypatch, caplog):
    monkeypatch.setattr(progress, "interactive", lambda stream=None: True)
    caplog.set_level(logging.INFO, logger="exittrain")
    _fit(target, [ProgressLogCallback("pretrain", every_n_steps=1, every_s=0)])
    assert not [r for r in caplog.records if r.getMessage().startswith("pretrain step")]


class BarSpy(Callback):
    """Records what the training bar shows after each batch (runs after the bar: later in the list)."""

    def __init__(self, read):
        self.read, self.seen = read, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen.append(self.read())


def test_rich_bar_counts_the_stages_steps_across_epochs(target):
    bar = StageRichProgressBar("pretrain")

    def read():
        task = bar.progress.tasks[bar.train_progress_bar_id]
        return task.description.split("]")[-1].strip(), task.completed, task.total

    spy = BarSpy(read)
    _fit(target, [bar, spy], enable_progress_bar=True)
    assert spy.seen == [(f"pretrain step {s}/5", s, 5) for s in range(1, STEPS + 1)]


def test_tqdm_bar_counts_the_stages_steps_across_epochs(target):
    bar = StageTQDMProgressBar("pretrain")

    def read():
        shown = bar.train_progress_bar
        return shown.desc.rstrip(": "), shown.n, shown.total  # tqdm appends ": " to a description

    spy = BarSpy(read)
    _fit(target, [bar, spy], enable_progress_bar=True)
    assert spy.seen == [(f"pretrain step {s}/5", s, 5) for s in range(1, STEPS + 1)]
