"""The radix tree's eviction: a policy-ordered heap of candidate leaves, whole or page by page.

`RadixCache` owns one `LeafEviction` and tells it, through `offer`, of every node whose
statistics, size or leaf/lock status changed; `evict` then frees tokens from the candidates in
the policy's order. The two meet at a small interface: the eviction reads nodes (`TreeNode`'s
public fields) and asks the tree (`LeafTree`) to unlink or trim a leaf; the tree keeps its own
counts and pool, the eviction its heap and the policy's ``on_evict``.

Entries are invalidated lazily: a node is re-offered whenever it changes, and a popped entry
counts only if it is the node's latest offer (``node.offer``) and the node is still an unlocked
leaf.

``evict_unit`` says what one step of `LeafEviction.evict` frees (docs/design.md §4):

- ``node`` (SGLang's rule): the whole candidate leaf, so an eviction may free more than asked;
- ``page``: the candidate's last whole pages, only as many as are still needed; the rest of the
  leaf stays a leaf with its statistics and competes again (a leaf wholly needed is removed, as
  under ``node``).
"""

from __future__ import annotations

import heapq
from functools import partial
from typing import Protocol

from testbed.cache.eviction import EvictionPolicy
from testbed.cache.native import evict_lru, offer_lru
from testbed.cache.tree_node import TreeNode
from testbed.errors import check_choice

#: what one eviction step frees: the whole leaf (SGLang) or just the tail pages still needed
EVICT_UNITS = ("node", "page")


def check_evict_unit(evict_unit: str) -> str:
    check_choice("cache.evict_unit", evict_unit, EVICT_UNITS)
    return evict_unit


class LeafTree(Protocol):
    """What `LeafEviction` needs of the tree it serves (`testbed.cache.radix.RadixCache`)."""

    root: TreeNode
    num_nodes: int  # nodes in the tree, the root included (bounds the heap's stale entries)

    def unlink_leaf(self, leaf: TreeNode) -> None:
        """Remove unlocked leaf ``leaf`` from the tree and free its KV."""

    def trim_leaf(self, leaf: TreeNode, keep: int) -> int:
        """Free the KV of unlocked leaf ``leaf`` after its first ``keep`` tokens (whole pages, at
        least one); returns the tokens freed."""


class LeafEviction:
    """Candidate leaves of one radix tree in ``policy`` order, and the eviction that frees them.
    ``evict_unit``: ``"node"`` frees whole leaves (SGLang), ``"page"`` only the tail pages
    needed (in pages of ``page_size`` tokens)."""

    def __init__(self, tree: LeafTree, policy: EvictionPolicy, page_size: int = 1,
                 evict_unit: str = "node", own_unlink: bool = False) -> None:
        self.tree = tree
        self.policy = policy
        self.page_size = page_size
        self.evict_unit = check_evict_unit(evict_unit)
        self._root = tree.root
        self._heap: list[tuple[object, int, int, TreeNode]] = []
        # LRU's key, read without a call (an offer per request and more); `on_evict` called
        # only where the policy's class has one (as the tree calls its other hooks)
        self._by_recency = type(policy).priority is EvictionPolicy.priority
        self._hooks_evict = type(policy).on_evict is not EvictionPolicy.on_evict
        # LRU over whole leaves at page size 1 without hooks, on a tree whose `unlink_leaf` is
        # `RadixTree`'s (``own_unlink``): `offer` and `evict` in C where it is built
        # (`testbed.cache.native`); the instance's `offer` then shadows the method (an offer per
        # request and evicted leaf, where a Python call in between would cost what C saves)
        native = (evict_lru is not None and self._by_recency and not self._hooks_evict
                  and evict_unit == "node" and page_size == 1 and own_unlink)
        self._evict_lru = evict_lru if native else None
        if native:
            self.offer = partial(offer_lru, self, tree, self._root)  # type: ignore[method-assign]

    def offer(self, node: TreeNode) -> None:
        """(Re)enter ``node`` as an eviction candidate if it is an unlocked leaf."""
        if node.children or node.lock_ref or node is self._root:
            return
        node.offer += 1
        key = node.last_access if self._by_recency else self.policy.priority(node)
        heapq.heappush(self._heap, (key, node.id, node.offer, node))
        if len(self._heap) > 4 * self.tree.num_nodes + 1024:
            self._rebuild_heap()

    def evict(self, num_tokens: int) -> int:
        """Free ``num_tokens`` from unlocked leaves in policy order, or as many as are unlocked.
        Returns tokens freed: with ``evict_unit="node"`` whole leaves (possibly more than asked),
        with ``"page"`` the asked amount rounded up to whole pages when that many are unlocked."""
        if self._evict_lru is not None:
            return self._evict_lru(self, self.tree, self._root, num_tokens)
        by_page = self.evict_unit == "page"
        tree, policy, hooked = self.tree, self.policy, self._hooks_evict
        freed = 0
        while freed < num_tokens and self._heap:  # (a rebuild may replace the list meanwhile)
            key, _, offer, node = heapq.heappop(self._heap)
            if offer != node.offer or not node.alive or node.children or node.lock_ref:
                continue  # a stale entry: the node changed since this offer
            if by_page:
                need = -(-(num_tokens - freed) // self.page_size) * self.page_size
                if need < len(node.slots):  # part of this leaf suffices: free its tail only
                    freed += tree.trim_leaf(node, len(node.slots) - need)
                    self.offer(node)  # the same node, statistics and all: its size changed
                    if hooked:
                        policy.on_evict(node, key)
                    break
            freed += len(node.slots)
            tree.unlink_leaf(node)
            self.offer(node.parent)  # a parent left childless competes with its own statistics
            if hooked:
                policy.on_evict(node, key)
        return freed

    def queued(self) -> dict[int, object]:
        """Invariant checks: each current candidate's id -> the priority it is queued with."""
        return {e[1]: e[0] for e in self._heap if self._current(e)}

    def _current(self, entry: tuple) -> bool:
        node = entry[3]
        return (entry[2] == node.offer and node.alive and not node.children
                and not node.lock_ref)

    def _rebuild_heap(self) -> None:
        """Drop stale entries: keep exactly one (the latest) per current candidate."""
        self._heap = [e for e in self._heap if self._current(e)]
        heapq.heapify(self._heap)
