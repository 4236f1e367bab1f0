"""Eviction in the tiered radix cache (`testbed.cache.tiers.TieredRadixCache`), tier by tier.

Each tier ``t`` (0: the GPU) keeps a heap of its candidates in its own policy's order: unlocked
nodes whose top (fastest) tier is ``t`` and none of whose children's top tier is ``t`` or faster;
on the GPU, nodes with no child on the GPU; in the slowest tier, leaves. Entries are invalidated
lazily, as in `testbed.cache.leaf_eviction`: a popped entry counts only if it is the node's
latest offer (``node.offer``) and the node is still a candidate of that tier.

The tree owns one `TierEviction` and tells it through `offer` of every node whose statistics,
tiers, children or locks changed. What evicting a node from a tier does (free the copy, demote
it, drop it with its subtree) is the tree's move: `TieredTree.leave_tier`.
"""

from __future__ import annotations

from heapq import heapify, heappop, heappush
from typing import Callable, Protocol

from testbed.cache.eviction import EvictionPolicy
from testbed.cache.pool import KVSlotPool
from testbed.cache.tier_state import GPU, LowerTier
from testbed.cache.tree_node import TreeNode


class TieredTree(Protocol):
    """What `TierEviction` needs of the tiered tree it serves."""

    root: TreeNode
    num_nodes: int  # nodes in the tree, the root included (bounds the heaps' stale entries)

    def top(self, node: TreeNode) -> int:
        """The fastest tier holding ``node`` (0: GPU), -1 for none."""

    def leave_tier(self, node: TreeNode, t: int) -> None:
        """Take candidate ``node`` out of tier ``t`` (freeing, demoting or dropping it)."""


class TierEviction:
    """The candidate heaps of one tiered tree: the GPU's in ``policy`` order, then one per lower
    tier `add_tier` adds (in its own policy's order, evicting to make room in its pool)."""

    def __init__(self, tree: TieredTree, policy: EvictionPolicy) -> None:
        self.tree = tree
        self._root = tree.root
        self._pools: list[KVSlotPool | None] = [None]  # the GPU's pool is the tree's
        self._policies = [policy]
        # per tier: its heap (rebuilt in place, so a reference stays valid) and its policy's
        # priority (bound once: `offer` runs on every change of every node)
        self._queues: list[tuple[list[tuple[object, int, int, TreeNode]], Callable]] = \
            [([], policy.priority)]

    def add_tier(self, tier: LowerTier) -> None:
        """The next tier down (before the tree holds anything)."""
        self._pools.append(tier.pool)
        self._policies.append(tier.policy)
        self._queues.append(([], tier.policy.priority))

    def is_candidate(self, node: TreeNode, t: int) -> bool:
        """Whether tier ``t`` may evict ``node`` now."""
        return (node.alive and not node.lock_ref and node is not self._root
                and self.tree.top(node) == t and not any(node.tier.kids[: t + 1]))

    def offer(self, node: TreeNode) -> None:
        """(Re)enter ``node`` in the heap of its top tier if it is that tier's candidate."""
        if node.lock_ref or node is self._root or not node.alive:
            return
        t = self.tree.top(node)
        if t < 0 or any(node.tier.kids[: t + 1]):
            return
        node.offer += 1
        heap, priority = self._queues[t]
        heappush(heap, (priority(node), node.id, node.offer, node))
        if len(heap) > 4 * self.tree.num_nodes + 1024:
            self._drop_stale(t)

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` GPU slots (demoting or dropping nodes) if possible."""
        heap, tree, policy = self._queues[GPU][0], self.tree, self._policies[GPU]
        freed = 0
        while freed < num_tokens and heap:
            key, _, offer, node = heappop(heap)
            if offer != node.offer or not self.is_candidate(node, GPU):
                continue
            freed += len(node.slots)
            tree.leave_tier(node, GPU)
            policy.on_evict(node, key)
        return freed

    def make_room(self, t: int, num_tokens: int) -> bool:
        """Evict from lower tier ``t`` until ``num_tokens`` of its slots are free; False when
        that many cannot be."""
        pool, heap, policy = self._pools[t], self._queues[t][0], self._policies[t]
        if num_tokens > pool.capacity:
            return False
        while pool.num_free < num_tokens:
            if not heap:
                return False
            key, _, offer, node = heappop(heap)
            if offer != node.offer or not self.is_candidate(node, t):
                continue
            self.tree.leave_tier(node, t)
            policy.on_evict(node, key)
        return True

    def queued(self, t: int) -> dict[int, object]:
        """Invariant checks: each current candidate of tier ``t``'s id -> its queued priority."""
        return {e[1]: e[0] for e in self._queues[t][0]
                if e[2] == e[3].offer and self.is_candidate(e[3], t)}

    def _drop_stale(self, t: int) -> None:
        """Rebuild tier ``t``'s heap without its stale entries (in place)."""
        heap = self._queues[t][0]
        heap[:] = [e for e in heap if e[2] == e[3].offer and self.is_candidate(e[3], t)]
        heapify(heap)
