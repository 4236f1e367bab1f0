"""Layering the code relies on (type-only imports included): the engine and the simulator differ
only in their executor, so nothing in testbed/engine imports testbed.sim; the serving loop they
share imports neither; and the cache knows nothing of who serves it.

Above them (docs/design.md §2): testbed/config reads and checks a run's config and builds its plan
(`assemble`), testbed/backends serve the plan, testbed/results hold what a run produces and
testbed/calibration what a calibration measures; the entry points (testbed/run.py, serve.py,
route.py, calibrate.py) sit on top. No lower layer imports the run's assembly or anything above
it, and testbed/'s top level holds only the entry points and a few modules every layer shares."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTBED = Path(__file__).resolve().parents[1] / "testbed"

#: the entry points (``python -m testbed.X``) and `execute`, the one run they and the fuzzer call
ENTRY = ("testbed.run", "testbed.serve", "testbed.route", "testbed.calibrate", "testbed.execute")
#: what runs a checked config: the assembly that builds a run, the backends that serve it, the
#: calibration grid, and every front end
ABOVE_THE_FAMILIES = ("testbed.config.assembly", "testbed.config.builders", "testbed.backends",
                      "testbed.calibration", "testbed.api", "testbed.gateway", "testbed.fuzz",
                      "testbed.report", "testbed.viz", *ENTRY)


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def is_under(module: str, prefixes: tuple[str, ...]) -> bool:
    """``module`` is one of ``prefixes`` or inside one (``testbed.serve`` is not
    ``testbed.serving``)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def offenders(package: str, forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    found = {p.name: sorted(m for m in imported_modules(p) if is_under(m, forbidden))
             for p in (TESTBED / package).glob("*.py")}
    return {k: v for k, v in found.items() if v}


@pytest.mark.parametrize("package, forbidden", [
    ("engine", ("testbed.sim", *ABOVE_THE_FAMILIES)),
    ("serving", ("testbed.sim", "testbed.engine", *ABOVE_THE_FAMILIES)),
    ("scheduler", ("testbed.sim", "testbed.engine", "testbed.serving", *ABOVE_THE_FAMILIES)),
    ("cache", ("testbed.sim", "testbed.engine", "testbed.serving", "testbed.scheduler",
               *ABOVE_THE_FAMILIES)),
    ("sim", ("testbed.engine", *ABOVE_THE_FAMILIES)),
    ("router", ("testbed.sim", "testbed.engine", "testbed.serving", "testbed.scheduler",
                *ABOVE_THE_FAMILIES)),
    # the config layer reads values and builds a plan: it imports no backend, result or front end
    ("config", ("testbed.backends", "testbed.results", "testbed.calibration", "testbed.api",
                "testbed.gateway", "testbed.fuzz", "testbed.report", "testbed.viz", *ENTRY)),
    # what a run produces knows neither how it was configured nor which backend produced it
    ("results", ("testbed.config", "testbed.backends", "testbed.calibration", "testbed.engine",
                 "testbed.sim", "testbed.scheduler", "testbed.cache", "testbed.remote",
                 *ABOVE_THE_FAMILIES)),
    # the backends serve a plan; the HTTP server and the router build on them, not the reverse
    ("backends", ("testbed.calibration", "testbed.api", "testbed.gateway", "testbed.fuzz",
                  "testbed.report", "testbed.viz", *ENTRY)),
    # the grid builds batches for whatever executor it is handed: it loads no engine itself
    ("calibration", ("testbed.engine", "testbed.backends", "testbed.results", "testbed.remote",
                     "testbed.config.assembly", "testbed.config.builders", "testbed.api",
                     "testbed.gateway", "testbed.fuzz", *ENTRY)),
])
def test_package_does_not_import_the_layers_it_must_not_know(package, forbidden):
    assert offenders(package, forbidden) == {}


def test_the_layering_names_only_packages_and_modules_that_exist():
    named = ("testbed.sim", "testbed.engine", "testbed.serving", "testbed.scheduler",
             "testbed.cache", "testbed.results", "testbed.remote", "testbed.config",
             *ABOVE_THE_FAMILIES)
    for module in named:
        path = TESTBED.parent / module.replace(".", "/")
        assert path.is_dir() or path.with_suffix(".py").is_file(), module


def test_the_top_level_holds_the_entry_points_and_few_other_modules():
    """At most eight modules beside testbed/'s packages; every other module lives in a package
    named for what it holds (docs/design.md §2)."""
    top = sorted(p.name for p in TESTBED.glob("*.py"))
    assert len(top) <= 8, top
    assert {f"{m.rpartition('.')[2]}.py" for m in ENTRY} <= set(top)


def test_no_package_imports_an_entry_point():
    """The entry points are the top: a package module importing one would turn it into a library
    (`testbed.execute` is the one run every caller shares, the fuzzer included)."""
    entry_points = tuple(m for m in ENTRY if m != "testbed.execute")
    found = {str(p.relative_to(TESTBED)): sorted(m for m in imported_modules(p)
                                                 if is_under(m, entry_points))
             for p in TESTBED.glob("*/*.py")}
    assert {k: v for k, v in found.items() if v} == {}
