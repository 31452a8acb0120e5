"""A full disk at every write a run makes: the error names the path, the cause and the fix, keeps the
original OSError as its cause, and leaves nothing half-written under a final name."""

from __future__ import annotations

import errno
import os

import datasets
import pytest
import torch
from safetensors import SafetensorError

from exittrain.atomic import WriteError
from exittrain.data.regen_cache import FEATURES, save_atomic
from exittrain.lit.callbacks import save_drafter
from exittrain.lit.checkpoint_io import AtomicCheckpointIO
from exittrain.run_dir import RunDir
from tests.faults.helpers import SAFETENSORS_FULL, fill_disk_after, printed


def _assert_names_full_disk(err: pytest.ExceptionInfo, path, fix: str) -> None:
    e = err.value
    assert isinstance(e, WriteError) and e.errno == errno.ENOSPC
    text = str(e)
    assert str(path) in text and "the disk is full" in text and "free there" in text and fix in text, text
    assert isinstance(e.__cause__, (OSError, SafetensorError)), "the original error is the cause"


def test_a_full_disk_during_a_checkpoint_names_the_checkpoint_not_torchs_archive_writer(tmp_path, monkeypatch):
    io, path = AtomicCheckpointIO(), tmp_path / "checkpoints" / "last.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.ones(4)}, path)
    fill_disk_after(monkeypatch, room=4096)  # the next checkpoint's first 4 KiB fit, then the disk is full
    with pytest.raises(OSError) as err:
        io.save_checkpoint({"global_step": 2, "w": torch.zeros(50_000)}, path)
    monkeypatch.undo()
    _assert_names_full_disk(err, path, "hydra.run.dir")
    assert "195.3 KiB" in str(err.value), "the bytes the checkpoint's tensors need (200,016 B)"
    assert err.value.__cause__.errno == errno.ENOSPC
    # torch's archive writer fails after the disk did ("unexpected pos"); that is not what the user reads
    assert "unexpected pos" not in printed(err.value) and "inline_container" not in printed(err.value)
    assert torch.load(path, weights_only=True)["global_step"] == 1, "the previous checkpoint is whole"
    assert os.listdir(path.parent) == ["last.ckpt"], "no temporary file is left"


def test_a_full_disk_while_writing_the_answer_cache_names_the_shard(tmp_path, monkeypatch):
    rows = [{"prompt_index": 0, "prompt": "p", "response": "r", "input_ids": [3, 4, 5], "loss_mask": [0, 1, 1],
             "n_prompt_tokens": 1, "n_response_tokens": 2, "finished": True}]
    shard = tmp_path / "tiny-0123.partial" / "shard_00000"
    shard.parent.mkdir()
    features = {"features-1.safetensors": ({"0": torch.ones(3, 4)}, {"layers": "1"})}

    def full(tensors, filename, metadata=None):  # what safetensors' Rust writer raises on a full disk
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr("safetensors.torch.save_file", full)
    with pytest.raises(OSError) as err:
        save_atomic(datasets.Dataset.from_list(rows, features=FEATURES), shard, {}, tensor_files=features)
    _assert_names_full_disk(err, shard, "data.cache_dir")
    assert "cannot write cache shard" in str(err.value) and "are kept" in str(err.value)
    assert os.listdir(shard.parent) == [], "no half-written shard, and no temporary folder"

    def arrow_full(self, path, **kwargs):  # the Arrow rows of an entry: an OSError from the writer
        os.makedirs(path)
        with open(os.path.join(path, "data-00000-of-00001.arrow"), "wb") as f:
            f.write(b"ARROW1")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", arrow_full)
    entry = tmp_path / "tiny-0123"
    with pytest.raises(OSError) as err:
        save_atomic(datasets.Dataset.from_list(rows, features=FEATURES), entry, {})
    _assert_names_full_disk(err, entry, "data.cache_dir")
    assert "cannot write cache entry" in str(err.value)
    assert sorted(os.listdir(tmp_path)) == ["tiny-0123.partial"], "no entry folder, complete or not"


def test_a_full_disk_at_run_files_and_the_drafter_export_names_them(tmp_path, monkeypatch, tiny_llama_target):
    from exittrain.models import new_drafter

    run = RunDir(tmp_path)
    run.write_stage_metrics("pretrain", {"final": {"loss": 1.0}})
    fill_disk_after(monkeypatch, room=10)
    with pytest.raises(OSError) as err:
        run.write_stage_metrics("pretrain", {"final": {"loss": 0.5, "val/block_length": 1.5}})
    monkeypatch.undo()
    _assert_names_full_disk(err, run.stage_metrics_path("pretrain"), "hydra.run.dir")
    assert run.read_stage_metrics()["pretrain"]["final"] == {"loss": 1.0}, "the previous file is whole"

    drafter = new_drafter(tiny_llama_target, num_layers=1, block_size=4)
    save_drafter(drafter, tmp_path / "drafter")
    exported = sorted(os.listdir(tmp_path / "drafter"))

    def full(tensors, filename, metadata=None):
        raise SafetensorError(SAFETENSORS_FULL)

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", full)  # save_pretrained's writer
    with pytest.raises(OSError) as err:
        save_drafter(drafter, tmp_path / "drafter")
    monkeypatch.undo()
    _assert_names_full_disk(err, tmp_path / "drafter", "checkpoints hold the trained drafter")
    assert sorted(os.listdir(tmp_path / "drafter")) == exported and "model.safetensors" in exported, "as before"
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".")], "no temporary folder is left"
