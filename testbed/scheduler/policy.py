"""Queue policies: in which order waiting requests are considered for the next prefill batch.

- ``fcfs``: submission order;
- ``lpm``: longest cached prefix first (SGLang's longest-prefix-match), FCFS among equals; falls
  back to FCFS when more than ``lpm_fallback_threshold`` requests wait (matching all is too slow);
- ``dfs_weight``: SGLang's DFS-weight order over the radix tree: at each node, visit the child
  subtrees holding more waiting requests first, then the requests whose match ends at the node;
- ``random``: a seeded shuffle; ``lof``: longest output first.

The order is applied to the queue in place and persists, as in SGLang, where
``SchedulePolicy.calc_priority`` sorts ``waiting_queue`` itself (a stable sort): ties keep the
order of the previous step, new and retracted requests join at the end, and when LPM falls back
to FCFS the queue is simply not re-sorted.

LPM also applies SGLang's in-batch prefix caching (``_compute_prefix_matches`` in SGLang 0.4.10's
``managers/schedule_policy.py``): a request with at most ``check_threshold`` tokens cached whose
prefix shares at least ``deprioritize_threshold`` tokens with an earlier waiting request is
deprioritized: sorted to the end of this step's order (``_sort_by_longest_prefix`` gives it key
+inf), not skipped. DFS-weight computes the same set in SGLang but never uses it, so it defers
nothing here. ``in_batch_hold=True`` (beyond SGLang) holds deprioritized requests out of the step
instead, so that they hit the shared prefix in the next one, which is what SGLang's code comment
says the rule intends. ``lpm_aging`` (beyond SGLang; 0 = SGLang) adds that many tokens to a
request's LPM key per second it has waited, so cache-cold requests are not starved under load.
A policy that needs a capability the cache lacks degrades to FCFS (lpm with ``cache=none``;
dfs_weight without a radix tree).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.cache.pool import SLOT_DTYPE
from testbed.cache.radix import RadixCache, TreeNode
from testbed.registry import Registry
from testbed.scheduler.request_state import Req

QUEUE_POLICIES = Registry("scheduler", methods=("order",), what="a queue policy",
                          context_keys=("cache", "rng"))


@dataclass
class Ordering:
    queue: list[Req]  # in the order to try (deprioritized requests last)
    deferred: set[int] = field(default_factory=set)  # id()s of the deprioritized requests
    held: bool = False  # whether the deferred sit this step out (``in_batch_hold``)


class QueuePolicy:
    """The interface of a queue policy, and FCFS: ``order(waiting, now)`` returns the order in
    which to try the waiting requests (the queue as it stands, ties kept in its order; ``now`` is
    the scheduler's clock). A policy may read the ``cache`` it is built with (look-ups only:
    `PrefixCache.match`), never change it."""

    name = "fcfs"

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def effective(self, num_waiting: int) -> str:
        """The policy actually applied with this many requests waiting."""
        return self.name

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        return Ordering(list(waiting))


@QUEUE_POLICIES.register("fcfs")
class FCFS(QueuePolicy):
    """Submission order."""


@QUEUE_POLICIES.register("lpm")
class LongestPrefixMatch(QueuePolicy):
    """Longest cached prefix first, with in-batch prefix caching and the FCFS fallback (module
    docstring)."""

    name = "lpm"

    def __init__(self, cache: PrefixCache, lpm_fallback_threshold: int = 128,
                 in_batch_prefix_caching: bool = True, in_batch_check_threshold: int = 32,
                 in_batch_deprioritize_threshold: int = 32, in_batch_hold: bool = False,
                 lpm_aging: float = 0.0) -> None:
        super().__init__(cache)
        self.lpm_fallback_threshold = lpm_fallback_threshold
        self.in_batch = in_batch_prefix_caching and cache.name != "none"
        self.check_threshold = in_batch_check_threshold
        self.deprioritize_threshold = in_batch_deprioritize_threshold
        self.in_batch_hold = in_batch_hold
        self.lpm_aging = lpm_aging

    def effective(self, num_waiting: int) -> str:
        if self.cache.name == "none" or num_waiting > self.lpm_fallback_threshold:
            return "fcfs"
        return self.name

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        queue = list(waiting)
        if self.effective(len(queue)) == "fcfs":
            return Ordering(queue)
        # a look-up of every waiting request (recency only; see PrefixCache.match)
        hits = [self.cache.match(r.fill(), limit=r.fill_len - 1, requester=r.requester)
                for r in queue]
        deferred = self._in_batch_deferrals(queue, hits)
        aging = self.lpm_aging

        def key(i: int) -> float:
            if id(queue[i]) in deferred:
                return math.inf
            return -(hits[i] + aging * (now - queue[i].submitted_s)) if aging else -hits[i]

        order = sorted(range(len(queue)), key=key)
        return Ordering([queue[i] for i in order], deferred, held=self.in_batch_hold)

    def _in_batch_deferrals(self, reqs: list[Req], hits: list[int]) -> set[int]:
        if not self.in_batch:
            return set()
        pending = RadixCache(capacity=None)  # prefixes earlier waiting requests will compute
        deferred = set()
        for req, hit in zip(reqs, hits):
            if hit > self.check_threshold:
                continue
            key = req.fill()[: req.fill_len - 1]
            shared, _, _ = pending.match_prefix(key)
            if shared >= self.deprioritize_threshold:
                deferred.add(id(req))
            else:
                pending.insert(key, np.zeros(len(key), dtype=SLOT_DTYPE))
        return deferred


@QUEUE_POLICIES.register("dfs_weight")
class DFSWeight(QueuePolicy):
    """SGLang's DFS-weight order over the radix tree (`dfs_weight_order`); FCFS without one."""

    name = "dfs_weight"

    def effective(self, num_waiting: int) -> str:
        return self.name if isinstance(self.cache, RadixCache) else "fcfs"

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if self.effective(len(waiting)) == "fcfs":
            return Ordering(list(waiting))
        last_nodes = [self.cache.match_prefix(r.fill()[: r.fill_len - 1], lookup=True)[1]
                      for r in waiting]
        return Ordering(dfs_weight_order(self.cache.root, list(waiting), last_nodes))


@QUEUE_POLICIES.register("random")
class RandomOrder(QueuePolicy):
    """A seeded shuffle at every step."""

    name = "random"

    def __init__(self, cache: PrefixCache, rng: np.random.Generator) -> None:
        super().__init__(cache)
        self.rng = rng

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        return Ordering([waiting[i] for i in self.rng.permutation(len(waiting))])


@QUEUE_POLICIES.register("lof")
class LongestOutputFirst(QueuePolicy):
    """Largest ``max_new_tokens`` first (SGLang's ``lof`` sorts by it, however many are out)."""

    name = "lof"

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        return Ordering(sorted(waiting, key=lambda r: -r.max_new_tokens))


def dfs_weight_order(root: TreeNode, reqs: list[Req], last_nodes: list[TreeNode]) -> list[Req]:
    """SGLang's DFS-weight order: a node's weight is the number of waiting requests whose match
    ends in its subtree; children are visited heaviest first (ties in tree order), and a node's
    own requests follow its subtrees. Only nodes on some request's path are visited."""
    at_node: dict[int, list[Req]] = {}
    weight: dict[int, int] = {}
    for req, node in zip(reqs, last_nodes):
        at_node.setdefault(node.id, []).append(req)
        while node is not None:
            weight[node.id] = weight.get(node.id, 0) + 1
            node = node.parent
    out: list[Req] = []
    stack: list[tuple[TreeNode, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            out += at_node.get(node.id, [])
            continue
        stack.append((node, True))
        children = [c for c in node.children.values() if c.id in weight]
        children.sort(key=lambda c: -weight[c.id])
        stack += [(c, False) for c in reversed(children)]
    return out
