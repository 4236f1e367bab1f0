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
(c) **Replay with pages** (`sglang_replay`). Our replay backend (`testbed.replay`, one request at a
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
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from experiments.validation import sglang_eviction, sglang_replay, sglang_wheel
from experiments.validation.sglang_cases import assembled, random_instance
from experiments.validation.sglang_mirror import SglangLoop
from experiments.validation.sglang_wheel import SglReq
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads import generate
from testbed.workloads.request import TOKEN_DTYPE, Request

CACHE_ROOT = Path.home() / ".cache" / "radix-testbed"  # the wheel of release V in sglang-V/
SGL_NAME = {"lpm": "lpm", "dfs_weight": "dfs-weight", "fcfs": "fcfs", "hrrn": "hrrn"}
# Small instances of the project's generators (names and parameters as in conf/workload/).
WORKLOADS = {
    "few_shot": dict(num_tasks=3, questions_per_task=6, num_shots=2, example_len=48,
                     question_len=24, output_len=4),
    "tree_of_thought": dict(num_problems=2, depth=3, branching=2, instruction_len=32,
                            problem_len=48, step_prompt_len=16, thought_len=24),
    "chat": dict(num_sessions=6, turns=3, system_prompt_len=32, min_question_len=40,
                 max_question_len=80, min_output_len=4, max_output_len=8),
    "shared_prefix": dict(num_groups=4, prompts_per_group=6, system_prompt_len=256,
                          question_len=32, output_len=24),
    "chat_long": dict(num_sessions=4, turns=2, system_prompt_len=32, min_question_len=64,
                      max_question_len=128, min_output_len=256, max_output_len=512),
}
# (capacity, max_running_requests, chunked_prefill_size, max_prefill_tokens); capacity "ample"
# never evicts, "evict" must, "tight" also retracts (sizes from the workload, see `capacities`).
CONFIGS = [("ample", 64, None, 16384), ("ample", 4, 64, 16384), ("ample", 16, 8192, 128),
           ("evict", 16, None, 16384), ("evict", 8, 64, 256), ("tight", 64, None, 16384),
           ("tight", 8, 64, 16384), ("tight", 16, 256, 512)]
QUICK_CONFIGS = [CONFIGS[0], CONFIGS[4], CONFIGS[5]]


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


# ---------------------------------------------------------------- (b) whole batches
def workload(name: str) -> list[Request]:
    return generate({"name": name, **WORKLOADS[name]}, seed=1)


def capacities(requests: list[Request]) -> dict[str, int]:
    """KV capacities for a workload: all of it, a third of it, or barely more than the longest
    request (and always above SGLang's max_req_len = capacity - 1 for every request)."""
    lengths = [len(r.prompt) + len(r.output) for r in requests]
    longest, total = max(lengths), sum(lengths)
    return {"ample": total + 64, "evict": max(longest + 64, total // 3),
            "tight": max(longest + 16, total // 8)}


def run_ours(requests, policy, cap, max_running, chunk, max_prefill,
             release: str = sglang_wheel.VERSION):
    run = assembled(policy, cap, release, max_running_requests=max_running,
                    max_prefill_tokens=max_prefill, chunked_prefill_size=chunk)
    sched = Scheduler(run.build_cache(cap, requests), run.scheduler)
    reqs = [sched.submit(r, 0.0) for r in requests]
    steps = []
    while len(steps) < 200_000:
        batch = sched.next_batch()
        if batch is None:
            break
        steps.append((batch.kind, frozenset(e.req.id for e in batch.entries)))
        tokens = [int(e.req.request.output[len(e.req.output)])
                  if e.produces_token and e.req.remaining_new_tokens > 0 else None
                  for e in batch.entries]
        sched.complete(batch, tokens, float(len(steps)))
    return steps, {r.id: r.cached_tokens for r in reqs}, sched.preemptions, sched.has_work


def run_sglang(sgl, requests, policy, cap, max_running, chunk, max_prefill,
               loop_cls=SglangLoop, req_cls=SglReq):
    """One case through SGLang's loop (``loop_cls``, with requests ``req_cls``): its steps, each
    request's first-admission hit, the retractions and whether it stalled for good."""
    max_req_len = cap - 1  # TpModelWorker: min(context_len - 1, max_total_num_tokens - 1)
    for r in requests:  # handle_generate_request would abort it or clip its max_new_tokens
        if len(r.prompt) >= max_req_len - 5 or len(r.prompt) + len(r.output) + 1 > max_req_len:
            raise ValueError(f"{r.id} does not fit SGLang's max_req_len {max_req_len}")
    width = max(len(r.prompt) + len(r.output) for r in requests) + 2
    loop = loop_cls(sgl, SGL_NAME[policy], cap, max_running, max_prefill, chunk, width)
    reqs = [req_cls(r.id, r.prompt.tolist(), r.output.tolist()) for r in requests]
    loop.waiting.extend(reqs)
    loop.run()
    return loop.steps, {r.rid: r.first_hit for r in reqs}, loop.retractions, loop.stuck


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe(steps: list, i: int) -> str:
    return f"{steps[i][0]} {' '.join(sorted(steps[i][1]))}" if i < len(steps) else "(ended)"


def check_batches(sgl, quick: bool, show: int, release: str = sglang_wheel.VERSION,
                  run_theirs=None, full_policies: tuple[str, ...] = ("fcfs",)) -> list[dict]:
    """(b) over the grid: our scheduler with ``scheduler.sglang=release`` against
    ``run_theirs`` (default `run_sglang`, 0.4.10's loop); LPM and DFS-weight, and
    ``full_policies`` too unless ``quick``."""
    run_theirs = run_theirs or run_sglang
    rows = []
    for name in WORKLOADS:
        requests = workload(name)
        caps = capacities(requests)
        for policy in ("lpm", "dfs_weight") + (() if quick else full_policies):
            for level, max_running, chunk, max_prefill in (QUICK_CONFIGS if quick else CONFIGS):
                args = (requests, policy, caps[level], max_running, chunk, max_prefill)
                row = {"case": f"{name}/{policy}/{level}={caps[level]}/run={max_running}/"
                               f"chunk={chunk}/pf={max_prefill}", "reqs": len(requests)}
                try:
                    ours = run_ours(*args, release=release)
                except Exception as e:  # a report, not a test: say what failed and go on
                    ours = None
                    row["error"] = f"ours: {type(e).__name__}: {e}"
                try:
                    theirs = run_theirs(sgl, *args)
                except Exception as e:
                    theirs = None
                    row["error"] = f"SGLang: {type(e).__name__}: {e}"
                rows.append(row)
                if ours is None or theirs is None:
                    continue
                kinds = [Counter(k for k, _ in s) for s in (ours[0], theirs[0])]
                row.update(hits=sum(ours[1][r.id] == theirs[1][r.id] for r in requests),
                           prefill=(kinds[0]["prefill"], kinds[1]["prefill"]),
                           decode=(kinds[0]["decode"], kinds[1]["decode"]),
                           retract=(ours[2], theirs[2]), stuck=(ours[3], theirs[3]),
                           diff=first_difference(ours[0], theirs[0]),
                           sglang_steps=len(theirs[0]))
                if row["diff"] is not None and show > 0:
                    show -= 1
                    i = row["diff"]
                    print(f"  {row['case']}: step {i}\n    ours   {describe(ours[0], i)}\n"
                          f"    SGLang {describe(theirs[0], i)}")
    return rows


def print_batches(rows: list[dict]) -> None:
    width = max(len(r["case"]) for r in rows)
    print(f"{'case':<{width}}  reqs  hits=  prefill o/s  decode o/s  retract o/s  steps")
    for r in rows:
        if "hits" not in r:
            print(f"{r['case']:<{width}}  {r['reqs']:>4}  {r['error']}")
            continue
        steps = "same" if r["diff"] is None else f"differ from step {r['diff']}"
        stuck = "; stuck: " + " and ".join(w for w, s in zip(("ours", "SGLang"), r["stuck"]) if s)
        print(f"{r['case']:<{width}}  {r['reqs']:>4}  {r['hits']:>5}  {'%d/%d' % r['prefill']:>11}"
              f"  {'%d/%d' % r['decode']:>10}  {'%d/%d' % r['retract']:>11}  {steps}"
              f"{stuck if any(r['stuck']) else ''}")


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
