"""(a) of the SGLang check: queue order against the release's own ``SchedulePolicy.calc_priority``.

Random radix trees and waiting queues (`cases.random_instance`: token runs branching off each
other, 1-40 requests, some 129-160 to cross LPM's FCFS fallback at 128, sharing prefixes with the
tree and with each other) are inserted in the same order into SGLang's RadixCache and ours, so
that child order and DFS-weight ties match. Per queue and policy (`POLICIES`), what is compared
depends on the release (`CHECKS`):

- **0.4.10** (`order_0410`; ``lpm``, ``dfs-weight``, in-batch thresholds 32/32): SGLang's order
  must equal our ``QueuePolicy.order(...).queue``, our deprioritized set (``Ordering.deferred``)
  SGLang's, with nothing held out of the step ("strict"). With ``hold`` (``--in-batch-hold``) our
  policy runs with ``in_batch_hold`` and must hold exactly SGLang's deprioritized requests (LPM
  only; dfs-weight deprioritizes nothing), and the rest, then them in queue order, must be
  SGLang's order ("held-as-deprioritized"). Both readings are counted, and whether our queue
  alone is SGLang's order; and whether the two trees agree on every request's hit.
- **0.5.23** (`order_0523`; also ``hrrn``, and ``fcfs`` with ``--enable-priority-scheduling``):
  each waiting request also gets a random number of prefill tokens that had run when it entered
  the queue (``arrival_processed_tokens``; ties frequent, as among a burst of arrivals) and a
  random priority and entry time (our priorities are lower-is-more-urgent, so theirs run with
  ``schedule_low_priority_values_first``). Compared: the order and the deprioritized set
  (SGLang keys it by rid), over one call or, for some queues, 33 in a row (the refresh of waiting
  prefixes runs on the first and every 32nd); every request's matched prefix
  (``num_matched_prefix_tokens`` against ours); and after the sort the trees' recency (the
  eviction order of a copy of each), which the queue's look-ups and the refresh change.
"""

from __future__ import annotations

from array import array
from collections import Counter
from types import SimpleNamespace

import numpy as np
import torch

from experiments.validation.sglang.cases import assembled, random_instance
from experiments.validation.sglang.stand_ins import REQS
from testbed.scheduler.request_state import Req
from testbed.workloads.request import TOKEN_DTYPE, Request

# Our policy names and SGLang's, per release.
POLICIES = {"0.4.10": {"lpm": "lpm", "dfs_weight": "dfs-weight"},
            "0.5.23": {"lpm": "lpm", "dfs_weight": "dfs-weight", "hrrn": "hrrn",
                       "fcfs_priority": "fcfs"}}
NOTING = {"0.4.10": ("lpm",), "0.5.23": ("lpm", "hrrn")}  # the policies that deprioritize


def our_tree(policy: str, release: str, tree: list[list[int]], **scheduler):
    """Our run config for ``policy`` and an unlimited cache holding ``tree``'s runs."""
    run = assembled(policy, release, **scheduler)
    cache = run.build_cache(None, [])  # unlimited
    for seq in tree:
        arr = np.asarray(seq, dtype=TOKEN_DTYPE)
        lease = cache.acquire(arr)
        cache.extend(lease, len(arr) - lease.hit)
        cache.release(lease, arr, insert=True)
    return run, cache


def their_tree(sgl, tree: list[list[int]]):
    """SGLang's RadixCache holding ``tree``'s runs, as a lone tree is built in each release."""
    if sgl.version == "0.4.10":
        cache = sgl.radix.RadixCache(req_to_token_pool=None, token_to_kv_pool_allocator=None,
                                     page_size=1, disable=False)
        for seq in tree:
            cache.insert(seq, torch.arange(len(seq)))
        return cache
    cache = sgl.radix.RadixCache.create_simulated()
    for seq in tree:
        cache.insert(sgl.base.InsertParams(key=sgl.radix.RadixKey(array("q", seq))))
    return cache


def noting_deprioritized(sgl, sgl_policy) -> set[str]:
    """The set SGLang's ``_compute_prefix_matches`` returns at each call (its deprioritized
    requests), kept up to date by wrapping it (not changed)."""
    deprioritized: set[str] = set()
    compute = sgl_policy._compute_prefix_matches

    def noting(queue, p):
        out = compute(queue, p)
        deprioritized.update(out if p.value in NOTING[sgl.version] else ())
        return out
    sgl_policy._compute_prefix_matches = noting
    return deprioritized


def our_reqs(prompts: list[list[int]], **fields) -> list[Req]:
    """Our waiting requests for ``prompts``; ``fields``: per request, ``priority``,
    ``queued_s``, ``queued_tokens``."""
    out = []
    for i, p in enumerate(prompts):
        each = {k: v[i] for k, v in fields.items()}
        prompt = np.asarray(p, dtype=TOKEN_DTYPE)
        out.append(Req(request=Request(f"r{i}", prompt, np.zeros(1, dtype=TOKEN_DTYPE),
                                       priority=each.pop("priority", 0)),
                       prompt=prompt, submitted_s=0.0, seq=i, **each))
    return out


def order_0410(sgl, policy: str, tree: list[list[int]], prompts: list[list[int]],
               rng: np.random.Generator, hold: bool) -> tuple[bool, dict, str]:
    """One queue through 0.4.10's policy and ours: whether it agrees (strictly, or held as
    deprioritized with ``hold``), the counts of each reading, and the detail to print."""
    theirs = their_tree(sgl, tree)
    run, ours = our_tree(policy, "0.4.10", tree, in_batch_hold=hold)
    sgl_policy = sgl.policy.SchedulePolicy(POLICIES["0.4.10"][policy], theirs, False)
    deprioritized = noting_deprioritized(sgl, sgl_policy)
    sgl_queue = [REQS["0.4.10"](f"r{i}", p, [0]) for i, p in enumerate(prompts)]
    sgl_policy.calc_priority(sgl_queue)
    expected = [r.rid for r in sgl_queue]
    reqs = our_reqs(prompts)
    c = run.scheduler  # its queue policy, built as the Scheduler builds it
    ordering = c.queue_policy().build(cache=ours, rng=np.random.default_rng(0),
                                      **c.settings()).order(reqs)
    deferred = {r.id for r in reqs if id(r) in ordering.deferred}
    got, held = [r.id for r in ordering.queue], deferred if ordering.held else set()
    held_last = [i for i in got if i not in held] + [r.id for r in reqs if r.id in held]
    hits = {r.rid: len(r.prefix_indices) for r in sgl_queue}
    trees = all(ours.match(r.prompt, limit=len(r.prompt) - 1) == hits[r.id] for r in reqs
                if len(prompts) <= 128 or policy == "dfs_weight")  # LPM's FCFS fallback: no match
    agree = {"strict": not held and got == expected and deferred == deprioritized,
             "queue": got == expected, "hold": held == deprioritized and held_last == expected}
    detail = (f"\n    SGLang {' '.join(expected)}\n    ours   {' '.join(got)}\n"
              f"    held   {' '.join(sorted(held))}")
    return (agree["hold" if hold else "strict"],
            {"held": bool(held), "tree_mismatch": not trees,
             **{f"{k}_agree": v for k, v in agree.items()}}, detail)


def order_0523(sgl, policy: str, tree: list[list[int]], prompts: list[list[int]],
               rng: np.random.Generator, calls: int) -> tuple[bool, dict, str]:
    """One queue through 0.5.23's policy and ours, ordered ``calls`` times in a row: whether
    the order, the matched prefixes and the recency all agree, which differ, and the detail."""
    processed = int(rng.integers(0, 5000))
    arrivals = rng.choice([0, processed // 2, processed], len(prompts)).tolist() \
        if rng.random() < 0.5 else rng.integers(0, processed + 1, len(prompts)).tolist()
    priorities = rng.integers(-2, 3, len(prompts)).tolist()
    entered = rng.integers(0, 4, len(prompts)).astype(float).tolist()
    theirs = their_tree(sgl, tree)
    sgl_policy = sgl.policy.SchedulePolicy(POLICIES["0.5.23"][policy], theirs, False,
                                           policy == "fcfs_priority", True)
    deprioritized = noting_deprioritized(sgl, sgl_policy)
    sgl_queue = []
    for i, (p, a, pr, t) in enumerate(zip(prompts, arrivals, priorities, entered)):
        req = REQS["0.5.23"](f"r{i}", p, [0])
        req.arrival_processed_tokens, req.priority = a, pr
        req.time_stats = SimpleNamespace(wait_queue_entry_time=t)
        sgl_queue.append(req)
    run, ours = our_tree("fcfs" if policy == "fcfs_priority" else policy, "0.5.23", tree)
    settings = run.scheduler.settings() | {"enable_priority_scheduling": policy == "fcfs_priority"}
    ours_policy = run.scheduler.queue_policy().build(cache=ours, rng=np.random.default_rng(0),
                                                     **settings)
    ours_policy.processed_tokens = processed
    reqs = our_reqs(prompts, priority=priorities, queued_s=entered, queued_tokens=arrivals)
    same = True
    for _ in range(calls):
        deprioritized.clear()
        sgl_policy.calc_priority(sgl_queue, None, processed_tokens=processed)
        ordering = ours_policy.order(reqs)
        reqs = ordering.queue
        same &= ([r.rid for r in sgl_queue] == [r.id for r in reqs]
                 and {r.id for r in reqs if id(r) in ordering.deferred} == deprioritized)
    recency = their_recency(theirs) == our_recency(ours)  # before the look-ups below
    cache_aware = policy != "fcfs_priority" and (len(prompts) <= 128 or policy == "dfs_weight")
    matched = {r.rid: r.num_matched_prefix_tokens for r in sgl_queue}
    hits = not cache_aware or all(
        min(ours.match(r.fill()), r.fill_len - 1) == matched[r.id] for r in reqs)
    agree = {"order": same, "hits": hits, "recency": recency}
    return (all(agree.values()), {f"{k}_differ": not v for k, v in agree.items()},
            ": " + ", ".join(k for k, v in agree.items() if not v) + " differ")


def their_recency(cache) -> list[tuple[int, ...]]:
    """The order in which LRU would evict 0.5.23's tree to empty (its nodes' paths)."""
    nodes, stack = {}, [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            full = path + tuple(child.key.raw_token_ids())
            nodes[full] = (child.last_access_time, path)
            stack.append((child, full))
    return lru_order(nodes)


def our_recency(cache) -> list[tuple[int, ...]]:
    nodes = {}
    for node in cache.nodes():
        path, x = [], node.parent
        while x is not cache.root:
            path[:0] = x.key.tolist()
            x = x.parent
        nodes[tuple(path) + tuple(node.key.tolist())] = (node.last_access, tuple(path))
    return lru_order(nodes)


def lru_order(nodes: dict[tuple[int, ...], tuple[int, tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """Leaves by least recent access, a parent joining the candidates once its children are
    gone: what the trees' recency means for eviction (a walk gives SGLang's whole path one
    access time, ours one each, which only ancestors and descendants can tell apart)."""
    children = Counter(parent for _, parent in nodes.values())
    out = []
    while len(out) < len(nodes):
        leaf = min((t, p) for p, (t, _) in nodes.items() if not children[p] and p not in out)[1]
        out.append(leaf)
        children[nodes[leaf][1]] -= 1
    return out


# Per release: the header's note, one queue's comparison, the per-trial draw of its options
# and the tail of each policy's line.
CHECKS = {
    "0.4.10": dict(
        note=lambda hold: " (held = deprioritized accepted)" if hold else "",
        order=order_0410, draw=lambda rng, hold: hold,
        tail=lambda c: (f"held something in {c['held']}; strict {c['strict_agree']}, "
                        f"held-as-deprioritized {c['hold_agree']}, queue alone "
                        f"{c['queue_agree']}; trees disagreeing on a hit: {c['tree_mismatch']}")),
    "0.5.23": dict(
        note=lambda hold: (" (order and deprioritized set; matched prefixes; the trees' recency "
                           "after the sort)"),
        order=order_0523, draw=lambda rng, hold: 33 if rng.random() < 0.05 else 1,
        tail=lambda c: (f"order or deprioritized set differ {c['order_differ']}, a matched "
                        f"prefix {c['hits_differ']}, the trees' recency {c['recency_differ']}")),
}


def check_queues(sgl, trials: int, seed: int, show: int, hold: bool = False
                 ) -> dict[str, Counter]:
    """(a): ``trials`` random queues through every policy of the loaded release; per policy,
    the queues and those that agree (over 128 waiting too), and the release's own counts."""
    check = CHECKS[sgl.version]
    rng = np.random.default_rng(seed)
    stats = {p: Counter() for p in POLICIES[sgl.version]}
    shown = 0
    for _ in range(trials):
        tree, prompts = random_instance(rng)
        option = check["draw"](rng, hold)
        big = len(prompts) > 128
        for policy, c in stats.items():
            ok, counts, detail = check["order"](sgl, policy, tree, prompts, rng, option)
            c.update(queues=1, agree=ok, big=big, big_agree=big and ok, **counts)
            if not ok and shown < show:
                shown += 1
                print(f"  {policy}, {len(prompts)} waiting{detail}")
    return stats


def report(sgl, trials: int, seed: int, show: int, hold: bool = False) -> dict[str, Counter]:
    """Run and print (a)."""
    check = CHECKS[sgl.version]
    print(f"(a) queue order, {trials} random queues per policy{check['note'](hold)}")
    stats = check_queues(sgl, trials, seed, show, hold)
    width = max(map(len, stats))
    for policy, c in stats.items():
        print(f"  {policy:<{width}} agree {c['agree']}/{c['queues']} (over 128 waiting: "
              f"{c['big_agree']}/{c['big']}); {check['tail'](c)}")
    return stats
