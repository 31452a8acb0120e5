"""exittrain/core is pure: torch and the standard library only (AST scan of every import)."""

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "exittrain" / "core"


def imported_roots(path):
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module.split(".")[0]


def test_core_imports_only_torch_and_stdlib():
    files = sorted(CORE.glob("*.py"))
    assert len(files) >= 5
    allowed = {"torch", "__future__"} | set(sys.stdlib_module_names)
    offenders = {f"{f.name}: {root}" for f in files for root in imported_roots(f) if root not in allowed}
    assert not offenders, f"exittrain/core must import torch and the standard library only: {offenders}"


def test_the_scan_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import lightning\nfrom transformers import AutoModel\n")
    assert set(imported_roots(bad)) == {"lightning", "transformers"}
