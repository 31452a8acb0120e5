"""Import rules of the package layers, checked by an AST scan of every import (those inside functions too).

- ``exittrain/core`` is pure: torch and the standard library only.
- ``exittrain/models`` holds nn.Modules, no Lightning.
- Lightning appears only in ``exittrain/lit/`` and the DataModule (``exittrain/data/datamodule.py``).
- Nothing in the package imports the entry point ``exittrain.cli`` but ``exittrain/__main__.py``.

Each rule has a negative control: the scan must flag a synthetic source that breaks it.
"""

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "exittrain"
CORE = PACKAGE / "core"
LIGHTNING = {"lightning", "pytorch_lightning", "lightning_fabric"}
# where Lightning may be imported, relative to the package
LIGHTNING_HOMES = ("lit/", "data/datamodule.py")
CLI_IMPORTERS = {"__main__.py", "cli.py"}  # the entry point on top, and the module itself


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module an ``import`` in ``path`` names: ``import a.b`` gives ``a.b``; ``from a import b`` gives
    ``a`` and ``a.b`` (``b`` may be a submodule). Relative imports are resolved against ``package``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    # the package ``path`` belongs to, as module parts: exittrain/eval/report.py -> ("exittrain", "eval")
    here = path.parent.relative_to(package.parent).parts
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here[: len(here) - (node.level - 1)]
                base = ".".join([*parent, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def roots(modules: set[str]) -> set[str]:
    return {m.split(".")[0] for m in modules}


def package_files(package: Path = PACKAGE) -> dict[str, Path]:
    return {p.relative_to(package).as_posix(): p for p in sorted(package.rglob("*.py"))}


def test_the_scan_sees_the_whole_package():
    assert {"cli.py", "fit.py", "core/tree.py", "lit/module.py", "data/datamodule.py"} <= set(package_files())


def test_core_imports_only_torch_and_stdlib():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 5
    allowed = {"torch", "__future__", "exittrain"} | set(sys.stdlib_module_names)
    offenders = {f"{f.name}: {root}" for f in files for root in roots(imported_modules(f)) if root not in allowed}
    inside = {f"{f.name}: {m}" for f in files for m in imported_modules(f)
              if m.startswith("exittrain.") and not m.startswith("exittrain.core")}
    bad = offenders | inside
    assert not bad, f"exittrain/core must import torch and the standard library only: {bad}"


def test_models_import_no_lightning():
    files = sorted((PACKAGE / "models").rglob("*.py"))
    assert files
    offenders = {f.name: sorted(roots(imported_modules(f)) & LIGHTNING) for f in files}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"exittrain/models holds nn.Modules only, no Lightning: {offenders}"


def lightning_outside_its_homes(package: Path = PACKAGE) -> dict[str, list[str]]:
    out = {}
    for name, path in package_files(package).items():
        if name.startswith(LIGHTNING_HOMES):
            continue
        found = sorted(roots(imported_modules(path, package)) & LIGHTNING)
        if found:
            out[name] = found
    return out


def test_lightning_only_in_lit_and_the_datamodule():
    offenders = lightning_outside_its_homes()
    assert not offenders, (
        f"Lightning belongs in exittrain/lit/ and the DataModule only; these import it: {offenders}. "
        "Move the Lightning part into exittrain/lit/ and call it from there"
    )


def cli_importers(package: Path = PACKAGE) -> list[str]:
    return sorted(
        name for name, path in package_files(package).items()
        if name not in CLI_IMPORTERS and "exittrain.cli" in imported_modules(path, package)
    )


def test_nothing_imports_the_cli():
    offenders = cli_importers()
    assert not offenders, f"library code never imports the entry point exittrain.cli: {offenders}"


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import lightning\nfrom transformers import AutoModel\n", {"lightning", "transformers"}),
        ("def f():\n    import lightning.pytorch as pl\n", {"lightning"}),
        ("from exittrain import cli\n", {"exittrain"}),
    ],
)
def test_the_scan_sees_a_forbidden_import(tmp_path, source, expected):
    bad = tmp_path / "exittrain" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(source)
    assert roots(imported_modules(bad, bad.parent)) == expected


def test_the_rules_flag_a_package_that_breaks_them(tmp_path):
    """Negative controls: a fake package breaking every rule is flagged by each scan, and only where it breaks it."""
    fake = tmp_path / "exittrain"
    sources = {
        "__main__.py": "from exittrain.cli import hydra_entry\n",  # the entry point on top of cli: allowed
        "cli.py": "import lightning\n",
        "lit/module.py": "import lightning.pytorch as pl\n",
        "data/datamodule.py": "from lightning import LightningDataModule\n",
        "eval/bench_x.py": "def f():\n    import lightning as L\n",
        "eval/report_x.py": "from exittrain import cli\n",
        "eval/rel_x.py": "from .. import cli\n",
        "eval/rel_ok.py": "from . import cli\n",  # exittrain.eval.cli, not the entry point
        "fit_x.py": "def run():\n    from exittrain.cli import hydra_entry\n",
    }
    for name, text in sources.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    assert lightning_outside_its_homes(fake) == {"cli.py": ["lightning"], "eval/bench_x.py": ["lightning"]}
    assert cli_importers(fake) == ["eval/rel_x.py", "eval/report_x.py", "fit_x.py"]
