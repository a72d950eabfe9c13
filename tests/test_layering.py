"""The layering contract (docs/architecture.md, "The layer map"): every import of core/, plugins/ and policies/ —
module-level and inside functions, relative or absolute — points down the layers or stays inside its own, and no
modules import each other in a circle. And no relative import leaves its top-level folder (core/, plugins/,
policies/, vendors/): written absolutely, every import of opdispatch names a path.

The checker reads the sources (no import runs): each file's module name comes from pyproject.toml's package-dir
map, each `import`/`from ... import` is resolved to the module it loads (a `from package import name` naming a
submodule loads that submodule), and two checks run over the resulting graph. `test_the_checker_*` run the same
checker on small fake trees, so a regression of the checker itself (an upward import or a circle it misses)
fails here too.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import REPO

# Each layer: the folders (or files) that make it, relative to the repository root. A module belongs to the first
# layer whose path contains it.
LAYER_PATHS: dict[str, tuple[str, ...]] = {
    "face": ("core/opdispatch/__init__.py", "core/opdispatch/__main__.py"),
    "base": ("core/opdispatch/base",),
    "ops": ("core/opdispatch/ops",),
    "plugins": ("plugins/opdispatch/plugins",),
    "policies": ("policies/opdispatch/policies",),
    "engine": ("core/opdispatch/engine",),
    "compile": ("core/opdispatch/compile",),
    "doors": ("core/opdispatch/doors",),
    "distributed": ("core/opdispatch/distributed",),
    "compat": ("core/opdispatch/compat",),
    "tools": ("core/opdispatch/tools",),
}

# The direction table: which layers a layer may import besides itself. The same table as docs/architecture.md's
# "The layer map" (its "builds on" column).
ALLOWED: dict[str, frozenset[str]] = {
    "base": frozenset(),
    "ops": frozenset({"base"}),
    "plugins": frozenset({"base", "ops"}),
    "policies": frozenset({"base"}),
    "engine": frozenset({"base", "ops", "plugins", "policies"}),
    "compile": frozenset({"base", "ops", "policies", "engine"}),
    "doors": frozenset({"base", "ops", "policies", "engine", "compile"}),
    "distributed": frozenset({"base", "ops", "policies", "engine", "doors"}),
    "compat": frozenset({"base", "ops", "policies", "engine", "doors", "distributed"}),
    "tools": frozenset({"base", "ops", "plugins", "policies", "engine", "compile", "doors", "distributed", "compat",
                        "face"}),
    "face": frozenset({"base", "ops", "plugins", "policies", "engine", "compile", "doors", "distributed", "compat",
                       "tools"}),
}

# Imports allowed against the table, each with its reason: (importer, imported) -> why. Aim: none.
UPWARD_EXCEPTIONS: dict[tuple[str, str], str] = {}

# Circles allowed, each as the sorted tuple of its modules -> why. Aim: none.
CYCLE_EXCEPTIONS: dict[tuple[str, ...], str] = {}


@dataclass(frozen=True)
class Import:
    importer: str  # module names
    imported: str
    line: int

    def where(self, files: Mapping[str, Path], root: Path) -> str:
        return f"{files[self.importer].relative_to(root)}:{self.line}"


def package_dirs(root: Path) -> dict[str, str]:
    """pyproject.toml's [tool.setuptools.package-dir]: import package -> folder."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    return mapping


def module_files(root: Path, package_dir: Mapping[str, str], folders: Iterable[str]) -> dict[str, Path]:
    """Module name -> file, for every .py under `folders`, named through the package-dir map (the longest folder
    that contains a file names its package)."""
    by_folder = sorted(((Path(folder), package) for package, folder in package_dir.items()),
                       key=lambda item: len(item[0].parts), reverse=True)
    files: dict[str, Path] = {}
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root)
            for base, package in by_folder:
                if rel.parts[:len(base.parts)] == base.parts:
                    parts = [*package.split("."), *rel.with_suffix("").parts[len(base.parts):]]
                    break
            else:
                raise AssertionError(f"{rel}: no package-dir entry maps its folder")
            if parts[-1] == "__init__":
                parts = parts[:-1]
            files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, known: Mapping[str, Path]) -> list[Import]:
    """Every import of the module `name` (its file `path`) that loads one of the `known` modules: module-level,
    in functions, under `if TYPE_CHECKING:` alike."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    found: list[Import] = []

    def add(target: str, line: int) -> None:
        while target and target not in known:  # `import a.b.c` of a module the tree does not hold: its package
            target = target.rpartition(".")[0]
        if target and target != name:
            found.append(Import(name, target, line))

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                add(submodule if submodule in known else module, node.lineno)
    return found


def layer_of(path: Path, root: Path) -> str | None:
    rel = path.relative_to(root).as_posix()
    for layer, places in LAYER_PATHS.items():
        if any(rel == place or rel.startswith(place + "/") for place in places):
            return layer
    return None


def upward_imports(files: Mapping[str, Path], edges: Iterable[Import], root: Path) -> list[str]:
    """Each import whose layer pair the direction table does not allow (and no exception names), as text."""
    problems = []
    for edge in edges:
        src, dst = layer_of(files[edge.importer], root), layer_of(files[edge.imported], root)
        if src is None or dst is None:
            problems.append(f"{edge.where(files, root)}: {edge.importer} -> {edge.imported}: a module outside the "
                            "layer map (add its folder to LAYER_PATHS and docs/architecture.md)")
        elif src != dst and dst not in ALLOWED[src] and (edge.importer, edge.imported) not in UPWARD_EXCEPTIONS:
            problems.append(f"{edge.where(files, root)}: {edge.importer} ({src}) imports {edge.imported} ({dst}); "
                            f"{src} may import {sorted(ALLOWED[src]) or 'nothing outside itself'}")
    return problems


def cycles(edges: Iterable[Import]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan), each sorted: the import circles."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the number of modules (~100)
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(tuple(sorted(component)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def check(root: Path, folders: Iterable[str] = ("core", "plugins", "policies")) -> list[str]:
    """Every violation of the contract in the tree at `root`, as text (empty: the contract holds)."""
    files = module_files(root, package_dirs(root), folders)
    edges = [edge for name, path in files.items() for edge in imports_of(name, path, files)]
    problems = list(dict.fromkeys(upward_imports(files, edges, root)))  # one line per import statement
    for circle in cycles(edges):
        if circle not in CYCLE_EXCEPTIONS:
            ties = sorted({f"{e.importer} -> {e.imported} ({e.where(files, root)})" for e in edges
                           if e.importer in circle and e.imported in circle})
            problems.append(f"import circle of {len(circle)} modules: " + "; ".join(ties))
    return problems


def relative_imports_across_folders(root: Path, folders: Iterable[str] = ("core", "plugins", "policies", "vendors")
                                    ) -> list[str]:
    """Each relative import that resolves into another top-level folder, as text: such an import names no path
    (core/opdispatch/engine/'s `..policies` is policies/opdispatch/policies/), so it must be written absolutely."""
    files = module_files(root, package_dirs(root), folders)
    problems = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = package.split(".")
            module = ".".join([*base[:len(base) - (node.level - 1)], *([node.module] if node.module else [])])
            for alias in node.names:
                target = f"{module}.{alias.name}" if f"{module}.{alias.name}" in files else module
                while target and target not in files:  # a name the tree does not hold: its package
                    target = target.rpartition(".")[0]
                if not target:
                    continue
                here, there = path.relative_to(root).parts[0], files[target].relative_to(root).parts[0]
                if here != there:
                    problems.append(f"{path.relative_to(root)}:{node.lineno}: `from {'.' * node.level}"
                                    f"{node.module or ''} import {alias.name}` reaches {target} in {there}/; "
                                    f"write it `from {module} import {alias.name}`")
    return problems


# -- the contract on this repository ---------------------------------------------------------------------------


def test_every_import_of_core_plugins_and_policies_points_down_the_layers_and_nothing_circles():
    problems = check(REPO)
    assert not problems, "the layering contract is broken:\n" + "\n".join(problems)


def test_no_relative_import_crosses_a_top_level_folder():
    problems = relative_imports_across_folders(REPO)
    assert not problems, "\n".join(problems)


def test_every_core_folder_is_a_layer_of_the_map():
    folders = {p.relative_to(REPO).as_posix() for p in (REPO / "core" / "opdispatch").iterdir() if p.is_dir()
               and p.name != "__pycache__"}
    layered = {place for places in LAYER_PATHS.values() for place in places}
    assert folders <= layered, f"folders of core/opdispatch/ outside the layer map: {sorted(folders - layered)}"
    assert set(ALLOWED) == set(LAYER_PATHS)


def test_the_direction_table_is_the_one_docs_architecture_md_states():
    """Each row of docs/architecture.md's layer map names, in its "builds on" column, exactly the layers
    ALLOWED gives it (ignoring the face, and torch/pydantic)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text.split("## The layer map", 1)[1].split("\n\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        layer = cells[0].strip("`").rstrip("/").rpartition("/")[2]  # `core/opdispatch/engine/` -> engine
        if len(cells) >= 4 and layer in ALLOWED:
            rows[layer] = {w.strip("`/ ,") for w in cells[-1].replace(",", " ").split()} & set(ALLOWED)
    assert set(rows) == set(ALLOWED) - {"face"}, sorted(rows)
    for layer, builds_on in rows.items():
        assert builds_on == ALLOWED[layer] - {"face"}, (layer, sorted(builds_on), sorted(ALLOWED[layer]))


# -- the checker itself, on fake trees ----------------------------------------------------------------------


CORE, PLUGINS, POLICIES = "core/opdispatch", "plugins/opdispatch/plugins", "policies/opdispatch/policies"


def _fake_tree(tmp_path: Path, modules: Mapping[str, str]) -> Path:
    """A tree with this repository's package-dir map and the given files (path -> source); every package folder
    gets an empty __init__.py unless given."""
    (tmp_path / "pyproject.toml").write_text((REPO / "pyproject.toml").read_text())
    for rel, source in modules.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for folder in (CORE, PLUGINS, POLICIES, *{str(Path(rel).parent) for rel in modules}):
        init = tmp_path / folder / "__init__.py"
        if not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text("")
    return tmp_path


_CLEAN = {
    "core/opdispatch/base/_errors.py": "class E(Exception): ...\n",
    "core/opdispatch/ops/_op.py": "from ..base._errors import E\n",
    "core/opdispatch/engine/_manager.py": "from opdispatch.ops import _op\nfrom opdispatch.policies._plan import plan\n",
    "policies/opdispatch/policies/_plan.py": "from opdispatch.base._errors import E\ndef plan(): ...\n",
    "core/opdispatch/doors/_api.py": "from ..engine._manager import *\n",
}


def test_the_checker_passes_a_clean_fake_tree(tmp_path):
    assert check(_fake_tree(tmp_path, _CLEAN)) == []


def test_the_checker_catches_an_injected_upward_import_inside_a_function(tmp_path):
    tree = _fake_tree(tmp_path, {**_CLEAN, "core/opdispatch/base/_errors.py": (
        "class E(Exception): ...\n\ndef current():\n    from ..engine import _manager\n    return _manager\n")})
    (problem, *others) = check(tree)
    assert "core/opdispatch/base/_errors.py:4: opdispatch.base._errors (base) imports opdispatch.engine._manager (engine)" \
        in problem
    # and the circle it closes: errors -> manager -> (op, plan) -> errors
    assert len(others) == 1 and others[0].startswith("import circle of 4 modules: opdispatch.base._errors -> "
                                                     "opdispatch.engine._manager (core/opdispatch/base/_errors.py:4)")


def test_the_checker_catches_an_absolute_upward_import_across_top_level_folders(tmp_path):
    tree = _fake_tree(tmp_path, {**_CLEAN, "policies/opdispatch/policies/_plan.py": "import opdispatch.doors._api\n"})
    problems = check(tree)
    assert problems[0].startswith("policies/opdispatch/policies/_plan.py:1: opdispatch.policies._plan (policies) imports "
                                  "opdispatch.doors._api (doors)"), problems
    assert any(p.startswith("import circle of 3 modules") for p in problems)  # plan -> api -> manager -> plan


def test_the_checker_catches_a_circle_inside_one_layer(tmp_path):
    tree = _fake_tree(tmp_path, {**_CLEAN, "core/opdispatch/ops/_other.py": "from . import _op\n",
                                 "core/opdispatch/ops/_op.py": "from ..base._errors import E\nfrom ._other import x\n"})
    assert check(tree) == ["import circle of 2 modules: opdispatch.ops._op -> opdispatch.ops._other "
                           "(core/opdispatch/ops/_op.py:2); opdispatch.ops._other -> opdispatch.ops._op (core/opdispatch/ops/_other.py:1)"]


def test_the_checker_names_a_module_outside_the_map(tmp_path):
    tree = _fake_tree(tmp_path, {**_CLEAN, "core/opdispatch/attic/_old.py": "from ..base import _errors\n"})
    (problem,) = check(tree)
    assert "opdispatch.attic._old -> opdispatch.base._errors: a module outside the layer map" in problem


def test_the_checker_catches_a_relative_import_across_top_level_folders(tmp_path):
    tree = _fake_tree(tmp_path, {**_CLEAN, "core/opdispatch/engine/_manager.py": "from ..policies._plan import plan\n"})
    assert relative_imports_across_folders(tree) == [
        "core/opdispatch/engine/_manager.py:1: `from ..policies._plan import plan` reaches opdispatch.policies._plan in "
        "policies/; write it `from opdispatch.policies._plan import plan`"]
    (tmp_path / "clean").mkdir()
    assert relative_imports_across_folders(_fake_tree(tmp_path / "clean", _CLEAN)) == []
