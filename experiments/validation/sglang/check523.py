"""``python -m experiments.validation.sglang --sglang 0.5.23``: the differential check against
SGLang 0.5.23's own code (`sglang_wheel523` says what is imported and what is a placeholder).

(a) queue order (`sglang_queue523`: lpm, dfs-weight, hrrn, and fcfs with priority scheduling, on
random queues over random trees); (b) whole offline batches: the workloads and configurations of
0.4.10's (b) (`experiments.validation.sglang_batches.WORKLOADS`, ``CONFIGS``), step by step through
0.5.23's event loop around its own SchedulePolicy, PrefillAdder and RadixCache
(`sglang_mirror523`) and through our `Scheduler` with ``scheduler.sglang=0.5.23``; LPM and
DFS-weight, and in the full grid FCFS and HRRN; then random offline cases (`random_batches`);
(c) replay with pages 1 and 16 through 0.5.23's own RadixCache, ``match_kv_cache``,
``evict_from_tree_cache`` and ``release_kv_cache``, under LRU and, on random token runs with
priorities, every other strategy its classic tree runs (`sglang_replay523`); (d) eviction order of
every strategy of 0.5.23's ``evict_policy.py`` (`sglang_eviction`).
Exit code 0 when every comparison agrees, 1 when one does not, 2 when the wheel cannot be had.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from experiments.validation.sglang import batches as sglang_batches
from experiments.validation.sglang import eviction as sglang_eviction
from experiments.validation.sglang import placeholders as sglang_wheel523
from experiments.validation.sglang import queues as sglang_queue523
from experiments.validation.sglang import tree_serving as sglang_replay523
from experiments.validation.sglang import wheel as sglang_wheel
from experiments.validation.sglang.loop523 import SglangLoop523
from experiments.validation.sglang.stand_ins import SglReq523
from testbed.workloads import generate


def run_sglang523(sgl, *case):
    """One (b) case through 0.5.23's loop (`sglang_batches.run_sglang` says what comes back; the same
    guard keeps every request under max_req_len, so none is aborted or clipped)."""
    return sglang_batches.run_sglang(sgl, *case, loop_cls=SglangLoop523, req_cls=SglReq523)


def random_batches(sgl, cases: int, seed: int, show: int) -> tuple[int, int]:
    """(b) on random offline cases: a grid workload drawn with a random seed, a random policy,
    capacity (from the longest request + 16 to all of them + 64), running limit, chunk size and
    prefill budget. Returns (identical, cases); prints the first ``show`` differences."""
    rng = random.Random(seed)
    same = 0
    for _ in range(cases):
        name = rng.choice(list(sglang_batches.WORKLOADS))
        requests = generate({"name": name, **sglang_batches.WORKLOADS[name]}, seed=rng.randrange(1000))
        lengths = [len(r.prompt) + len(r.output) for r in requests]
        args = (requests, rng.choice(["lpm", "dfs_weight", "fcfs", "hrrn"]),
                rng.randint(max(lengths) + 16, sum(lengths) + 64), rng.choice([2, 4, 8, 16, 64]),
                rng.choice([None, 16, 32, 64, 256, 8192]), rng.choice([64, 128, 512, 16384]))
        ours, theirs = sglang_batches.run_ours(*args, release="0.5.23"), run_sglang523(sgl, *args)
        i = sglang_batches.first_difference(ours[0], theirs[0])
        same += i is None
        if i is not None and show > 0:
            show -= 1
            print(f"  {name} {args[1:]}: step {i}\n    ours   {sglang_batches.describe(ours[0], i)}\n"
                  f"    SGLang {sglang_batches.describe(theirs[0], i)}")
    return same, cases


def main(args: argparse.Namespace) -> int:
    try:
        sgl = sglang_wheel523.load(sglang_wheel.fetch(args.cache_dir, "0.5.23"))
    except Exception as e:
        print(f"cannot get SGLang 0.5.23 into {args.cache_dir}: {e}", file=sys.stderr)
        return 2
    print(f"SGLang 0.5.23 from {sgl.root}: "
          + ", ".join(m.rsplit(".", 1)[1] + ".py" for m in sorted(sglang_wheel523.REAL))
          + " imported; every other sglang module a placeholder (experiments/validation/"
          "sglang_wheel523.py); re-implemented (not isolable): the Scheduler loop, ScheduleBatch "
          "bookkeeping, Req, the pools (sglang_mirror523.py, sglang_req523.py)\n")
    start = time.time()
    trials = args.queues or (300 if args.quick else 1000)
    print(f"(a) queue order, {trials} random queues per policy (order and deprioritized set; "
          "matched prefixes; the trees' recency after the sort)")
    queues = sglang_queue523.check_queues(sgl, trials, args.seed, args.show)
    sglang_queue523.print_queues(queues)

    print(f"\n(b) whole offline batches ({'quick' if args.quick else 'full'} grid), ours with "
          "scheduler.sglang=0.5.23. hits=: requests whose first-admission hit agrees; o/s: "
          "ours/SGLang; steps: 'same' or the first step whose (kind, request ids) differ")
    rows = sglang_batches.check_batches(sgl, args.quick, args.show, "0.5.23", run_sglang523,
                                ("fcfs", "hrrn"))
    print()
    sglang_batches.print_batches(rows)
    cases = args.random_batches if args.random_batches is not None else (
        100 if args.quick else 1000)
    print(f"\n(b) {cases} random offline cases (workload seed, policy, capacity, running limit, "
          "chunk size, prefill budget)")
    randoms = random_batches(sgl, cases, args.seed, args.show)
    print(f"  identical steps in {randoms[0]}/{randoms[1]}")
    replay_agree, replay_summary = sglang_replay523.report(sgl, args.quick, args.show)
    per_strategy = 100 if args.quick else 500
    print(f"\n(d) eviction order, {per_strategy} random trees per strategy")
    evictions = sglang_eviction.check_eviction(sgl, per_strategy, args.seed)
    sglang_eviction.print_eviction(evictions)
    every = [c for c in (*queues.values(), *evictions.values())]
    same = sum(r.get("diff", 0) is None for r in rows)
    hits = sum(r.get("hits", 0) for r in rows), sum(r["reqs"] for r in rows)
    agree = (all(c["agree"] == c.get("queues", c.get("trees")) for c in every)
             and same == len(rows) and randoms[0] == randoms[1] and replay_agree)
    print(f"\nagreement: (a) " + ", ".join(f"{p} {c['agree']}/{c['queues']}"
                                        for p, c in queues.items())
          + f" queues; (b) identical steps in {same}/{len(rows)} cases, first-admission hits "
          f"{hits[0]}/{hits[1]} requests, {sum('hits' not in r for r in rows)} cases failed to "
          f"run, {randoms[0]}/{randoms[1]} random cases; (d) "
          + ", ".join(f"{s} {c['agree']}/{c['trees']}" for s, c in evictions.items())
          + f" trees ({time.time() - start:.0f} s)\n           {replay_summary}")
    return 0 if agree else 1
