"""The radix-tree prefix cache: SGLang's RadixCache, exact to docs/design.md §4.

Every cached token's KV slot lives in exactly one tree node; edges hold token runs as bytes
(`testbed.cache.token_runs`), so a walk passes an edge with one C-level comparison whatever its
length, and only the edge it stops inside is searched for the exact divergence. Children are keyed
by the bytes of their first token (first page when ``page_size > 1``).

With ``page_size`` P > 1 the KV pool hands out whole pages (SGLang's paged allocator): the tree holds
page-aligned runs whose slots are whole pages; a running request holds ``ceil(len/P)`` pages, its
last page's unused slots as ``lease.spare``, which `extend` fills before taking a new page; `release`
caches the whole pages of a finished sequence and returns its unaligned tail page to the pool.

Access times are a logical clock that ticks on every access, so recency is a strict total order and
runs are deterministic. Eviction (the heap of candidate leaves, whole-leaf or tail-page eviction by
``evict_unit``) is `testbed.cache.leaf_eviction`.

`replay_one` serves one request of the replay backend in a single pass (page size 1): the match,
the eviction, the insert and the unlock of `acquire`/`extend`/`release` with the same effects,
touching the matched path a second time where the insert's walk would, without building a lease.
"""

from __future__ import annotations

import math
from itertools import count
from typing import Iterable

import numpy as np

from testbed.cache.base import EMPTY_SLOTS, Lease, PrefixCache, Released
from testbed.cache.eviction import LRU, EvictionPolicy, Requester, queued_as_valued
from testbed.cache.leaf_eviction import LeafEviction, check_evict_unit
from testbed.cache.pool import KVSlotPool
from testbed.cache.token_runs import (TOKEN_BYTES, TOKEN_DTYPE, as_bytes, joined_bytes,
                                      matched_bytes)
from testbed.errors import BadInput


#: what a walk that stops inside an edge does to the split-off tail's access time: ``refresh``
#: (SGLang: counts as accessed now) or ``keep`` (its time before the walk; docs/design.md §4)
SPLIT_RECENCY = ("refresh", "keep")


class TreeNode:
    """A run of tokens and their KV slots; the path from the root spells the cached sequence.

    ``kb`` holds the tokens as bytes; ``key`` shows them as a (read-only) token array."""

    __slots__ = (
        "id", "parent", "children", "kb", "slots", "lock_ref", "last_access", "access_count",
        "created", "start", "priority", "category", "offer", "alive", "tier",
    )

    def __init__(self, node_id: int, parent: "TreeNode | None", kb: bytes, slots: np.ndarray,
                 clock: int, start: int = 0, requester: Requester | None = None) -> None:
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, TreeNode] = {}
        self.kb = kb
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
    def key(self) -> np.ndarray:
        return np.frombuffer(self.kb, TOKEN_DTYPE)

    @property
    def size(self) -> int:
        return len(self.kb) // TOKEN_BYTES

    def __repr__(self) -> str:
        return (f"TreeNode(id={self.id}, tokens={self.size}, lock={self.lock_ref}, "
                f"t={self.last_access}, children={len(self.children)})")


def common_prefix_length(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (vectorised)."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    i = int(differ.argmax())
    return i if differ[i] else n


class RadixCache(LeafEviction, PrefixCache):
    """Radix tree over token sequences with ref-counted locks and policy-ordered leaf eviction.

    ``capacity`` is the KV pool size in tokens (None: unbounded), rounded down to whole pages.
    ``page_size > 1`` matches, splits, inserts, allocates and evicts only whole pages.
    ``evict_unit``: ``"node"`` frees whole leaves (SGLang), ``"page"`` only the tail pages needed.
    """

    name = "radix"

    def __init__(self, capacity: int | None = None, page_size: int = 1,
                 policy: EvictionPolicy | None = None, pool: KVSlotPool | None = None,
                 evict_unit: str = "node", split_recency: str = "refresh") -> None:
        if page_size < 1:
            raise BadInput(f"cache.page_size must be >= 1, got {page_size}")
        if pool is not None and pool.page_size != page_size:
            raise ValueError(f"cache.page_size is {page_size} but the KV pool's pages are "
                             f"{pool.page_size} slots")
        self.pool = pool if pool is not None else KVSlotPool(capacity, page_size)
        self.page_size = page_size
        self.evict_unit = check_evict_unit(evict_unit)
        if split_recency not in SPLIT_RECENCY:
            raise BadInput(f"cache.split_recency must be one of {', '.join(SPLIT_RECENCY)}; "
                           f"got {split_recency!r}")
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
        self._tiered = type(self)._new_leaf is not RadixCache._new_leaf  # a subclass's hook
        self._clock = 0
        self._ids = count()
        self.root = TreeNode(next(self._ids), None, b"", EMPTY_SLOTS, 0)
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

    def _hit(self, node: TreeNode) -> None:
        """A match used all of ``node``'s tokens (after any split): frequency statistics."""
        node.access_count += 1
        if self._on_hit is not None:
            self._on_hit(node)

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens: a new head takes the first part (and the lock count);
        ``node`` keeps the tail, its children and its slots. Returns the head."""
        self._clock += 1
        cut, kw = at * TOKEN_BYTES, self._kw
        head = TreeNode(next(self._ids), node.parent, node.kb[:cut], node.slots[:at], self._clock,
                        start=node.start)
        head.lock_ref = node.lock_ref
        head.access_count = node.access_count
        head.priority, head.category = node.priority, node.category
        node.start += at
        head.children[node.kb[cut : cut + kw]] = node
        node.parent.children[node.kb[:kw]] = head
        node.parent = head
        node.kb = node.kb[cut:]
        node.slots = node.slots[at:]
        self._num_nodes += 1
        self._offer(node)  # its size changed; a size-aware policy must see it
        return head

    def _walk(self, kb: bytes, end: int, requester: Requester | None, hit: bool,
              path: list[TreeNode]) -> tuple[TreeNode, int]:
        """Follow ``kb[:end]`` (token bytes, ``end`` page-aligned) from the root, touching every
        node on the way (as hits for a match) and splitting the edge the walk stops inside.
        Returns (last node, bytes matched) and appends the nodes passed to ``path``.
        ``requester`` None: a look-up, which refreshes recency only."""
        self._touch(self.root, requester)
        return self._descend(self.root, kb, 0, end, requester, hit, path)

    def _descend(self, node: TreeNode, kb: bytes, at: int, end: int, requester: Requester | None,
                 hit: bool, path: list[TreeNode]) -> tuple[TreeNode, int]:
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
            if urgent is not None and urgent < child.priority:
                child.priority = urgent
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
                    self._offer(tail)
            else:
                k = len(edge)
            if hit:  # the head of a split: its tail was only passed through
                child.access_count += 1
                if on_hit is not None:
                    on_hit(child)
            path.append(child)
            at += k
            node = child
            if split:
                break
        self._clock = clock
        self._offer(node)
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

    def insert(self, key: np.ndarray, slots: np.ndarray, requester: Requester | None = None) -> int:
        """Cache ``key`` with KV ``slots`` (same length); returns how many leading tokens were
        already cached. Their entries in ``slots`` are duplicates the caller gives back. With
        ``page_size > 1`` only whole pages are inserted (the caller frees the rest)."""
        if len(key) != len(slots):
            raise ValueError(f"insert: {len(key)} tokens but {len(slots)} slots")
        n = self._aligned(len(key))
        if n == 0:
            return 0
        kb = as_bytes(key[:n])
        node, at = self._walk(kb, len(kb), requester, False, [])
        present = at // TOKEN_BYTES
        if present < n:
            self._add_leaf(node, kb[at:], slots[present:n].copy(), present, requester)
        return present

    def _add_leaf(self, parent: TreeNode, kb: bytes, slots: np.ndarray, start: int,
                  requester: Requester | None) -> TreeNode:
        """A new leaf under ``parent`` holding the tokens ``kb`` and their ``slots`` (kept, not
        copied), newest in the eviction order and offered as a victim."""
        self._clock += 1
        leaf = TreeNode(next(self._ids), parent, kb, slots, self._clock, start, requester)
        if self._tiered:
            self._new_leaf(leaf)
        parent.children[kb[: self._kw]] = leaf
        self._num_nodes += 1
        self._evictable += len(slots)
        if self._on_create is not None:
            self._on_create(leaf)
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

    def replay_one(self, prompt: np.ndarray, output: np.ndarray,
                   requester: Requester | None = None) -> tuple[int, int, bool, dict | None]:
        """`PrefixCache.replay_one` in one pass (page size 1, no lower tiers): the calls of
        `acquire`, `extend` and `release` with the same effects on the tree, the pool and the
        policy, in the same order. The insert's walk passes the locked matched path again (every
        node touched anew, as `insert` does) and goes on from its end; the new leaf takes its slots
        straight from the allocation."""
        if self.page_size != 1 or self.lower_tiers:
            return super().replay_one(prompt, output, requester)
        kb = joined_bytes(prompt, output)
        n = len(kb) // TOKEN_BYTES
        pool = self.pool
        if pool.capacity is not None and n > pool.capacity:
            return 0, 0, False, None
        if self._on_access is not None:
            self._on_access(requester)
        path: list[TreeNode] = []
        node, at = (self._walk(kb, len(prompt) * TOKEN_BYTES, requester, True, path)
                    if len(prompt) else (self.root, 0))
        hit = at // TOKEN_BYTES
        need = n - hit
        evicted = 0
        # The lock matters only while evicting: without eviction, locking and unlocking the path
        # change nothing (its nodes but the last have children, so unlocking offers none of them;
        # the last one is offered at the end of the insert's walk instead, by then unlocked).
        locked = not pool.can_alloc(need)
        if locked:
            self.lock(node)
            if pool.num_free + self._evictable < need:
                raise RuntimeError(f"radix: no room for {n} tokens although they fit")
            evicted = self.evict(need - pool.num_free)
        fresh = pool.alloc(need)
        # The insert's walk: the root and the matched path touched again, then on from its end.
        urgent = requester.priority if requester is not None else None
        clock = self._clock
        for x in (self.root, *path):
            clock += 1
            x.last_access = clock
            if urgent is not None and urgent < x.priority:
                x.priority = urgent
        self._clock = clock
        if at < len(kb) and kb[at : at + TOKEN_BYTES] in node.children:
            end, at = self._descend(node, kb, at, len(kb), requester, False, [])
        else:  # the usual case: nothing cached beyond the hit (`_descend` would only offer it)
            end = node
            self._offer(node)
        present = at // TOKEN_BYTES
        if present < n:
            self._add_leaf(end, kb[at:], fresh[present - hit :], present, requester)
        if present > hit:
            pool.free(fresh[: present - hit])  # output tokens cached meanwhile: duplicates
        if locked:
            self.unlock(node)
        return hit, evicted, True, None

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
                    assert queued_as_valued(self.policy, candidates, node), \
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
