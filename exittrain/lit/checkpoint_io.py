"""Lightning checkpoint IO that writes local checkpoints atomically and durably.

Why the stock ``TorchCheckpointIO`` is not enough (read in lightning 2.6 and fsspec 2026.9):
``lightning.fabric.utilities.cloud_io._atomic_save`` serialises the whole checkpoint into memory,
then writes it inside an fsspec transaction. For a local path the transaction's file is a
``tempfile.mkstemp()`` in the *system* temporary directory, moved into place with ``shutil.move``
at commit. When that directory is on another filesystem than the checkpoint (a tmpfs ``/tmp``, a
scratch or network disk for outputs), ``shutil.move`` falls back to copying the bytes into the
final name, so a kill during the copy leaves a truncated ``last.ckpt`` (rewritten in place at
every save) under its real name. Nothing is fsynced either, and a killed process leaves a
full-size orphan in ``/tmp``.

:class:`AtomicCheckpointIO` streams ``torch.save`` into a hidden sibling of the checkpoint and
renames it into place (:func:`exittrain.atomic.atomic_open`). The hidden name (``.last.ckpt.*.tmp``)
never matches ModelCheckpoint's ``last*.ckpt`` pattern, so ``ckpt_path="last"`` cannot pick a torn
temporary file; after a successful save, such leftovers of earlier killed saves are removed.
Remote paths (``s3://`` and the like) keep Lightning's behaviour.

A save that fails on the file system (a full disk) raises :class:`exittrain.atomic.WriteError`
naming the checkpoint, the bytes its tensors need, the free space and the fix, from the first
failed write: torch's archive writer then fails on its own state (``unexpected pos``), and that
error is not what the user reads. The previous checkpoint under the name stays whole.

Loading (``fit ckpt_path=...`` resumes through it) refuses a checkpoint whose weights hold NaN or
infinity, naming the file and the tensor, before Lightning restores the module: a resumed fit
would otherwise stop later on a non-finite loss that points at the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from exittrain.atomic import atomic_open, remove_stale_temps
from exittrain.models.drafter.saved_files import check_finite_weights

__all__ = ["AtomicCheckpointIO", "CHECKPOINT_WRITE_FIX", "tensor_bytes"]

CHECKPOINT_WRITE_FIX = (
    "point hydra.run.dir (the run directory) at a disk with room; the checkpoints written before this one are "
    "whole, and fit resumes from one with ckpt_path=RUN_DIR/checkpoints/<stage>/last.ckpt"
)


def tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested checkpoint (dicts, lists, tuples): what its file needs, less the pickle."""
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, Mapping):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves replace the file in one rename (see the module docstring).

    Use: ``Trainer(plugins=[AtomicCheckpointIO()])``. Loading is Lightning's plus the check of the
    weights (:meth:`load_checkpoint`); removal is Lightning's.
    """

    def load_checkpoint(self, path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(path, *args, **kwargs)
        state = checkpoint.get("state_dict", {}) if isinstance(checkpoint, dict) else {}
        check_finite_weights(
            {k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
            file_of=lambda name: f"checkpoint {path} (state_dict['{name}'])",
            fix="resume from an earlier checkpoint of the run (RUN_DIR/checkpoints/<stage>/), or leave ckpt_path "
            "unset to re-run the stage from its start (or from a warm_start)",
        )
        return checkpoint

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(
                f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by {type(self).__name__}"
            )
        fs, local_path = fsspec.core.url_to_fs(str(path))  # strips a file:// prefix
        if not isinstance(fs, LocalFileSystem):
            super().save_checkpoint(checkpoint, path)
            return
        needed = tensor_bytes(checkpoint)
        with atomic_open(local_path, "wb", what="checkpoint", fix=CHECKPOINT_WRITE_FIX, needed=needed) as f:
            torch.save(checkpoint, f)
        remove_stale_temps(local_path)  # temporaries of writes killed earlier; only global rank 0 saves
