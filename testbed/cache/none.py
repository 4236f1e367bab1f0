"""`NoCache`: the baseline without prefix sharing. Never hits; a request's KV is freed when it ends."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from testbed.cache.base import EMPTY_SLOTS, Lease, PrefixCache, Released
from testbed.cache.eviction import Requester
from testbed.cache.pool import KVSlotPool


class NoCache(PrefixCache):
    name = "none"

    def __init__(self, capacity: int | None = None, pool: KVSlotPool | None = None) -> None:
        self.pool = pool if pool is not None else KVSlotPool(capacity)

    @property
    def evictable_size(self) -> int:
        return 0

    @property
    def protected_size(self) -> int:
        return 0

    def fits(self, num_tokens: int) -> bool:
        return self.pool.capacity is None or num_tokens <= self.pool.capacity

    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        return 0

    @property
    def available_size(self) -> float:
        return math.inf if self.pool.unbounded else self.pool.num_free

    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        return Lease(hit=0)

    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        if not self.pool.can_alloc(num_tokens):
            return None
        lease.append(self.pool.alloc(num_tokens))
        return 0

    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        self.pool.free(lease.slots)
        lease.reset(EMPTY_SLOTS, 0)
        return Released(inserted=False, already_cached=0)

    def commit(self, lease: Lease, tokens: np.ndarray) -> None:
        """Nothing is shared, so nothing to do."""

    def evict(self, num_tokens: int) -> int:
        return 0

    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        self.pool.check_ownership([lease.slots for lease in leases])
