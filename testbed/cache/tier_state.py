"""What the tiered radix cache (`testbed.cache.tiers`) keeps besides the tree: per node, its
lower-tier copies and children counts; per lower tier, a slot pool, policy and candidate heap; the
log of copies; and the check that all of it agrees with the tree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

import numpy as np

from testbed.cache.base import Lease
from testbed.cache.eviction import EvictionPolicy
from testbed.cache.pool import KVSlotPool

if TYPE_CHECKING:
    from testbed.cache.radix import TreeNode
    from testbed.cache.tiers import TieredRadixCache

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
    """A tier below the GPU: its slot pool (in the GPU's pages, as SGLang's host pool), eviction
    policy and candidate heap."""

    def __init__(self, name: str, capacity: int, policy: EvictionPolicy, page_size: int = 1) -> None:
        self.name = name
        self.pool = KVSlotPool(capacity, page_size)
        self.policy = policy
        self.heap: list[tuple[object, int, int, "TreeNode"]] = []


def check_tiered(cache: TieredRadixCache, leases: Iterable[Lease] = ()) -> None:
    """Raise AssertionError unless the tiered cache is consistent: `RadixCache`'s checks (GPU
    tokens only), plus every node held by some tier, GPU residency prefix-closed, each copy as long
    as its node, each tier's slots owned once, children counts and every tier's heap current."""
    evictable = protected = 0
    owned = [cache._check_lease(lease) for lease in leases]
    lower_owned: list[list[np.ndarray]] = [[] for _ in range(cache.ntiers)]
    heaps = [cache._heap] + [tier.heap for tier in cache.tiers[1:]]
    policies = [cache.policy] + [tier.policy for tier in cache.tiers[1:]]
    current: list[dict[int, object]] = [{} for _ in range(cache.ntiers)]
    for t, heap in enumerate(heaps):
        for e in heap:
            if e[2] == e[3].offer and cache._candidate(e[3], t):
                current[t][e[3].id] = e[0]
    kids: dict[int, list[int]] = {cache.root.id: [0] * cache.ntiers}
    nodes = list(cache.nodes())
    for node in nodes:
        kids[node.id] = [0] * cache.ntiers
    for node in nodes:
        assert node.alive, f"dead node in tree: {node!r}"
        size = len(node.key)
        assert size > 0 and size % cache.page_size == 0, f"bad node size {node!r}"
        assert len(node.slots) in (0, size), f"partly on the GPU: {node!r}"
        cache.pool.assert_whole_pages(node.slots)
        assert node.lock_ref >= 0, f"negative lock: {node!r}"
        assert node.parent is cache.root or node.parent.lock_ref >= node.lock_ref, node
        assert node.start == node.parent.start + len(node.parent.key), f"bad start: {node!r}"
        assert node.parent.children.get(cache._child_key(node.key, 0)) is node, node
        assert not len(node.slots) or node.parent is cache.root or len(node.parent.slots), \
            f"on the GPU under a parent that is not: {node!r}"
        for t in range(1, cache.ntiers):
            copy = node.tier.copies[t]
            if copy is not None:
                assert len(copy) == size, f"{cache.tiers[t].name} copy of {len(copy)}: {node!r}"
                cache.tiers[t].pool.assert_whole_pages(copy)
                lower_owned[t].append(copy)
        top = cache.top(node)
        assert top >= 0, f"held by no tier: {node!r}"
        kids[node.parent.id][top] += 1
        if node.lock_ref:
            protected += len(node.slots)
        else:
            evictable += len(node.slots)
        if cache._candidate(node, top):
            assert current[top].get(node.id) == policies[top].priority(node), \
                f"tier {top} candidate without a current heap entry: {node!r}"
        owned.append(node.slots)
    for node in [cache.root] + nodes:
        assert node.tier.kids == kids[node.id], f"children counts {node.tier.kids} != " \
            f"{kids[node.id]}: {node!r}"
    assert evictable == cache._evictable, f"evictable {cache._evictable} != recount {evictable}"
    assert protected == cache._protected, f"protected {cache._protected} != recount {protected}"
    assert cache._num_nodes == 1 + len(nodes)
    cache.pool.check_ownership(owned)
    for t in range(1, cache.ntiers):
        cache.tiers[t].pool.check_ownership(lower_owned[t])
