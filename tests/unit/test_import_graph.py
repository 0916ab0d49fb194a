"""The package's modules import each other without a cycle (module-level and function-level
imports alike): a module never reaches up to one that imports it."""

from __future__ import annotations

import ast
from pathlib import Path

import ulysses

PACKAGE = Path(ulysses.__file__).parent


def _module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports (``from . import x`` counts x)."""
    files = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    for target in (f"{base}.{alias.name}", base):
                        if target in files:
                            edges.add(target)
                            break
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
        edges.discard(name)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (a package importing its own submodules is not one),
    or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):  # a package's __init__ importing its submodules
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_function_level_cycle(tmp_path):
    """Planted: the shape of the cycle ``grid.clear_caches`` once had (an import inside a
    function of a module that the imported one imports)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import grid, stats\n")
    (pkg / "grid.py").write_text("from .sub import a\n\ndef clear():\n    from . import stats\n")
    (pkg / "stats.py").write_text("from . import grid\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .. import grid\n")
    graph = import_graph(pkg)
    assert graph["pkg.grid"] == {"pkg.sub.a", "pkg.stats"}, graph
    assert find_cycle(graph) is not None
    (pkg / "grid.py").write_text("def clear():\n    pass\n")
    assert find_cycle(import_graph(pkg)) is None
