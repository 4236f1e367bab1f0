"""Hierarchical KV cache: the radix tree with host-DRAM and disk tiers below the GPU (SGLang's
HiCache, LMCache). Evicted prefixes are demoted instead of dropped; a later hit loads them back.

One tree; each node knows which tiers hold its KV: the GPU (``node.slots``, as in `RadixCache`) and
each lower tier ``t`` (``node.tier.copies[t]``, slot ids in that tier's own pool). A node's *top*
tier is the fastest one holding it. The rules:

- GPU residency is prefix-closed: a node on the GPU has its parent on the GPU. A match reads as GPU
  tokens followed by a run of lower-tier tokens (each node loaded from its fastest copy).
- Every node is held by at least one tier. A node leaving its last tier leaves the tree with its
  subtree (whose KV is useless without it). A locked node never loses a copy.
- Tier ``t`` evicts, in its own policy's order, unlocked nodes whose top tier is ``t`` and none of
  whose children's top tier is ``t`` or faster: on the GPU, nodes with no child on the GPU; in the
  slowest tier, leaves. A lower tier's copy of a node a faster tier still holds is not evictable
  (SGLang keeps a GPU node's host backup). The tree owns these candidate heaps as a
  `testbed.cache.tier_eviction.TierEviction`; what leaving a tier does is `leave_tier`.
- Evicting a node from tier ``t`` frees that copy if a slower tier has one; otherwise the node is
  demoted to the next tier (room made there by that tier's eviction) when the write policy allows
  it, and dropped when not or when there is no room.
- Write policies, GPU to host, as SGLang names them: ``write_through`` copies a node to the host as
  soon as the GPU caches it; ``write_through_selective`` once it has been hit ``write_threshold``
  times; ``write_back`` only when the GPU evicts it. Under the write-through policies a node the
  GPU evicts without a lower copy is dropped (as in SGLang). Host to disk always demotes on eviction.
- `acquire` locks the whole match and reports the GPU part as the hit, the rest as
  ``lease.lower``; `load_back` then allocates GPU slots for the rest (evicting as needed), so it
  counts as hit, or gives it up (recompute: the request's fresh KV is adopted by those nodes when
  it is inserted). A ``planner`` (`testbed.sim.transfer.LoadPlanner`) may veto loads slower than
  recomputing.
- With ``record_transfers=True`` every copy is logged in order as a `Transfer`; applying the log in
  order before the next forward pass moves the real KV (the engine does; tests check the data path).

With ``page_size`` P > 1 every tier's pool hands out whole pages (capacities round down to them):
nodes are page-aligned, so GPU slots, copies and transfers are whole pages too.

`insert` returns how many leading tokens were already on the GPU (their fresh slots are duplicates),
so `release` and `commit` work unchanged. Without lower tiers use `RadixCache` (exact, docs/design.md §4).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import numpy as np

from testbed.cache.base import EMPTY_SLOTS, Lease
from testbed.cache.eviction import LRU, EvictionPolicy, Requester
from testbed.cache.pool import KVSlotPool
from testbed.cache.radix import SGLANG_RELEASES, RadixCache
from testbed.cache.tier_config import check_tier_values, tier_options
from testbed.cache.tier_eviction import TierEviction
from testbed.cache.tier_state import (GPU, WRITE_POLICIES, LowerTier, TierState,  # noqa: F401
                                      Transfer)  # (Transfer re-exported: testbed.engine.host_kv)
from testbed.cache.token_runs import TOKEN_BYTES
from testbed.cache.tree_checks import check_tiered_tree
from testbed.cache.tree_node import TreeNode


class TieredRadixCache(RadixCache):
    """`RadixCache` with lower tiers: ``host_tokens`` of host DRAM, then ``disk_tokens`` of SSD
    (0: absent; at least one must be present)."""

    name = "radix"
    eviction: TierEviction  # `_make_eviction`'s

    def __init__(self, capacity: int | None = None, page_size: int = 1,
                 policy: EvictionPolicy | None = None, pool: KVSlotPool | None = None, *,
                 host_tokens: int = 0, disk_tokens: int = 0, write_policy: str = "write_through",
                 write_threshold: int = 2, host_policy: EvictionPolicy | None = None,
                 disk_policy: EvictionPolicy | None = None, record_transfers: bool = False,
                 planner: Any = None, sglang: str = SGLANG_RELEASES[0]) -> None:
        super().__init__(capacity, page_size, policy, pool, leaf_hook=self._new_leaf,
                         sglang=sglang)
        check_tier_values(host_tokens, disk_tokens, write_policy, write_threshold)
        if not host_tokens and not disk_tokens:
            raise ValueError("TieredRadixCache needs cache.host_tokens or cache.disk_tokens > 0 "
                             "(use RadixCache without lower tiers)")
        self.tiers: list[LowerTier | None] = [None]
        for name, size, tier_policy in (("host", host_tokens, host_policy),
                                        ("disk", disk_tokens, disk_policy)):
            if size:
                self.tiers.append(LowerTier(name, size, tier_policy or LRU(), page_size))
                self.eviction.add_tier(self.tiers[-1])
        self.ntiers = len(self.tiers)
        self.lower_tiers = tuple(t.name for t in self.tiers[1:])
        self.write_policy, self.write_threshold = write_policy, write_threshold
        self.transfers: list[Transfer] | None = [] if record_transfers else None
        self.planner = planner
        self.root.tier = TierState(self.ntiers)
        # tokens per tier: loaded from it to the GPU, written into it, evicted from it; dropped
        self.loaded = [0] * self.ntiers
        self.written = [0] * self.ntiers
        self.evicted = [0] * self.ntiers
        self.dropped = 0

    # ---------------------------------------------------------------- where a node lives
    def top(self, node: TreeNode) -> int:
        """The fastest tier holding ``node`` (0: GPU), -1 for none."""
        if len(node.slots):
            return GPU
        for t in range(1, self.ntiers):
            if node.tier.copies[t] is not None:
                return t
        return -1

    def tiers_of(self, node: TreeNode) -> list[str]:
        """Names of the tiers holding ``node``, fastest first."""
        names = ["gpu"] if len(node.slots) else []
        return names + [self.tiers[t].name for t in range(1, self.ntiers)
                        if node.tier.copies[t] is not None]

    def _set_top(self, node: TreeNode, old: int, new: int) -> None:
        kids = node.parent.tier.kids
        kids[old] -= 1
        kids[new] += 1
        self.eviction.offer(node)
        self.eviction.offer(node.parent)

    def _log(self, src: int, src_slots: np.ndarray, dst: int, dst_slots: np.ndarray) -> None:
        if self.transfers is not None:
            self.transfers.append(Transfer(src, src_slots, dst, dst_slots))

    def drain_transfers(self) -> list[Transfer]:
        """The copies logged since the last call, in the order they must be applied."""
        out = self.transfers or []
        if self.transfers is not None:
            self.transfers = []
        return out

    # ---------------------------------------------------------------- the tree, tier-aware
    def _make_eviction(self, evict_unit: str) -> TierEviction:
        """Tier-by-tier eviction: the GPU's heap now, each lower tier's as `__init__` adds it."""
        return TierEviction(self, self.policy)

    def _new_leaf(self, leaf: TreeNode) -> None:
        """``leaf_hook``: a new leaf's tier state, before the tree links and offers it."""
        leaf.tier = TierState(self.ntiers)
        leaf.parent.tier.kids[GPU] += 1

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        head = super()._split(node, at)
        state = TierState(self.ntiers)
        for t in range(1, self.ntiers):
            copy = node.tier.copies[t]
            if copy is not None:
                state.copies[t], node.tier.copies[t] = copy[:at], copy[at:]
        state.kids[self.top(node)] = 1
        head.tier = state
        return head

    def match_prefix(self, key: np.ndarray, requester: Requester | None = None,
                     lookup: bool = False) -> tuple[int, TreeNode, np.ndarray]:
        """Longest cached prefix in any tier: (length, deepest node, slots of its GPU part)."""
        matched, node, slots = super().match_prefix(key, requester, lookup)
        if matched and self.write_policy == "write_through_selective":
            self.lock(node)  # backups make room in the host: not at the expense of this path
            self._after_walk(node)
            self.unlock(node)
        elif matched:
            self._after_walk(node)
        return matched, node, slots

    def insert(self, key: np.ndarray, slots: np.ndarray, requester: Requester | None = None,
               inserted: int = 0) -> int:
        """Cache ``key`` with GPU KV ``slots``; path nodes held only below the GPU adopt their part
        of ``slots``. Returns how many leading tokens were already on the GPU (duplicates)."""
        walked = self._insert_walk(key, slots, requester, inserted)
        if walked is None:
            return 0
        node, kb, at, n = walked
        present = at // TOKEN_BYTES
        on_gpu, new = self._adopt(node, slots)
        if present < n:
            new.append(self._add_leaf(node, kb[at:], slots[present:n].copy(), present, requester,
                                      hits=int(n > inserted)))
        if self.write_policy == "write_through":  # once the whole path is on the GPU
            for x in new:
                self._backup(x)
        self._after_walk(node)
        return on_gpu

    def _adopt(self, node: TreeNode, slots: np.ndarray) -> tuple[int, list[TreeNode]]:
        """Give the path's nodes below the GPU their part of ``slots`` (the request computed them
        again); returns the length of the path's part already on the GPU, and the adopters."""
        below = []
        while node is not self.root and not len(node.slots):
            below.append(node)
            node = node.parent
        for x in reversed(below):
            old = self.top(x)
            x.slots = slots[x.start : x.start + len(x.key)].copy()
            if x.lock_ref:
                self._protected += len(x.key)
            else:
                self._evictable += len(x.key)
            self._set_top(x, old, GPU)
        below.reverse()
        return (0 if node is self.root else node.start + len(node.key)), below

    def _after_walk(self, node: TreeNode) -> None:
        """A walk touched every node from the root to ``node``: re-offer them (a node on a tier
        boundary can be an eviction candidate though it has children), and back up the ones hit
        often enough (write_through_selective)."""
        selective = self.write_policy == "write_through_selective"
        x = node
        while x is not self.root:
            if selective and len(x.slots) and x.tier.copies[1] is None \
                    and x.access_count - 1 >= self.write_threshold:
                self._backup(x)
            if x is not node:  # the walk offered its last node
                self.eviction.offer(x)
            x = x.parent

    # ---------------------------------------------------------------- the request lifecycle
    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        self.policy.on_access(requester)
        matched, node, slots = self.match_prefix(prompt if limit is None else prompt[:limit],
                                                 requester)
        self.lock(node)
        lease = Lease(hit=len(slots), handle=node, slots=slots, requester=requester,
                      prompt=len(prompt))
        lease.lower = matched - len(slots)
        return lease

    def load_back(self, lease: Lease) -> int | None:
        """Load the lease's ``lower`` tokens onto the GPU (right after `acquire`). Returns the
        tokens evicted to make room, or None when the run is recomputed instead: the planner
        finds recomputing faster, or the GPU cannot hold it. Either way ``lease.lower`` becomes 0."""
        if not lease.lower:
            return None
        if lease.num_tokens != lease.cached:
            raise ValueError("load_back must come right after acquire, before extend")
        below, node = [], lease.handle
        while node is not self.root and not len(node.slots):
            below.append(node)
            node = node.parent
        below.reverse()
        loads = dict.fromkeys(self.lower_tiers, 0)
        for x in below:
            loads[self.tiers[self.top(x)].name] += len(x.key)
        need = sum(loads.values())
        if self.planner is not None and not self.planner.worth_loading(lease.cached, loads):
            return self._give_up_lower(lease, node)
        evicted = 0
        if not self.pool.can_alloc(need):
            if self.pool.num_free + self._evictable < need:
                return self._give_up_lower(lease, node)
            evicted = self.evict(need - self.pool.num_free)
        gpu = self.pool.alloc(need)
        at = 0
        for x in below:  # locked: nothing above could evict them meanwhile
            t, n = self.top(x), len(x.key)
            x.slots = gpu[at : at + n]
            at += n
            self._log(t, x.tier.copies[t], GPU, x.slots)
            self._protected += n
            self.loaded[t] += n
            self._set_top(x, t, GPU)
        if self.write_policy == "write_through":
            for x in below:
                self._backup(x)
        lease.reset(np.concatenate([lease.slots, gpu]), cached=lease.cached + need)
        lease.hit += need
        lease.lower = 0
        lease.loaded = loads
        return evicted

    def _give_up_lower(self, lease: Lease, gpu_node: TreeNode) -> None:
        """Keep only the GPU part of the lease's match locked."""
        self.lock(gpu_node)
        self.unlock(lease.handle)
        lease.handle = gpu_node
        lease.lower = 0
        return None

    # ---------------------------------------------------------------- leaving a tier
    def leave_tier(self, node: TreeNode, t: int) -> None:
        """`TieredTree.leave_tier`: take ``node`` (an eviction candidate of tier ``t``) out of tier
        ``t``: free that copy if a slower tier has one, else demote or drop it."""
        self.evicted[t] += len(node.key)
        slower = next((u for u in range(t + 1, self.ntiers) if node.tier.copies[u] is not None),
                      None)
        if slower is None and t + 1 < self.ntiers and (t > GPU or self.write_policy == "write_back"):
            if self._copy_down(node, t + 1):
                slower = t + 1
            elif not node.alive:  # dropped with an ancestor's subtree while making room
                return
        if slower is None:
            self._drop(node)
            return
        if t == GPU:
            self.pool.free(node.slots)
            node.slots = EMPTY_SLOTS
            self._evictable -= len(node.key)
        else:
            self.tiers[t].pool.free(node.tier.copies[t])
            node.tier.copies[t] = None
        self._set_top(node, t, slower)

    def _copy_down(self, node: TreeNode, t: int) -> bool:
        """Copy ``node`` from its top tier into lower tier ``t`` if room can be made there."""
        n = len(node.key)
        if not self.eviction.make_room(t, n) or not node.alive:
            return False
        slots = self.tiers[t].pool.alloc(n)
        src = self.top(node)
        self._log(src, node.slots if src == GPU else node.tier.copies[src], t, slots)
        node.tier.copies[t] = slots
        self.written[t] += n
        return True

    def _backup(self, node: TreeNode) -> None:
        """Write-through: give a GPU node a copy in the first lower tier if there is room."""
        if node.tier.copies[1] is None and node.alive:
            self._copy_down(node, 1)

    def _drop(self, node: TreeNode) -> None:
        """Remove ``node`` and its subtree (held only below the GPU) from every tier."""
        parent = node.parent
        del parent.children[node.kb[: self._kw]]
        parent.tier.kids[self.top(node)] -= 1
        stack = [node]
        while stack:
            x = stack.pop()
            assert not x.lock_ref, f"dropping a locked node {x!r}"
            stack.extend(x.children.values())
            if len(x.slots):
                self.pool.free(x.slots)
                self._evictable -= len(x.slots)
            for t in range(1, self.ntiers):
                copy = x.tier.copies[t]
                if copy is not None:
                    self.tiers[t].pool.free(copy)
                    if x is not node:
                        self.evicted[t] += len(copy)
            x.alive = False
            self.num_nodes -= 1
            self.dropped += len(x.key)
        self.eviction.offer(parent)

    # ---------------------------------------------------------------- checks and figures
    def tier_summary(self) -> dict[str, Any]:
        """Run-level tier figures for summary.json."""
        out: dict[str, Any] = {"write_policy": self.write_policy,
                               "evicted_tokens_gpu": self.evicted[GPU]}
        for t in range(1, self.ntiers):
            name = self.tiers[t].name
            out |= {f"{name}_tokens": self.tiers[t].pool.capacity,
                    f"loaded_tokens_{name}": self.loaded[t],
                    f"written_tokens_{name}": self.written[t],
                    f"evicted_tokens_{name}": self.evicted[t]}
        out["dropped_tokens"] = self.dropped
        return out

    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        """Raise AssertionError unless the tiered cache is consistent
        (`testbed.cache.tree_checks.check_tiered_tree`)."""
        check_tiered_tree(self, leases)


def make_tiered_cache(cache_cfg: Mapping[str, Any], capacity_tokens: int | None,
                      policy: EvictionPolicy | None = None, planner: Any = None,
                      record_transfers: bool = False, sglang: str = SGLANG_RELEASES[0]
                      ) -> TieredRadixCache | None:
    """The tiered radix cache the ``cache`` config group asks for (its tier settings:
    `testbed.cache.tier_config.tier_options`), or None when it asks for no lower tier;
    ``sglang``: whose insert rule it follows (`RadixCache`)."""
    options = tier_options(cache_cfg)
    if options is None:
        return None
    return TieredRadixCache(capacity_tokens, page_size=cache_cfg.get("page_size") or 1,
                            policy=policy, record_transfers=record_transfers, planner=planner,
                            sglang=sglang, **options)
