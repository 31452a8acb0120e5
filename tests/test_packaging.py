"""The wheel carries the package and its configs, so an installed exittrain needs no checkout.

The fast test builds the wheel (offline, no build isolation: the running environment's setuptools)
and lists it; tests/test_fit_smoke.py installs it into a fresh virtual environment and runs the
smoke fit from outside any checkout (slow tier).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what building the wheel reads from the checkout
SOURCES = ("exittrain", "conf", "recipes", "setup.py", "pyproject.toml", "README.md")


def copy_sources(dest: Path) -> Path:
    """The files the build needs, copied (a build in place would leave build/ and *.egg-info in the checkout)."""
    dest.mkdir(parents=True)
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dest / name)
    return dest


def build_wheel(tmp_path: Path) -> Path:
    src = copy_sources(tmp_path / "src")
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
           "-w", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("exittrain-*.whl")
    return wheel


def test_the_wheel_carries_every_module_and_every_config(tmp_path):
    names = set(zipfile.ZipFile(build_wheel(tmp_path)).namelist())
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "exittrain").rglob("*.py")}
    configs = {f"exittrain/{p.relative_to(REPO).as_posix()}" for d in ("conf", "recipes")
               for p in (REPO / d).rglob("*.yaml")}
    assert "exittrain/conf/fit.yaml" in configs and "exittrain/recipes/code.yaml" in configs
    assert modules <= names, sorted(modules - names)
    assert configs <= names, sorted(configs - names)
    assert not any(n.startswith(("conf/", "recipes/", "tests/")) for n in names), "nothing outside the package"
