"""Import rules of the package layers, checked by an AST scan of every import (those inside functions too).

- ``exittrain/core`` is pure: torch and the standard library only.
- ``exittrain/models`` holds nn.Modules, no Lightning.
- Lightning appears only in ``exittrain/lit/`` and the DataModule (``exittrain/data/datamodule.py``).
- Entry points sit on top: nothing in the package imports ``exittrain.cli`` but ``exittrain/__main__.py``,
  and nothing imports the commands' runs ``exittrain.fit`` and ``exittrain.evaluate`` (the CLI calls
  them by name); the benchmarks build through the library modules ``fit`` itself uses.
- The import graph among ``exittrain.*`` modules has no cycle (:func:`import_graph` states the rule).

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
# entry point -> the files that may import it: the layer above it, and the module itself
ENTRY_POINTS = {
    "exittrain.cli": {"__main__.py", "cli.py"},
    "exittrain.fit": {"cli.py", "fit.py"},
    "exittrain.evaluate": {"cli.py", "evaluate.py"},
    "exittrain.prepare": {"cli.py", "prepare.py"},
}


def imported_modules(path: Path, package: Path = PACKAGE) -> set[str]:
    """Every module an ``import`` in ``path`` names: ``import a.b`` gives ``a.b``; ``from a import b`` gives
    ``a`` and ``a.b`` (``b`` may be a submodule). Relative imports are resolved against ``package``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, path, package)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def from_base(node: ast.ImportFrom, path: Path, package: Path = PACKAGE) -> str:
    """The absolute module a ``from ... import`` in ``path`` reads from, relative imports resolved."""
    base = node.module or ""
    if node.level:
        # the package ``path`` belongs to, as module parts: exittrain/models/drafter.py -> ("exittrain", "models")
        here = path.parent.relative_to(package.parent).parts
        parent = here[: len(here) - (node.level - 1)]
        base = ".".join([*parent, *([base] if base else [])])
    return base


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


def entry_point_importers(package: Path = PACKAGE) -> dict[str, list[str]]:
    """{entry point: the files that import it but may not}, for every entry point one imports."""
    files = {name: imported_modules(path, package) for name, path in package_files(package).items()}
    out = {}
    for module, allowed in ENTRY_POINTS.items():
        found = sorted(name for name, modules in files.items() if name not in allowed and module in modules)
        if found:
            out[module] = found
    return out


def test_nothing_imports_an_entry_point():
    offenders = entry_point_importers()
    assert not offenders, (
        f"library code never imports an entry point (exittrain.cli, or a command's run): {offenders}. "
        "Move what it needs into a library module (exittrain.settings, exittrain.build, ...) and import that"
    )


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
        "bench/arm.py": "def train():\n    from exittrain.fit import build_module\n",
        "bench/ok.py": "from exittrain.build import build_module\n",
        "report_y.py": "from exittrain import evaluate\n",
        "fit.py": "from exittrain.fit import fit\n",  # the module itself
    }
    for name, text in sources.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    assert lightning_outside_its_homes(fake) == {"cli.py": ["lightning"], "eval/bench_x.py": ["lightning"]}
    assert entry_point_importers(fake) == {
        "exittrain.cli": ["eval/rel_x.py", "eval/report_x.py", "fit_x.py"],
        "exittrain.fit": ["bench/arm.py"],
        "exittrain.evaluate": ["report_y.py"],
    }


# -- no import cycles -----------------------------------------------------------------------------


def module_name(path: Path, package: Path = PACKAGE) -> str:
    """exittrain/models/drafter.py -> ``exittrain.models.drafter``; models/__init__.py -> ``exittrain.models``."""
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _prefixes(name: str) -> list[str]:
    """``a.b.c`` -> ``["a", "a.b", "a.b.c"]``."""
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package modules it imports, from every ``import`` statement anywhere in its
    source (inside functions and ``if TYPE_CHECKING:`` too: a cycle of lazy imports is still a cycle).

    The rule: an edge goes to each module whose code the import runs or whose namespace it reads.

    - ``import a.b.c`` -> ``a.b.c``; ``from a import b`` -> ``a.b`` when that is a module file
      (``a/b.py`` or ``a/b/__init__.py``), else ``a`` (``b`` is a name defined in ``a``); relative
      imports are resolved first. A name that is no module of the package resolves to its longest
      prefix that is one; imports of other packages are dropped. A package's ``__init__.py`` is the
      module named by the package, with its own edges (an ``__init__`` that re-exports imports).
    - Python runs the ``__init__`` of every package on the way (``a``, ``a.b`` for ``a.b.c``), so
      those are edges too, except the packages that contain the importer: they are already
      imported when it runs. Hence ``pkg/__init__.py`` importing ``pkg.one`` and ``pkg/one.py``
      doing ``from exittrain.pkg import two`` (a module) is no cycle, while ``pkg/one.py`` doing
      ``from exittrain.pkg import NAME`` (a name ``pkg/__init__.py`` defines) is one: it reads the
      half-run ``__init__``. A module outside ``pkg`` importing ``pkg.one`` also runs
      ``pkg/__init__.py``, so what that ``__init__`` imports can close a cycle.
    - A module importing itself is no edge. ``importlib.import_module(string)`` is not seen.
    """
    modules = {module_name(p, package): p for p in sorted(package.rglob("*.py"))}

    def known(name: str) -> str | None:
        return next((p for p in reversed(_prefixes(name)) if p in modules), None)

    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = from_base(node, path, package)
                targets.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base) for alias in node.names
                )
        inside = set(_prefixes(name))  # the importer's own packages: already run when it runs
        edges = set()
        for target in targets - {None, name}:
            edges.add(target)
            edges.update(p for p in _prefixes(target)[:-1] if p in modules and p not in inside)
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph`` as closed chains ``[a, b, c, a]``: for every module on a cycle, the
    shortest cycle through it (so every module of every strongly connected component shows up),
    each chain starting at its smallest name, without repeats, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or w != v:
                w = stack.pop()
                component.add(w)
            components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = set()
    for component in (c for c in components if len(c) > 1):
        for start in sorted(component):
            path = _shortest_cycle(graph, component, start)
            first = path.index(min(path))
            cycles.add(tuple(path[first:] + path[:first]))
    return sorted([*c, c[0]] for c in cycles)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    """The modules of a shortest cycle from ``start`` back to it inside ``component`` (breadth first)."""
    came_from = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while came_from[path[-1]] is not None:
                        path.append(came_from[path[-1]])
                    return path[::-1]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is on no cycle of its component {sorted(component)}")


def format_cycles(cycles: list[list[str]]) -> str:
    return "\n".join(" -> ".join(chain) for chain in cycles)


def test_the_import_graph_sees_the_package():
    graph = import_graph()
    assert {"exittrain", "exittrain.models", "exittrain.models.drafter", "exittrain.fit"} <= set(graph)
    assert "exittrain.models.drafter" in graph["exittrain.models"]  # the __init__ re-exports from it
    assert "exittrain.models.drafter_layers" in graph["exittrain.models.drafter"]


def test_the_package_has_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, (
        "import cycles among exittrain modules (imports inside functions count):\n" + format_cycles(cycles)
        + "\nDefine each name once, in the module that owns it, and import it from there"
    )


def write_package(root: Path, sources: dict[str, str]) -> Path:
    fake = root / "exittrain"
    for name, text in {"__init__.py": "", **sources}.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    return fake


def test_the_cycle_scan_flags_a_cycle_through_a_function_level_import(tmp_path):
    """Negative control: a 3-module cycle, one edge an import inside a function, is flagged; the
    same package without that edge is not."""
    sources = {
        "a.py": "from exittrain import b\n",  # b is a module: an edge to exittrain.b
        "b.py": "import exittrain.c\n",
        "c.py": "def f():\n    from exittrain.a import thing\n",
    }
    cyclic = import_cycles(import_graph(write_package(tmp_path / "cyclic", sources)))
    assert format_cycles(cyclic) == "exittrain.a -> exittrain.b -> exittrain.c -> exittrain.a"
    acyclic = write_package(tmp_path / "acyclic", {**sources, "c.py": "def f():\n    import json\n"})
    assert import_graph(acyclic)["exittrain.a"] == {"exittrain.b"}
    assert import_graph(acyclic)["exittrain.b"] == {"exittrain.c"}
    assert import_cycles(import_graph(acyclic)) == []


def test_the_cycle_scan_reads_package_inits_by_its_rule(tmp_path):
    """Control of the ``__init__`` rule (:func:`import_graph`): an ``__init__`` importing its own
    submodules, which import siblings through ``from exittrain.pkg import sibling`` or relatively,
    is no cycle; a submodule reading a name from the half-run ``__init__`` is one, and so is a
    cycle closed by the ``__init__`` Python runs on the way to a module of another package."""
    ok = write_package(tmp_path / "ok", {
        "pkg/__init__.py": "from exittrain.pkg.one import f\nfrom .two import g\n",
        "pkg/one.py": "from exittrain.pkg import two\n",
        "pkg/two.py": "from . import three\nfrom .three import h\n",
        "pkg/three.py": "import json\n",
        "user.py": "from exittrain.pkg.one import f\n",
    })
    graph = import_graph(ok)
    assert graph["exittrain.pkg"] == {"exittrain.pkg.one", "exittrain.pkg.two"}
    assert graph["exittrain.pkg.one"] == {"exittrain.pkg.two"}
    assert graph["exittrain.pkg.two"] == {"exittrain.pkg.three"}
    assert graph["exittrain.user"] == {"exittrain.pkg", "exittrain.pkg.one"}  # pkg/__init__.py runs first
    assert import_cycles(graph) == []

    name_from_init = write_package(tmp_path / "name", {
        "pkg/__init__.py": "from exittrain.pkg.one import f\nLIMIT = 3\n",
        "pkg/one.py": "from exittrain.pkg import LIMIT\n",  # a name, not a module: reads pkg/__init__.py
    })
    assert format_cycles(import_cycles(import_graph(name_from_init))) == (
        "exittrain.pkg -> exittrain.pkg.one -> exittrain.pkg"
    )
    through_init = write_package(tmp_path / "through", {
        "fit.py": "def run():\n    from exittrain.ev.table import t\n",  # runs ev/__init__.py first
        "ev/__init__.py": "from exittrain.ev.run import go\n",
        "ev/run.py": "from exittrain.fit import run\n",
        "ev/table.py": "t = 1\n",
    })
    assert format_cycles(import_cycles(import_graph(through_init))) == (
        "exittrain.ev -> exittrain.ev.run -> exittrain.fit -> exittrain.ev"
    )
