"""A differential check of our scheduler and cache against SGLang's own code, per release.

``python -m experiments.validation.sglang --release R`` (``0.5.23``, the default, or ``0.4.10``):
SGLang R's wheel is downloaded once into ``--cache-dir`` (`wheel.fetch`) and its scheduling code
imported from it (`wheel.load` says what is real and what stands in); our side runs with
``scheduler.sglang=R``. Four comparisons, (a), (b) and (d) at page size 1:

(a) **Queue order** (`queues`): random trees and waiting queues through SGLang's
    ``SchedulePolicy.calc_priority`` and our queue policy, for every policy the release has
    (0.4.10: lpm, dfs-weight; 0.5.23 also hrrn, and fcfs with priority scheduling).
    ``--in-batch-hold`` (0.4.10) reads our held requests as SGLang's deprioritized ones.
(b) **Whole offline batches** (`batches`): small workloads of `testbed.workloads` step by step
    through the release's event loop around its own SchedulePolicy, PrefillAdder and RadixCache
    (`loop`, `release_loops`) and through our `Scheduler` with a radix cache of the same
    capacity: LPM and DFS-weight, and in the full grid FCFS (0.5.23: and HRRN); then
    ``--random-batches`` random offline cases (0.5.23 by default).
(c) **Replay with pages** (`replay`): our replay backend against the release's RadixCache
    serving the same requests one at a time (`tree_serving`), with and without SGLang's three
    serving rules, at pages 1, 4 and 16 (0.5.23: 1 and 16); 0.5.23's other eviction strategies
    on random token runs with priorities.
(d) **Eviction order** (`eviction`): random histories of inserts and look-ups, then one-token
    evictions to empty, for every strategy the release has (0.4.10: LRU).

Not isolated, hence re-implemented (each function citing SGLang's): the ``Scheduler`` loop,
``ScheduleBatch`` bookkeeping, ``Req``, the KV allocator and the req-to-token pool (`loop`,
`release_loops`, `stand_ins`; in (c) `tree_serving.PagedSlots` and ``OneRow``). Capacities keep
every request under SGLang's ``max_req_len`` so that its ``max_new_tokens`` clipping never
applies. Exit code 0 when every comparison agrees, 1 when one does not (0.4.10's (b) counts a
case that runs the same steps until SGLang stalls for good as agreeing), 2 when the wheel cannot
be had.

    python -m experiments.validation.sglang [--release R] [--cache-dir DIR]  # 0.5.23 ~4.5 min
    python -m experiments.validation.sglang --release 0.4.10                 # ~2.5 min
    python -m experiments.validation.sglang [--release R] --quick            # 20-45 s
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from experiments.validation.sglang import batches, eviction, queues, replay, wheel

RANDOM_BATCHES = {"0.4.10": (0, 0), "0.5.23": (1000, 100)}  # (full, quick) by default


def stalled(rows: list[dict]) -> list[dict]:
    """The cases of (b) that ran SGLang's steps until SGLang stalled for good (work left it never
    schedules) while ours went on."""
    return [r for r in rows if "hits" in r and r["diff"] == r["sglang_steps"] and r["stuck"][1]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.validation.sglang",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--release", "--sglang", choices=wheel.RELEASES, default=wheel.RELEASES[0],
                    help="the SGLang release to check against (default %(default)s)")
    ap.add_argument("--cache-dir", type=Path,
                    help=f"where the wheel is kept (default {wheel.CACHE_ROOT}/sglang-RELEASE)")
    ap.add_argument("--quick", action="store_true",
                    help="300 queues, 30 of the cases, a smaller (c) and (d) (20-45 s)")
    ap.add_argument("--queues", type=int, help="random queues in (a) (default 1000; 300 quick)")
    ap.add_argument("--in-batch-hold", action="store_true",
                    help="0.4.10's (a): accept held requests equal to SGLang's deprioritized set")
    ap.add_argument("--show", type=int, default=3, help="disagreements to print in detail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-batches", type=int,
                    help="random offline cases after the grid in (b) (default: 0.5.23 1000, 100 "
                         "quick; 0.4.10 none)")
    args = ap.parse_args(argv)
    release = args.release
    cache_dir = (args.cache_dir or wheel.wheel_dir(release)).expanduser()
    try:
        sgl = wheel.load(wheel.fetch(cache_dir, release), release)
    except Exception as e:  # noqa: BLE001 (no network, no wheel: say why)
        print(f"cannot get SGLang {release} into {cache_dir}: {e}", file=sys.stderr)
        return 2
    print(wheel.describe(sgl) + " (experiments/validation/sglang/wheel.py); re-implemented (not "
          "isolable): the Scheduler loop, ScheduleBatch bookkeeping, Req, the KV allocator and "
          "req-to-token pool (loop.py, release_loops.py, stand_ins.py)\n")
    start = time.time()
    trials = args.queues or (300 if args.quick else 1000)
    stats = queues.report(sgl, trials, args.seed, args.show, args.in_batch_hold)

    print(f"\n(b) whole offline batches ({'quick' if args.quick else 'full'} grid), ours with "
          f"scheduler.sglang={release}. hits=: requests whose first-admission hit agrees; o/s: "
          "ours/SGLang; steps: 'same' or the first step whose (kind, request ids) differ; stuck: "
          "work left that could never be scheduled (SGLang would idle forever)")
    rows = batches.check_batches(sgl, args.quick, args.show)
    print()
    batches.print_batches(rows)
    cases = (args.random_batches if args.random_batches is not None
             else RANDOM_BATCHES[release][args.quick])
    randoms = (0, 0)
    if cases:
        print(f"\n(b) {cases} random offline cases (workload seed, policy, capacity, running "
              "limit, chunk size, prefill budget)")
        randoms = batches.random_batches(sgl, cases, args.seed, args.show)
        print(f"  identical steps in {randoms[0]}/{randoms[1]}")

    replay_agree, replay_summary = replay.report(sgl, args.quick, args.show)
    per_strategy = 100 if args.quick else 500
    print(f"\n(d) eviction order, {per_strategy} random trees per strategy")
    evictions = eviction.check_eviction(sgl, per_strategy, args.seed)
    eviction.print_eviction(evictions)

    done = [r for r in rows if "hits" in r]
    same, stalls = sum(r["diff"] is None for r in done), stalled(rows)
    hits = sum(r["hits"] for r in done), sum(r["reqs"] for r in rows)
    never = sum(r["reqs"] - r["hits"] for r in stalls)
    stall = (f", and in {len(stalls)} more up to where SGLang stalls for good (of their requests "
             f"{never} never admitted by it)" if stalls else "")
    tolerated = len(stalls) if release == "0.4.10" else 0
    agree = (all(c["agree"] == c["queues"] for c in stats.values())
             and all(c["agree"] == c["trees"] for c in evictions.values())
             and same + tolerated == len(rows) and randoms[0] == randoms[1] and replay_agree)
    print("\nagreement: (a) " + ", ".join(f"{p} {c['agree']}/{c['queues']}"
                                          for p, c in stats.items())
          + f" queues; (b) identical steps in {same}/{len(rows)} cases{stall}, first-admission "
          f"hits {hits[0]}/{hits[1]} requests, {len(rows) - len(done)} cases failed to run"
          + (f", {randoms[0]}/{randoms[1]} random cases" if randoms[1] else "") + "; (d) "
          + ", ".join(f"{s} {c['agree']}/{c['trees']}" for s, c in evictions.items())
          + f" trees ({time.time() - start:.0f} s)\n           {replay_summary}")
    return 0 if agree else 1

