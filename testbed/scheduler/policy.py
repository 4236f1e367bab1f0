"""Queue policies: in which order waiting requests are considered for the next prefill batch.

- ``fcfs``: submission order;
- ``lpm``: longest cached prefix first (SGLang's longest-prefix-match), FCFS among equals; falls
  back to FCFS when more than ``lpm_fallback_threshold`` requests wait (matching all is too slow);
- ``dfs_weight``: SGLang's DFS-weight order over the radix tree: at each node, visit the child
  subtrees holding more waiting requests first, then the requests whose match ends at the node;
- ``hrrn``: SGLang 0.5.23's highest response ratio next with token-based aging: the most prefill
  tokens processed since the request (re)entered the queue per uncached prompt token first, ties
  (and every new arrival, which has waited 0 tokens) by request id as a string;
- ``random``: a seeded shuffle; ``lof``: longest output first.

``sglang`` picks the release whose rules apply where they differ (docs/design.md §4): under
``0.5.23`` (the default) the queue's cache match is over the whole fill (its key capped at the
fill less one token), in-batch prefix caching checks that uncapped match and keeps whole fills in
its tree of waiting prefixes, and a cache-agnostic order (fcfs, lof, random, and LPM or HRRN
fallen back to FCFS) over an LRU radix tree refreshes the recency of the first 128 waiting
requests' prefixes, last first, every 32nd step (``_touch_waiting_prefixes``). Under ``0.4.10``
the match and the in-batch tree stop one token short of the fill, and nothing is refreshed.
``enable_priority_scheduling`` (0.5.23's ``--enable-priority-scheduling``) sorts fcfs (when
configured, not fallen back to) by priority, then time of entering the queue, and lof by priority,
then output length; priorities are this project's (lower is more urgent: SGLang's with
``--schedule-low-priority-values-first``).

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
says the rule intends; a request that shares no token with an earlier waiting request has none to
hit and is not held (with ``in_batch_deprioritize_threshold=0`` SGLang deprioritizes every
request, the first too, so none shares a prefix the step computes: held, the whole queue sat out
and the run stalled). ``lpm_aging`` (beyond SGLang; 0 = SGLang) adds that many tokens to a
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
from testbed.cache.radix import SGLANG_RELEASES, RadixCache, TreeNode  # noqa: F401 (re-exported)
from testbed.cache.token_runs import as_bytes
from testbed.config.registry import Registry
from testbed.scheduler.request_state import Req

QUEUE_POLICIES = Registry("scheduler", methods=("order",), what="a queue policy",
                          context_keys=("cache", "rng"))


@dataclass
class Ordering:
    # in the order to try (deprioritized requests last); the waiting list itself, not a copy,
    # where the order is the queue's own (FCFS: it may hold thousands, ordered every step)
    queue: list[Req]
    deferred: set[int] = field(default_factory=set)  # id()s of the deprioritized requests
    held: bool = False  # whether the deferred sit this step out (``in_batch_hold``)


REFRESH_EVERY = 32  # SGLang 0.5.23's WAITING_PREFIX_REFRESH_INTERVAL (scheduling passes)
REFRESH_FIRST = 128  # ... over this many waiting requests (WAITING_QUEUE_PREFIX_MATCH_MAX)


class QueuePolicy:
    """The interface of a queue policy, and FCFS: ``order(waiting, now)`` returns the order in
    which to try the waiting requests (the queue as it stands, ties kept in its order; ``now`` is
    the scheduler's clock; ``processed_tokens``, set by the scheduler before each call, the prefill
    tokens it has run so far). A policy may read the ``cache`` it is built with (look-ups only:
    `PrefixCache.match`), never change it."""

    name = "fcfs"
    processed_tokens = 0  # the scheduler's counter of prefill tokens run (HRRN's clock)

    def __init__(self, cache: PrefixCache, sglang: str = "0.5.23",
                 enable_priority_scheduling: bool = False) -> None:
        self.cache = cache
        self.sglang = sglang
        self.enable_priority_scheduling = enable_priority_scheduling
        self._refresh_calls = 0
        # SGLang refreshes under --radix-eviction-policy lru only (a user's class: never)
        self._refreshes = (sglang == "0.5.23" and isinstance(cache, RadixCache)
                           and getattr(cache.policy, "name", None) == "lru")
        # the refreshed requests' fills as bytes, kept from one refresh to the next (the head of
        # a long queue changes little in `REFRESH_EVERY` passes; a Mooncake fill is 48 KB)
        self._refresh_keys = FillKeys() if self._refreshes else None

    def effective(self, num_waiting: int) -> str:
        """The policy actually applied with this many requests waiting."""
        return self.name

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if not self.enable_priority_scheduling:
            return self.refreshed(Ordering(waiting))
        queue = sorted(waiting, key=lambda r: (r.request.priority, r.queued_s))
        return self.refreshed(Ordering(queue))

    def refreshed(self, ordering: Ordering) -> Ordering:
        """SGLang 0.5.23's ``_touch_waiting_prefixes`` after a cache-agnostic order over an LRU
        radix tree: every `REFRESH_EVERY`-th such order, the prefixes of the first `REFRESH_FIRST`
        requests are looked up (recency refreshed) from the last to the first, so that LRU
        evicts them in the reverse of the order they will be admitted in."""
        if not self._refreshes or not ordering.queue:
            return ordering
        refresh = self._refresh_calls % REFRESH_EVERY == 0
        self._refresh_calls += 1
        if refresh:
            for kb in reversed(self._refresh_keys(ordering.queue[:REFRESH_FIRST])):
                self.cache.match_bytes(kb)
        return ordering


class FillKeys:
    """Each waiting request's fill as token bytes (the radix tree's keys), kept from one
    ordering to the next while the fill is the same, for the requests of the latest queue only:
    LPM looks up to 128 waiting fills every step, and converting a long prompt each time (48 KB
    for a Mooncake prompt) cost more than the walk."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Req, int, bytes]] = {}

    def __call__(self, queue: list[Req]) -> list[bytes]:
        kept, fresh, out = self._kept, {}, []
        for r in queue:
            key = kept.get(id(r))
            if key is None or key[0] is not r or key[1] != len(r.output):
                key = (r, len(r.output), as_bytes(r.fill()))
            fresh[id(r)] = key
            out.append(key[2])
        self._kept = fresh
        return out


def queue_matches(cache: PrefixCache, queue: list[Req], sglang: str,
                  keys: FillKeys | None = None) -> tuple[list[int], list[int]]:
    """Each waiting request's cache look-up, as the queue's sort sees it: (the policy's key, at
    most the fill less one token; the match the in-batch check reads). SGLang 0.5.23 matches the
    whole fill (``match_kv_cache``) and caps the key (``num_matched_prefix_tokens``); 0.4.10
    matches the fill less one token (``adjust_max_prefix_ids``), both the same then. ``keys``:
    the fills' bytes kept between calls, for a radix cache."""
    old = sglang == "0.4.10"
    if keys is not None and isinstance(cache, RadixCache):
        matched = [cache.match_bytes(kb, r.fill_len - 1 if old else None)
                   for r, kb in zip(queue, keys(queue))]
    else:
        matched = [cache.match(r.fill(), limit=r.fill_len - 1 if old else None,
                               requester=r.requester) for r in queue]
    for r, m in zip(queue, matched):
        r.matched = m  # match_kv_cache sets req.prefix_len (priority preemption reads it)
    if old:
        return matched, matched
    return [min(m, max(r.fill_len - 1, 0)) for m, r in zip(matched, queue)], matched


@QUEUE_POLICIES.register("fcfs")
class FCFS(QueuePolicy):
    """Submission order (with ``enable_priority_scheduling``: priority first)."""


@QUEUE_POLICIES.register("lpm")
class LongestPrefixMatch(QueuePolicy):
    """Longest cached prefix first, with in-batch prefix caching and the FCFS fallback (module
    docstring)."""

    name = "lpm"

    def __init__(self, cache: PrefixCache, lpm_fallback_threshold: int = 128,
                 in_batch_prefix_caching: bool = True, in_batch_check_threshold: int = 32,
                 in_batch_deprioritize_threshold: int = 32, in_batch_hold: bool = False,
                 lpm_aging: float = 0.0, sglang: str = "0.5.23") -> None:
        super().__init__(cache, sglang)
        self.lpm_fallback_threshold = lpm_fallback_threshold
        self.in_batch = in_batch_prefix_caching and cache.name != "none"
        self.check_threshold = in_batch_check_threshold
        self.deprioritize_threshold = in_batch_deprioritize_threshold
        self.in_batch_hold = in_batch_hold
        self.lpm_aging = lpm_aging
        self.keys = FillKeys()

    def effective(self, num_waiting: int) -> str:
        if self.cache.name == "none" or num_waiting > self.lpm_fallback_threshold:
            return "fcfs"
        return self.name

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if self.effective(len(waiting)) == "fcfs":
            return self.refreshed(Ordering(waiting))
        queue = list(waiting)
        # a look-up of every waiting request (recency only; see PrefixCache.match)
        hits, matched = queue_matches(self.cache, queue, self.sglang, self.keys)
        deferred, sharing = self._in_batch_deferrals(queue, matched)
        aging = self.lpm_aging

        def key(i: int) -> float:
            if id(queue[i]) in deferred:
                return math.inf
            return -(hits[i] + aging * (now - queue[i].submitted_s)) if aging else -hits[i]

        order = sorted(range(len(queue)), key=key)
        if self.in_batch_hold:  # held: only those with a prefix to hit in the next step
            return Ordering([queue[i] for i in order], sharing, held=True)
        return Ordering([queue[i] for i in order], deferred)

    def _in_batch_deferrals(self, reqs: list[Req], matched: list[int]
                            ) -> tuple[set[int], set[int]]:
        """The deprioritized requests' ids, and those of them that share at least one token
        with a request of the tree of prefixes the step computes (with
        ``in_batch_deprioritize_threshold=0`` every request is deprioritized, the first too, and
        the tree stays empty: holding them would hold the whole queue)."""
        if not self.in_batch:
            return set(), set()
        pending = RadixCache(capacity=None)  # prefixes earlier waiting requests will compute
        deferred, sharing = set(), set()
        whole = self.sglang != "0.4.10"  # 0.5.23 keeps whole fills in the tree of waiting prefixes
        for req, hit in zip(reqs, matched):
            if hit > self.check_threshold:
                continue
            key = req.fill() if whole else req.fill()[: req.fill_len - 1]
            shared, _, _ = pending.match_prefix(key)
            if shared >= self.deprioritize_threshold:
                deferred.add(id(req))
                if shared > 0:
                    sharing.add(id(req))
            else:
                pending.insert(key, np.zeros(len(key), dtype=SLOT_DTYPE))
        return deferred, sharing


@QUEUE_POLICIES.register("dfs_weight")
class DFSWeight(QueuePolicy):
    """SGLang's DFS-weight order over the radix tree (`dfs_weight_order`); FCFS without one."""

    name = "dfs_weight"

    def effective(self, num_waiting: int) -> str:
        return self.name if isinstance(self.cache, RadixCache) else "fcfs"

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if self.effective(len(waiting)) == "fcfs":
            return Ordering(list(waiting))
        cut = 1 if self.sglang == "0.4.10" else 0  # 0.5.23 matches the whole fill (queue_matches)
        last_nodes = [self.cache.match_prefix(r.fill()[: r.fill_len - cut], lookup=True)[1]
                      for r in waiting]
        return Ordering(dfs_weight_order(self.cache.root, list(waiting), last_nodes))


@QUEUE_POLICIES.register("random")
class RandomOrder(QueuePolicy):
    """A seeded shuffle at every step."""

    name = "random"

    def __init__(self, cache: PrefixCache, rng: np.random.Generator, sglang: str = "0.5.23"
                 ) -> None:
        super().__init__(cache, sglang)
        self.rng = rng

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        return self.refreshed(Ordering([waiting[i] for i in self.rng.permutation(len(waiting))]))


@QUEUE_POLICIES.register("lof")
class LongestOutputFirst(QueuePolicy):
    """Largest ``max_new_tokens`` first (SGLang's ``lof`` sorts by it, however many are out)."""

    name = "lof"

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if self.enable_priority_scheduling:
            queue = sorted(waiting, key=lambda r: (r.request.priority, -r.max_new_tokens))
        else:
            queue = sorted(waiting, key=lambda r: -r.max_new_tokens)
        return self.refreshed(Ordering(queue))


@QUEUE_POLICIES.register("hrrn")
class HighestResponseRatio(LongestPrefixMatch):
    """SGLang 0.5.23's HRRN (``_sort_by_hrrn``): the key of a request is minus the prefill tokens
    the scheduler ran since it entered the queue (``processed_tokens`` less its
    ``Req.queued_tokens``) per prompt token not cached (prompt length less its capped match), then
    its id as a string; a deprioritized request (in-batch prefix caching, as LPM) sorts last, one
    with nothing left to prefill first. It falls back to FCFS as LPM does (more than
    ``lpm_fallback_threshold`` waiting, or no cache). ``in_batch_hold`` and ``lpm_aging`` do not
    apply; the match is 0.5.23's whatever ``sglang`` says (HRRN is not in 0.4.10)."""

    name = "hrrn"

    def __init__(self, cache: PrefixCache, lpm_fallback_threshold: int = 128,
                 in_batch_prefix_caching: bool = True, in_batch_check_threshold: int = 32,
                 in_batch_deprioritize_threshold: int = 32, sglang: str = "0.5.23") -> None:
        super().__init__(cache, lpm_fallback_threshold, in_batch_prefix_caching,
                         in_batch_check_threshold, in_batch_deprioritize_threshold)
        self._refreshes = sglang == "0.5.23" and self._refreshes  # for the FCFS fallback

    def order(self, waiting: list[Req], now: float = 0.0) -> Ordering:
        if self.effective(len(waiting)) == "fcfs":
            return self.refreshed(Ordering(waiting))
        queue = list(waiting)
        hits, matched = queue_matches(self.cache, queue, "0.5.23")
        deferred, _ = self._in_batch_deferrals(queue, matched)
        processed = self.processed_tokens

        def key(i: int) -> tuple[float, str]:
            r = queue[i]
            if id(r) in deferred:
                return (math.inf, r.id)
            uncached = len(r.prompt) - hits[i]
            if uncached <= 0:
                return (-math.inf, r.id)
            return (-max(0, processed - r.queued_tokens) / uncached, r.id)

        order = sorted(range(len(queue)), key=key)
        return Ordering([queue[i] for i in order], deferred)


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
