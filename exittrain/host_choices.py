"""Settings chosen by measuring the host: decided once per host type, recorded, reused and reported.

A setting that a timing decides (``data.generation.dtype: auto`` and ``trainer.precision: auto`` on a
CPU, :mod:`exittrain.precision`) would otherwise follow the host's load at the moment it is timed:
the same host type once chose fp32 answers ("bf16 2x slower") and another day bf16 ("3x faster"),
and every drafter trained on them followed. So the first decision is written to a record, and every
later process with the same host identity reads it back instead of timing again.

- **Where.** :func:`recorded_choice` looks in its folders in order: the first record found wins, and
  every folder that lacks one gets a copy. The host's folder (:func:`host_folder`) is
  ``$EXITTRAIN_CACHE/host_choices``, else ``~/.cache/exittrain/host_choices`` (beside the converted
  target), so a new checkout or cache on the same host reuses it. The answers' cache folder comes
  first for ``data.generation.dtype``: shards answering at the same time on several machines that
  share the cache key the same entry.
- **Key.** One file per setting and host identity (:func:`record_path`): ``.auto-<key>-<hash>.json``,
  the hash over the setting's name and the identity (:func:`exittrain.precision.device_identity`:
  the CPU model, torch's CPU capability, the bf16 flags, ``ONEDNN_MAX_CPU_ISA`` and torch's
  version). Another host type, or a torch upgrade, decides anew.
- **Reported.** Each choice is a :class:`HostChoice`: the value, the config's setting, why, the record
  and when it was decided. The log has it once per process; a regenerated entry's metadata and a
  fit's ``metrics.json`` hold it (``choices``).
- **Override.** An explicit value in the config is never looked up or recorded. To measure again
  (the first decision ran on a host too busy to time it, say), delete the record files the log
  line names: every folder's copy, or the one left is copied back.

Limits: the record trusts the identity. Two machines that report the same one but differ in speed
(a throttled VM, a neighbour using the cores) share the first one's choice, which is the point:
the choice is then stable, and it is printed beside every result it shapes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from exittrain.atomic import temp_sibling, write_errors_named

__all__ = ["HostChoice", "host_folder", "lookup", "record_path", "recorded_choice"]

_RECORD_FIX = "point EXITTRAIN_CACHE at a folder with room and write permission, then run again"


@dataclass(frozen=True)
class HostChoice:
    """One setting as a run uses it, and how it was chosen.

    ``key``: the config key (``data.generation.dtype``); ``setting``: the config's value (``auto``
    or an explicit one); ``value``: what the run uses; ``reason``: why, one line. For a measured
    choice, ``record`` is the file it was read from or written to, ``decided`` when that file was
    written (UTC), ``host`` the identity it is keyed by and ``measured_now`` whether this process
    timed it (no record existed). An explicit setting, or one decided without a timing (a CUDA
    device's bf16 support), has no record. ``records``: every copy of the record (the first one
    is read), all of which must go for the setting to be measured again."""

    key: str
    setting: Any
    value: Any
    reason: str
    records: tuple[str, ...] = ()
    decided: str | None = None
    host: str | None = None
    measured_now: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "records": list(self.records)}

    def line(self) -> str:
        """The log line: ``key auto -> value (why; where it is recorded)``."""
        shown = "null (the target as loaded)" if self.value is None else self.value
        text = f"{self.key} {self.setting} -> {shown} ({self.reason}"
        if self.records:
            files = " and ".join(self.records)
            text += (f"; measured {self.decided}, recorded in {files}: delete "
                     f"{'it' if len(self.records) == 1 else 'them'} to measure again")
        return text + ")"


def host_folder() -> Path:
    """The folder of this host's records: ``$EXITTRAIN_CACHE/host_choices``, else
    ``~/.cache/exittrain/host_choices``."""
    root = os.environ.get("EXITTRAIN_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "exittrain") / "host_choices"


def record_path(folder: str | os.PathLike, key: str, host: str) -> Path:
    """The record of setting ``key`` for host identity ``host`` in ``folder``."""
    name = hashlib.sha256(f"{key}\n{host}".encode()).hexdigest()[:12]
    return Path(folder) / f".auto-{key}-{name}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        record = json.loads(path.read_text())
        record["choice"]  # noqa: B018 - a record without its choice is as broken as bad JSON
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a recorded choice ({type(e).__name__}: {e}); delete the file and the next "
                         "run measures the setting again") from e
    return record


def _write_once(path: Path, record: dict[str, Any]) -> None:
    """Write ``record`` to ``path`` unless a record is there: atomic, never over another process's."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(path)  # the project's temporary names, which remove_stale_temps recognises
    try:
        with write_errors_named(path, what="host choice record", fix=_RECORD_FIX):
            tmp.write_text(json.dumps(record, indent=1))
            try:
                os.link(tmp, path)  # not os.replace: the first record stands
            except FileExistsError:
                pass  # another process recorded first: its choice stands, and the caller reads it back
    finally:
        tmp.unlink(missing_ok=True)


def _choice(key: str, host: str, record: dict[str, Any], paths: Sequence[Path], measured_now: bool) -> HostChoice:
    return HostChoice(key=key, setting="auto", value=record["choice"],
                      reason=record.get("reason", "recorded before records kept a reason"),
                      records=tuple(map(str, paths)), decided=record.get("decided"), host=host,
                      measured_now=measured_now)


def lookup(key: str, host: str, folders: Sequence[str | os.PathLike]) -> HostChoice | None:
    """The recorded choice of ``key`` for ``host`` in the first of ``folders`` that holds one, or None;
    nothing is measured or written."""
    for folder in folders:
        path = record_path(folder, key, host)
        if path.is_file():
            return _choice(key, host, _read(path), [path], False)
    return None


def recorded_choice(
    key: str, host: str, decide: Callable[[], tuple[Any, str]], folders: Sequence[str | os.PathLike],
) -> HostChoice:
    """The recorded choice of setting ``key`` (``auto``) for host identity ``host``.

    The first of ``folders`` holding a record gives it; with none, ``decide()`` runs once and
    returns ``(value, reason)`` (value: JSON). Every folder without a record then gets one (written
    atomically; when two processes race, the first record wins and both return it). ValueError
    naming the file for a record that cannot be read."""
    if not folders:
        raise ValueError(f"recorded_choice({key!r}) needs at least one folder to keep the record in")
    paths = [record_path(folder, key, host) for folder in folders]
    found = next((p for p in paths if p.is_file()), None)
    mine = None  # this process's decision, when no record existed
    if found is None:
        value, reason = decide()
        mine = {"key": key, "device": host, "choice": value, "reason": reason,
                "decided": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    source = mine if mine is not None else _read(found)
    for path in paths:
        if not path.is_file():
            _write_once(path, source)
    record = _read(paths[0])  # a racing process may have recorded first: its record is the one kept
    return _choice(key, host, record, paths, record == mine)
