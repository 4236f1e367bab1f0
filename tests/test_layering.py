"""Layering the code relies on (type-only imports included): the engine and the simulator differ
only in their executor, so nothing in testbed/engine imports testbed.sim; the serving loop they
share imports neither; and the cache knows nothing of who serves it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTBED = Path(__file__).resolve().parents[1] / "testbed"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {p.name: sorted(m for m in imported_modules(p) if m.startswith(forbidden))
             for p in (TESTBED / package).glob("*.py")}
    return {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("package, forbidden", [
    ("engine", ("testbed.sim",)),
    ("serving", ("testbed.sim", "testbed.engine")),
    ("scheduler", ("testbed.sim", "testbed.engine", "testbed.serving")),
    ("cache", ("testbed.sim", "testbed.engine", "testbed.serving", "testbed.scheduler")),
])
def test_package_does_not_import_the_layers_it_must_not_know(package, forbidden):
    assert offenders(package, forbidden) == {}
