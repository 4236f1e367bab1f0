"""The researcher's loop, timed beside its peers (docs/results/trace_replay.md, "Speed").

Three parts (``--part``, default all of them):

- ``replay``: the held-out random-tree trace (`RANDOM_TREE`: 20,000 requests of short shared
  segments, capacity 10 tokens a request) and the Mooncake conversation trace at 3M tokens,
  under SGLang 0.5.23's rules (its checkpoint insert: the default) and 0.4.10's, through three
  sides, each on the same requests and each checked to give our hits and evictions request by
  request:
  ``ours``, `testbed.backends.replay.replay` over `RadixCache`; ``plain``, a plain per-edge Python
  radix tree written for the benchmark (`experiments.benchmarks.trees.EdgeRadix`: a dict of
  children, LRU leaf eviction, ~120 lines, with 0.5.23's rule walking the prompt and the sequence again as
  SGLang does); ``sglang``, SGLang's own ``RadixCache`` of the same release from its wheel
  (`experiments.validation.sglang.wheel.fetch` unpacks it once; skipped with a note when it
  cannot be had). Each side gets the requests in its own form, made before its clock starts
  (parsing is nobody's loop); sides alternate within a round, the fastest of ``--rounds``
  counts (SGLang's, minutes long, runs once). Peak memory: each side once more in a fresh
  process, the peak resident set during the replay above what it held when it started
  (``VmHWM`` reset through ``/proc/self/clear_refs``), beside the trace's own token arrays.
- ``sim``: the Mooncake conversation trace simulated (`experiments.benchmarks.speed_sim.MOONCAKE_SIM`: Llama-3-8B on an H100,
  radix cache, LPM) in a fresh process, its whole run and each phase (``summary.json``'s
  ``timing``), and peak memory; and Vidur's comparison (docs/results/vs_vidur.md) on the Azure
  code trace's first ``--vidur-requests``: Vidur 0.0.26's event loop (its own environment, set up
  by `experiments.validation.vidur`) beside our simulator's loop (``run_s``) on the same clipped
  requests.
- ``scaling``: 10k, 100k and 1M requests (``--sizes``) of random trees (ours and the plain tree)
  and of the Mooncake trace repeated (ours; the plain tree takes about 1 ms a Mooncake request),
  `experiments.benchmarks.traces`, each cell in a fresh process, replayed in chunks of 20,000
  (the plain tree's lists made a chunk at a time, outside the clock): microseconds a request and
  peak memory beyond the loaded trace (random trees are made whole first; the repeated
  Mooncake trace, 47 GB of tokens at 1M requests, a chunk at a time inside the measure).

``--out DIR`` writes the rows to ``DIR/speed.csv`` (pandas reads it), each with its ``date`` and
``commit``; the rows of parts not run this time are kept.

    python -m experiments.benchmarks.speed [--part replay,sim,scaling] [--rounds 3]
        [--traces random_tree,mooncake] [--sizes 10000,100000,1000000] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from experiments.benchmarks.cache import records_outcome, timed
from experiments.benchmarks.cells import child, mb, peak_during, status, token_mb
from experiments.benchmarks.speed_sim import part_sim, sim_cell
from experiments.benchmarks.traces import forest, mooncake_tiled
from experiments.benchmarks.trees import EdgeRadix, as_lists, replay_edge, replay_sglang
from testbed.cache import native
from testbed.cache.radix import SGLANG_RELEASES, RadixCache
from testbed.backends.replay import replay
from testbed.workloads.request import Request
from testbed.workloads.synthetic import random_tree
from testbed.workloads.traces import load_mooncake

PARTS = ("replay", "sim", "scaling")
TRACES = ("random_tree", "mooncake")
SIDES = ("ours", "plain", "sglang")
# the held-out random trees: 32-token roots, 8-token segments and outputs, 10 tokens a request
RANDOM_TREE = dict(num_requests=20_000, root_len=32, segment_len=8, output_len=8)
TOKENS_PER_REQUEST = 10
MOONCAKE_CAPACITY = 3_000_000  # the README's Mooncake setting
SIZES = (10_000, 100_000, 1_000_000)
CHUNK = 20_000
SGLANG_CACHE = Path.home() / ".cache" / "radix-testbed"


class Unavailable(Exception):
    """A side that cannot run here (a wheel or a trace that cannot be had): skipped, saying why."""


# ------------------------------------------------------------------------- replay
def load_trace(name: str) -> tuple[list[Request], int]:
    """The requests of trace ``name`` and the capacity they are replayed at."""
    if name == "random_tree":
        requests = random_tree(**RANDOM_TREE)
        return requests, TOKENS_PER_REQUEST * len(requests)
    if name == "mooncake":
        from testbed.data.fetch import DataError, resolve_trace
        try:
            path, _ = resolve_trace("data:mooncake_conversation")
        except DataError as e:
            raise Unavailable(str(e)) from None
        return load_mooncake(path), MOONCAKE_CAPACITY
    raise SystemExit(f"--traces: unknown trace {name!r}; one of {', '.join(TRACES)}")


def sglang_of(release: str):
    """SGLang's modules of ``release`` from its unpacked wheel (fetched into the cache folder the
    first time), or Unavailable."""
    from experiments.validation.sglang import wheel
    try:
        root = wheel.fetch(SGLANG_CACHE / f"sglang-{release}", release)
    except Exception as e:  # noqa: BLE001 (no network, no wheel: say why)
        raise Unavailable(f"SGLang {release}'s wheel: {type(e).__name__}: {e}") from None
    return wheel.load(root, release)


def side(name: str, release: str, requests: list[Request], capacity: int
         ) -> Callable[[], tuple[list[int], list[int]]]:
    """Side ``name`` of the race, its input made now: a call replaying ``requests`` that returns
    (hit, evicted tokens) per request."""
    if name == "ours":
        return lambda: records_outcome(replay(requests, RadixCache(capacity, sglang=release)))
    if name == "plain":
        lists = as_lists(requests)
        return lambda: replay_edge(lists, EdgeRadix(capacity), checkpoint=release != "0.4.10")
    sgl = sglang_of(release)
    if release == "0.4.10":
        return lambda: replay_sglang(sgl, requests, capacity)
    from experiments.validation.sglang.tree_serving import serve
    return lambda: tuple(serve(sgl, requests, 1, capacity, rules=())[:2])


def replay_cell(trace: str, release: str, name: str) -> dict:
    """One side once, in this (fresh) process: seconds and peak memory."""
    requests, capacity = load_trace(trace)
    run = side(name, release, requests, capacity)
    seconds, peak, _ = peak_during(run)
    return {"seconds": seconds, "peak_mb": peak, "trace_mb": token_mb(requests)}


def part_replay(args) -> list[dict]:
    rows = []
    for trace in args.traces:
        try:
            requests, capacity = load_trace(trace)
        except Unavailable as e:
            print(f"\n== replay {trace}: skipped ({e})")
            continue
        trace_mb = token_mb(requests)
        for release in SGLANG_RELEASES:
            print(f"\n== replay {trace} ({len(requests):,} requests, capacity {capacity:,} "
                  f"tokens) under SGLang {release}'s rules; fastest of {args.rounds}", flush=True)
            sides = {}
            for name in args.sides:
                try:
                    sides[name] = side(name, release, requests, capacity)
                except Unavailable as e:
                    print(f"{name}: skipped ({e})")
            best: dict[str, tuple[float, object]] = {}
            for round_ in range(args.rounds):
                for name, run in sides.items():
                    if name == "sglang" and round_:
                        continue  # minutes a run: once is enough to place it
                    seconds, out = timed(run)
                    if name not in best or seconds < best[name][0]:
                        best[name] = (seconds, out)
            ours = best["ours"]
            for name, (seconds, out) in best.items():
                same = tuple(map(list, out)) == tuple(map(list, ours[1]))
                memory = child(["--cell", "replay", trace, release, name], args.budget)
                row = {"part": "replay", "trace": trace, "rules": release, "side": name,
                       "requests": len(requests), "seconds": seconds,
                       "requests_per_s": len(requests) / seconds,
                       "vs_ours": seconds / ours[0], "peak_mb": memory.get("peak_mb"),
                       "trace_mb": trace_mb, "check": "same hits and evictions" if same
                       else "MISMATCH with ours"}
                rows.append(row)
                print(f"{name:<8}{seconds:>9.3f} s{row['requests_per_s']:>12,.0f} req/s"
                      f"{row['vs_ours']:>8.2f}x ours   peak +{mb(row['peak_mb'])} "
                      f"(trace {trace_mb:,.0f} MB)   {row['check']}", flush=True)
    return rows


# ------------------------------------------------------------------------- scaling
def scaling_cell(kind: str, n: int, name: str) -> dict:
    """``n`` requests of ``kind`` replayed by ``name`` (ours under 0.5.23's rules, or the plain
    tree), chunk by chunk, in this (fresh) process. Random trees are made whole before the memory
    baseline, as the replay and simulation cells load their traces, so the peak is what the
    replay holds beyond its trace; the tiled Mooncake trace (47 GB of tokens at 1M requests) is
    made a chunk at a time inside it."""
    if kind == "random_tree":
        requests = iter(list(forest(n, **{k: v for k, v in RANDOM_TREE.items()
                                          if k != "num_requests"})))
        capacity = TOKENS_PER_REQUEST * n
    else:
        from testbed.data.fetch import resolve_trace
        path, _ = resolve_trace("data:mooncake_conversation")
        requests, capacity = mooncake_tiled(n, path), MOONCAKE_CAPACITY
    cache, tree = RadixCache(capacity), EdgeRadix(capacity)
    records, seconds, trace_mb = [], 0.0, 0.0
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    while True:
        part = list(itertools.islice(requests, CHUNK))
        if not part:
            break
        trace_mb += token_mb(part)
        lists = as_lists(part) if name == "plain" else None
        t, out = timed(lambda: replay(part, cache) if name == "ours" else
                       replay_edge(lists, tree, checkpoint=True))
        seconds += t
        records.append(out if name == "ours" else None)
        del part, lists
    return {"seconds": seconds, "peak_mb": (status("VmHWM") - before) / 1024,
            "trace_mb": trace_mb}


def part_scaling(args) -> list[dict]:
    rows = []
    print(f"\n== scaling: random trees ({RANDOM_TREE['root_len']}-token roots, "
          f"{TOKENS_PER_REQUEST} tokens of capacity a request) and the Mooncake trace repeated "
          f"(3M tokens); SGLang 0.5.23's rules; each cell a fresh process", flush=True)
    for kind in ("random_tree", "mooncake"):
        for name in ("ours", "plain") if kind == "random_tree" else ("ours",):
            for n in args.sizes:
                cell = child(["--cell", "scaling", kind, str(n), name], args.budget)
                if "error" in cell:
                    print(f"{kind:<12}{name:<6}{n:>10,}  {cell['error']}")
                    break  # larger sizes of it would not fit the budget either
                rows.append({"part": "scaling", "trace": kind, "side": name, "requests": n,
                             "rules": "0.5.23", **cell, "requests_per_s": n / cell["seconds"]})
                print(f"{kind:<12}{name:<6}{n:>10,}{cell['seconds']:>9.2f} s"
                      f"{cell['seconds'] / n * 1e6:>8.1f} us/req   peak +{mb(cell['peak_mb'])}"
                      f" (requests' tokens {cell['trace_mb']:,.0f} MB)", flush=True)
    return rows


# ------------------------------------------------------------------------- main
def run_cell(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    try:
        if kind == "replay":
            out = replay_cell(*rest)
        elif kind == "sim":
            out = sim_cell(rest)
        elif kind == "scaling":
            out = scaling_cell(rest[0], int(rest[1]), rest[2])
        else:
            raise SystemExit(f"--cell: unknown cell {kind!r}")
    except Unavailable as e:
        print(f"unavailable: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0


def listed(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [t for t in text.split(",") if t]
    bad = [t for t in items if t not in allowed]
    if bad:
        raise SystemExit(f"{flag}: {', '.join(bad)} not one of {', '.join(allowed)}")
    return items


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--cell"]:
        return run_cell(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", default=",".join(PARTS), help="comma-separated: " + ", ".join(PARTS))
    ap.add_argument("--traces", default=",".join(TRACES), help="replay's traces")
    ap.add_argument("--sides", default=",".join(SIDES), help="replay's sides")
    ap.add_argument("--rounds", type=int, default=3, help="fastest of this many (SGLang: one)")
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="scaling's sizes")
    ap.add_argument("--vidur-requests", type=int, default=2000,
                    help="sim: the Azure code trace's first N requests beside Vidur")
    ap.add_argument("--budget", type=float, default=1800, help="seconds a fresh-process cell may take")
    ap.add_argument("--work", type=Path, default=Path("outputs/speed"), help="scratch folder")
    ap.add_argument("--out", type=Path, default=None, help="write speed.csv here")
    args = ap.parse_args(argv)
    parts = listed(args.part, PARTS, "--part")
    args.traces = listed(args.traces, TRACES, "--traces")
    args.sides = ["ours"] + [s for s in listed(args.sides, SIDES, "--sides") if s != "ours"]
    try:
        args.sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        raise SystemExit(f"--sizes: whole numbers, comma-separated, got {args.sizes!r}") from None
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be >= 1, got {args.rounds}")
    print(f"{time.strftime('%Y-%m-%d')}, {platform.node()}: {os.cpu_count()} cores, "
          f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; "
          f"the replay's loops in {'C' if native.NATIVE else 'Python (C not built)'}")
    rows = []
    for part in parts:
        rows += {"replay": part_replay, "sim": part_sim, "scaling": part_scaling}[part](args)
    if args.out is not None and rows:
        stamp = {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": head_commit(),
                 "c_loops": native.NATIVE}
        path = write_rows(args.out / "speed.csv", [{**row, **stamp} for row in rows], parts)
        print(f"\nrows in {path}")
    return 0


def head_commit() -> str | None:
    """The checkout's commit (short), or None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_rows(path: Path, rows: list[dict], parts: list[str]) -> Path:
    """``rows`` into the CSV at ``path``: the rows of the parts not run this time are kept (a
    ``--part sim`` run leaves the replay's and the scaling's rows as they were), each row
    saying when (``date``, UTC), at which ``commit`` and whether with the replay's C loops
    (``c_loops``, `testbed.cache.native`) it was measured (empty in rows older than those
    columns)."""
    import pandas as pd

    new = pd.DataFrame(rows)
    if path.exists():
        old = pd.read_csv(path)
        new = pd.concat([old[~old["part"].isin(parts)], new], ignore_index=True)
        new["order"] = new["part"].map({part: i for i, part in enumerate(PARTS)})
        new = new.sort_values("order", kind="stable").drop(columns="order")
    path.parent.mkdir(parents=True, exist_ok=True)
    new.to_csv(path, index=False)
    return path


if __name__ == "__main__":
    from experiments import entry
    entry(main)
