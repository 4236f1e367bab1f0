"""The radix-tree prefix cache: SGLang's RadixCache, exact to docs/design.md §4.

Every cached token's KV slot lives in exactly one tree node; edges hold token runs (numpy arrays,
compared vectorised, so long system prompts cost one comparison per edge, not one per token).
Children are keyed by their first token (first page when ``page_size > 1``).

With ``page_size`` P > 1 the KV pool hands out whole pages (SGLang's paged allocator): the tree holds
page-aligned runs whose slots are whole pages; a running request holds ``ceil(len/P)`` pages, its
last page's unused slots as ``lease.spare``, which `extend` fills before taking a new page; `release`
caches the whole pages of a finished sequence and returns its unaligned tail page to the pool.

Access times are a logical clock that ticks on every access, so recency is a strict total order and
runs are deterministic. Eviction candidates (unlocked leaves) sit in a heap ordered by the eviction
policy's priority; entries are invalidated lazily: a node is re-offered whenever its statistics or
its leaf/lock status change, and a popped entry counts only if it is the node's latest offer and the
node is still an unlocked leaf.
"""

from __future__ import annotations

import heapq
import math
from itertools import count
from typing import Iterable

import numpy as np

from testbed.cache.base import EMPTY_SLOTS, Lease, PrefixCache, Released
from testbed.cache.eviction import LRU, EvictionPolicy, Requester
from testbed.cache.pool import KVSlotPool

TOKEN_DTYPE = np.int32


class TreeNode:
    """A run of tokens and their KV slots; the path from the root spells the cached sequence."""

    __slots__ = (
        "id", "parent", "children", "key", "slots", "lock_ref", "last_access", "access_count",
        "created", "start", "priority", "category", "offer", "alive", "tier",
    )

    def __init__(self, node_id: int, parent: "TreeNode | None", key: np.ndarray, slots: np.ndarray,
                 clock: int, start: int = 0, requester: Requester | None = None) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[object, TreeNode] = {}
        self.key = key
        self.slots = slots
        self.lock_ref = 0
        self.last_access = clock
        self.access_count = 1
        self.created = clock
        self.start = start  # tokens on the path before this node
        self.priority = requester.priority if requester else 0
        self.category = requester.category if requester else None
        self.offer = 0  # version of the node's latest heap entry
        self.alive = True
        self.tier = None  # where lower tiers hold copies (testbed.cache.tiers); None without them

    @property
    def size(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={len(self.key)}, lock={self.lock_ref}, "
                f"t={self.last_access}, children={len(self.children)})")


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    i = int(differ.argmax())
    return i if differ[i] else n


class RadixCache(PrefixCache):
    """Radix tree over token sequences with ref-counted locks and policy-ordered leaf eviction.

    ``capacity`` is the KV pool size in tokens (None: unbounded), rounded down to whole pages.
    ``page_size > 1`` matches, splits, inserts, allocates and evicts only whole pages.
    """

    name = "radix"

    def __init__(self, capacity: int | None = None, page_size: int = 1,
                 policy: EvictionPolicy | None = None, pool: KVSlotPool | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"cache.page_size must be >= 1, got {page_size}")
        if pool is not None and pool.page_size != page_size:
            raise ValueError(f"cache.page_size is {page_size} but the KV pool's pages are "
                             f"{pool.page_size} slots")
        self.pool = pool if pool is not None else KVSlotPool(capacity, page_size)
        self.page_size = page_size
        self.policy: EvictionPolicy = policy if policy is not None else LRU()
        self._clock = 0
        self._ids = count()
        self.root = TreeNode(next(self._ids), None, np.zeros(0, TOKEN_DTYPE), EMPTY_SLOTS, 0)
        self.root.lock_ref = 1  # the root is never evicted nor counted
        self._evictable = 0
        self._protected = 0
        self._num_nodes = 1
        self._heap: list[tuple[object, int, int, TreeNode]] = []

    # ---------------------------------------------------------------- sizes
    @property
    def evictable_size(self) -> int:
        return self._evictable

    @property
    def protected_size(self) -> int:
        return self._protected

    @property
    def num_nodes(self) -> int:
        """Nodes in the tree, the root included."""
        return self._num_nodes

    def fits(self, num_tokens: int) -> bool:
        return self.pool.capacity is None or self.pool.round_up(num_tokens) <= self.pool.capacity

    # ---------------------------------------------------------------- walking
    def _child_key(self, key: np.ndarray, at: int) -> object:
        if self.page_size == 1:
            return int(key[at])
        return tuple(key[at : at + self.page_size].tolist())

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _touch(self, node: TreeNode, requester: Requester | None) -> None:
        """An access: refreshes recency (a node a walk stops inside counts too)."""
        self._clock += 1
        node.last_access = self._clock
        if requester is not None and requester.priority < node.priority:
            node.priority = requester.priority

    def _hit(self, node: TreeNode) -> None:
        """A match used all of ``node``'s tokens (after any split): frequency statistics."""
        node.access_count += 1
        self.policy.on_hit(node)

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens: a new head takes the first part (and the lock count);
        ``node`` keeps the tail, its children and its slots. Returns the head."""
        self._clock += 1
        head = TreeNode(next(self._ids), node.parent, node.key[:at], node.slots[:at], self._clock,
                        start=node.start)
        head.lock_ref = node.lock_ref
        head.access_count = node.access_count
        head.priority, head.category = node.priority, node.category
        node.start += at
        head.children[self._child_key(node.key, at)] = node
        node.parent.children[self._child_key(node.key, 0)] = head
        node.parent = head
        node.key = node.key[at:]
        node.slots = node.slots[at:]
        self._num_nodes += 1
        self._offer(node)  # its size changed; a size-aware policy must see it
        return head

    def _walk(self, key: np.ndarray, requester: Requester | None,
              hit: bool) -> tuple[TreeNode, int, list[np.ndarray]]:
        """Follow ``key`` from the root, touching every node on the way (as hits for a match) and
        splitting the edge the walk stops inside. Returns (last node, matched length, slot runs of
        the matched path). ``requester`` None: a look-up, which refreshes recency only."""
        node = self.root
        self._touch(node, requester)
        matched = 0
        runs: list[np.ndarray] = []
        n = len(key)
        while matched < n:
            child = node.children.get(self._child_key(key, matched))
            if child is None:
                break
            self._touch(child, requester)
            k = self._aligned(common_prefix_length(child.key, key[matched:]))
            split = k < len(child.key)
            if split:
                child = self._split(child, k)
            if hit:
                self._hit(child)  # the head of a split: its tail was only passed through
            runs.append(child.slots)
            matched += k
            node = child
            if split:
                break
        self._offer(node)
        return node, matched, runs

    # ---------------------------------------------------------------- core API (SGLang's names)
    def match_prefix(self, key: np.ndarray, requester: Requester | None = None,
                     lookup: bool = False) -> tuple[int, TreeNode, np.ndarray]:
        """Longest cached prefix of ``key`` (page-aligned): (length, deepest node, its slots).

        ``lookup=True`` is a scheduler's look-up, not a use: like SGLang's ``match_prefix`` it
        refreshes the recency of every node it passes (and splits the edge it stops inside), but it
        counts no hit and leaves the requester's priority out of the nodes' statistics."""
        key = key[: self._aligned(len(key))]
        if len(key) == 0:
            return 0, self.root, EMPTY_SLOTS
        node, matched, runs = self._walk(key, None if lookup else requester, hit=not lookup)
        slots = np.concatenate(runs) if runs else EMPTY_SLOTS
        return matched, node, slots

    def insert(self, key: np.ndarray, slots: np.ndarray, requester: Requester | None = None) -> int:
        """Cache ``key`` with KV ``slots`` (same length); returns how many leading tokens were
        already cached. Their entries in ``slots`` are duplicates the caller gives back. With
        ``page_size > 1`` only whole pages are inserted (the caller frees the rest)."""
        if len(key) != len(slots):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        n = self._aligned(len(key))
        if n == 0:
            return 0
        key = key[:n]
        node, present, _ = self._walk(key, requester, hit=False)
        if present < n:
            self._add_leaf(node, key[present:], slots[present:n], present, requester)
        return present

    def _add_leaf(self, parent: TreeNode, key: np.ndarray, slots: np.ndarray, start: int,
                  requester: Requester | None) -> TreeNode:
        """A new leaf under ``parent`` holding copies of ``key`` and its ``slots``, newest in the
        eviction order and offered as a victim."""
        self._clock += 1
        leaf = TreeNode(next(self._ids), parent, key.copy(), slots.copy(), self._clock,
                        start=start, requester=requester)
        self._new_leaf(leaf)
        parent.children[self._child_key(leaf.key, 0)] = leaf
        self._num_nodes += 1
        self._evictable += len(leaf.key)
        self.policy.on_create(leaf)
        self._offer(leaf)
        return leaf

    def _new_leaf(self, leaf: TreeNode) -> None:
        """Hook for subclasses: per-node state a new leaf needs before it is offered."""

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
        (`_offer` passes over those with children)."""
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"unlock of an unlocked node {node!r}")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.slots)
                self._protected -= len(node.slots)
                self._offer(node)
            node = node.parent

    def evict(self, num_tokens: int) -> int:
        """Remove unlocked leaves in policy order until ``num_tokens`` are freed (whole nodes, so
        possibly more) or nothing unlocked is left. Returns tokens freed."""
        freed = 0
        while freed < num_tokens and self._heap:  # (a rebuild may replace the list meanwhile)
            key, _, offer, node = heapq.heappop(self._heap)
            if offer != node.offer or not node.alive or node.children or node.lock_ref:
                continue  # a stale entry: the node changed since this offer
            freed += len(node.key)
            self._delete_leaf(node)
            self.policy.on_evict(node, key)
        return freed

    # ---------------------------------------------------------------- PrefixCache lifecycle
    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        # A look-up: recency refreshed as SGLang's match_prefix does; no hit, no policy access.
        return self.match_prefix(tokens if limit is None else tokens[:limit], requester,
                                 lookup=True)[0]

    @property
    def available_size(self) -> float:
        return math.inf if self.pool.unbounded else self.pool.num_free + self._evictable

    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        self.policy.on_access(requester)
        hit, node, slots = self.match_prefix(prompt if limit is None else prompt[:limit], requester)
        self.lock(node)
        return Lease(hit=hit, handle=node, slots=slots, requester=requester)

    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        """Add ``num_tokens`` slots: the lease's spare ones first, then whole new pages."""
        cost = self.extension_cost(lease, num_tokens)
        evicted = 0
        if not self.pool.can_alloc(cost):
            # Every unlocked token can go (locks cover whole root paths, so no unlocked node sits
            # above a locked one): decide before evicting anything.
            if self.pool.num_free + self._evictable < cost:
                return None
            evicted = self.evict(cost - self.pool.num_free)
        lease.grow(num_tokens, self.pool.alloc(cost))
        return evicted

    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        if insert and len(tokens) > lease.num_tokens:
            raise ValueError(f"release: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        present = lease.cached
        slots = lease.slots
        if insert:
            present = self.insert(tokens, slots[: len(tokens)], lease.requester)
            # The tree owned slots[:cached] all along; slots[cached:present] duplicate KV cached
            # meanwhile (whole pages: both ends are aligned); the unaligned tail (page_size > 1)
            # was not inserted, and with the spare slots it makes up the last page.
            self.pool.free(slots[lease.cached : present])
            self.pool.free(np.concatenate([slots[self._aligned(len(tokens)) :], lease.spare]))
        else:
            self.pool.free(lease.owned)
        self.unlock(lease.handle)
        lease.reset(EMPTY_SLOTS, 0)
        return Released(inserted=insert, already_cached=present)

    def commit(self, lease: Lease, tokens: np.ndarray) -> None:
        if len(tokens) > lease.num_tokens:
            raise ValueError(f"commit: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        slots = lease.slots
        present = self.insert(tokens, slots[: len(tokens)], lease.requester)
        self.pool.free(slots[lease.cached : present])
        # now all cached; re-matched as SGLang's cache_unfinished_req does (a look-up, not a hit)
        n, node, cached_slots = self.match_prefix(tokens, lease.requester, lookup=True)
        self.lock(node)
        self.unlock(lease.handle)
        lease.handle = node
        # The unaligned tail (n is page-aligned) and the spare slots stay the request's.
        lease.reset(np.concatenate([cached_slots, slots[n:]]), cached=n, spare=lease.spare)

    # ---------------------------------------------------------------- eviction bookkeeping
    def _offer(self, node: TreeNode) -> None:
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

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        del parent.children[self._child_key(node.key, 0)]
        node.alive = False
        self._num_nodes -= 1
        self._evictable -= len(node.key)
        self.pool.free(node.slots)
        self._offer(parent)  # a parent left childless competes with its own stored statistics

    # ---------------------------------------------------------------- checks and views
    def nodes(self) -> Iterable[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        """Besides the counts and heap: every slot is free xor owned by one node or one lease
        (its spare slots included), and node slots and lease-owned slots are whole pages."""
        evictable = protected = 0
        owned = [self._check_lease(lease) for lease in leases]
        candidates = {}
        for e in self._heap:
            node = e[3]
            if e[2] == node.offer and node.alive and not node.children and not node.lock_ref:
                candidates[node.id] = e[0]
        for node in self.nodes():
            assert node.alive, f"dead node in tree: {node!r}"
            assert len(node.key) > 0 and len(node.key) == len(node.slots), node
            assert len(node.key) % self.page_size == 0, f"unaligned node {node!r}"
            self.pool.assert_whole_pages(node.slots)
            assert node.lock_ref >= 0, f"negative lock: {node!r}"
            assert node.parent is self.root or node.parent.lock_ref >= node.lock_ref, node
            assert node.start == node.parent.start + len(node.parent.key), f"bad start: {node!r}"
            assert node.parent.children.get(self._child_key(node.key, 0)) is node, node
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    assert candidates.get(node.id) == self.policy.priority(node), \
                        f"evictable leaf without a current heap entry: {node!r}"
            owned.append(node.slots)
        assert evictable == self._evictable, f"evictable {self._evictable} != recount {evictable}"
        assert protected == self._protected, f"protected {self._protected} != recount {protected}"
        assert self._num_nodes == 1 + sum(1 for _ in self.nodes())
        self.pool.check_ownership(owned)

    def _check_lease(self, lease: Lease) -> np.ndarray:
        """Assert the lease's page layout; returns the slots it owns."""
        assert lease.cached % self.page_size == 0, f"cached prefix not page-aligned: {lease!r}"
        assert len(lease.spare) == -lease.num_tokens % self.page_size, \
            f"spare slots do not fill the last page: {lease!r}"
        owned = lease.owned
        self.pool.assert_whole_pages(owned)
        return owned
