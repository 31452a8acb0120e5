"""Crash safety: a `fit` killed with SIGKILL resumes exactly, and every file is written atomically.

- Kill and resume (real processes, the real `python -m exittrain fit` on a tiny target; the slow tier): a run that
  is never interrupted and a run killed with SIGKILL in the middle of training run side by side;
  a third process resumes the killed one from its ``last.ckpt``. It continues at the checkpoint's
  step with the uninterrupted run's batches and losses and exports the same drafters.
- Reproducibility: those two fresh processes with the same seed give identical per-step losses.
- Data order: a resume from a checkpoint written at any step, at an epoch end or after validation
  trains the uninterrupted run's batches (:class:`~exittrain.data.sampler.ResumableSampler`).
- Atomic writes, by fault injection: a write that dies half way (an exception after partial bytes,
  or a real SIGKILL in the middle of a checkpoint write) leaves the previous copy intact and
  loadable, and no half-written entry is ever read as complete.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from exittrain.data import ExitTrainDataModule
from exittrain.data.generation import GenerationConfig
from exittrain.data.regen_cache import cache_path
from exittrain.data.regenerate import regenerate
from exittrain.data.sampler import ResumableSampler
from exittrain.lit import ExitTrainModule, save_drafter
from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.models import load_drafter, load_target, new_drafter
from exittrain.run_dir import write_json_atomic
from tests.data.helpers import CountingTarget
from tests.lit.crash_helpers import REPO_ROOT, fit_command, prepare_workdir, read_records, subprocess_env
from tests.lit.helpers import make_module
from tests.lit.helpers import trainer as make_trainer

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated"),
    pytest.mark.filterwarnings("ignore:The dirpath has changed"),  # resumed runs checkpoint elsewhere on purpose
    pytest.mark.filterwarnings("ignore:Total length of `list` across ranks is zero"),  # val_fraction=0: no val loader
]

PRETRAIN_STEPS, EXITTRAIN_STEPS = 10, 4  # as in crash_helpers.fit_command
KILL_AFTER_STEP = 5  # SIGKILL once last.ckpt holds at least this step (pretrain, epoch 1 of 4-batch epochs)


# ----------------------------------------------------------------------------------------------
# kill and resume through the real CLI


@dataclasses.dataclass
class Runs:
    full: Path  # run directory of the uninterrupted run
    killed: Path
    resumed: Path
    records: dict[str, list[dict]]  # StepRecorder lines per run
    killed_returncode: int
    resume_step: int  # global step in the killed run's last.ckpt after the kill
    polls: int  # times the test read last.ckpt while the killed run was rewriting it


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=subprocess_env(), stdout=out, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, f"{' '.join(proc.args[:4])} failed ({proc.returncode}):\n{log.read_text()[-4000:]}"


def _kill_after_checkpoint(proc: subprocess.Popen, ckpt: Path, step: int, log: Path, timeout: float) -> int:
    """SIGKILL ``proc`` once ``ckpt`` holds global step >= ``step``; returns how often ``ckpt`` was read.

    Every read happens while the process may be replacing the file, so each one also checks that
    a reader never sees a torn checkpoint.
    """
    deadline, seen, polls = time.monotonic() + timeout, None, 0
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"fit ended ({proc.returncode}) before step {step} was saved:\n{log.read_text()[-3000:]}"
        )
        stamp = ckpt.stat().st_mtime_ns if ckpt.is_file() else None
        if stamp is not None and stamp != seen:
            seen, polls = stamp, polls + 1
            if torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"] >= step:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return polls
        time.sleep(0.02)
    proc.kill()
    raise AssertionError(f"no checkpoint of step {step} after {timeout} s:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    """Three `fit` processes: uninterrupted and killed side by side (own caches), then the resume."""
    work = prepare_workdir(tmp_path_factory.mktemp("crash"))
    full, killed, resumed = work / "full", work / "killed", work / "resumed"
    started: list[subprocess.Popen] = []
    try:
        full_proc = _start(fit_command(work, full, work / "full.jsonl", cache=work / "cache_full"), work / "full.log")
        started.append(full_proc)
        # the killed run sleeps 0.25 s per step so that the kill lands in the middle of pretraining, not after it
        killed_cmd = fit_command(work, killed, work / "killed.jsonl", cache=work / "cache_killed", sleep_s=0.25)
        killed_proc = _start(killed_cmd, work / "killed.log")
        started.append(killed_proc)
        last = killed / "checkpoints" / "pretrain" / "last.ckpt"
        polls = _kill_after_checkpoint(killed_proc, last, KILL_AFTER_STEP, work / "killed.log", timeout=120)
        resume_step = torch.load(last, map_location="cpu", weights_only=True)["global_step"]
        resume = f"ckpt_path={last}"  # the resumed run reads the killed run's cache, as a real restart would
        resumed_cmd = fit_command(work, resumed, work / "resumed.jsonl", resume, cache=work / "cache_killed")
        resumed_proc = _start(resumed_cmd, work / "resumed.log")
        started.append(resumed_proc)
        _finish(full_proc, work / "full.log", timeout=120)
        _finish(resumed_proc, work / "resumed.log", timeout=120)
    finally:
        for proc in started:  # only the processes this fixture started, by their handle
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    records = {name: read_records(work / f"{name}.jsonl") for name in ("full", "killed", "resumed")}
    return Runs(full, killed, resumed, records, killed_proc.returncode, resume_step, polls)


def _by_step(records: list[dict]) -> dict[tuple[str, int], dict]:
    return {(r["stage"], r["step"]): r for r in records}


@pytest.mark.slow  # three `python -m exittrain fit` processes (the runs fixture)
def test_killed_fit_resumes_at_its_checkpoint_step_with_the_same_batches(runs):
    assert runs.killed_returncode == -signal.SIGKILL
    assert KILL_AFTER_STEP <= runs.resume_step < PRETRAIN_STEPS, "the kill must land inside pretraining"
    resumed = runs.records["resumed"]
    steps = [(r["stage"], r["step"]) for r in resumed]
    want = [("pretrain", s) for s in range(runs.resume_step, PRETRAIN_STEPS)]
    assert steps == want + [("exittrain", s) for s in range(EXITTRAIN_STEPS)], "no batch replayed or skipped"
    full = _by_step(runs.records["full"])
    for r in resumed:
        ref = full[(r["stage"], r["step"])]
        assert (r["epoch"], r["rows"]) == (ref["epoch"], ref["rows"]), f"data order differs at {r['stage']} {r['step']}"
        assert r["loss"] == pytest.approx(ref["loss"], rel=1e-6, abs=1e-7), f"loss differs at {r['stage']} {r['step']}"
    metrics = json.loads((runs.resumed / "metrics.json").read_text())
    assert metrics["stages"] == ["pretrain", "exittrain"]


@pytest.mark.slow  # three `python -m exittrain fit` processes (the runs fixture)
def test_resumed_run_exports_the_uninterrupted_drafters(runs):
    for name in ("warmstart_drafter", "drafter"):
        want = load_file(runs.full / name / "model.safetensors")
        got = load_file(runs.resumed / name / "model.safetensors")
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-5, msg=f"{name}: {key}")
        config = json.loads((runs.full / name / "config.json").read_text())
        assert json.loads((runs.resumed / name / "config.json").read_text()) == config


@pytest.mark.slow  # three `python -m exittrain fit` processes (the runs fixture)
def test_same_seed_gives_identical_losses_across_processes(runs):
    """Two fresh processes, one seed: the killed run's steps are the uninterrupted run's, bit for bit."""
    killed, full = runs.records["killed"], _by_step(runs.records["full"])
    assert len(killed) >= runs.resume_step
    for r in killed:
        ref = full[(r["stage"], r["step"])]
        assert (r["rows"], r["loss"]) == (ref["rows"], ref["loss"]), f"step {r['step']}"


@pytest.mark.slow  # three `python -m exittrain fit` processes (the runs fixture)
def test_killed_run_leaves_only_whole_checkpoints(runs):
    assert runs.polls >= 2, "last.ckpt was read while being rewritten"
    ckpt_dir = runs.killed / "checkpoints" / "pretrain"
    checkpoints = sorted(ckpt_dir.glob("*.ckpt"))
    assert ckpt_dir / "last.ckpt" in checkpoints
    for path in checkpoints:
        assert torch.load(path, map_location="cpu", weights_only=True)["global_step"] >= 1
    # anything else is a hidden temporary of a write the kill interrupted, never a checkpoint name
    assert all(p.name.startswith(".") and p.name.endswith(".tmp") for p in ckpt_dir.iterdir() if p.suffix != ".ckpt")


# ----------------------------------------------------------------------------------------------
# data order after a resume, in process


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """The tiny target on disk, loaded, with its prompt files (see crash_helpers.prepare_workdir)."""
    work = prepare_workdir(tmp_path_factory.mktemp("order"))
    return work, load_target(work / "target")


def _datamodule(work: Path, target, val_fraction: float) -> ExitTrainDataModule:
    return ExitTrainDataModule(
        "tiny",
        train_sources=[f"jsonl:{work / 'train.jsonl'}:text"],
        eval_sources=[f"jsonl:{work / 'eval.jsonl'}:text"],
        target=lambda: (target.model, target.tokenizer),
        tokenizer=target.tokenizer,
        target_name="tiny",
        cache_dir=work / "cache",
        max_length=64,
        batch_size=2,
        generation={"max_new_tokens": 12, "batch_size": 4},
        val_fraction=val_fraction,
        progress=False,
    )


class _Batches(pl.Callback):
    def __init__(self):
        self.seen: dict[int, tuple[int, list[int], float]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen[trainer.global_step - 1] = (trainer.current_epoch, batch["row_id"].tolist(), float(outputs["loss"]))


def _checkpoint(mode: str, dirpath: Path) -> ModelCheckpoint:
    if mode == "step":
        return ModelCheckpoint(dirpath=dirpath, filename="{step}", every_n_train_steps=1, save_top_k=-1)
    # "epoch_end" saves in on_train_epoch_end, "validation" after each epoch's validation
    return ModelCheckpoint(
        dirpath=dirpath, filename="{step}", every_n_epochs=1, save_top_k=-1, save_on_train_epoch_end=mode == "epoch_end"
    )


@pytest.mark.parametrize(
    "mode, val_fraction, resume_steps",
    [
        ("step", 0.0, [1, 4, 5, 7]),  # 9 rows, batches of 2: mid-epoch, before the 1-row batch, epoch edge, epoch 1
        ("epoch_end", 0.0, [5, 10]),
        ("validation", 0.1, [4, 8]),  # 8 train rows + 1 validation row
    ],
)
def test_resume_from_any_checkpoint_trains_the_uninterrupted_batches(
    tiny_data, tmp_path, mode, val_fraction, resume_steps
):
    work, target = tiny_data
    max_steps = 12  # about 2.5 epochs

    def module(seed: int) -> ExitTrainModule:
        drafter = new_drafter(target, block_size=4, num_layers=1, seed=seed)
        return ExitTrainModule(
            drafter, target, stage="pretrain", anchors_per_seq=4, budget=4, lr=3e-3, vocab_sample=None, analytic_every=0
        )

    full = _Batches()
    trainer = make_trainer(max_steps, callbacks=[full, _checkpoint(mode, tmp_path / "ckpt")], checkpointing=True)
    trainer.fit(module(0), datamodule=_datamodule(work, target, val_fraction))
    saved = {torch.load(p, weights_only=True)["global_step"]: p for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert set(resume_steps) <= set(saved), sorted(saved)
    for step in resume_steps:
        resumed = _Batches()
        trainer = make_trainer(
            max_steps, callbacks=[resumed, _checkpoint(mode, tmp_path / f"again{step}")], checkpointing=True
        )
        trainer.fit(module(123), datamodule=_datamodule(work, target, val_fraction), ckpt_path=saved[step])
        assert sorted(resumed.seen) == list(range(step, max_steps)), f"resumed at {step}"
        for s, (epoch, rows, loss) in resumed.seen.items():
            assert (epoch, rows) == full.seen[s][:2], f"resumed at {step}: step {s}"
            assert loss == pytest.approx(full.seen[s][2], rel=1e-6), f"resumed at {step}: step {s}"


def test_sampler_order_depends_only_on_seed_and_epoch():
    data = list(range(10))
    one, two = ResumableSampler(data, seed=3), ResumableSampler(data, seed=3)
    epochs = []
    for e in range(3):
        one.set_epoch(e)
        two.set_epoch(e)
        epochs.append(list(one))
        assert list(two) == epochs[-1] and sorted(epochs[-1]) == data
    assert epochs[0] != epochs[1] != epochs[2]
    assert list(ResumableSampler(data, seed=4)) != epochs[0]

    # resume: epoch 1 without its first 4 indices, once; then whole epochs (here from epoch_fn)
    clock = {"epoch": 1}
    sampler = ResumableSampler(data, seed=3, epoch_fn=lambda: clock["epoch"])
    sampler.resume(1, 4)
    assert len(sampler) == 10 and list(sampler) == epochs[1][4:]
    clock["epoch"] = 2
    assert list(sampler) == epochs[2]
    sampler.resume(0, 10)  # epoch 0 was finished: the next pass is epoch 1 from its start
    assert list(sampler) == epochs[1]

    # ranks split each epoch's permutation between them
    shards = [ResumableSampler(data, seed=3, num_replicas=2, rank=r) for r in (0, 1)]
    assert sorted(list(shards[0]) + list(shards[1])) == data and list(shards[0]) == epochs[0][0::2]
    with pytest.raises(ValueError, match="epoch"):
        sampler.resume(-1, 0)


def test_resume_with_another_batch_size_restarts_the_epoch(tiny_data, caplog):
    work, target = tiny_data
    dm = _datamodule(work, target, 0.0)
    dm.load_state_dict({"train_order": {"epoch": 2, "batches_done": 3, "seed": 0, "batch_size": 2, "world_size": 1}})
    assert dm._resume_order == (2, 3)
    dm.load_state_dict({"train_order": {"epoch": 2, "batches_done": 3, "seed": 0, "batch_size": 4, "world_size": 1}})
    assert dm._resume_order == (2, 0) and "restarts from its first batch" in caplog.text


# ----------------------------------------------------------------------------------------------
# atomic writes: Lightning checkpoints


def test_checkpoint_io_keeps_the_previous_checkpoint_when_a_save_dies(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, path)

    def torn_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04" + bytes(64))  # the start of a zip archive, as torch.save writes
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", torn_save)
    with pytest.raises(OSError, match="No space"):
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(4)}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert os.listdir(tmp_path) == ["last.ckpt"], "the temporary file is removed"

    def no_rename(src, dst):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "replace", no_rename)  # dies after the data is written, before the rename
    with pytest.raises(OSError, match="I/O"):
        io.save_checkpoint({"global_step": 3}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True)["global_step"] == 1 and os.listdir(tmp_path) == ["last.ckpt"]
    io.save_checkpoint({"global_step": 4}, f"file://{path}")
    assert torch.load(path, weights_only=True)["global_step"] == 4
    assert path.stat().st_mode & 0o777 != 0o600, "a checkpoint gets the usual permissions, not mkstemp's"


KILLED_WRITER = """
import sys, time, torch
from exittrain.lit.checkpoint_io import AtomicCheckpointIO

def half_then_hang(obj, f, *args, **kwargs):
    f.write(b"PK\\x03\\x04" + bytes(4096))
    f.flush()
    open(sys.argv[2], "w").close()  # tell the test: in the middle of the write
    time.sleep(120)

torch.save = half_then_hang
AtomicCheckpointIO().save_checkpoint({"global_step": 2}, sys.argv[1])
"""


def test_sigkill_in_the_middle_of_a_checkpoint_write_keeps_the_previous_one(tmp_path):
    path, marker = tmp_path / "ckpt" / "last.ckpt", tmp_path / "writing"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, path)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(path), str(marker)], cwd=REPO_ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer never started its write"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torch.load(path, weights_only=True)["global_step"] == 1
    (leftover,) = [p for p in path.parent.iterdir() if p != path]
    assert leftover.name.startswith(".last.ckpt.") and leftover.suffix == ".tmp"
    # Lightning's ckpt_path="last" looks for last*.ckpt: the torn temporary is never a candidate
    assert ModelCheckpoint(dirpath=path.parent)._find_last_checkpoints(None) == {str(path)}
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, path)  # the next save clears the leftover
    assert os.listdir(path.parent) == ["last.ckpt"] and torch.load(path, weights_only=True)["global_step"] == 3


def test_stock_checkpoint_io_tears_when_its_temp_dir_is_on_another_filesystem(tmp_path, monkeypatch):
    """Why AtomicCheckpointIO exists: Lightning 2.6 writes into the system temp dir and moves the file.

    Across filesystems ``shutil.move`` copies into the final name; a kill during that copy leaves a
    torn ``last.ckpt``. AtomicCheckpointIO never copies: its temporary file sits beside the target.
    """
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    stock, ours = tmp_path / "stock" / "last.ckpt", tmp_path / "ours" / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"global_step": 1}, stock)
    AtomicCheckpointIO().save_checkpoint({"global_step": 1}, ours)

    def cross_device(src, dst, *args, **kwargs):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    def copy_dies_half_way(src, dst, *args, **kwargs):
        data = Path(src).read_bytes()
        Path(dst).write_bytes(data[: len(data) // 2])
        raise OSError(errno.EINTR, "killed during the copy")

    monkeypatch.setattr(os, "rename", cross_device)  # a /tmp on another filesystem
    monkeypatch.setattr(shutil, "copyfile", copy_dies_half_way)
    with pytest.raises(OSError, match="killed during the copy"):
        TorchCheckpointIO().save_checkpoint({"global_step": 2}, stock)
    AtomicCheckpointIO().save_checkpoint({"global_step": 2}, ours)  # neither rename nor copy is involved
    monkeypatch.undo()
    with pytest.raises(Exception):  # noqa: B017 (torch raises RuntimeError or a pickle error, by version)
        torch.load(stock, weights_only=True)
    assert torch.load(ours, weights_only=True)["global_step"] == 2


# ----------------------------------------------------------------------------------------------
# atomic writes: exported drafters


def _same_weights(a, b) -> bool:
    return all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())


def test_save_drafter_keeps_the_previous_export_when_a_write_dies(tmp_path, monkeypatch):
    from tests.models.helpers import tiny_target

    target = tiny_target("llama")
    first, second = make_module(target, drafter_seed=1).drafter, make_module(target, drafter_seed=2).drafter
    path = tmp_path / "drafter"
    save_drafter(first, path)
    real_save = type(second).save_pretrained

    def torn(self, save_directory, **kwargs):  # the weights file half written when the "kill" comes
        real_save(self, save_directory, **kwargs)
        weights = Path(save_directory) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        raise OSError(errno.EINTR, "killed while writing model.safetensors")

    monkeypatch.setattr(type(second), "save_pretrained", torn)
    with pytest.raises(OSError, match="killed"):
        save_drafter(second, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["drafter"] and _same_weights(first, load_drafter(path, target))

    # dies between its two renames (the old export is aside, the new one not yet in place): the old one comes back
    real_replace = os.replace

    def fail_second_rename(src, dst):
        if Path(src).suffix == ".tmp":
            raise OSError(errno.EIO, "I/O error")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_second_rename)
    with pytest.raises(OSError, match="I/O"):
        save_drafter(second, path)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["drafter"] and _same_weights(first, load_drafter(path, target))

    # what a SIGKILL leaves (no handler runs): a torn hidden folder; readers never see it, the next export clears it
    stale = tmp_path / ".drafter.0123456789ab.tmp"
    shutil.copytree(path, stale)
    (stale / "model.safetensors").write_bytes(b"torn")
    assert _same_weights(first, load_drafter(path, target))
    save_drafter(second, path)
    assert os.listdir(tmp_path) == ["drafter"] and _same_weights(second, load_drafter(path, target))


# ----------------------------------------------------------------------------------------------
# atomic writes: the regeneration cache and JSON files

PROMPTS = ["w5 w6 w7", "w8 w9 w10 w11", "w12 w13", "w14 w15 w16 w17 w18", "w19 w20 w21"]
GEN = GenerationConfig(max_new_tokens=6, batch_size=2)  # 3 batches (shards): 2 + 2 + 1


def _counting_target(folder: Path) -> CountingTarget:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return CountingTarget(AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder))


def _regenerate(folder: Path, cache: Path, target=None):
    target = target or _counting_target(folder)
    return regenerate(PROMPTS, target, target_name="tiny", cache_dir=cache, gen=GEN, progress=False)


def test_regeneration_cache_never_reads_a_half_written_entry(tiny_data, tmp_path, monkeypatch):
    folder = tiny_data[0] / "target"
    reference = [dict(r) for r in _regenerate(folder, tmp_path / "reference")]
    cache = tmp_path / "cache"
    final = cache_path(cache, "tiny", "", PROMPTS, GEN)
    partial = final.with_name(final.name + ".partial")

    real_save = datasets.Dataset.save_to_disk
    saves: list[str] = []

    def dies_on_second_shard(self, dataset_path, *args, **kwargs):
        saves.append(str(dataset_path))
        real_save(self, dataset_path, *args, **kwargs)
        if len(saves) == 2:  # written, then torn before its rename
            arrow = next(Path(dataset_path).glob("*.arrow"))
            arrow.write_bytes(arrow.read_bytes()[:16])
            raise OSError(errno.EINTR, "killed while writing a shard")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", dies_on_second_shard)
    with pytest.raises(OSError, match="killed"):
        _regenerate(folder, cache)
    monkeypatch.undo()
    assert not final.exists() and sorted(os.listdir(partial)) == ["shard_00000"]

    # what a SIGKILL at that moment leaves instead (no handler runs): the torn temporary shard, and a
    # torn temporary of the final folder from an earlier kill. Neither name is read as complete.
    shutil.copytree(partial / "shard_00000", partial / "shard_00001.tmp-deadbeef")
    for arrow in (partial / "shard_00001.tmp-deadbeef").glob("*.arrow"):
        arrow.write_bytes(b"torn")
    (cache / f"{final.name}.tmp-deadbeef").mkdir()
    (cache / f"{final.name}.tmp-deadbeef" / "data-00000-of-00001.arrow").write_bytes(b"torn")

    target = _counting_target(folder)
    resumed = _regenerate(folder, cache, target)
    assert target.generate_calls == 2, "shard 0 reused; shards 1 and 2 generated again"
    assert [dict(r) for r in resumed] == reference
    assert not partial.exists()


def test_regeneration_cache_finishes_from_its_shards_when_the_final_write_dies(tiny_data, tmp_path, monkeypatch):
    folder = tiny_data[0] / "target"
    reference = [dict(r) for r in _regenerate(folder, tmp_path / "reference")]
    cache = tmp_path / "cache"
    final = cache_path(cache, "tiny", "", PROMPTS, GEN)
    real_save = datasets.Dataset.save_to_disk

    def dies_on_final(self, dataset_path, *args, **kwargs):
        real_save(self, dataset_path, *args, **kwargs)
        if Path(dataset_path).name.startswith(final.name + ".tmp-"):
            raise OSError(errno.EINTR, "killed while writing the final dataset")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", dies_on_final)
    with pytest.raises(OSError, match="killed"):
        _regenerate(folder, cache)
    monkeypatch.undo()
    assert not final.exists(), "a failed final write is not an entry"
    assert sorted(p.name for p in cache.iterdir()) == [final.name + ".partial"], "its temporary folder is removed"

    target = _counting_target(folder)
    assert [dict(r) for r in _regenerate(folder, cache, target)] == reference
    assert target.generate_calls == 0, "every shard was complete"


def test_write_json_atomic_keeps_the_previous_file_when_a_write_dies(tmp_path, monkeypatch):
    path = write_json_atomic(tmp_path / "metrics.json", {"step": 1})

    def torn_dump(obj, f, **kwargs):
        f.write('{"step": ')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", torn_dump)
    with pytest.raises(OSError, match="No space"):
        write_json_atomic(path, {"step": 2})
    monkeypatch.undo()
    assert json.loads(path.read_text()) == {"step": 1}
    assert os.listdir(tmp_path) == ["metrics.json"]
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "not mkstemp's private 0600"
