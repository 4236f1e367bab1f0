"""Queue order against SGLang 0.5.23's own ``SchedulePolicy.calc_priority`` (``--sglang 0.5.23``).

The random trees and queues of `experiments.validation.sglang_cases.random_instance` (1-40 requests,
some 129-160 to cross the FCFS fallback at 128), inserted into 0.5.23's RadixCache and ours in
the same order. Each waiting request also gets a random number of prefill tokens that had run when
it entered the queue (``arrival_processed_tokens``; ties frequent, as among a burst of arrivals)
and a random priority and entry time. Compared per queue, for ``lpm``, ``dfs-weight``, ``hrrn``
and ``fcfs`` with ``--enable-priority-scheduling`` (our priorities are lower-is-more-urgent, so
theirs run with ``schedule_low_priority_values_first``): the order, the deprioritized set
(in-batch prefix caching; SGLang keys it by rid), and every request's matched prefix
(``num_matched_prefix_tokens`` against ours) -- and after the sort, the trees' recency (the
eviction order of a copy of each), which the queue's look-ups and 0.5.23's waiting-prefix refresh
change.
"""

from __future__ import annotations

from array import array
from collections import Counter
from types import SimpleNamespace

import numpy as np

from experiments.validation.sglang.cases import assembled, random_instance
from testbed.scheduler.request_state import Req
from testbed.workloads.request import TOKEN_DTYPE, Request

POLICIES = {"lpm": "lpm", "dfs_weight": "dfs-weight", "hrrn": "hrrn", "fcfs_priority": "fcfs"}


class SglReq523:
    """Stand-in for 0.5.23's ``schedule_batch.Req``: what ``calc_priority`` and
    ``match_kv_cache`` read and write, for a waiting request without logprobs."""

    def __init__(self, rid: str, prompt: list[int], arrival_tokens: int, priority: int,
                 entered: float) -> None:
        self.rid = rid
        self.origin_input_ids = array("q", prompt)
        self.output_ids = array("q")
        self.extra_key = self.cache_salt = None
        self.priority = priority
        self.arrival_processed_tokens = arrival_tokens
        self.time_stats = SimpleNamespace(wait_queue_entry_time=entered)
        self.sampling_params = SimpleNamespace(max_new_tokens=1)
        self.kv = SimpleNamespace(cache_protected_len=0)
        self.prefix_len = self.num_matched_prefix_tokens = self.host_hit_length = 0
        self.last_node = None

    def _compute_max_prefix_len(self, input_len: int) -> int:
        return input_len - 1  # Req._compute_max_prefix_len without logprobs or dLLM


def their_tree(sgl, tree: list[list[int]]):
    cache = sgl.radix.RadixCache.create_simulated()
    for seq in tree:
        cache.insert(sgl.base.InsertParams(key=sgl.radix.RadixKey(array("q", seq))))
    return cache


def our_tree(policy: str, tree: list[list[int]]):
    run = assembled("fcfs" if policy == "fcfs_priority" else policy, release="0.5.23")
    cache = run.build_cache(None, [])  # unlimited
    for seq in tree:
        arr = np.asarray(seq, dtype=TOKEN_DTYPE)
        lease = cache.acquire(arr)
        cache.extend(lease, len(arr) - lease.hit)
        cache.release(lease, arr, insert=True)
    return run, cache


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


def order_once(sgl, policy: str, tree: list[list[int]], prompts: list[list[int]],
               rng: np.random.Generator, calls: int) -> dict[str, bool]:
    """One queue through 0.5.23's policy and ours; ``calls`` orders in a row (the refresh of
    waiting prefixes runs on the first and every 32nd)."""
    processed = int(rng.integers(0, 5000))
    arrivals = rng.choice([0, processed // 2, processed], len(prompts)).tolist() \
        if rng.random() < 0.5 else rng.integers(0, processed + 1, len(prompts)).tolist()
    priorities = rng.integers(-2, 3, len(prompts)).tolist()
    entered = rng.integers(0, 4, len(prompts)).astype(float).tolist()
    theirs = their_tree(sgl, tree)
    sgl_policy = sgl.policy.SchedulePolicy(POLICIES[policy], theirs, False,
                                           policy == "fcfs_priority", True)
    deprioritized: set[str] = set()
    compute = sgl_policy._compute_prefix_matches  # wrapped to note its result, not changed

    def noting(queue, p):
        out = compute(queue, p)
        deprioritized.update(out if p.value in ("lpm", "hrrn") else ())  # dfs-weight ignores it
        return out
    sgl_policy._compute_prefix_matches = noting
    sgl_queue = [SglReq523(f"r{i}", p, a, pr, t)
                 for i, (p, a, pr, t) in enumerate(zip(prompts, arrivals, priorities, entered))]
    run, ours = our_tree(policy, tree)
    settings = run.scheduler.settings() | {"enable_priority_scheduling": policy == "fcfs_priority"}
    ours_policy = run.scheduler.queue_policy().build(cache=ours, rng=np.random.default_rng(0),
                                                     **settings)
    ours_policy.processed_tokens = processed
    reqs = [Req(request=Request(f"r{i}", np.asarray(p, dtype=TOKEN_DTYPE),
                                np.zeros(1, dtype=TOKEN_DTYPE), priority=pr),
                prompt=np.asarray(p, dtype=TOKEN_DTYPE), submitted_s=0.0, seq=i, queued_s=t,
                queued_tokens=a)
            for i, (p, a, pr, t) in enumerate(zip(prompts, arrivals, priorities, entered))]
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
    return {"order": same, "hits": hits, "recency": recency}


def check_queues(sgl, trials: int, seed: int, show: int) -> dict[str, Counter]:
    rng = np.random.default_rng(seed)
    stats = {p: Counter() for p in POLICIES}
    shown = 0
    for _ in range(trials):
        tree, prompts = random_instance(rng)
        calls = 33 if rng.random() < 0.05 else 1
        for policy, c in stats.items():
            agree = order_once(sgl, policy, tree, prompts, rng, calls)
            ok = all(agree.values())
            c.update(queues=1, agree=ok, big=len(prompts) > 128,
                     big_agree=len(prompts) > 128 and ok,
                     **{f"{k}_differ": not v for k, v in agree.items()})
            if not ok and shown < show:
                shown += 1
                print(f"  {policy}, {len(prompts)} waiting: "
                      + ", ".join(k for k, v in agree.items() if not v) + " differ")
    return stats


def print_queues(stats: dict[str, Counter]) -> None:
    for policy, c in stats.items():
        print(f"  {policy:<13} agree {c['agree']}/{c['queues']} (over 128 waiting: "
              f"{c['big_agree']}/{c['big']}); order or deprioritized set differ "
              f"{c['order_differ']}, a matched prefix {c['hits_differ']}, the trees' recency "
              f"{c['recency_differ']}")
