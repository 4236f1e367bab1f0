"""Layering the code relies on: the engine and the simulator differ only in their executor, so
nothing in testbed/engine imports testbed.sim (type-only imports included)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "testbed" / "engine"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_nothing_in_the_engine_imports_the_simulator():
    offenders = {p.name: sorted(m for m in imported_modules(p) if m.startswith("testbed.sim"))
                 for p in ENGINE.glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
