"""The radix tree under `testbed.cache.radix.RadixCache`: token runs and their KV slots in nodes,
walks that match and split, inserts, ref-counted locks, and the eviction the tree owns.

Every cached token's KV slot lives in exactly one tree node; edges hold token runs as bytes
(`testbed.cache.token_runs`), so a walk passes an edge with one C-level comparison whatever its
length, and only the edge it stops inside is searched for the exact divergence. Children are keyed
by the bytes of their first token (first page when ``page_size > 1``). With ``page_size`` P > 1
the tree holds page-aligned runs whose slots are whole pages of the KV pool.

Access times are a logical clock that ticks on every access, so recency is a strict total order and
runs are deterministic. The tree owns its eviction (``tree.eviction``; `LeafEviction`, the heap of
candidate leaves freed whole or by tail pages per ``evict_unit``, in testbed/cache/leaf_eviction.py)
and tells it, through ``offer``, of every node that changed; the eviction asks the tree to
`unlink_leaf` or `trim_leaf`. A subclass with other eviction rules (the tiered tree) returns its own
eviction from `RadixTree._make_eviction`, and gives new leaves state of its own in ``leaf_hook``.
"""

from __future__ import annotations

from itertools import count
from typing import Callable, Iterable, Protocol

import numpy as np

from testbed.cache.base import EMPTY_SLOTS
from testbed.cache.eviction import LRU, EvictionPolicy, Requester
from testbed.cache.leaf_eviction import LeafEviction, check_evict_unit
from testbed.cache.pool import KVSlotPool
from testbed.cache.token_runs import TOKEN_BYTES, as_bytes, matched_bytes
from testbed.cache.tree_node import TreeNode, descendants, own_children
from testbed.errors import BadInput, check_choice

#: what a walk that stops inside an edge does to the split-off tail's access time: ``refresh``
#: (SGLang: counts as accessed now) or ``keep`` (its time before the walk; docs/design.md §4)
SPLIT_RECENCY = ("refresh", "keep")


class TreeEviction(Protocol):
    """What a radix tree asks of the eviction it owns (`LeafEviction`; the tiered tree's
    `testbed.cache.tier_eviction.TierEviction`)."""

    def offer(self, node: TreeNode) -> None:
        """``node``'s statistics, size, children or locks changed: (re)consider it a candidate."""

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if that many are evictable; returns tokens
        freed."""


class RadixTree:
    """Radix tree over token sequences with ref-counted locks and policy-ordered leaf eviction.

    ``capacity`` is the KV pool size in tokens (None: unbounded), rounded down to whole pages.
    ``page_size > 1`` matches, splits, inserts, allocates and evicts only whole pages.
    ``evict_unit``: ``"node"`` frees whole leaves (SGLang), ``"page"`` only the tail pages needed.

    The tree owns its eviction (``self.eviction``, a `LeafEviction` unless a subclass's
    `_make_eviction` returns another) and tells it of every node that may have become a candidate
    or changed; the eviction unlinks or trims leaves through `unlink_leaf` and `trim_leaf`.
    ``leaf_hook`` (for subclasses) is called with every new leaf before it is linked and offered.
    """

    def __init__(self, capacity: int | None = None, page_size: int = 1,
                 policy: EvictionPolicy | None = None, pool: KVSlotPool | None = None,
                 evict_unit: str = "node", split_recency: str = "refresh", *,
                 leaf_hook: Callable[[TreeNode], None] | None = None) -> None:
        if page_size < 1:
            raise BadInput(f"cache.page_size must be >= 1, got {page_size}")
        if pool is not None and pool.page_size != page_size:
            raise ValueError(f"cache.page_size is {page_size} but the KV pool's pages are "
                             f"{pool.page_size} slots")
        self.pool = pool if pool is not None else KVSlotPool(capacity, page_size)
        self.page_size = page_size
        self.evict_unit = check_evict_unit(evict_unit)
        check_choice("cache.split_recency", split_recency, SPLIT_RECENCY)
        self.split_recency = split_recency
        self._keep_tail = split_recency == "keep"
        self.policy: EvictionPolicy = policy if policy is not None else LRU()
        self._kw = page_size * TOKEN_BYTES  # bytes of a child's key (its first page)
        # the policy's hooks, None where they are the base class's no-ops (LRU and most others)
        self._on_hit = (None if type(self.policy).on_hit is EvictionPolicy.on_hit
                        else self.policy.on_hit)
        self._on_create = (None if type(self.policy).on_create is EvictionPolicy.on_create
                           else self.policy.on_create)
        self._on_access = (None if type(self.policy).on_access is EvictionPolicy.on_access
                           else self.policy.on_access)
        # optional (a user's class need not have it): called with (head, tail) of every split
        on_split = getattr(type(self.policy), "on_split", EvictionPolicy.on_split)
        self._on_split = None if on_split is EvictionPolicy.on_split else self.policy.on_split
        self._leaf_hook = leaf_hook
        self._history = getattr(self.policy, "needs_history", False)
        self._clock = 0
        self._ids = count()
        self.root = TreeNode(next(self._ids), None, b"", EMPTY_SLOTS, 0)
        self.root.lock_ref = 1  # the root is never evicted nor counted
        self._evictable = 0
        self._protected = 0
        self.num_nodes = 1  # nodes in the tree, the root included (read by the eviction)
        self.eviction: TreeEviction = self._make_eviction(evict_unit)

    def _make_eviction(self, evict_unit: str) -> TreeEviction:
        """The eviction this tree owns (called once, at the end of `__init__`, with the tree
        empty). A subclass with its own eviction rules returns its own object here."""
        return LeafEviction(self, self.policy, self.page_size, evict_unit,
                            own_unlink=type(self).unlink_leaf is RadixTree.unlink_leaf)

    # ---------------------------------------------------------------- sizes
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    # ---------------------------------------------------------------- walking
    def _child_key(self, key: np.ndarray, at: int) -> bytes:
        """The children-dict key of the run of ``key`` starting at token ``at``."""
        return as_bytes(key[at : at + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _touch(self, node: TreeNode, requester: Requester | None) -> None:
        """An access: refreshes recency (a node a walk stops inside counts too)."""
        self._clock += 1
        node.last_access = self._clock
        if requester is not None and requester.priority < node.priority:
            node.priority = requester.priority

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens: a new head takes the first part (and the lock count);
        ``node`` keeps the tail, its children and its slots. Returns the head."""
        self._clock += 1
        cut, kw = at * TOKEN_BYTES, self._kw
        head = TreeNode(next(self._ids), node.parent, node.kb[:cut], node.slots[:at], self._clock,
                        start=node.start)
        head.lock_ref = node.lock_ref
        head.access_count = node.access_count
        head.hits, head.history = node.hits, node.history
        head.priority, head.category = node.priority, node.category
        node.start += at
        head.children = {node.kb[cut : cut + kw]: node}
        node.parent.children[node.kb[:kw]] = head
        node.parent = head
        node.kb = node.kb[cut:]
        node.slots = node.slots[at:]
        self.num_nodes += 1
        if self._on_split is not None:  # before the offer: a policy's key may read what it moves
            self._on_split(head, node)
        self.eviction.offer(node)  # its size changed; a size-aware policy must see it
        return head

    def _walk(self, kb: bytes, end: int, requester: Requester | None, hit: bool,
              path: list[TreeNode], counted: int | None = None) -> tuple[TreeNode, int]:
        """Follow ``kb[:end]`` (token bytes, ``end`` page-aligned) from the root, touching every
        node on the way (as hits for a match) and splitting the edge the walk stops inside.
        Returns (last node, bytes matched) and appends the nodes passed to ``path``.
        ``requester`` None: a look-up, which refreshes recency only. ``counted`` (an insert's
        walk): bytes the inserting request inserted before; each node the walk passes whose end
        lies beyond them counts an insert hit (``TreeNode.hits``, SGLang 0.5.23's
        ``_insert_helper``)."""
        self._touch(self.root, requester)
        return self._descend(self.root, kb, 0, end, requester, hit, path, counted)

    def _descend(self, node: TreeNode, kb: bytes, at: int, end: int, requester: Requester | None,
                 hit: bool, path: list[TreeNode], counted: int | None = None
                 ) -> tuple[TreeNode, int]:
        """`_walk` from ``node`` (already touched), ``kb[:at]`` being its path. (The loop runs for
        every edge walked: `_touch` and `_hit` are inlined, the clock kept in a local.)"""
        kw = self._kw
        on_hit = self._on_hit
        urgent = requester.priority if requester is not None else None
        clock = self._clock
        while at < end:
            child = node.children.get(kb[at : at + kw])
            if child is None:
                break
            clock += 1
            before = child.last_access
            child.last_access = clock
            edge = child.kb
            split = not kb.startswith(edge, at, end)
            if split:
                k = matched_bytes(edge, kb, at, end)
                k -= k % kw
                self._clock = clock
                tail = child
                child = self._split(child, k // TOKEN_BYTES)
                clock = self._clock
                if self._keep_tail:  # the walk did not use the tail: its recency stays
                    tail.last_access = before
                    self.eviction.offer(tail)
            else:
                k = len(edge)
            if urgent is not None and urgent < child.priority:  # (a split's tail keeps its own)
                child.priority = urgent
            if hit:  # the head of a split: its tail was only passed through
                child.access_count += 1
                if on_hit is not None:
                    on_hit(child)
            path.append(child)
            at += k
            if counted is not None and at > counted:
                child.hits += 1
            node = child
            if split:
                break
        self._clock = clock
        self.eviction.offer(node)
        return node, at

    # ---------------------------------------------------------------- core API (SGLang's names)
    def match_prefix(self, key: np.ndarray, requester: Requester | None = None,
                     lookup: bool = False) -> tuple[int, TreeNode, np.ndarray]:
        """Longest cached prefix of ``key`` (page-aligned): (length, deepest node, its slots).

        ``lookup=True`` is a scheduler's look-up, not a use: like SGLang's ``match_prefix`` it
        refreshes the recency of every node it passes (and splits the edge it stops inside), but it
        counts no hit and leaves the requester's priority out of the nodes' statistics."""
        kb = as_bytes(key)
        end = len(kb) - len(kb) % self._kw
        if end == 0:
            return 0, self.root, EMPTY_SLOTS
        path: list[TreeNode] = []
        node, matched = self._walk(kb, end, None if lookup else requester, not lookup, path)
        slots = np.concatenate([x.slots for x in path]) if path else EMPTY_SLOTS
        return matched // TOKEN_BYTES, node, slots

    def insert(self, key: np.ndarray, slots: np.ndarray, requester: Requester | None = None,
               inserted: int = 0) -> int:
        """Cache ``key`` with KV ``slots`` (same length); returns how many leading tokens were
        already cached. Their entries in ``slots`` are duplicates the caller gives back. With
        ``page_size > 1`` only whole pages are inserted (the caller frees the rest).
        ``inserted``: tokens of ``key`` the same request inserted before (a chunk), whose nodes
        count no insert hit again."""
        walked = self._insert_walk(key, slots, requester, inserted)
        if walked is None:
            return 0
        node, kb, at, n = walked
        present = at // TOKEN_BYTES
        if present < n:
            self._add_leaf(node, kb[at:], slots[present:n].copy(), present, requester,
                           hits=int(n > inserted))
        return present

    def _insert_walk(self, key: np.ndarray, slots: np.ndarray, requester: Requester | None,
                     inserted: int = 0) -> tuple[TreeNode, bytes, int, int] | None:
        """`insert`'s check and walk: None if ``key`` holds no whole page, else (the node the walk
        of its whole pages ends at, those pages' bytes, bytes matched, tokens in those pages)."""
        if len(key) != len(slots):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        n = self._aligned(len(key))
        if n == 0:
            return None
        kb = as_bytes(key[:n])
        node, at = self._walk(kb, len(kb), requester, False, [], inserted * TOKEN_BYTES)
        return node, kb, at, n

    def _add_leaf(self, parent: TreeNode, kb: bytes, slots: np.ndarray, start: int,
                  requester: Requester | None, hits: int = 1) -> TreeNode:
        """A new leaf under ``parent`` holding the tokens ``kb`` and their ``slots`` (kept, not
        copied), newest in the eviction order and offered as a victim; ``hits``: its insert hit
        count (the creating insert's)."""
        self._clock += 1
        leaf = TreeNode(next(self._ids), parent, kb, slots, self._clock, start, requester)
        leaf.hits = hits
        if self._leaf_hook is not None:
            self._leaf_hook(leaf)
        if self._history:
            raise_history(leaf, start + len(slots))
        own_children(parent)[kb[: self._kw]] = leaf
        self.num_nodes += 1
        self._evictable += len(slots)
        if self._on_create is not None:
            self._on_create(leaf)
        self.eviction.offer(leaf)
        return leaf

    def lock(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction (ref-counted). Counts the tokens whose
        KV is on the device (``slots``: all of them here; a tiered subclass keeps some below)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.slots)
                self._protected += len(node.slots)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock` of ``node``; a node left unlocked is offered as a candidate again
        (the eviction's `offer` passes over those with children)."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.slots)
                self._protected -= len(node.slots)
                self.eviction.offer(node)
            node = node.parent

    # ---------------------------------------------------------------- what the eviction calls
    def evict(self, num_tokens: int) -> int:
        """Free ``num_tokens`` through the eviction the tree owns (`LeafEviction.evict`)."""
        return self.eviction.evict(num_tokens)

    def unlink_leaf(self, leaf: TreeNode) -> None:
        """`LeafTree.unlink_leaf`: take unlocked leaf ``leaf`` out of the tree, its KV freed."""
        del leaf.parent.children[leaf.kb[: self._kw]]
        leaf.alive = False
        self.num_nodes -= 1
        self._evictable -= len(leaf.slots)
        self.pool.free(leaf.slots)

    def trim_leaf(self, leaf: TreeNode, keep: int) -> int:
        """`LeafTree.trim_leaf`: free the KV of unlocked leaf ``leaf`` after its first ``keep``
        tokens (whole pages, at least one, so its key in the parent is unchanged). It stays the
        same node, statistics and all. Returns tokens freed."""
        tail = leaf.slots[keep:]
        leaf.kb = leaf.kb[: keep * TOKEN_BYTES]
        leaf.slots = leaf.slots[:keep]
        self._evictable -= len(tail)
        self.pool.free(tail)
        return len(tail)

    # ---------------------------------------------------------------- views
    def nodes(self) -> Iterable[TreeNode]:
        """Every node but the root, parents before children."""
        return descendants(self.root)


def raise_history(leaf: TreeNode, depth: int) -> None:
    """T-LRU's branch high-water mark: ``depth`` tokens are now cached through ``leaf`` and its
    ancestors; raise their ``history`` to it, stopping at the first ancestor already that deep
    (SGLang 0.5.23's ``_set_tlru_lens_and_raise_history``)."""
    leaf.history = max(leaf.history, depth)
    node = leaf.parent
    while node is not None and node.history < depth:
        node.history = depth
        node = node.parent
