"""The GPU validation's one report: ``gpu_validate.json`` from what gpu_validate.sh left in its
work folder, with issue 61's acceptance points measured against their bounds.

It reads ``steps.tsv`` (each step's exit code and seconds), the two test runs' JUnit files, the
engine's ``gpu_engine.json``, the kernels' ``kernels.json`` and ``sim_vs_engine/sim_vs_engine.json``
(whichever exist), and prints the ratios, the step shapes beside their floors and the acceptance
table (`experiments.validation.gpu_runs.acceptance`)::

    python -m experiments.validation.gpu_report WORK
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from experiments.validation.gpu_runs import acceptance
from testbed.errors import BadInput

SOURCES = ("gpu_engine.json", "kernels.json", "sim_vs_engine/sim_vs_engine.json")
SHAPES = ("shape_plain_eager", "shape_plain_graph", "shape_plain_graph_overlap",
          "shape_cascade_eager", "shape_cascade_graph", "small_plain_graph_b8",
          "small_plain_graph_b16")


def junit(path: Path) -> dict[str, Any]:
    """A pytest JUnit file's counts and the names of its failed tests."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    out: dict[str, Any] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors",
                                                              "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                     if c.find("failure") is not None or c.find("error") is not None]
    return out


def build(work: Path) -> dict[str, Any]:
    """The report of the work folder ``work``."""
    doc: dict[str, Any] = {"steps": {}}
    tsv = work / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.is_file() else []:
        name, rc, seconds = line.split("\t")
        doc["steps"][name] = {"exit_code": rc, "seconds": int(seconds)}
    for name in ("kernel_tests", "engine_tests"):
        if (work / f"{name}.xml").is_file():
            doc[name] = junit(work / f"{name}.xml")
    for name in SOURCES:
        path = work / name
        doc[name] = json.loads(path.read_text()) if path.is_file() else None
    doc["acceptance"] = acceptance((doc["gpu_engine.json"] or {}).get("runs") or {},
                                   doc["kernels.json"], doc[SOURCES[2]])
    return doc


def lines(doc: dict[str, Any]) -> list[str]:
    """What the report prints: the ratios, each step shape beside its floor, the acceptance."""
    runs = (doc.get("gpu_engine.json") or {}).get("runs") or {}
    out = [f"{key}: {value:.3f}" if value is not None else f"{key}: -"
           for key, value in (runs.get("ratios") or {}).items()]
    for name in SHAPES:
        r = runs.get(name) or {}
        if r.get("decode_step_s"):
            out.append(f"{name}: decode step {r['decode_step_s'] * 1e3:.2f} ms (GPU "
                       f"{(r.get('decode_gpu_s') or 0) * 1e3:.2f} ms, host "
                       f"{(r.get('decode_host_s') or 0) * 1e3:.2f} ms), byte floor "
                       f"{(r.get('byte_floor_s') or 0) * 1e3:.2f} ms "
                       f"({r.get('over_floor') or 0:.2f}x)")
    for point in doc.get("acceptance") or []:
        verdict = {True: "ok", False: "NOT MET", None: "not measured"}[point["ok"]]
        measured = "-" if point["measured"] is None else f"{point['measured']:.3f}"
        out.append(f"[{verdict}] {point['point']}: {measured} ({point['bound']}; "
                   f"{point['from']})")
    return out


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 1 or not Path(args[0]).is_dir():
        raise BadInput(f"python -m experiments.validation.gpu_report WORK: WORK is the folder "
                       f"gpu_validate.sh wrote (outputs/gpu_validate); got {' '.join(args)!r}")
    work = Path(args[0])
    doc = build(work)
    print("\n".join(lines(doc)))
    (work / "gpu_validate.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    print(f"wrote {work / 'gpu_validate.json'}")
    return 0


if __name__ == "__main__":
    from experiments import entry
    entry(main)
