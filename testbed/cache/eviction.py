"""Eviction policies: which unprotected cached entry goes first.

A policy maps a cache entry's statistics to a priority; the cache evicts the lowest priority first.
The cache owns the data structure (a lazily-invalidated heap of candidates) and re-asks the policy
whenever an entry's statistics change, so policy code never lives inside the tree.
"""

from __future__ import annotations

from typing import Protocol


class EntryStats(Protocol):
    """What a cache maintains per entry (a radix node) for policies to read."""

    last_access: int  # logical clock of the latest access; unique per access
    access_count: int  # accesses since creation (creation counts as one)
    created: int  # logical clock at creation


class EvictionPolicy(Protocol):
    name: str

    def priority(self, entry: EntryStats) -> object:
        """Sort key: the entry with the smallest key is evicted first. Keys must be totally ordered
        and distinct between entries (end with ``last_access`` to break ties deterministically)."""


class LRU:
    """Least recently used first (SGLang's default)."""

    name = "lru"

    def priority(self, entry: EntryStats) -> object:
        return entry.last_access


EVICTION_POLICIES: dict[str, type] = {"lru": LRU}


def make_eviction_policy(name: str) -> EvictionPolicy:
    try:
        return EVICTION_POLICIES[name]()
    except KeyError:
        allowed = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"eviction must be one of {allowed}; got {name!r}") from None
