"""The runs a report reads: run directories found below a folder, each parsed into a :class:`Run`.

:func:`discover_runs` walks a folder (a run directory, or a Hydra multirun sweep above some) and
returns every folder that holds run files (:meth:`exittrain.run_dir.RunDir.has_run_files`),
skipping hidden folders, :data:`SKIP_DIRS` and ``exclude`` (the report's own output folder).
:func:`load_run` parses one run directory through :class:`~exittrain.run_dir.RunDir`, which
gives each file its one layout; a folder without run files, or a malformed file, is a ValueError.

The recipe of a run is ``metrics.json["recipe"]``, else ``recipe_name`` in ``.hydra/config.yaml``,
else the label of its eval rows, else the folder name. Summary rows come from the files'
summaries, else from :func:`~exittrain.heldout.decode_eval.summarize` of the per-prompt rows (a
warning, and no rows, when those cannot be summarised). Offline: no model is loaded.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from exittrain.run_dir import EXPECTED_FILES, RunDir

__all__ = ["SKIP_DIRS", "Run", "discover_runs", "load_run"]

log = logging.getLogger(__name__)

SKIP_DIRS = {"wandb", "checkpoints", "ckpt", "lightning_logs", "drafter", "drafter-best", "__pycache__"}


@dataclass
class Run:
    """The files of one run directory, parsed. ``stage_metrics``: stage -> callback metrics file content."""

    path: Path
    name: str
    recipe: str = ""
    kind: str = ""  # "fit", "eval" or "files"
    files: list[str] = field(default_factory=list)
    fit: dict | None = None
    summary: list[dict] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)
    stage_metrics: dict[str, dict] = field(default_factory=dict)
    tree_example: dict | None = None


def _hydra_recipe(path: Path) -> str | None:
    cfg = path / ".hydra" / "config.yaml"
    if not cfg.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        # resolved: recipe_name is ${data.domain} in the configs (an older run's is the name itself)
        name = OmegaConf.select(OmegaConf.load(cfg), "recipe_name", default=None)
    except Exception as err:  # noqa: BLE001 - an unreadable Hydra config only loses the recipe name
        log.warning("could not read %s (%s); recipe name falls back to the eval label or folder name", cfg, err)
        return None
    return str(name) if name else None


def load_run(path: str | os.PathLike, name: str | None = None) -> Run:
    """Parse the run files in ``path`` (:class:`~exittrain.run_dir.RunDir`); ValueError if there are
    none or one is malformed."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"run directory {path} does not exist (expected a folder with {EXPECTED_FILES})")
    files = RunDir(path)
    run = Run(path=path, name=name or path.name)
    summary = files.read_fit_summary()
    if summary is not None:
        run.files.append(files.fit_summary_path.name)
        run.fit, run.kind = summary, "fit"
        run.recipe = str(summary.get("recipe") or "")
        for label, table in summary["tables"].items():
            run.summary.extend({**row, "label": row.get("label") or label} for row in table)
    run.stage_metrics = files.read_stage_metrics()
    run.files += [files.stage_metrics_path(stage).name for stage in run.stage_metrics]
    for label, rows in files.read_eval_rows().items():
        run.files.append(files.eval_rows_path(label).name)
        run.rows.extend({**r, "label": r.get("label") or label} for r in rows)
    results = files.read_results()
    if results is not None:
        run.files.append(files.results_path.name)
        run.kind = run.kind or "eval"
        run.rows.extend(results["rows"])
        run.summary.extend(results["summary"])
    run.tree_example = files.read_tree_example()
    if run.tree_example is not None:
        run.files.append(files.tree_example_path.name)
    if not run.files:
        raise ValueError(f"run directory {path} holds none of the expected files: {EXPECTED_FILES}")
    run.kind = run.kind or "files"
    if not run.summary and run.rows:
        from exittrain.heldout.decode_eval import summarize

        try:
            run.summary = summarize(run.rows)
        except (KeyError, ZeroDivisionError) as err:
            log.warning("%s: cannot summarize the per-prompt rows (%r); no table rows from this run", path, err)
    if not run.recipe:
        labels = [r.get("label") for r in run.summary + run.rows if r.get("label")]
        run.recipe = _hydra_recipe(path) or (labels[0] if run.kind == "eval" and labels else "") or path.name
    return run


def discover_runs(root: str | os.PathLike, exclude: Path | None = None) -> list[Path]:
    """Run directories at or below ``root`` (sorted); ValueError if ``root`` is missing or has none."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"run directory {root} does not exist (expected a folder with {EXPECTED_FILES})")
    found = []
    exclude = exclude.resolve() if exclude is not None else None
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames
            if not d.startswith(".") and d not in SKIP_DIRS and (exclude is None or (here / d).resolve() != exclude)
        )
        if RunDir(here).has_run_files():
            found.append(here)
    if not found:
        raise ValueError(f"run directory {root} holds none of the expected files, nor does any folder below it: "
                         f"{EXPECTED_FILES}")
    return found
