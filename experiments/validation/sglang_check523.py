"""``python -m experiments.validation.sglang --sglang 0.5.23``: the differential check against
SGLang 0.5.23's own code (`sglang_wheel523` says what is imported and what is a placeholder).

(a) queue order (`sglang_queue523`: lpm, dfs-weight, hrrn, and fcfs with priority scheduling, on
random queues over random trees), (d) eviction order of every strategy of 0.5.23's
``evict_policy.py`` (`sglang_eviction`); (c) replay with pages 1 and 16 through 0.5.23's own
RadixCache, ``match_kv_cache``, ``evict_from_tree_cache`` and ``release_kv_cache``, under LRU
and, on random token runs with priorities, every other strategy its classic tree runs
(`sglang_replay523`). Whole offline batches (b), which drive 0.4.10's PrefillAdder and
ScheduleBatch through `sglang_mirror`, are not ported to 0.5.23's interfaces (its adder, request
and KV bookkeeping were rewritten); they run with ``--sglang 0.4.10``. Exit code 0 when every comparison agrees, 1
when one does not, 2 when the wheel cannot be had.
"""

from __future__ import annotations

import argparse
import sys
import time

from experiments.validation import sglang_eviction, sglang_queue523, sglang_wheel, sglang_wheel523
from experiments.validation import sglang_replay523


def main(args: argparse.Namespace) -> int:
    try:
        sgl = sglang_wheel523.load(sglang_wheel.fetch(args.cache_dir, "0.5.23"))
    except Exception as e:
        print(f"cannot get SGLang 0.5.23 into {args.cache_dir}: {e}", file=sys.stderr)
        return 2
    print(f"SGLang 0.5.23 from {sgl.root}: "
          + ", ".join(m.rsplit(".", 1)[1] + ".py" for m in sorted(sglang_wheel523.REAL))
          + " imported; every other sglang module a placeholder (experiments/validation/"
          "sglang_wheel523.py)\n")
    start = time.time()
    trials = args.queues or (300 if args.quick else 1000)
    print(f"(a) queue order, {trials} random queues per policy (order and deprioritized set; "
          "matched prefixes; the trees' recency after the sort)")
    queues = sglang_queue523.check_queues(sgl, trials, args.seed, args.show)
    sglang_queue523.print_queues(queues)
    print("\n(b) whole offline batches: not ported to 0.5.23 (run --sglang 0.4.10)")
    replay_agree, replay_summary = sglang_replay523.report(sgl, args.quick, args.show)
    per_strategy = 100 if args.quick else 500
    print(f"\n(d) eviction order, {per_strategy} random trees per strategy")
    evictions = sglang_eviction.check_eviction(sgl, per_strategy, args.seed)
    sglang_eviction.print_eviction(evictions)
    every = [c for c in (*queues.values(), *evictions.values())]
    agree = all(c["agree"] == c.get("queues", c.get("trees")) for c in every) and replay_agree
    print(f"\nagreement: (a) " + ", ".join(f"{p} {c['agree']}/{c['queues']}"
                                        for p, c in queues.items())
          + " queues; (d) " + ", ".join(f"{s} {c['agree']}/{c['trees']}"
                                       for s, c in evictions.items())
          + f" trees ({time.time() - start:.0f} s)\n           {replay_summary}")
    return 0 if agree else 1
