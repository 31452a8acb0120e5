"""Import rules of the package layers, checked by an AST scan of every import (those inside functions too).

- ``exittrain/core`` is pure: torch and the standard library only.
- ``exittrain/models`` holds nn.Modules, no Lightning.
- Lightning appears only in ``exittrain/lit/`` and the DataModule (``exittrain/data/datamodule.py``).
- Entry points sit on top: nothing in the package imports ``exittrain.cli`` but ``exittrain/__main__.py``,
  and nothing imports the commands' runs ``exittrain.fit`` and ``exittrain.evaluate`` (the CLI calls
  them by name); the benchmarks build through the library modules ``fit`` itself uses.
- The import graph among ``exittrain.*`` modules has no cycle (:func:`import_graph` states the rule).
- The package is an ordered list of layers (:data:`LAYERS`, bottom first): every import points to the
  importer's own layer or one below it. What makes a CPU decode fast (``cpu_decode/``, the lab) sits
  above the runs (``fit``, ``eval``), so the training path cannot reach it; the entry layer binds it.
- The lab stays out of the product: the import closure of the training path (``fit``, ``eval``,
  ``lit/``, ``objective``, ``models/``; imports inside functions too) holds no ``cpu_decode`` module
  (:data:`LAB_FREE`); no module assigns attributes of an imported package module or class
  (``module.attr = ...``, ``Class.attr = ...``, ``setattr(module, ...)``); a lab function sets no
  attribute of an object it is passed (``target.row_kernels = ...``); and no function of a training
  path module writes a module-level name (a process-wide switch or cache: ``_INSTALLED[0] = ...``).
  A speed-up is an explicit option of the object that uses it (docs/STYLE.md, habit 17).
- No two modules share a file name.
- One import path per name: no module but a package's ``__init__`` lists in ``__all__`` a name it
  imports, and no import takes a name from a module that only imported it.

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
        # the package ``path`` belongs to, as module parts: exittrain/models/vocab_head.py -> ("exittrain", "models")
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
    """exittrain/models/drafter/layers.py -> ``exittrain.models.drafter.layers``; models/__init__.py ->
    ``exittrain.models``."""
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
    drafter = "exittrain.models.drafter.block_drafter"
    assert {"exittrain", "exittrain.models", "exittrain.models.drafter", drafter, "exittrain.fit"} <= set(graph)
    assert drafter in graph["exittrain.models"]  # the __init__ re-exports from it
    assert "exittrain.models.drafter.layers" in graph[drafter]


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


# -- the layers -----------------------------------------------------------------------------------

# The package's layers, bottom first: a module may import (at module level or inside a function) only
# modules of its own layer or of a layer below it. Each layer is the files it holds, relative to the
# package: a subpackage ("core/") or a top-level module ("fit.py"). Every file has exactly one layer.
LAYERS = (
    # small utilities every layer may use: files, timing, progress lines, tables, dtypes and the host's
    # recorded choices of them, host memory, the run folder, where vLLM's interpreter is (data's vLLM
    # backend and the serving check both ask)
    ("foundation", ("__init__.py", "atomic.py", "safe_io.py", "timing.py", "progress.py", "tables.py",
                    "precision.py", "host_choices.py", "host_memory.py", "run_dir.py", "vllm_interpreter.py")),
    ("core", ("core/",)),  # pure math on tensors
    ("models", ("models/",)),  # nn.Modules: the frozen target and the drafter (models/drafter/)
    ("data", ("data/",)),  # prompt choice (data/prompts/), the data step, the feature store, collate
    ("objective", ("objective.py",)),
    ("decoding", ("decoding/",)),  # the plain decoders: speculative (tree and chain), autoregressive, oracle
    ("serve", ("serve/",)),  # formats and engines a drafter leaves for (DFlash, vLLM runs)
    ("heldout", ("heldout/",)),  # the one evaluator
    ("lit", ("lit/",)),  # Lightning glue
    # what a command composes from a config. configs.py (where the Hydra YAML lives) sits here, not in
    # the foundation: no layer below it reads the Hydra configs (the data layer's defaults are Python)
    ("settings", ("settings.py", "build.py", "export.py", "configs.py")),
    ("plan", ("plan/",)),  # the memory planner
    ("runs", ("fit.py", "evaluate.py", "prepare.py")),  # the commands' runs
    # the lab: what makes a decode fast on a CPU (the auto probe, packed linears, row layouts, draft
    # vocabulary). Above the runs, so that fit and eval cannot import it: the entry layer (cli.py)
    # binds it for eval.decode=auto and passes it to them (lab=); the CPU benches import it
    ("cpu_decode", ("cpu_decode/",)),
    ("report", ("report/",)),
    ("bench", ("bench/",)),
    ("entry", ("cli.py", "__main__.py")),
)


def layer_of(relative: str, layers=LAYERS) -> int | None:
    """The index in ``layers`` of the package file ``relative`` (``core/tree.py``); None for a file
    no layer holds."""
    found = [i for i, (_, paths) in enumerate(layers) for p in paths
             if relative == p or (p.endswith("/") and relative.startswith(p))]
    assert len(found) <= 1, f"{relative} belongs to several layers: {[layers[i][0] for i in found]}"
    return found[0] if found else None


def module_files(package: Path = PACKAGE) -> dict[str, str]:
    """Module name -> its file relative to the package (``exittrain.models`` -> ``models/__init__.py``)."""
    return {module_name(path, package): name for name, path in package_files(package).items()}


def unlayered(package: Path = PACKAGE, layers=LAYERS) -> list[str]:
    return sorted(name for name in package_files(package) if layer_of(name, layers) is None)


def upward_imports(package: Path = PACKAGE, layers=LAYERS) -> list[str]:
    """``importer (layer) -> imported (layer)`` for every import that points up the layers."""
    files = module_files(package)
    out = []
    for module, targets in import_graph(package).items():
        here = layer_of(files[module], layers)
        for target in sorted(targets):
            there = layer_of(files[target], layers)
            if here is not None and there is not None and there > here:
                out.append(f"{module} ({layers[here][0]}) -> {target} ({layers[there][0]})")
    return sorted(out)


def test_every_module_has_a_layer():
    assert not unlayered(), f"add these files to a layer of LAYERS (tests/test_architecture.py): {unlayered()}"
    names = [name for name, _ in LAYERS]
    held = {names[layer_of(f)] for f in package_files()}
    # a layer may hold no file yet (cpu_decode while it is being made); the others must hold some
    assert set(names) - held <= {"cpu_decode"}


def test_imports_point_down_the_layers():
    offenders = upward_imports()
    assert not offenders, (
        "imports that point up the layers (LAYERS in tests/test_architecture.py, bottom first):\n"
        + "\n".join(offenders)
        + "\nMove what the lower module needs down to its layer (or into a library module both call)"
    )


def test_the_layer_scan_flags_upward_imports(tmp_path):
    """Negative controls: an upward import at module level and one inside a function are flagged, a
    downward import is not, and a layer with no file is no error."""
    layers = (
        ("low", ("__init__.py", "util.py", "core/")), ("mid", ("mid/",)), ("empty", ("empty/",)), ("top", ("top.py",)),
    )
    fake = write_package(tmp_path, {
        "util.py": "from exittrain.mid.a import thing\n",  # up, at module level
        "core/__init__.py": "",
        "core/math.py": "def f():\n    import exittrain.top\n",  # up, inside a function
        "mid/__init__.py": "",
        "mid/a.py": "from exittrain.core import math\nthing = 1\n",  # down
        "top.py": "from exittrain.mid.a import thing\nfrom exittrain import util\n",  # down
    })
    assert unlayered(fake, layers) == []
    assert upward_imports(fake, layers) == [
        "exittrain.core.math (low) -> exittrain.top (top)",
        "exittrain.util (low) -> exittrain.mid (mid)",
        "exittrain.util (low) -> exittrain.mid.a (mid)",
    ]
    assert upward_imports(write_package(tmp_path / "down", {
        "util.py": "import json\n", "core/__init__.py": "", "core/math.py": "from exittrain import util\n",
        "mid/__init__.py": "", "mid/a.py": "from exittrain.core import math\n", "top.py": "import exittrain.mid.a\n",
    }), layers) == []
    assert unlayered(write_package(tmp_path / "stray", {"stray.py": ""}), layers) == ["stray.py"]


def test_no_two_modules_share_a_file_name():
    """A file name says what a module is: two ``chain.py`` (a tree shape and a decoder) or two
    ``memory.py`` (a benchmark and a plan's model) make a reader open both to find out."""
    by_name: dict[str, list[str]] = {}
    for name in package_files():
        if Path(name).name not in ("__init__.py", "__main__.py"):
            by_name.setdefault(Path(name).name, []).append(name)
    shared = {k: v for k, v in by_name.items() if len(v) > 1}
    assert not shared, f"modules sharing a file name: {shared}; name each for its concept"


# -- one import path per name ---------------------------------------------------------------------

# Modules allowed to list in __all__ names they import, each with the reason. A package's __init__.py
# is the one place a name may have a second path (its package's public face); no other module is a
# re-export shim.
REEXPORT_ALLOWED: dict[str, str] = {}


def _module_level(tree: ast.Module):
    """The statements of a module that run when it is imported: the top level and the bodies of
    top-level ``if``/``try``/``with`` blocks, not functions or classes."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for part in ("body", "orelse", "finalbody", "handlers"):
                stack.extend(getattr(node, part, []))
        elif isinstance(node, ast.ExceptHandler):
            stack.extend(node.body)


def reexports(package: Path = PACKAGE) -> dict[str, list[str]]:
    """{file: the names it lists in ``__all__`` but imports from another exittrain module} for every
    module but a package's ``__init__.py``: a name re-exported gets a second import path."""
    out = {}
    for name, path in package_files(package).items():
        if path.name == "__init__.py":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        listed, imported = set(), set()
        for node in _module_level(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                    listed.update(ast.literal_eval(node.value))
            elif isinstance(node, ast.ImportFrom) and from_base(node, path, package).split(".")[0] == package.name:
                imported.update(alias.asname or alias.name for alias in node.names)
        if listed & imported:
            out[name] = sorted(listed & imported)
    return out


def test_no_module_reexports_a_name_it_does_not_define():
    offenders = {k: v for k, v in reexports().items() if k not in REEXPORT_ALLOWED}
    assert not offenders, (
        f"modules listing in __all__ names they import from another exittrain module: {offenders}. "
        "Import each name from the module that defines it and drop it from this module's __all__"
    )


def test_the_reexport_scan_flags_a_shim(tmp_path):
    """Negative control: a module listing an imported name in ``__all__`` is flagged, at the top level
    or under ``if``; the same name imported without being listed, a package ``__init__`` listing it,
    and a name imported inside a function are not."""
    fake = write_package(tmp_path, {
        "pkg/__init__.py": "from exittrain.pkg.home import LIMIT\n__all__ = ['LIMIT']\n",
        "pkg/home.py": "LIMIT = 3\n__all__ = ['LIMIT']\n",
        "shim.py": (
            "from exittrain.pkg.home import LIMIT\nfrom .pkg import home\n__all__ = ['LIMIT', 'home', 'own']\nown = 1\n"
        ),
        "guarded.py": "import sys\nif sys:\n    from exittrain.pkg.home import LIMIT as CAP\n__all__: list = ['CAP']\n",
        "user.py": "from exittrain.pkg.home import LIMIT\n__all__ = ['twice']\ndef twice():\n    return 2 * LIMIT\n",
        "lazy.py": "__all__ = ['LIMIT']\ndef f():\n    from exittrain.pkg.home import LIMIT\n",
    })
    assert reexports(fake) == {"guarded.py": ["CAP"], "shim.py": ["LIMIT", "home"]}


def _imported_names(path: Path, package: Path) -> set[str]:
    """The names a module binds at import time by importing them (``from x import a`` binds ``a``)."""
    names = set()
    for node in _module_level(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return names


def imports_through_a_non_owner(package: Path = PACKAGE, roots: tuple[Path, ...] = ()) -> list[str]:
    """``file:line: from M import name`` for every import, in the package and the files under
    ``roots``, of a name that module ``M`` (not a package's ``__init__``) only imports itself: the
    name has a home elsewhere, and this import gives it a second path."""
    modules = {module_name(p, package): p for p in package.rglob("*.py") if p.name != "__init__.py"}
    bound: dict[str, set[str]] = {}
    out = []
    for path in sorted({*package.rglob("*.py"), *(p for r in roots for p in r.rglob("*.py"))}):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = from_base(node, path, package)
            if base not in modules:
                continue
            if base not in bound:
                bound[base] = _imported_names(modules[base], package)
            for alias in node.names:
                if alias.name in bound[base] and f"{base}.{alias.name}" not in modules:
                    out.append(f"{path.relative_to(package.parent).as_posix()}:{node.lineno}: "
                               f"from {base} import {alias.name}")
    return out


def test_every_name_is_imported_from_its_home():
    offenders = imports_through_a_non_owner(roots=(PACKAGE.parent / "tests",))
    assert not offenders, (
        "imports of a name from a module that only imports it (import it from the module that defines it):\n"
        + "\n".join(offenders)
    )


def test_the_home_scan_flags_an_import_through_another_module(tmp_path):
    """Negative control: a name imported from a module that imported it is flagged, inside a
    function too; the same name from its home, from a package ``__init__``, and a submodule are not."""
    fake = write_package(tmp_path, {
        "pkg/__init__.py": "from exittrain.pkg.home import LIMIT\n",
        "pkg/home.py": "LIMIT = 3\n",
        "pkg/user.py": "from exittrain.pkg.home import LIMIT\nfrom exittrain.pkg import home\n",
        "far.py": "from exittrain.pkg.user import LIMIT\ndef f():\n    from exittrain.pkg.user import home\n",
        "near.py": "from exittrain.pkg.home import LIMIT\nfrom exittrain.pkg import LIMIT as L, user\n",
    })
    assert imports_through_a_non_owner(fake) == [
        "exittrain/far.py:1: from exittrain.pkg.user import LIMIT",
        "exittrain/far.py:3: from exittrain.pkg.user import home",
    ]


# -- the lab stays out of the product -------------------------------------------------------------

LAB = ("cpu_decode/",)  # the lab's files, relative to the package
# the training path, relative to the package: what fit runs. Its import closure holds no lab module
# (eval's run too: it binds the lab only through its lab= argument), and its modules keep no
# process-wide switch or cache
TRAINING_PATH = ("fit.py", "lit/", "objective.py", "models/")
LAB_FREE = (*TRAINING_PATH, "evaluate.py")
# training path modules allowed a function that writes a module-level name, each with the reason
MODULE_STATE_ALLOWED: dict[str, str] = {
    "objective.py": "_warned_top_forward, a warn-once flag: it changes a log line, never what is computed",
}


def _held(relative: str, paths: tuple[str, ...]) -> bool:
    return any(relative == p or (p.endswith("/") and relative.startswith(p)) for p in paths)


def import_closure(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others (``import_graph``'s edges: imports
    inside functions too), ``start`` excluded."""
    seen, stack = set(), [start]
    while stack:
        for target in graph.get(stack.pop(), ()):
            if target not in seen and target != start:
                seen.add(target)
                stack.append(target)
    return seen


def lab_reached(package: Path = PACKAGE, free=LAB_FREE, lab=LAB) -> dict[str, list[str]]:
    """{module of ``free``: the lab modules its import closure holds}, for every such module that reaches one."""
    graph, files = import_graph(package), module_files(package)
    out = {}
    for module in sorted(graph):
        if not _held(files[module], free):
            continue
        reached = sorted(m for m in import_closure(graph, module) if _held(files[m], lab))
        if reached:
            out[module] = reached
    return out


def test_the_training_path_imports_no_lab_module():
    graph = import_graph()
    assert "exittrain.fit" in graph and import_closure(graph, "exittrain.fit")  # the scan sees fit's imports
    offenders = lab_reached()
    assert not offenders, (
        f"the training path reaches the CPU decode lab (exittrain/cpu_decode) through its imports: {offenders}. "
        "Take what it needs as an explicit argument (fit(cfg, lab=...), bound in exittrain/cli.py) instead"
    )


def test_the_closure_scan_flags_a_lab_module_reached_through_others(tmp_path):
    """Negative control: fit reaching the lab through a function-level import of a module that imports
    it is flagged, and so is a model importing it directly; a lab module importing the models, and
    the entry point importing the lab, are not."""
    fake = write_package(tmp_path, {
        "fit.py": "def run():\n    from exittrain.heldout import table\n",
        "heldout/__init__.py": "",
        "heldout/table.py": "import exittrain.cpu_decode.probe\n",
        "cpu_decode/__init__.py": "",
        "cpu_decode/probe.py": "from exittrain.models.head import apply_head\n",
        "models/__init__.py": "",
        "models/head.py": "def apply_head():\n    pass\n",
        "models/vocab.py": "from exittrain.cpu_decode import probe\n",
        "cli.py": "from exittrain.cpu_decode.probe import apply_head\n",
    })
    assert lab_reached(fake) == {
        "exittrain.fit": ["exittrain.cpu_decode", "exittrain.cpu_decode.probe"],
        "exittrain.models.vocab": ["exittrain.cpu_decode", "exittrain.cpu_decode.probe"],
    }


def _bound_imports(tree: ast.Module, path: Path, package: Path) -> set[str]:
    """The names a module binds, anywhere in it, by importing a module of the package or a name from one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.asname or alias.name.split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] == package.name)
        elif isinstance(node, ast.ImportFrom) and from_base(node, path, package).split(".")[0] == package.name:
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.AST) -> tuple[str | None, bool]:
    """``(the name an assignment target hangs from, whether an attribute lies on the way)``:
    ``a.b[0].c`` -> ``("a", True)``, ``a[0]`` -> ``("a", False)``, ``a`` -> ``("a", False)``."""
    attribute = False
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        attribute = attribute or isinstance(node, ast.Attribute)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attribute


def _written(node: ast.AST) -> list[ast.AST]:
    """The targets a statement writes or deletes (tuple targets unpacked), or ``setattr``/``delattr``'s object."""
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Delete):
        targets = node.targets
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr")
          and node.args):
        return [ast.Attribute(value=node.args[0], attr="?", ctx=ast.Store())]
    else:
        return []
    out = []
    for target in targets:
        out.extend(target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target])
    return out


def monkey_patches(package: Path = PACKAGE, lab=LAB) -> list[str]:
    """``file:line: target`` for every write of an attribute that patches code the writer does not own:

    - anywhere in the package, an attribute of a name bound by importing a package module or a name
      from one (``head_product.X = ...``, ``TargetModel.row_kernels = ...``, ``target_model.CACHE[k] = ...``,
      ``setattr(module, ...)``; also ``del``);
    - in a lab module, an attribute of a function's parameter other than ``self``/``cls``: an object
      it was passed (``target.row_kernels = packs``).
    """
    out = []
    for name, path in package_files(package).items():
        tree = ast.parse(path.read_text(), filename=str(path))
        imported = _bound_imports(tree, path, package)
        for node in ast.walk(tree):
            for target in _written(node):
                root, attribute = _root(target)
                if attribute and root in imported:
                    out.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
        if not _held(name, lab):
            continue
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = function.args
            passed = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]} - {"self", "cls"}
            for node in ast.walk(function):
                for target in _written(node):
                    root, attribute = _root(target)
                    if attribute and root in passed:
                        out.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
    return sorted(set(out))


def module_state_writes(package: Path = PACKAGE, paths=TRAINING_PATH) -> list[str]:
    """``file:line: what`` for every function of a module under ``paths`` that writes a module-level
    name of its module: a ``global`` statement, an item or attribute written through it
    (``_INSTALLED[0] = ...``, ``_SWITCH.on = True``), or a container method that changes it
    (``_CACHE.clear()``, ``.update``, ``.pop``, ...). Such a name is a process-wide switch or cache:
    an option of an object, or an object its owner creates and drops, says the same explicitly."""
    mutators = {"clear", "update", "pop", "popitem", "setdefault", "append", "extend", "insert", "remove", "add",
                "discard"}
    out = []
    for name, path in package_files(package).items():
        if not _held(name, paths):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        module_names = {n.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                        for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                        for n in ast.walk(t) if isinstance(n, ast.Name)}
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            arguments = function.args
            local = {a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                                     *filter(None, (arguments.vararg, arguments.kwarg))]}
            local |= {n.id for n in ast.walk(function) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            shared = module_names - local
            for node in ast.walk(function):
                if isinstance(node, ast.Global):
                    out.append(f"{name}:{node.lineno}: global {', '.join(node.names)}")
                for target in _written(node):
                    root, _ = _root(target)
                    if root in shared and not isinstance(target, ast.Name):
                        out.append(f"{name}:{node.lineno}: {ast.unparse(target)}")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in shared):
                    out.append(f"{name}:{node.lineno}: {ast.unparse(node.func)}()")
    return sorted(set(out))


def test_no_module_patches_what_it_imports_and_the_lab_patches_nothing_it_is_passed():
    offenders = monkey_patches()
    assert not offenders, (
        "attribute writes that patch another module's code or an object a lab function was passed:\n"
        + "\n".join(offenders)
        + "\nMake the speed-up an explicit option of the object that uses it (a constructor or per-call argument)"
    )


def test_the_training_path_keeps_no_process_wide_switch_or_cache():
    offenders = [o for o in module_state_writes() if o.split(":")[0] not in MODULE_STATE_ALLOWED]
    assert not offenders, (
        "functions of the training path that write a module-level name (a process-wide switch or cache):\n"
        + "\n".join(offenders)
        + "\nMake it an option of the object that uses it, or a cache object its owner creates and drops"
    )


def test_the_patch_scans_flag_a_lab_that_patches_the_product(tmp_path):
    """Negative controls: a lab module assigning a product module's global, a product class's attribute
    (by ``setattr`` too) and an attribute of the target it was passed is flagged, and so is a product
    function holding a switch or a cache at module level; a lab writing its own objects' attributes
    and a product module's own local state are not."""
    fake = write_package(tmp_path, {
        "models/__init__.py": "",
        "models/head.py": (
            "_INSTALLED = [None]\n_CACHE = {}\n_OK = 3\n"
            "def install(p):\n    _INSTALLED[0] = p\n"
            "def rows(k):\n    _CACHE.clear()\n    return _OK\n"
            "def local(x):\n    _CACHE = {}\n    _CACHE[x] = 1\n    return _CACHE\n"
            "def switch():\n    global _OK\n    _OK = 4\n"
        ),
        "models/target.py": "class Target:\n    kernels = None\n    def set(self, k):\n        self.kernels = k\n",
        "cpu_decode/__init__.py": "",
        "cpu_decode/fast.py": (
            "from exittrain.models import head\nfrom exittrain.models.target import Target\n"
            "import exittrain.models.head as h\n"
            "def fast(target, packs):\n"
            "    head._INSTALLED[0] = packs\n    Target.kernels = packs\n    setattr(h, 'X', 1)\n"
            "    target.kernels = packs\n    box = Box()\n    box.kernels = packs\n"
            "class Box:\n    def __init__(self, packs):\n        self.packs = packs\n"
        ),
        "bench/__init__.py": "",
        "bench/rows.py": "def time_it(target):\n    target.kernels = None\n",  # not the lab: its own business
    })
    assert monkey_patches(fake) == [
        "cpu_decode/fast.py:5: head._INSTALLED[0]",
        "cpu_decode/fast.py:6: Target.kernels",
        "cpu_decode/fast.py:7: h.?",
        "cpu_decode/fast.py:8: target.kernels",
    ]
    assert module_state_writes(fake) == [
        "models/head.py:14: global _OK",
        "models/head.py:5: _INSTALLED[0]",
        "models/head.py:7: _CACHE.clear()",
    ]
