"""The radix tree's eviction: a policy-ordered heap of candidate leaves, whole or page by page.

Eviction candidates (unlocked leaves) sit in a heap ordered by the eviction policy's priority;
entries are invalidated lazily: a node is re-offered whenever its statistics, its size or its
leaf/lock status change, and a popped entry counts only if it is the node's latest offer and the
node is still an unlocked leaf.

``evict_unit`` says what one step of `LeafEviction.evict` frees (docs/design.md §4):

- ``node`` (SGLang's rule): the whole candidate leaf, so an eviction may free more than asked;
- ``page``: the candidate's last whole pages, only as many as are still needed; the rest of the
  leaf stays a leaf with its statistics and competes again (a leaf wholly needed is removed, as
  under ``node``).
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from testbed.cache.token_runs import TOKEN_BYTES
from testbed.errors import BadInput

if TYPE_CHECKING:
    from testbed.cache.eviction import EvictionPolicy
    from testbed.cache.pool import KVSlotPool
    from testbed.cache.radix import TreeNode

#: what one eviction step frees: the whole leaf (SGLang) or just the tail pages still needed
EVICT_UNITS = ("node", "page")


def check_evict_unit(evict_unit: str) -> str:
    if evict_unit not in EVICT_UNITS:
        raise BadInput(f"cache.evict_unit must be one of {', '.join(EVICT_UNITS)}; "
                       f"got {evict_unit!r}")
    return evict_unit


class LeafEviction:
    """Eviction bookkeeping of `testbed.cache.radix.RadixCache` (a mixin: the tree's state is
    the cache's)."""

    # the cache's state this mixin reads and updates
    root: "TreeNode"
    pool: "KVSlotPool"
    policy: "EvictionPolicy"
    page_size: int
    evict_unit: str
    _heap: list
    _num_nodes: int
    _evictable: int
    _kw: int

    def evict(self, num_tokens: int) -> int:
        """Free ``num_tokens`` from unlocked leaves in policy order, or as many as are unlocked.
        Returns tokens freed: with ``evict_unit="node"`` whole leaves (possibly more than asked),
        with ``"page"`` the asked amount rounded up to whole pages when that many are unlocked."""
        by_page = self.evict_unit == "page"
        freed = 0
        while freed < num_tokens and self._heap:  # (a rebuild may replace the list meanwhile)
            key, _, offer, node = heapq.heappop(self._heap)
            if offer != node.offer or not node.alive or node.children or node.lock_ref:
                continue  # a stale entry: the node changed since this offer
            if by_page:
                need = -(-(num_tokens - freed) // self.page_size) * self.page_size
                if need < len(node.slots):  # part of this leaf suffices: free its tail only
                    freed += self._trim_leaf(node, len(node.slots) - need)
                    self.policy.on_evict(node, key)
                    break
            freed += len(node.slots)
            self._delete_leaf(node)
            self.policy.on_evict(node, key)
        return freed

    def _trim_leaf(self, node: "TreeNode", keep: int) -> int:
        """Free the KV of candidate leaf ``node`` after its first ``keep`` tokens (whole pages,
        at least one, so its key in the parent is unchanged). It stays the same node, statistics
        and all, and is offered again: its size changed. Returns tokens freed."""
        tail = node.slots[keep:]
        node.kb = node.kb[: keep * TOKEN_BYTES]
        node.slots = node.slots[:keep]
        self._evictable -= len(tail)
        self.pool.free(tail)
        self._offer(node)
        return len(tail)

    def _offer(self, node: "TreeNode") -> None:
        """(Re)enter ``node`` as an eviction candidate if it is an unlocked leaf."""
        if node.children or node.lock_ref or node is self.root:
            return
        node.offer += 1
        heapq.heappush(self._heap, (self.policy.priority(node), node.id, node.offer, node))
        if len(self._heap) > 4 * self._num_nodes + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep exactly one (the latest) per current candidate."""
        self._heap = [e for e in self._heap
                      if e[2] == e[3].offer and e[3].alive and not e[3].children and not e[3].lock_ref]
        heapq.heapify(self._heap)

    def _delete_leaf(self, node: "TreeNode") -> None:
        parent = node.parent
        del parent.children[node.kb[: self._kw]]
        node.alive = False
        self._num_nodes -= 1
        self._evictable -= len(node.slots)
        self.pool.free(node.slots)
        self._offer(parent)  # a parent left childless competes with its own stored statistics
