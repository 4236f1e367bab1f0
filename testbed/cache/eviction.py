"""Eviction policies: which unprotected cached entry goes first.

A policy maps an entry's statistics to a priority key; the cache evicts the smallest key first.
The cache owns the data structure (a lazily-invalidated heap of candidates) and re-asks the policy
whenever an entry's statistics change, so policy code never lives inside the tree. Policies with
state of their own (an aging clock, reuse statistics, the future) learn about accesses, creations,
hits and evictions through the hooks of `EvictionPolicy` (and ``on_split``, optional: a radix node
was cut in two, so that history kept per entry id can follow; docs/design.md §4). `EVICTION` builds
the one the ``eviction`` config group names (a built-in, or ``eviction=custom
eviction.target=module.Class``: any class with `EvictionPolicy`'s methods; docs/extending.md).

Keys are computed when an entry is (re)offered; a policy whose key drifts with global state (GDSF's
clock, the workload-aware estimator) sees it applied to an entry at its next offer, as in the usual
heap-based implementations of those policies.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Protocol

from testbed.errors import BadInput, check_choice
from testbed.config.registry import Registry


class Requester(NamedTuple):
    """Who is using the cache right now: what policies may know of a request. (A named tuple:
    replay makes one per request, and a frozen dataclass costs three times as much to build.)"""

    request_id: str | None = None
    priority: int = 0  # lower is more urgent
    category: str | None = None  # e.g. a trace's request type and turn


class EntryStats(Protocol):
    """What a cache maintains per entry (a radix node, a block) for policies to read."""

    id: int
    last_access: int  # logical clock of the latest access; unique per access
    access_count: int  # creation counts one, each hit one more
    hits: int  # SGLang 0.5.23's ``hit_count``: inserts passing the entry (the creating one too)
    created: int  # logical clock at creation
    start: int  # tokens before the entry on its sequence (its depth)
    size: int  # tokens in the entry
    history: int  # T-LRU: the deepest sequence (in tokens) ever cached through the entry
    priority: int  # the most urgent priority of the requests that used it
    category: str | None  # the category of the request that created it


class EvictionPolicy:
    """Base policy: LRU. Subclasses override `priority` and the hooks they need."""

    name = "lru"
    # Whether priority() also reads state of the policy that changes as entries come and go
    # (GDSF's aging clock, the workload-aware estimates): a queued entry then keeps the value it
    # had when it was queued, as those algorithms specify, and a recomputed one may differ.
    priority_drifts = False
    needs_history = False  # whether the cache must keep `EntryStats.history` (T-LRU)

    def priority(self, entry: EntryStats) -> Any:
        return entry.last_access

    def on_access(self, requester: Requester | None) -> None:
        """A request starts using the cache (before its match)."""

    def on_create(self, entry: EntryStats) -> None:
        """A new entry was cached."""

    def on_hit(self, entry: EntryStats) -> None:
        """An entry was hit by a match."""

    def on_evict(self, entry: EntryStats, key: Any) -> None:
        """An entry was evicted with this key."""

    def on_split(self, head: EntryStats, tail: EntryStats) -> None:
        """A radix node was cut in two: ``head`` (a new entry, a new id) took its first tokens,
        ``tail`` (the same entry as before, its id kept) the rest. The tree has copied what SGLang's
        ``_split_node`` copies (hits, priority) and more (``access_count``, ``history``,
        ``category``) to the head; history a policy keeps by entry id is its own to share.
        Optional: the tree calls it only on policies that define it. Under SGLang 0.5.23's
        checkpoint insert every finished request's leaf is cut at its prompt's end by an insert
        walk, which calls no other hook."""

    def path_key_needed(self) -> bool:
        """Whether the cache must tell the policy the tokens leading into an entry (oracle)."""
        return False


def queued_as_valued(policy: EvictionPolicy, queued: dict[int, Any], entry: EntryStats) -> bool:
    """Invariant checks: whether an evictable entry is queued (``queued``: entry id -> the
    priority it was queued with) at the priority the policy gives it now, or at all where the
    policy's priorities drift (`EvictionPolicy.priority_drifts`)."""
    if getattr(policy, "priority_drifts", False):
        return entry.id in queued
    return queued.get(entry.id) == policy.priority(entry)


class LRU(EvictionPolicy):
    """Least recently used first (SGLang's default)."""

    name = "lru"


class FIFO(EvictionPolicy):
    """Oldest entry first, however often it was used."""

    name = "fifo"

    def priority(self, entry: EntryStats) -> Any:
        return (entry.created, entry.id)


HIT_COUNTS = ("insert", "match", "none")


def check_hits(hits: str) -> str:
    check_choice("eviction.hits", hits, HIT_COUNTS)
    return hits


def hit_count(entry: EntryStats, hits: str) -> int:
    """The hit count a frequency policy reads, per ``eviction.hits``: ``insert`` SGLang 0.5.23's
    (``TreeNode.hit_count``: each insert walking through the entry, the one creating it
    included, except over what the same request inserted before), ``match`` this project's
    earlier count (creation one, each non-look-up match one more), ``none`` SGLang 0.4.10's
    (never incremented, so its LFU was LRU; SGLang PR 18843)."""
    if hits == "insert":
        return entry.hits
    return entry.access_count if hits == "match" else 0


class FILO(EvictionPolicy):
    """Newest entry first, however often it was used (SGLang 0.5.23's ``FILOStrategy``)."""

    name = "filo"

    def priority(self, entry: EntryStats) -> Any:
        return (-entry.created, -entry.id)


class LFU(EvictionPolicy):
    """Fewest hits first; ties by LRU (SGLang 0.5.23's ``LFUStrategy``; ``hits``: which count,
    `hit_count`)."""

    name = "lfu"

    def __init__(self, hits: str = "insert") -> None:
        self.hits = check_hits(hits)

    def priority(self, entry: EntryStats) -> Any:
        return (hit_count(entry, self.hits), entry.last_access)


class MRU(EvictionPolicy):
    """Most recently used first (good for scans larger than the cache)."""

    name = "mru"

    def priority(self, entry: EntryStats) -> Any:
        return -entry.last_access


class SLRU(EvictionPolicy):
    """Segmented LRU (SGLang 0.5.23's ``SLRUStrategy``): entries hit fewer than
    ``protected_threshold`` times (probation) go before the others (protected); LRU within each
    segment. With the default ``hits=insert`` and threshold 2, an entry is protected once a second
    request's insert walked through it."""

    name = "slru"

    def __init__(self, protected_threshold: int = 2, hits: str = "insert") -> None:
        if protected_threshold < 0:
            raise BadInput(f"eviction.protected_threshold must be >= 0, got {protected_threshold}")
        self.protected_threshold = protected_threshold
        self.hits = check_hits(hits)

    def priority(self, entry: EntryStats) -> Any:
        return (hit_count(entry, self.hits) >= self.protected_threshold, entry.last_access)


class TLRU(EvictionPolicy):
    """Tail-optimized LRU (Zhang et al., arXiv:2510.15152; SGLang 0.5.23's ``TLRUStrategy``).
    A conversation whose history reached L tokens and whose next prompt adds about
    ``next_prompt_estimate`` (Q) needs only its first L + Q - ``threshold`` tokens cached to keep
    its next prefill within the budget ``threshold`` (tokens); an entry lying wholly past that
    point (its ``start`` at least the budget) cannot help the tail and goes first, then LRU. L is
    the entry's ``history``, which the tree raises along the path whenever a deeper sequence is
    cached under it and never lowers (so a trimmed conversation is not walked down to nothing)."""

    name = "tlru"
    needs_history = True  # the tree keeps `EntryStats.history` only for policies that ask

    def __init__(self, threshold: int = 0, next_prompt_estimate: int = 0) -> None:
        for key, value in (("threshold", threshold), ("next_prompt_estimate", next_prompt_estimate)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadInput(f"eviction.{key} must be an integer >= 0 (tokens), got {value!r}")
        self.threshold = threshold
        self.next_prompt_estimate = next_prompt_estimate

    def priority(self, entry: EntryStats) -> Any:
        budget = max(entry.history + self.next_prompt_estimate - self.threshold, 0)
        return (-1 if entry.start >= budget else 0, entry.last_access)


class SizeAware(EvictionPolicy):
    """Hits per token (SGLang PR 30300's ``hpt``, "size-aware" eviction): key ``(hits + 1) /
    size``, smallest first, so among entries hit about as often the largest goes first and one
    eviction frees more KV; ties by LRU (SGLang's heap compares ``(priority, node)`` and a node
    orders by its last access). ``hits`` as LFU's (`hit_count`): 0.5.23's insert count by
    default. A split or a page trim changes ``size``, and the tree re-offers the entry."""

    name = "size_aware"

    def __init__(self, hits: str = "insert") -> None:
        self.hits = check_hits(hits)

    def priority(self, entry: EntryStats) -> Any:
        return ((hit_count(entry, self.hits) + 1) / max(entry.size, 1), entry.last_access)


class WLFU(EvictionPolicy):
    """LRU with a frequency age penalty (SGLang PR 23781's ``wlfu``): key ``last_access − alpha ×
    log1p(hits)``, smallest first, so of two entries last used at the same time the one hit more
    often goes first (a prefix that has served many requests makes room for newer ones); ties by
    LRU. ``alpha`` 0 is LRU. SGLang's ``last_access_time`` is seconds of ``time.monotonic``, ours
    the cache's logical clock (one tick per node a walk touches), so ``alpha`` is in ticks here;
    the PR's default is 2.0 (seconds)."""

    name = "wlfu"

    def __init__(self, alpha: float = 2.0, hits: str = "insert") -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha < 0:
            raise BadInput(f"eviction.alpha must be a number >= 0, got {alpha!r}")
        self.alpha = float(alpha)
        self.hits = check_hits(hits)

    def priority(self, entry: EntryStats) -> Any:
        return (entry.last_access - self.alpha * math.log1p(hit_count(entry, self.hits)),
                entry.last_access)


class PriorityLRU(EvictionPolicy):
    """Entries used only by less urgent requests go first (larger priority value); then LRU."""

    name = "priority"

    def priority(self, entry: EntryStats) -> Any:
        return (-entry.priority, entry.last_access)


class GDSF(EvictionPolicy):
    """Greedy-Dual-Size-Frequency: value = L + frequency × recompute cost / size, lowest first;
    L (the aging clock) becomes the value of each evicted entry. The recompute cost of an entry is
    the time to prefill its tokens on top of its prefix (``cost_fn(start, size)``), so deep entries,
    whose attention spans a long prefix, are costlier per token."""

    name = "gdsf"
    priority_drifts = True  # the clock L at the time an entry was valued

    def __init__(self, cost_fn: Callable[[int, int], float] | None = None) -> None:
        self.cost_fn = cost_fn or (lambda start, size: size * (1.0 + start / 4096.0))
        self.clock = 0.0

    def priority(self, entry: EntryStats) -> Any:
        value = entry.access_count * self.cost_fn(entry.start, entry.size) / max(entry.size, 1)
        return (self.clock + value, entry.last_access)

    def on_evict(self, entry: EntryStats, key: Any) -> None:
        self.clock = max(self.clock, key[0])


class WorkloadAware(EvictionPolicy):
    """Reuse-probability-weighted recency, after "KVCache Cache in the Wild" (ATC'25): per request
    category, estimate the probability that a newly cached entry is hit again (Laplace-smoothed
    hits over creations); evict the lowest ``log p(category) + last_access / tau`` first. Entries of
    requests without a category are ranked by recency alone (so a trace without categories gets
    LRU); ``tau`` (in accesses) trades the estimate against recency."""

    name = "workload_aware"
    priority_drifts = True  # the reuse estimate at the time an entry was queued

    def __init__(self, tau: float = 20000.0) -> None:
        if tau <= 0:
            raise BadInput(f"eviction.tau must be > 0, got {tau}")
        self.tau = tau
        self.created: dict[str | None, int] = {}
        self.reused: dict[str | None, int] = {}
        self._hit_ids: set[int] = set()

    def reuse_probability(self, category: str | None) -> float:
        return (self.reused.get(category, 0) + 1) / (self.created.get(category, 0) + 2)

    def priority(self, entry: EntryStats) -> Any:
        if entry.category is None:  # nothing to estimate by: recency alone
            return (entry.last_access / self.tau, entry.last_access)
        return (math.log(self.reuse_probability(entry.category)) + entry.last_access / self.tau,
                entry.last_access)

    def on_create(self, entry: EntryStats) -> None:
        self.created[entry.category] = self.created.get(entry.category, 0) + 1

    def on_hit(self, entry: EntryStats) -> None:
        if entry.id not in self._hit_ids:
            self._hit_ids.add(entry.id)
            self.reused[entry.category] = self.reused.get(entry.category, 0) + 1


EVICTION = Registry("eviction", methods=("priority", "on_access", "on_create", "on_hit", "on_evict"),
                    context_keys=("requests", "cost_fn"), what="an eviction policy")
for _policy in (LRU, FIFO, FILO, LFU, MRU, SLRU, TLRU, SizeAware, WLFU, PriorityLRU, GDSF,
                WorkloadAware):
    EVICTION.register(_policy.name, _policy)
# "oracle" registers in testbed/cache/oracle.py: it is built from the whole workload (``requests``)
# scikit-learn is imported only when a run chooses it (testbed/cache/learned.py)
EVICTION.register("learned", "testbed.cache.learned:LearnedEviction")
