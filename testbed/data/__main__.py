"""``python -m testbed.data list`` and ``python -m testbed.data fetch NAME...``."""

from __future__ import annotations

import argparse
import sys

from testbed.data import TRACES, DataError, data_dir, describe_fetch, fetch, local_path, lookup


def list_traces() -> None:
    print(f"data folder: {data_dir()} (TESTBED_DATA sets it)")
    rows = [("name", "format", "bytes", "sha256", "here")]
    for t in TRACES.values():
        rows.append((t.name, t.format, f"{t.size:,}" if t.size is not None else "?",
                     t.sha256[:16] + "…" if t.sha256 else "not pinned",
                     "yes" if local_path(t).is_file() else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if i:
            print(f"  {TRACES[row[0]].url}")
    print("use: workload=trace workload.path=data:NAME (fetched on first use)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.data",
                                     description="Public traces, pinned by URL and SHA-256.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="the registry and which files are in the data folder")
    get = sub.add_parser("fetch", help="download traces into the data folder")
    get.add_argument("names", nargs="+", metavar="NAME")
    args = parser.parse_args(argv)
    if args.command == "list":
        list_traces()
        return 0
    try:
        for name in args.names:
            trace = lookup(name)
            print(describe_fetch(trace, fetch(trace)))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
