"""Sweep reports: ``python -m testbed.report DIR [--out OUT]``.

Collects every run under DIR (any folder holding ``summary.json`` or ``failed.json``, searched
recursively: a Hydra multirun dir, or any folder of run dirs) into one table: the run's config
choices (flattened from ``summary["config"]``) and its summary figures, one row per run, failed runs
included with status ``failed`` and their error. Writes into DIR (or OUT):

- ``results.csv`` and ``results.parquet``: the whole table;
- ``report.md``: tables, findings computed from the table, and the figures of ``figures``
  (PNGs in ``figures/``): throughput normalised to no cache, hit rate against the ideal, hit rate vs
  capacity, latency CDFs, latency vs load, TTFT p99 of cache-cold vs cache-warm requests (each
  where the data has what it needs); for a single sim or engine run also the time series of
  ``timeseries`` from its ``steps.jsonl`` (hit rate, KV pool, batch size and queue);
- where runs of one workload were predicted (``sim``) and measured (``server``, ``engine``):
  ``side_by_side.csv``, a section of the report and a figure per workload (``side_by_side``).

The package's modules: the table's columns (and the no-cache normalisation) are described in
``table``; the findings and tables in ``markdown``; the figures in ``figures`` and
``timeseries``; predicted against measured in ``side_by_side``. ``__main__`` runs :func:`main`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from testbed.errors import BadInput
from testbed.report.figures import make_figures
from testbed.report.markdown import write_report
from testbed.report.side_by_side import side_by_side
from testbed.report.table import load_results
from testbed.report.timeseries import timeseries_figures


def build(root: str | Path, out: str | Path | None = None, progress: bool | None = None) -> dict:
    """Load the runs under ``root`` and write the table, figures and report into ``out``."""
    root = Path(root)
    out = Path(out) if out is not None else root
    df = load_results(root, progress=progress)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "results.csv", index=False)
    df.to_parquet(out / "results.parquet", index=False)
    figures = make_figures(df, root, out / "figures") + timeseries_figures(df, root,
                                                                           out / "figures")
    compared, compared_figures = side_by_side(df, root, out)
    figures += compared_figures
    report = write_report(df, root, out, [(str(p.relative_to(out)), t) for p, t in figures],
                          compared)
    return {"table": df, "report": report, "figures": [p for p, _ in figures],
            "side_by_side": compared}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testbed.report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("dir", help="a multirun dir or any folder containing run dirs")
    ap.add_argument("--out", help="where to write the report (default: DIR)")
    args = ap.parse_args(argv)
    if not Path(args.dir).is_dir():
        print(f"error: {args.dir} is not a directory", file=sys.stderr)
        return 2
    try:
        result = build(args.dir, args.out)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    df = result["table"]
    print(f"{len(df)} runs ({int((df['status'] == 'failed').sum())} failed) -> {result['report']}")
    return 0
