"""Where the Hydra configs are, and the ``recipe`` group registered from them.

The configs live at the top of a checkout, in ``conf/`` (one primary config per command and its
groups) and ``recipes/`` (the ``recipe`` group). A wheel carries the same two folders inside the
package, as ``exittrain/conf`` and ``exittrain/recipes`` (see ``setup.py``), so an installed
exittrain runs without a checkout. :data:`CONF_DIR` and :data:`RECIPES_DIR` are the packaged
folders when they are there, else the checkout's.

Hydra cannot see ``recipes/`` by itself: :func:`register_recipes` stores every ``recipes/*.yaml``
in the ConfigStore as option ``NAME`` of the ``recipe`` group (package ``_global_``), so
``+recipe=code`` works exactly as typed. Call it before composing a config. ``conf/experiment/``
(full-scale presets, ``+experiment=NAME``) is a group under ``conf/`` and needs no registration.

One resolver serves the configs: ``${largest:${eval.budgets}}`` (:func:`largest`), so that the
decode check and the held-out callback of conf/callbacks/default.yaml decode at the largest budget
of ``eval.budgets``, the one evaluation budget. It is registered when this module is imported,
which every composer of a config does (for :data:`CONF_DIR`) before anything resolves.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

__all__ = ["CONF_DIR", "RECIPES_DIR", "config_dirs", "register_recipes", "largest"]

PACKAGE_DIR = Path(__file__).resolve().parent


def config_dirs(package_dir: Path = PACKAGE_DIR) -> tuple[Path, Path]:
    """``(conf, recipes)``: the folders packaged in ``package_dir``, else those of the checkout above it.

    ValueError naming both places when neither holds ``conf/fit.yaml``.
    """
    for root in (package_dir, package_dir.parent):
        if (root / "conf" / "fit.yaml").is_file() and (root / "recipes").is_dir():
            return root / "conf", root / "recipes"
    raise ValueError(
        f"no exittrain configs: neither {package_dir / 'conf'} (an installed wheel) nor {package_dir.parent / 'conf'} "
        "(a checkout) holds fit.yaml; reinstall exittrain (pip install .) or run from a checkout"
    )


CONF_DIR, RECIPES_DIR = config_dirs()


def largest(values) -> int:
    """``${largest:${eval.budgets}}``: the largest of a non-empty list of integers (ValueError otherwise,
    naming ``eval.budgets``, the one list the configs pass it)."""
    items = list(values) if OmegaConf.is_list(values) or isinstance(values, (list, tuple)) else None
    if not items or any(isinstance(v, bool) or not isinstance(v, int) for v in items):
        raise ValueError(f"eval.budgets={values!r}: need a non-empty list of integers >= 1 (draft nodes per round)")
    return max(items)


OmegaConf.register_new_resolver("largest", largest, replace=True)  # replace: a re-import (tests) registers it again


def register_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Store every ``recipes_dir/*.yaml`` as option NAME of the ``recipe`` group (package _global_).

    Returns the names stored."""
    cs = ConfigStore.instance()
    names = []
    for path in sorted(recipes_dir.glob("*.yaml")):
        cs.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")
        names.append(path.stem)
    return names
