"""Per-drafter measurements kept on disk, so that a rerun of an experiment measures only what is new.

An entry set belongs to one drafter (by name) under one set of measuring settings and, when a
weights file is named, one exact set of weights: a retrained arm or a changed setting gets no
stale numbers, it is measured again. Files: ``<folder>/<name>.pt``, written atomically.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import torch

from exittrain.atomic import atomic_open

__all__ = ["MeasureCache"]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class MeasureCache:
    """``load`` / ``save`` of ``{entry key: per-row tensors}`` per drafter name, keyed by ``settings``
    (JSON-serialisable) and the digest of the drafter's ``model.safetensors``."""

    def __init__(self, folder: str | Path, settings: dict) -> None:
        self.folder = Path(folder)
        self.settings = json.dumps(settings, sort_keys=True, default=str)

    def _key(self, drafter_dir: str | Path | None) -> str:
        weights = "" if drafter_dir is None else _file_digest(Path(drafter_dir) / "model.safetensors")
        return hashlib.sha256(f"{self.settings}\n{weights}".encode()).hexdigest()

    def _path(self, name: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".pt")

    def load(self, name: str, drafter_dir: str | Path | None = None) -> dict[str, list[torch.Tensor]]:
        """The entries saved for ``name`` under these settings and weights; ``{}`` when none or stale."""
        path = self._path(name)
        if not path.is_file():
            return {}
        saved = torch.load(path, weights_only=True)
        return dict(saved["entries"]) if saved.get("key") == self._key(drafter_dir) else {}

    def save(self, name: str, entries: dict[str, list[torch.Tensor]], drafter_dir: str | Path | None = None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_open(self._path(name), "wb") as f:
            torch.save({"key": self._key(drafter_dir), "entries": entries}, f)
