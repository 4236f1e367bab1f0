"""Replay speed of the prefix caches, side by side (docs/design.md §4 "Replay backend").

Three parts (``--part``, default ``mooncake,versus``):

- ``mooncake``: the Mooncake conversation trace (``--trace``, capacity ``--capacity``, default
  3,000,000 tokens) through ``RadixCache`` and ``BlockHashCache``
  (``testbed.backends.replay.replay``) and the per-token Python tree
  (`experiments.benchmarks.trees.PlainRadix`); requests and prompt tokens per second.
- ``versus``: 20,000 requests of ``workload=random_tree`` with short shared segments (root 32,
  segments and outputs of 8 tokens: `VERSUS`), capacity 10 tokens per request, through the
  radix replay, the ideal-hit trie (`testbed.workloads.ideal`), the per-edge and the per-token
  Python trees (`experiments.benchmarks.trees`) and SGLang 0.4.10's own ``RadixCache`` (from the
  wheel `experiments.validation.sglang` caches; skipped with a note when it is not there).
- ``scaling``: 10,000, 100,000 and 1,000,000 requests (``--sizes``) of the same random trees and of
  the Mooncake trace repeated (`experiments.benchmarks.traces`), for radix, block-hash and the
  per-token tree: seconds, microseconds per request and peak memory (the child process's peak
  RSS, and how far it rose during the replay). Each cell runs in a fresh process, requests made in chunks of 20,000
  outside the timed part; a cell over ``--budget`` seconds is stopped and shown as such, and the
  larger sizes of that cache are not tried.

Every contender serves replay.py's calls and must report the radix cache's hit and evicted tokens
request for request (the block-hash cache has its own rules: vLLM's). Times are the replay
loops alone (``time.perf_counter``; making requests and building empty caches not counted), every
contender with Python's cyclic collector paused as ``replay`` pauses it. Each figure is the
fastest of ``--rounds`` runs (default 2), contenders alternating within a round; this machine is
shared, so the slower runs say more about the neighbours than about the code.

    python -m experiments.benchmarks.cache [--part mooncake,versus,scaling] [--rounds 2]
    make bench ARGS="--part versus"
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from experiments import MOONCAKE_TRACE, REPO, entry
from experiments.benchmarks.traces import forest, mooncake_tiled
from experiments.benchmarks.trees import (EdgeRadix, PlainRadix, as_lists, load_sglang,
                                          replay_edge, replay_plain, replay_sglang)

# Built directly, not through testbed.config.assembly: this benchmark times the raw data structures
# (caches, replay, loaders, generator) on purpose, without a run config's choices around them.
from testbed.cache.block_hash import BlockHashCache
from testbed.cache.radix import RadixCache
from testbed.perf import gc_paused
from testbed.backends.replay import replay
from testbed.workloads.ideal import ideal_hits
from testbed.workloads.synthetic import random_tree
from testbed.workloads.traces import load_mooncake

DEFAULT_TRACE = MOONCAKE_TRACE
DEFAULT_CAPACITY = 3_000_000  # the README's Mooncake setting
# Short shared segments: 32-token roots, 8-token segments and outputs (random_tree's shape).
VERSUS = dict(root_len=32, segment_len=8, output_len=8)
VERSUS_REQUESTS = 20_000
TOKENS_PER_REQUEST = 10  # the random trees' capacity, per request
SIZES = (10_000, 100_000, 1_000_000)
CHUNK = 20_000
CACHES = ("radix", "block_hash", "per-token")


def records_outcome(records) -> tuple[list[int], list[int]]:
    return [r.cached_tokens for r in records], [r.evicted_tokens for r in records]


def timed(fn):
    """(seconds, result) of ``fn()`` after a collection, the collector paused inside."""
    gc.collect()
    with gc_paused():
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, out


def race(contenders: dict, rounds: int) -> dict[str, tuple[float, object]]:
    """Run every contender ``rounds`` times, alternating; (fastest seconds, last result) each."""
    best: dict[str, tuple[float, object]] = {}
    for _ in range(rounds):
        for name, fn in contenders.items():
            seconds, out = timed(fn)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, out)
    return best


def check(name: str, got, want) -> str:
    return "same hits and evictions" if tuple(got) == tuple(want) else \
        f"MISMATCH: {name} disagrees with the radix cache"


# ------------------------------------------------------------------------- part: mooncake
def part_mooncake(args) -> int:
    if args.trace.is_file():
        requests = load_mooncake(args.trace)
        source = str(args.trace)
    else:
        requests = random_tree(num_requests=12_000, **VERSUS)
        source = f"random_tree(num_requests=12000, {VERSUS}) (no trace at {args.trace})"
    if args.limit:
        requests = requests[: args.limit]
    prompt = sum(len(r.prompt) for r in requests)
    cap = "unlimited" if args.capacity is None else f"{args.capacity:,} tokens"
    print(f"\n== mooncake: {source}\nrequests: {len(requests):,}   prompt tokens: {prompt:,}   "
          f"capacity: {cap}")
    contenders = {
        "radix": lambda: records_outcome(replay(requests, RadixCache(args.capacity))),
        "block_hash": lambda: records_outcome(replay(requests, BlockHashCache(args.capacity))),
    }
    if not args.skip_baseline:
        contenders["per-token"] = lambda: replay_plain(requests, PlainRadix(args.capacity))
    best = race(contenders, args.rounds)
    print(f"{'cache':<12}{'requests/s':>14}{'prompt tok/s':>16}{'seconds':>10}{'hit rate':>10}")
    for name, (seconds, (hits, _)) in best.items():
        print(f"{name:<12}{len(requests) / seconds:>14,.0f}{prompt / seconds:>16,.0f}"
              f"{seconds:>10.3f}{sum(hits) / max(prompt, 1):>10.6f}")
    if "per-token" not in best:
        return 0
    base = best["per-token"][0]
    for name in ("radix", "block_hash"):
        print(f"{name} / per-token: {base / best[name][0]:.1f}x faster")
    verdict = check("per-token", best["per-token"][1], best["radix"][1])
    print(verdict)
    return 0 if verdict.startswith("same") else 1


# ------------------------------------------------------------------------- part: versus
def part_versus(args) -> int:
    requests = random_tree(num_requests=VERSUS_REQUESTS, **VERSUS)
    lists = as_lists(requests)
    capacity = TOKENS_PER_REQUEST * len(requests)
    print(f"\n== versus: random_tree(num_requests={len(requests):,}, {VERSUS}), "
          f"capacity {capacity:,} tokens; fastest of {args.rounds}")
    contenders = {
        "radix replay": lambda: records_outcome(replay(requests, RadixCache(capacity))),
        "ideal trie": lambda: ideal_hits(requests),
        "per-edge tree": lambda: replay_edge(lists, EdgeRadix(capacity)),
        "per-token tree": lambda: replay_plain(requests, PlainRadix(capacity)),
    }
    sgl = load_sglang()
    if sgl is not None:
        contenders["SGLang RadixCache"] = lambda: replay_sglang(sgl, requests, capacity)
    best = race(contenders, args.rounds)
    ours, want = best["radix replay"][0], best["radix replay"][1]
    status = 0
    print(f"{'':<20}{'seconds':>10}{'us/request':>12}{'vs radix':>10}  check")
    for name, (seconds, out) in best.items():
        if name == "ideal trie":
            verdict = f"ideal hit rate, {seconds / ours:.1%} of the replay's time"
        else:
            verdict = "" if name == "radix replay" else check(name, out, want)
            status |= verdict.startswith("MISMATCH")
        print(f"{name:<20}{seconds:>10.3f}{seconds / len(requests) * 1e6:>12.1f}"
              f"{seconds / ours:>9.2f}x  {verdict}")
    if sgl is None:
        print("SGLang RadixCache: skipped (no sglang 0.4.10 wheel in ~/.cache/radix-testbed; "
              "`python -m experiments.validation.sglang --release 0.4.10 --quick` fetches it)")
    return status


# ------------------------------------------------------------------------- part: scaling
def make_trace(kind: str, n: int, path: Path):
    if kind == "random_tree":
        return forest(n, **VERSUS), TOKENS_PER_REQUEST * n
    return mooncake_tiled(n, path), DEFAULT_CAPACITY


def run_cell(kind: str, n: int, cache: str, path: Path) -> dict:
    """One scaling cell in this process: replay ``n`` requests, chunk by chunk."""
    requests, capacity = make_trace(kind, n, path)
    start_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if cache == "per-token":
        tree = PlainRadix(capacity)
        serve = lambda part: replay_plain(part, tree)  # noqa: E731
    else:
        target = RadixCache(capacity) if cache == "radix" else BlockHashCache(capacity)
        serve = lambda part: records_outcome(replay(part, target))  # noqa: E731
    seconds, hit, evicted, records = 0.0, 0, 0, []
    while True:
        part = list(itertools.islice(requests, CHUNK))
        if not part:
            break
        t, (hits, ev) = timed(lambda: serve(part))
        seconds += t
        hit += sum(hits)
        evicted += sum(ev)
        records.append(len(hits))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "requests": sum(records), "hit": hit, "evicted": evicted,
            "start_mb": start_rss / 1024, "peak_mb": peak / 1024}


def part_scaling(args) -> int:
    kinds = ["random_tree"] + (["mooncake"] if args.trace.is_file() else [])
    if len(kinds) == 1:
        print(f"scaling: no Mooncake trace at {args.trace}; random trees only")
    print(f"\n== scaling: random_tree({VERSUS}) at {TOKENS_PER_REQUEST} tokens of capacity per "
          f"request; the Mooncake trace repeated at {DEFAULT_CAPACITY:,}; fastest of "
          f"{args.rounds}, budget {args.budget:.0f} s a run")
    status = 0
    for kind in kinds:
        stopped: set[str] = set()
        for n in args.sizes:
            cells: dict[str, dict | str] = {}
            for _ in range(args.rounds):
                for cache in CACHES:
                    if cache in stopped:
                        cells.setdefault(cache, "skipped (a smaller size was over budget)")
                        continue
                    cmd = [sys.executable, "-m", "experiments.benchmarks.cache", "--cell", kind,
                           str(n), cache, "--trace", str(args.trace)]
                    try:
                        out = subprocess.run(cmd, capture_output=True, text=True, check=True,
                                             timeout=args.budget, cwd=REPO)
                    except subprocess.TimeoutExpired:
                        if not isinstance(cells.get(cache), dict):
                            cells[cache] = f"over {args.budget:.0f} s (stopped)"
                            stopped.add(cache)
                        continue
                    cell = json.loads(out.stdout.splitlines()[-1])
                    old = cells.get(cache)
                    if not isinstance(old, dict) or cell["seconds"] < old["seconds"]:
                        cells[cache] = cell
            radix = cells.get("radix")
            for cache, cell in cells.items():
                if isinstance(cell, str):
                    print(f"{kind:<12}{n:>10,}  {cache:<11} {cell}")
                    continue
                agree = ""
                if cache == "per-token" and isinstance(radix, dict):
                    same = (cell["hit"], cell["evicted"]) == (radix["hit"], radix["evicted"])
                    agree = "  same hits and evictions as radix" if same else "  MISMATCH"
                    status |= not same
                print(f"{kind:<12}{n:>10,}  {cache:<11}{cell['seconds']:>9.2f} s"
                      f"{cell['seconds'] / n * 1e6:>9.1f} us/req   peak {cell['peak_mb']:>7.0f} MB"
                      f" (+{cell['peak_mb'] - cell['start_mb']:.0f} MB replaying)   hit "
                      f"{cell['hit']:,} evicted {cell['evicted']:,}{agree}", flush=True)
    return status


# ------------------------------------------------------------------------- main
def parse_capacity(text: str) -> int | None:
    if text.lower() in ("0", "none", "null", "unlimited"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(
            f"--capacity must be an integer >= 0 or 'none', got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="mooncake,versus",
                    help="comma-separated: mooncake, versus, scaling (default: %(default)s)")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="Mooncake trace file (default: %(default)s)")
    ap.add_argument("--capacity", type=parse_capacity, default=DEFAULT_CAPACITY,
                    help="mooncake part: cache size in tokens; 0 or 'none' for unlimited "
                         "(default: %(default)s)")
    ap.add_argument("--limit", type=int, default=0,
                    help="mooncake part: only the first N requests; 0 for all")
    ap.add_argument("--skip-baseline", action="store_true",
                    help="mooncake part: do not run the per-token tree")
    ap.add_argument("--rounds", type=int, default=2, help="runs of every figure (default 2)")
    ap.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES,
                    help="scaling part: request counts (default 10000,100000,1000000)")
    ap.add_argument("--budget", type=float, default=300.0,
                    help="scaling part: seconds one run may take (default %(default)s)")
    ap.add_argument("--cell", nargs=3, metavar=("TRACE", "N", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell:
        kind, n, cache = args.cell
        print(json.dumps(run_cell(kind, int(n), cache, args.trace)))
        return 0
    parts = args.part.split(",")
    unknown = set(parts) - {"mooncake", "versus", "scaling"}
    if unknown:
        ap.error(f"--part must name mooncake, versus or scaling; got {', '.join(sorted(unknown))}")
    if args.limit < 0 or args.rounds < 1:
        ap.error("--limit must be >= 0 and --rounds >= 1")
    status = 0
    for part in parts:
        status |= {"mooncake": part_mooncake, "versus": part_versus,
                   "scaling": part_scaling}[part](args)
    return status


if __name__ == "__main__":
    entry(main)
