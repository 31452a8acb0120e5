"""The run directory: the one place that names, writes and reads a run's result files.

``fit``, ``eval``, the training callbacks and ``report`` all go through :class:`RunDir`, so each
file has one layout. Every JSON file is written atomically (:func:`write_json_atomic`).

Files of a ``fit`` run:

- ``metrics.json``, the run's summary (:meth:`RunDir.write_fit_summary`): ``recipe``, ``stages``
  (the stages run, in order), ``target``, ``tables`` {label: summary rows of
  :func:`~exittrain.heldout.decode_eval.summarize`}, ``<stage>_metrics`` {metric: value} (the
  trainer's scalar metrics at the stage's end), ``timings`` {name: seconds} and ``drafter`` (the
  exported drafter's folder). The held-out table after stage ``s`` has label ``STAGE_LABELS[s]``.
  On ranks other than 0 nothing is written.
- ``metrics_<stage>.json``, one per stage (:meth:`RunDir.write_stage_metrics`, from
  :class:`~exittrain.lit.callbacks.MetricsFileCallback`): ``global_step``, ``epoch``, ``final``
  {metric: value or null}, ``best`` [{monitor, mode, score, path}] and, with a decoding callback,
  ``decode_eval`` {best, history [{step, block_length, ...}]}.
- ``eval_<label>.json``: the per-prompt rows of :func:`~exittrain.heldout.decode_eval.evaluate_prompts`.
- ``tree_example.json``: one draft tree (:func:`exittrain.heldout.tree_example.tree_example`).

Files of an ``eval`` run: ``results.json`` (``rows`` per prompt, ``summary`` rows, ``drafter``),
``results.csv`` (the rows without their list columns) and ``tree_example.json``.

Readers raise ``ValueError`` naming the file and what is wrong with it; a file that is absent
reads as ``None`` (or an empty mapping).
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from exittrain.atomic import atomic_open

__all__ = [
    "STAGE_LABELS",
    "DRAFTER_DIRS",
    "RunDir",
    "write_json_atomic",
    "save_tree_example",
    "load_tree_example",
]

FIT_SUMMARY = "metrics.json"
RESULTS = "results.json"
RESULTS_CSV = "results.csv"
TREE_EXAMPLE = "tree_example.json"
# the held-out table after each stage, and the folder its drafter is exported to
STAGE_LABELS = {"pretrain": "warm_start", "exittrain": "exittrain"}
DRAFTER_DIRS = {"pretrain": "warmstart_drafter", "exittrain": "drafter"}
FIT_SUMMARY_KEYS = ("recipe", "stages", "tables")
TREE_EXAMPLE_KEYS = ("tokens", "parents", "depths", "reach", "exit_mass")
# the files of a run go where hydra.run.dir points (fit, eval); a file that could not be written stays as it was
RUN_FILE_FIX = "point hydra.run.dir at a disk with room and write permission, then run again"
EXPECTED_FILES = (
    "metrics.json (fit run), results.json (eval run), eval_<label>.json, metrics_<stage>.json or tree_example.json"
)


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as JSON to ``path`` via a temporary sibling file, fsync and ``os.replace``.

    A failure (or a kill) while writing leaves the previous ``path`` untouched (:func:`exittrain.atomic.atomic_open`);
    a failure of the file system raises :class:`exittrain.atomic.WriteError` naming ``path`` and the fix.
    """
    path = Path(path)
    with atomic_open(path, "w", what="run file", fix=RUN_FILE_FIX) as f:
        json.dump(data, f, indent=2, sort_keys=True, ensure_ascii=False)
        f.write("\n")
    return path


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {what} {path}: {err}") from err


def _need_object(data: Any, path: Path, what: str) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object ({what}), got {type(data).__name__}")
    return data


def _need_rows(value: Any, path: Path, what: str) -> list[dict]:
    if not isinstance(value, list) or not all(isinstance(r, dict) for r in value):
        raise ValueError(f"{path}: {what} must be a list of objects, got {type(value).__name__}")
    return value


def save_tree_example(example: dict, path: str | os.PathLike) -> Path:
    """Write ``example`` (from :func:`~exittrain.heldout.tree_example.tree_example`) as JSON to ``path``, atomically."""
    return write_json_atomic(path, example)


def load_tree_example(path: str | os.PathLike) -> dict:
    """Read a file written by :func:`save_tree_example`; ValueError if it is not one."""
    path = Path(path)
    data = _read_json(path, "the tree example")
    missing = [k for k in TREE_EXAMPLE_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{path} is not a tree example (missing keys {missing}); write it with save_tree_example")
    return data


class RunDir:
    """The result files of one run directory (module docstring). Writing creates the folder."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    # -- names ----------------------------------------------------------------------------------

    @property
    def fit_summary_path(self) -> Path:
        return self.path / FIT_SUMMARY

    def stage_metrics_path(self, stage: str) -> Path:
        if not stage or "/" in stage or stage.startswith("."):
            raise ValueError(f"stage={stage!r}: need a plain name (no '/', not hidden) for metrics_<stage>.json")
        return self.path / f"metrics_{stage}.json"

    def eval_rows_path(self, label: str) -> Path:
        if not label or "/" in label or label.startswith("."):
            raise ValueError(f"label={label!r}: need a plain name (no '/', not hidden) for eval_<label>.json")
        return self.path / f"eval_{label}.json"

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS

    @property
    def tree_example_path(self) -> Path:
        return self.path / TREE_EXAMPLE

    def drafter_path(self, stage: str = "exittrain") -> Path:
        return self.path / DRAFTER_DIRS[stage]

    def has_run_files(self) -> bool:
        """True when the folder holds any of the files above (what ``report`` reads as a run)."""
        names = (FIT_SUMMARY, RESULTS, TREE_EXAMPLE)
        return (
            any((self.path / n).is_file() for n in names)
            or any(self.path.glob("eval_*.json"))
            or any(self.path.glob("metrics_*.json"))
        )

    # -- writing --------------------------------------------------------------------------------

    def write_fit_summary(self, summary: dict) -> Path:
        """``metrics.json``; ValueError when ``summary`` lacks a key of the schema."""
        missing = [k for k in FIT_SUMMARY_KEYS if k not in summary]
        if missing:
            raise ValueError(f"a fit summary needs the keys {list(FIT_SUMMARY_KEYS)}; {missing} missing")
        return write_json_atomic(self.fit_summary_path, summary)

    def write_stage_metrics(self, stage: str, metrics: dict) -> Path:
        """``metrics_<stage>.json`` (the layout of :meth:`MetricsFileCallback.collect`)."""
        if "final" not in metrics:
            raise ValueError(f"stage metrics need a 'final' mapping; got the keys {sorted(metrics)}")
        return write_json_atomic(self.stage_metrics_path(stage), metrics)

    def write_eval_rows(self, label: str, rows: list[dict]) -> Path:
        """``eval_<label>.json``: the per-prompt rows of one held-out evaluation."""
        return write_json_atomic(self.eval_rows_path(label), list(rows))

    def write_results(self, rows: list[dict], summary: list[dict], drafter: str | os.PathLike) -> list[Path]:
        """``results.json`` and ``results.csv`` of an ``eval`` run; returns both paths."""
        json_path = write_json_atomic(self.results_path, {"rows": rows, "summary": summary, "drafter": str(drafter)})
        flat = [{k: v for k, v in r.items() if not isinstance(v, list)} for r in rows]
        csv_path = self.path / RESULTS_CSV
        with atomic_open(csv_path, "w", what="run file", fix=RUN_FILE_FIX) as f:
            writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(k for r in flat for k in r)))
            writer.writeheader()
            writer.writerows(flat)
        return [json_path, csv_path]

    def write_tree_example(self, example: dict) -> Path:
        return save_tree_example(example, self.tree_example_path)

    # -- reading --------------------------------------------------------------------------------

    def read_fit_summary(self) -> dict | None:
        """``metrics.json``, or None when absent; ValueError when it is not a fit summary."""
        path = self.fit_summary_path
        if not path.is_file():
            return None
        data = _need_object(_read_json(path, "the fit summary"), path, "a fit summary")
        missing = [k for k in FIT_SUMMARY_KEYS if k not in data]
        if missing:
            raise ValueError(
                f"{path} is not a fit summary (missing keys {missing} of {list(FIT_SUMMARY_KEYS)}); `fit` writes "
                "metrics.json, the training callbacks write metrics_<stage>.json: rename a callback file to "
                "metrics_<stage>.json"
            )
        if not isinstance(data["tables"], dict):
            raise ValueError(f"{path}: tables must be an object {{label: rows}}, got {type(data['tables']).__name__}")
        for label, table in data["tables"].items():
            _need_rows(table, path, f"tables[{label!r}]")
        return data

    def read_stage_metrics(self) -> dict[str, dict]:
        """``{stage: content}`` of every ``metrics_<stage>.json``, sorted by file name."""
        out = {}
        for path in sorted(self.path.glob("metrics_*.json")):
            data = _need_object(_read_json(path, "stage metrics"), path, "with 'final' and 'decode_eval'")
            out[path.stem.removeprefix("metrics_")] = data
        return out

    def read_eval_rows(self) -> dict[str, list[dict]]:
        """``{label: per-prompt rows}`` of every ``eval_<label>.json``, sorted by file name."""
        return {
            path.stem.removeprefix("eval_"): _need_rows(_read_json(path, "eval rows"), path, "per-prompt rows")
            for path in sorted(self.path.glob("eval_*.json"))
        }

    def read_results(self) -> dict | None:
        """``results.json`` of an eval run (``rows`` and ``summary`` checked), or None when absent."""
        path = self.results_path
        if not path.is_file():
            return None
        data = _need_object(_read_json(path, "eval results"), path, "with 'rows' and 'summary'")
        return {
            **data,
            "rows": _need_rows(data.get("rows", []), path, "rows"),
            "summary": _need_rows(data.get("summary", []), path, "summary"),
        }

    def read_tree_example(self) -> dict | None:
        return load_tree_example(self.tree_example_path) if self.tree_example_path.is_file() else None
