"""Packaging beyond pyproject.toml: the configs travel inside the wheel.

The Hydra configs live at the top of the checkout, in conf/ and recipes/. A wheel carries them
inside the package, as exittrain/conf and exittrain/recipes, so that an installed exittrain
(``pip install .``, not editable) runs ``python -m exittrain fit`` without a checkout;
exittrain/configs.py looks for the packaged folders first, then for the checkout's.
pyproject.toml cannot map a folder outside the package into it, hence this file.
"""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
CONFIG_DIRS = {"exittrain.conf": "conf", "exittrain.recipes": "recipes"}


def yaml_files(folder: str) -> list[str]:
    """Every YAML file below ``folder``, relative to it (the package data of its package)."""
    return sorted(str(p.relative_to(ROOT / folder)) for p in (ROOT / folder).rglob("*.yaml"))


setup(
    packages=find_packages(include=["exittrain", "exittrain.*"]) + list(CONFIG_DIRS),
    package_dir=CONFIG_DIRS,
    package_data={package: yaml_files(folder) for package, folder in CONFIG_DIRS.items()},
)
