"""The `PrefixCache` interface every cache implements, and the `Lease` a request holds on it.

A request's life in any cache, in the replay backend and (later) in the scheduler alike:

1. ``lease = cache.acquire(prompt)`` — find the longest cached prefix (``lease.hit`` tokens) and
   protect it from eviction while the request runs;
2. ``evicted = cache.extend(lease, n)`` — make room for ``n`` more tokens of KV, evicting if needed;
   returns the tokens evicted, or ``None`` when even evicting everything unprotected is not enough;
3. ``cache.release(lease, tokens)`` — offer the request's sequence to the cache (``insert=False``
   just frees it), give back duplicate or unused slots, and lift the protection.

How each step is carried out — tree walk and LRU leaves, hashed blocks and a free queue, or nothing
at all — is the cache's business. Callers only see hit lengths, evicted counts and slot ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from testbed.cache.pool import SLOT_DTYPE

EMPTY_SLOTS = np.zeros(0, dtype=SLOT_DTYPE)


@dataclass
class Lease:
    """A running request's hold on the cache.

    ``hit`` tokens of the prompt were found cached; ``slots`` are the KV slots of the request's
    sequence so far (cached prefix first, then what ``extend`` added); ``handle`` is the cache's own
    marker of what it protects (a tree node, a list of blocks).
    """

    hit: int
    handle: Any = None
    slots: np.ndarray = field(default_factory=lambda: EMPTY_SLOTS)

    @property
    def num_tokens(self) -> int:
        """Tokens of KV this lease covers (cached prefix plus extensions)."""
        return len(self.slots)


@dataclass(frozen=True)
class Released:
    """What `PrefixCache.release` did: whether the sequence is now cached, and how much of it was
    already there (those tokens' fresh slots were duplicates and went back to the pool)."""

    inserted: bool
    already_cached: int


class PrefixCache(ABC):
    """A KV cache that can share prompt prefixes across requests."""

    #: the config name (``cache=NAME``)
    name: str = ""

    @abstractmethod
    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever be held, with nothing else protected."""

    @abstractmethod
    def match(self, tokens: np.ndarray) -> int:
        """Length of the longest cached prefix of ``tokens`` usable as a hit (no protection taken).

        Like SGLang's ``match_prefix`` this counts as an access (it refreshes recency)."""

    @abstractmethod
    def acquire(self, prompt: np.ndarray) -> Lease:
        """Match ``prompt`` and protect the matched prefix until `release`."""

    @abstractmethod
    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        """Add ``num_tokens`` slots to the lease, evicting as needed. Returns the number of tokens
        evicted, or None (having changed nothing) if even evicting every unprotected token would
        not make the room."""

    @abstractmethod
    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        """End the lease. With ``insert`` the cache keeps ``tokens`` (the lease's sequence, whose
        length must equal ``lease.num_tokens``); otherwise the slots the lease added are freed
        (the matched prefix stays cached) and ``tokens`` is ignored."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of unprotected cached KV if possible; returns tokens freed."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no running request protects."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens some running request protects."""

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @abstractmethod
    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        """Raise AssertionError unless the cache's bookkeeping is consistent; ``leases`` are the
        running requests, whose slots must be disjoint from the cache's and the free list's."""
