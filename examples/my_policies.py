"""Policies written outside the package, plugged in by import path (docs/extending.md).

Put this folder on ``PYTHONPATH`` (or run from it: the working directory is on the import path)::

    PYTHONPATH=examples python -m testbed.run backend=replay workload=chat \
        cache.capacity_tokens=4000 eviction=custom eviction.target=my_policies.LRUK +eviction.k=2

- `LRUK`: LRU-K eviction (O'Neil et al., SIGMOD'93): evict the entry whose K-th most recent use is
  oldest; entries used fewer than K times go first, least recently used first. K=1 is LRU.
- `MostRecentlyUsed`: MRU eviction without the package's base class: what the cache calls.
- `LongestOutputFirst`: a queue policy, the largest ``max_new_tokens`` first.
- `Rotate`: a router that sends request i to replica i mod N.

The last three re-implement built-ins (``eviction=mru``, ``scheduler=lof``,
``router=round_robin``); tests/test_extending.py checks that each gives the same run as its
built-in.
"""

from __future__ import annotations

from typing import Any

from testbed.router import Router


class LRUK:
    """LRU-K: the priority of an entry is the time of its K-th most recent use (the cache evicts
    the smallest first); entries used fewer than K times rank below all others, by recency."""

    def __init__(self, k: int = 2) -> None:
        if k < 1:
            raise ValueError(f"eviction.k must be >= 1, got {k}")
        self.k = k
        self.uses: dict[int, list[int]] = {}  # entry id -> its last K use times (logical clock)

    def priority(self, entry: Any) -> Any:
        # uses are what the hooks saw (creations and hits), not every refresh of last_access:
        # SGLang 0.5.23's checkpoint refreshes a request's whole path twice after its insert,
        # which would count as two uses of every new entry (docs/extending.md)
        uses = self.uses.get(entry.id, [])
        kth = uses[-self.k] if len(uses) >= self.k else -1
        return (kth, entry.last_access)

    def on_access(self, requester: Any) -> None:
        pass

    def on_create(self, entry: Any) -> None:
        self.uses[entry.id] = [entry.last_access]

    def on_hit(self, entry: Any) -> None:
        uses = self.uses.setdefault(entry.id, [])
        if not uses or uses[-1] != entry.last_access:
            uses.append(entry.last_access)
            del uses[:-self.k]

    def on_evict(self, entry: Any, key: Any) -> None:
        self.uses.pop(entry.id, None)

    def on_split(self, head: Any, tail: Any) -> None:
        # optional hook: a radix node was cut; the new head shares the entry's uses
        if tail.id in self.uses:
            self.uses[head.id] = list(self.uses[tail.id])


class MostRecentlyUsed:
    """MRU: the most recently used unprotected entry goes first."""

    def priority(self, entry: Any) -> Any:
        return -entry.last_access

    def on_access(self, requester: Any) -> None:
        pass

    def on_create(self, entry: Any) -> None:
        pass

    def on_hit(self, entry: Any) -> None:
        pass

    def on_evict(self, entry: Any, key: Any) -> None:
        pass


class LongestOutputFirst:
    """Waiting requests with the largest ``max_new_tokens`` first (a stable sort: ties keep the
    queue's order)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache  # a policy may look things up in the cache; this one does not

    def order(self, waiting: list, now: float) -> list:
        return sorted(waiting, key=lambda req: -req.max_new_tokens)


class Rotate(Router):
    """Request i to replica i mod N."""

    name = "rotate"

    def bind(self, num_workers: int, caches=()) -> None:
        super().bind(num_workers, caches)
        self.sent = 0

    def _choose(self, tokens, loads, now):
        worker = self.sent % self.num_workers
        self.sent += 1
        return worker, "rotate"
