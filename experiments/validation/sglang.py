"""A differential check of our scheduler against SGLang's own scheduling code (0.4.10 or 0.5.23).

This module is 0.4.10's check; ``--sglang 0.5.23`` runs `sglang_check523` instead.

SGLang's wheel is downloaded once into ``--cache-dir`` and its ``schedule_policy.py``
(SchedulePolicy, PrefillAdder) and ``radix_cache.py`` (RadixCache) are imported from it
(`sglang_wheel` says how, and what gets a stand-in). Three comparisons, (a) and (b) at page_size 1:

(a) **Queue order.** Random radix trees (random token runs branching off each other, inserted in
    the same order into SGLang's RadixCache and ours, so child order and DFS-weight ties match) and
    random waiting queues (1-40 requests, some 129-160 to cross LPM's FCFS fallback at 128) sharing
    prefixes with the tree and with each other. SGLang's ``SchedulePolicy.calc_priority`` order
    (``lpm`` and ``dfs-weight``, in-batch thresholds 32/32) must equal our
    ``QueuePolicy.order(...).queue``, our deprioritized set (``Ordering.deferred``) SGLang's, with
    nothing held out of the step ("strict"). ``--in-batch-hold`` runs our policy with
    ``in_batch_hold`` and checks that it holds exactly SGLang's deprioritized requests (LPM only;
    dfs-weight deprioritizes nothing) and that the rest, then them in queue order, is SGLang's
    order ("held-as-deprioritized"). Both readings are printed, and whether our queue alone equals
    SGLang's order.
(b) **Whole offline batches.** Small workloads from ``testbed.workloads`` (dependencies ignored, all
    requests submitted at once, outputs forced: each request produces its predetermined tokens and
    stops after the last), run step by step through SGLang's non-overlap event loop around its own
    SchedulePolicy, PrefillAdder and RadixCache (`sglang_mirror.SglangLoop`), and through our
    `Scheduler` with a radix cache of the same capacity. Compared: each request's cache hit at its
    first admission, and the list of (kind, request ids) per step; retractions are counted.
(c) **Replay with pages** (`sglang_replay`). Our replay backend (`testbed.backends.replay`, one request at a
    time: acquire, extend, release with insert) over ``RadixCache(capacity, page_size=P)`` against
    SGLang's RadixCache serving the same requests one at a time with its own ``match_prefix``,
    ``evict`` and ``cache_finished_req`` and the eviction rule of
    ``ScheduleBatch._evict_tree_cache_if_needed`` (a numpy stand-in for the paged allocator), for P
    in 1, 4, 16 and unlimited, evicting and tight capacities, on small ``random_tree``, ``chat``
    and ``few_shot`` workloads, random token runs and, when ``../shared/traces`` holds it, the
    first 2,000 requests of the Mooncake conversation trace. Compared per request: hit and tokens
    evicted; and the tokens left in the tree. Three of SGLang's rules are not replay.py's (the
    match leaves the prompt's last token out; the last output token is never cached; eviction
    asks for the whole allocation, plus a page, not the shortfall); our cache is also driven with
    all of them switched to SGLang's (which isolates the tree and its LRU order), with all but one
    (what that rule alone changes), and, as a control, with all of them and FIFO eviction (the
    cases it disagrees in are those that test the LRU order).

Not isolated, hence re-implemented in `sglang_mirror` (each function cites SGLang's): the
``Scheduler`` loop, ``ScheduleBatch`` bookkeeping, ``Req``, the KV allocator (a free list) and the
req-to-token pool (a dict of rows); in (c) `sglang_replay.PagedSlots` and `OneRow` instead.
Capacities keep every request under SGLang's ``max_req_len`` so that its ``max_new_tokens``
clipping never applies. Exit code 0 unless the wheel cannot be had.

    python -m experiments.validation.sglang [--cache-dir DIR]   # ~2.5 min on 2 cores, (c) 2 min
    python -m experiments.validation.sglang --quick             # ~20 s
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from experiments.validation import sglang_eviction, sglang_replay, sglang_wheel
from experiments.validation.sglang_batches import SGL_NAME, check_batches, print_batches
from experiments.validation.sglang_cases import assembled, random_instance
from experiments.validation.sglang_wheel import SglReq
from testbed.scheduler.request_state import Req
from testbed.workloads.request import TOKEN_DTYPE, Request

CACHE_ROOT = Path.home() / ".cache" / "radix-testbed"  # the wheel of release V in sglang-V/


# ---------------------------------------------------------------- (a) queue order
def held_ids(ordering, reqs: list[Req]) -> set[str]:
    """The ids of the requests an `Ordering` holds out of the step (``in_batch_hold``)."""
    return deprioritized_ids(ordering, reqs) if ordering.held else set()


def deprioritized_ids(ordering, reqs: list[Req]) -> set[str]:
    """The ids of the requests an `Ordering` marks as deprioritized (in-batch prefix caching)."""
    return {r.id for r in reqs if id(r) in ordering.deferred}


def order_once(sgl, policy: str, tree: list[list[int]], prompts: list[list[int]],
               hold: bool = False):
    """One queue through both policies. Returns which comparisons agree (``strict``: our queue is
    SGLang's order and nothing is held; ``hold``: we hold exactly SGLang's deprioritized requests
    and the rest of our queue, then them in queue order, is SGLang's order; ``queue``: our queue
    alone is SGLang's order), whether the trees agree on every hit, and the two orders."""
    theirs = sgl.radix.RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                  page_size=1, disable=False)
    run = assembled(policy, in_batch_hold=hold)
    ours = run.build_cache(None, [])  # unlimited
    for seq in tree:
        theirs.insert(seq, torch.arange(len(seq)))
        arr = np.asarray(seq, dtype=TOKEN_DTYPE)
        lease = ours.acquire(arr)
        ours.extend(lease, len(arr) - lease.hit)
        ours.release(lease, arr, insert=True)
    sgl_policy = sgl.policy.SchedulePolicy(SGL_NAME[policy], theirs, False)
    deprioritized: set[str] = set()
    compute = sgl_policy._compute_prefix_matches  # wrapped to note its result, not changed

    def noting(queue, p):
        out = compute(queue, p)
        deprioritized.update(out if p.value == "lpm" else ())  # dfs-weight ignores the set
        return out
    sgl_policy._compute_prefix_matches = noting
    sgl_queue = [SglReq(f"r{i}", p, [0]) for i, p in enumerate(prompts)]
    sgl_policy.calc_priority(sgl_queue)
    expected = [r.rid for r in sgl_queue]

    reqs = [Req(request=Request(f"r{i}", np.asarray(p, dtype=TOKEN_DTYPE),
                                np.zeros(1, dtype=TOKEN_DTYPE)),
                prompt=np.asarray(p, dtype=TOKEN_DTYPE), submitted_s=0.0, seq=i)
            for i, p in enumerate(prompts)]
    c = run.scheduler  # its queue policy, built as the Scheduler builds it
    ordering = c.queue_policy().build(cache=ours, rng=np.random.default_rng(0),
                                      **c.settings()).order(reqs)
    got, held = [r.id for r in ordering.queue], held_ids(ordering, reqs)
    held_last = [i for i in got if i not in held] + [r.id for r in reqs if r.id in held]
    hits = {r.rid: len(r.prefix_indices) for r in sgl_queue}
    trees = all(ours.match(r.prompt, limit=len(r.prompt) - 1) == hits[r.id] for r in reqs
                if len(prompts) <= 128 or policy == "dfs_weight")  # LPM's FCFS fallback: no match
    same_set = deprioritized_ids(ordering, reqs) == deprioritized
    agree = {"strict": not held and got == expected and same_set, "queue": got == expected,
             "hold": held == deprioritized and held_last == expected}
    return agree, bool(held), trees, (expected, got, sorted(held))


def check_order(sgl, trials: int, hold: bool, seed: int, show: int) -> dict[str, Counter]:
    rng = np.random.default_rng(seed)
    stats = {p: Counter() for p in ("lpm", "dfs_weight")}
    shown = 0
    for _ in range(trials):
        tree, prompts = random_instance(rng)
        big = len(prompts) > 128
        for policy, c in stats.items():
            agree, held, trees, detail = order_once(sgl, policy, tree, prompts, hold)
            ok = agree["hold" if hold else "strict"]
            c.update(queues=1, agree=ok, held=held, tree_mismatch=not trees, big=big,
                     big_agree=big and ok, **{f"{k}_agree": v for k, v in agree.items()})
            if not ok and shown < show:
                shown += 1
                print(f"  {policy}, {len(prompts)} waiting\n    SGLang {' '.join(detail[0])}\n"
                      f"    ours   {' '.join(detail[1])}\n    held   {' '.join(detail[2])}")
    return stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sglang", choices=sglang_wheel.RELEASES, default="0.5.23",
                    help="the release to check against (0.5.23: `sglang_check523`)")
    ap.add_argument("--cache-dir", type=Path,
                    help=f"where the wheel is kept (default {CACHE_ROOT}/sglang-RELEASE)")
    ap.add_argument("--quick", action="store_true",
                    help="300 queues, 30 of the 120 cases, a smaller (c) (~20 s)")
    ap.add_argument("--queues", type=int, help="random queues in (a) (default 1000; 300 quick)")
    ap.add_argument("--in-batch-hold", action="store_true",
                    help="(a): accept held requests equal to SGLang's deprioritized set")
    ap.add_argument("--show", type=int, default=3, help="disagreements to print in detail")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random-batches", type=int,
                    help="0.5.23: random offline cases after the grid (default 1000; 100 quick)")
    args = ap.parse_args()
    args.cache_dir = (args.cache_dir or CACHE_ROOT / f"sglang-{args.sglang}").expanduser()
    if args.sglang == "0.5.23":
        from experiments.validation import sglang_check523
        return sglang_check523.main(args)
    try:
        sgl = sglang_wheel.load(sglang_wheel.fetch(args.cache_dir))
    except Exception as e:
        print(f"cannot get SGLang {sglang_wheel.VERSION} into {args.cache_dir}: {e}",
              file=sys.stderr)
        return 2
    print(f"SGLang {sglang_wheel.VERSION} from {sgl.root}: schedule_policy.py, radix_cache.py, "
          "global_config.py imported; stand-ins for "
          + "; ".join(f"{m} ({why})" for m, _, why in sglang_wheel.STAND_INS))
    print("re-implemented (not isolable): Scheduler loop, ScheduleBatch bookkeeping, Req, "
          "KV allocator, req-to-token pool; see experiments/validation/sglang_mirror.py\n")

    start = time.time()
    trials = args.queues or (300 if args.quick else 1000)
    print(f"(a) queue order, {trials} random queues per policy"
          f"{' (held = deprioritized accepted)' if args.in_batch_hold else ''}")
    stats = check_order(sgl, trials, args.in_batch_hold, args.seed, args.show)
    for policy, c in stats.items():
        print(f"  {policy:<10} agree {c['agree']}/{c['queues']} (over 128 waiting: "
              f"{c['big_agree']}/{c['big']}); held something in {c['held']}; strict "
              f"{c['strict_agree']}, held-as-deprioritized {c['hold_agree']}, queue alone "
              f"{c['queue_agree']}; trees disagreeing on a hit: {c['tree_mismatch']}")

    print(f"\n(b) whole offline batches ({'quick' if args.quick else 'full'} grid). hits=: "
          "requests whose first-admission hit agrees; o/s: ours/SGLang; steps: 'same' or the "
          "first step whose (kind, request ids) differ; stuck: work left that could never be "
          "scheduled (SGLang would idle forever)")
    rows = check_batches(sgl, args.quick, args.show)
    print()
    print_batches(rows)

    print(f"\n(c) replay with pages, one request at a time ({'quick' if args.quick else 'full'}): "
          "hits=, evicted=: requests whose hit, tokens evicted agree; both=: requests where both "
          "agree; tree o/s: tokens left in the tree, ours/SGLang. SGLang's rules that replay.py "
          "does not follow:")
    sglang_replay.print_rules()
    replay_rows = sglang_replay.check_replay(sgl, args.quick, args.show)
    print()
    sglang_replay.print_replay(replay_rows)
    print("\n(d) eviction order on random trees (its radix cache's one order, LRU)")
    evictions = sglang_eviction.check_eviction(sgl, 100 if args.quick else 500, args.seed)
    sglang_eviction.print_eviction(evictions)
    done = [r for r in rows if "hits" in r]
    same = sum(r["diff"] is None for r in done)
    # SGLang stalls for good (work left it never schedules) and ours goes on: same until then
    stalled = [r for r in done if r["diff"] == r["sglang_steps"] and r["stuck"][1]]
    hits = sum(r["hits"] for r in done), sum(r["reqs"] for r in done)
    print(f"\nagreement: (a) lpm {stats['lpm']['agree']}/{trials}, dfs_weight "
          f"{stats['dfs_weight']['agree']}/{trials} queues; (b) identical steps in {same}/"
          f"{len(rows)} cases, and in {len(stalled)} more up to where SGLang stalls for good; "
          f"first-admission hits {hits[0]}/{hits[1]} requests (of which "
          f"{sum(r['reqs'] - r['hits'] for r in stalled)} never admitted by the stalled SGLang), "
          f"{len(rows) - len(done)} cases failed to run;")
    print(f"           {sglang_replay.summary(replay_rows)} ({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
