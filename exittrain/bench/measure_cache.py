"""Per-drafter measurements kept on disk, so that a rerun of an experiment measures only what is new.

An entry belongs to one drafter (by name) under one key: the measuring settings (what the caller
passes: the prompts, the evaluator's settings), the digest of the drafter's ``model.safetensors``
when a folder is named, and the version of the measuring code (:func:`code_version`: the source of
:data:`MEASURING_CODE`). A retrained arm, a changed setting or a changed measurement gets no stale
numbers: it is measured again. Files: ``<folder>/<name>.json``, written atomically.

Limits: the code version covers the packages that walk, decode and score rounds, not every module a
measurement imports (the drafter's and the target's forward passes live in ``exittrain/models``); a
change there that moves the numbers needs the folder deleted by hand.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from exittrain.run_dir import write_json_atomic
from exittrain.safe_io import load_json_object

__all__ = ["MEASURING_CODE", "MeasureCache", "code_version"]

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # exittrain/
# the packages whose source decides a held-out measurement: the evaluator, the decoders, the tree and verifier math
MEASURING_CODE = ("heldout", "decoding", "core")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def code_version(packages: tuple[str, ...] = MEASURING_CODE, root: Path = PACKAGE_DIR) -> str:
    """sha256 over every ``*.py`` file under ``root/<package>`` (its path relative to ``root`` and its
    bytes, in sorted order): a changed, added or removed source file gives another version."""
    h = hashlib.sha256()
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.relative_to(root).as_posix().encode() + b"\0")
            h.update(_file_digest(path).encode() + b"\n")
    return h.hexdigest()


class MeasureCache:
    """``load`` / ``save`` of one JSON-serialisable measurement per drafter name, keyed by ``settings``
    (JSON-serialisable), the digest of the drafter's ``model.safetensors`` and ``code`` (default:
    :func:`code_version`)."""

    def __init__(self, folder: str | Path, settings: dict, code: str | None = None) -> None:
        self.folder = Path(folder)
        self.settings = json.dumps(settings, sort_keys=True, default=str)
        self.code = code_version() if code is None else code

    def _key(self, drafter_dir: str | Path | None) -> str:
        weights = "" if drafter_dir is None else _file_digest(Path(drafter_dir) / "model.safetensors")
        return hashlib.sha256(f"{self.settings}\n{weights}\n{self.code}".encode()).hexdigest()

    def path(self, name: str) -> Path:
        return self.folder / (re.sub(r"[^A-Za-z0-9_.@-]+", "_", name) + ".json")

    def load(self, name: str, drafter_dir: str | Path | None = None) -> dict | None:
        """What was saved for ``name`` under this key; None when nothing was, or under another key."""
        path = self.path(name)
        if not path.is_file():
            return None
        saved = load_json_object(path, what="a kept measurement", fix=f"delete {path} (it is measured again)")
        return saved.get("measured") if saved.get("key") == self._key(drafter_dir) else None

    def save(self, name: str, measured: dict, drafter_dir: str | Path | None = None) -> Path:
        return write_json_atomic(self.path(name), {"name": name, "key": self._key(drafter_dir), "measured": measured})
