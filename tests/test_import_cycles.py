"""No import cycles in the testbed and experiments packages, type-only imports included.

The import graph is read from the source, not from a running interpreter: every module of
``testbed`` and ``experiments`` is parsed with `ast`, and every ``import`` / ``from ... import``
statement anywhere in it counts (module level, under ``if TYPE_CHECKING:``, inside functions). Relative imports are
resolved against the importing module's package, and ``from pkg import name`` is an edge to the
submodule ``pkg.name`` where there is one, else to ``pkg``. Only edges between those modules
are kept. A package's ``__init__`` importing its own names is no edge, and neither is the implicit
import of the parent packages of an imported module (every submodule would form a cycle with a
package ``__init__`` that imports it).

A cycle is reported with its path (``a → b → c → a``): for each strongly connected component of
the graph, the shortest cycle through each of its modules.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder under ``root``): dotted name -> source file (a C
    extension's ``.c`` file included)."""
    out = {}
    folder = root / package.replace(".", "/")
    # a C extension's source stands for its module (it imports nothing of ours)
    for path in sorted([*folder.rglob("*.py"), *folder.rglob("*.c")]):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Dotted names ``module`` imports anywhere in its ``source``: for ``from X import a, b``
    ``X.a`` and ``X.b`` (relative ``X`` resolved; `import_graph` maps a name that is no module to
    ``X``), for ``from X import *`` ``X``, for ``import X.Y`` ``X.Y``."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                base_name = ".".join(base + ([node.module] if node.module else []))
            else:
                base_name = node.module
            names.update(base_name if alias.name == "*" else f"{base_name}.{alias.name}"
                         for alias in node.names)
    return names


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (names resolved to the longest known
    module they start with: ``pkg.name`` is the submodule where one exists, else ``pkg``)."""
    graph = {}
    for module, path in modules.items():
        targets = set()
        if path.suffix == ".c":
            graph[module] = targets
            continue
        for name in imported_names(path.read_text(), module, path.name == "__init__.py"):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components (Tarjan's algorithm, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles of ``graph``, each as a path that ends where it starts: per strongly connected
    component with an edge inside it, the shortest cycle through each of its nodes (rotated to
    start at its smallest node; duplicates dropped), sorted."""
    cycles = set()
    for component in strongly_connected(graph):
        members = set(component)
        for start in component:
            # breadth-first from start's successors back to start, inside the component
            parent: dict[str, str] = {}
            queue = deque()
            for child in sorted(graph[start] & members):
                if child not in parent:
                    parent[child] = start
                    queue.append(child)
            while queue:
                node = queue.popleft()
                if node == start:
                    break
                for child in sorted(graph.get(node, set()) & members):
                    if child not in parent:
                        parent[child] = node
                        queue.append(child)
            if start not in parent:
                continue  # a component of one node without a self-loop
            path = [start]
            node = parent[start]
            while node != start:
                path.append(node)
                node = parent[node]
            path.reverse()  # start ... -> start, read forwards
            path = [start] + path[:-1]
            i = path.index(min(path))
            cycles.add(tuple(path[i:] + path[:i]))
    return sorted([*cycle, cycle[0]] for cycle in cycles)


def describe(cycles: list[list[str]]) -> str:
    return "\n".join(" → ".join(cycle) for cycle in cycles)


# ---------------------------------------------------------------- the finder itself
def test_find_cycles_reports_each_cycle_of_a_hand_made_graph_with_its_path():
    graph = {
        "a": {"b"},
        "b": {"c", "x"},
        "c": {"a"},  # a → b → c → a
        "x": {"y"},
        "y": set(),  # an acyclic branch
        "e": {"f"},
        "f": {"e", "g"},  # e → f → e, and f → g → f
        "g": {"f"},
        "s": {"s"},  # a self-loop
    }
    assert find_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"], ["f", "g", "f"],
                                  ["s", "s"]]
    assert describe(find_cycles({"p": {"q"}, "q": {"p"}})) == "p → q → p"
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a", "c"}}) == []


def test_the_graph_counts_type_only_relative_and_function_level_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\nfrom . import helpers\n")
    (pkg / "helpers.py").write_text("X = 1\n")
    (pkg / "a.py").write_text(
        "from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .sub.b import B\nclass A: ...\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "import os\ndef late():\n    from ..helpers import X\n    from pkg import a\n"
        "    import pkg.sub\n")
    graph = import_graph(package_modules(tmp_path, "pkg"))
    assert graph == {
        "pkg": {"pkg.a", "pkg.helpers"},
        "pkg.helpers": set(),
        "pkg.a": {"pkg.sub.b"},
        "pkg.sub": set(),
        "pkg.sub.b": {"pkg.helpers", "pkg.a", "pkg.sub"},
    }
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


# ---------------------------------------------------------------- the project's packages
def cycles_in_testbed() -> list[list[str]]:
    """The cycles among the modules of testbed and experiments (which imports testbed)."""
    modules = package_modules(REPO, "testbed") | package_modules(REPO, "experiments")
    return find_cycles(import_graph(modules))


def test_no_import_cycle_in_testbed_or_experiments():
    cycles = cycles_in_testbed()
    assert not cycles, f"import cycles:\n{describe(cycles)}"


if __name__ == "__main__":  # print the cycles the packages have now
    print(describe(cycles_in_testbed()) or "no import cycles in testbed or experiments")
