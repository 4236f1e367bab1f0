"""What the tiered radix cache (`testbed.cache.tiers`) keeps besides the tree: per node, its
lower-tier copies and children counts; per lower tier, a slot pool and policy; the log of copies.
(`TieredRadixCache.check_invariants` checks that all of it agrees with the tree.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from testbed.cache.eviction import EvictionPolicy
from testbed.cache.pool import KVSlotPool

GPU = 0
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


@dataclass(frozen=True)
class Transfer:
    """Copy the KV in ``src_slots`` of tier ``src`` into ``dst_slots`` of tier ``dst`` (0: GPU)."""

    src: int
    src_slots: np.ndarray
    dst: int
    dst_slots: np.ndarray


class TierState:
    """A node's lower-tier side: its copies, and how many of its children have each top tier."""

    __slots__ = ("copies", "kids")

    def __init__(self, ntiers: int) -> None:
        self.copies: list[np.ndarray | None] = [None] * ntiers  # index 0 unused: GPU is node.slots
        self.kids = [0] * ntiers


class LowerTier:
    """A tier below the GPU: its slot pool (in the GPU's pages, as SGLang's host pool) and
    eviction policy (its candidate heap is `testbed.cache.tier_eviction.TierEviction`'s)."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy, page_size: int = 1) -> None:
        self.name = name
        self.pool = KVSlotPool(capacity, page_size)
        self.policy = policy
