"""Block-hash prefix cache: vLLM V1's automatic prefix caching, exact to docs/design.md §4.

KV is held in blocks of ``block_size`` tokens. A full block's key chains the previous block's key
with its own tokens, so equal keys mean equal prefixes; a partial last block has no key and is never
shared. All blocks not used by a running request sit in one free queue: cached (keyed) blocks are
reused least-recently-freed first, and a block popped for reuse loses its key (that is eviction).

Replay of one request (``seq = prompt + output``, ``nb = ceil(len(seq)/B)``), as vLLM's
KVCacheManager does it: take the ``k`` leading cached blocks of the prompt out of the free queue
(among the first ``(len(prompt)-1)//B``, so the last prompt token is always computed), pop
``nb - k`` blocks from the queue head (evicting their keys), register the key of every full block
from ``k`` on, then free the request's blocks last to first: keyed blocks to the queue tail, the
unkeyed partial block to the head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from testbed.cache.base import Lease, PrefixCache, Released
from testbed.cache.eviction import Requester
from testbed.cache.eviction import LRU, EvictionPolicy
from testbed.cache.free_queue import BlockStats, FreeBlockQueue
from testbed.cache.pool import SLOT_DTYPE


@dataclass
class _Handle:
    blocks: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # chained keys of the sequence's full blocks
    registered: int = 0  # leading blocks whose keys are in the cache (hits, then committed)


class BlockHashCache(PrefixCache):
    """Hash-keyed KV blocks with a FIFO free queue (vLLM V1). ``capacity`` in tokens; None means
    unbounded (fresh blocks are minted instead of reusing cached ones)."""

    name = "block_hash"

    def __init__(self, capacity: int | None = None, block_size: int = 16,
                 policy: EvictionPolicy | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"cache.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = None if capacity is None else capacity // block_size
        self.policy = policy if policy is not None else LRU()
        self._free = FreeBlockQueue(self.policy)
        self._minted = 0
        self._clock = 0
        if self.num_blocks is not None:
            for _ in range(self.num_blocks):
                self._mint(head=False)
        self._ref = {}  # block id -> running requests using it (absent or 0 when free)
        self._key_of: dict[int, int] = {}  # block id -> its key, for cached blocks
        self._stats: dict[int, BlockStats] = {}  # block id -> statistics, for cached blocks
        # key -> blocks holding it, oldest registration first (lookups use the first)
        self._blocks_of: dict[int, dict[int, None]] = {}
        self._cached_tokens = 0
        self._protected_tokens = 0

    # ---------------------------------------------------------------- keys
    def block_keys(self, tokens: np.ndarray, known: list[int] | None = None) -> list[int]:
        """Chained keys of the full blocks of ``tokens``; ``known`` are already computed keys of
        its leading blocks (a prompt's, when keying prompt + output)."""
        b = self.block_size
        keys = list(known or [])
        start, n = len(keys), len(tokens) // b
        rows = np.ascontiguousarray(tokens[start * b : n * b], dtype=np.int64).reshape(n - start, b)
        prev = keys[-1] if keys else 0
        for row in rows:
            prev = hash((prev, row.tobytes()))
            keys.append(prev)
        return keys

    def _lookup(self, keys: list[int], prompt_len: int, limit: int | None = None) -> list[int]:
        """Blocks of the leading cached keys, among the first (prompt_len - 1) // B (and covering
        at most ``limit`` tokens)."""
        eligible = max(prompt_len - 1, 0)
        if limit is not None:
            eligible = min(eligible, limit)
        found = []
        for key in keys[: eligible // self.block_size]:
            holders = self._blocks_of.get(key)
            if not holders:
                break
            found.append(next(iter(holders)))
        return found

    # ---------------------------------------------------------------- sizes
    @property
    def evictable_size(self) -> int:
        return self._cached_tokens - self._protected_tokens

    @property
    def protected_size(self) -> int:
        return self._protected_tokens

    def fits(self, num_tokens: int) -> bool:
        return self.num_blocks is None or -(-num_tokens // self.block_size) <= self.num_blocks

    # ---------------------------------------------------------------- lifecycle
    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        # A look-up (as vLLM's scheduler computes a hit): no statistics change, no policy access.
        return len(self._lookup(self.block_keys(tokens), len(tokens), limit)) * self.block_size

    @property
    def available_size(self) -> float:
        return math.inf if self.num_blocks is None else len(self._free) * self.block_size

    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        self.policy.on_access(requester)
        handle = _Handle(keys=self.block_keys(prompt))
        for block in self._lookup(handle.keys, len(prompt), limit):
            self._take(block, requester)
            handle.blocks.append(block)
        handle.registered = len(handle.blocks)
        hit = len(handle.blocks) * self.block_size
        return Lease(hit=hit, handle=handle, slots=self._slots(handle.blocks, 0, hit),
                     requester=requester)

    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        handle: _Handle = lease.handle
        total = lease.num_tokens + num_tokens
        need = -(-total // self.block_size) - len(handle.blocks)
        if self.num_blocks is not None and need > len(self._free):
            return None
        evicted = 0
        for _ in range(need):
            if self.num_blocks is None and (not len(self._free) or self._free.head_is_keyed()):
                self._mint(head=True)  # unbounded: never reuse a cached block
            block, key = self._free.pop()
            if key is not None:
                self._forget(block, key)
                evicted += self.block_size
            self._ref[block] = 1
            handle.blocks.append(block)
        lease.append(self._slots(handle.blocks, lease.num_tokens, total))
        return evicted

    def extension_cost(self, lease: Lease, num_tokens: int) -> int:
        blocks = -(-(lease.num_tokens + num_tokens) // self.block_size) - len(lease.handle.blocks)
        return blocks * self.block_size

    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        handle: _Handle = lease.handle
        if insert and len(tokens) > lease.num_tokens:
            raise ValueError(f"release: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        if insert:
            self._register_full_blocks(handle, tokens, lease.requester)
        for block in reversed(handle.blocks):  # last to first: a sequence's tail is reused first
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._key_of:
                    self._protected_tokens -= self.block_size
                    self._clock += 1
                    stats = self._stats.get(block)
                    if stats is not None:
                        stats.last_access = self._clock
                    self._free.push_keyed(block, stats)
                else:
                    self._free.push_unkeyed(block, head=True)
        lease.reset(lease.slots[:0], 0)
        return Released(inserted=insert, already_cached=lease.hit)

    def commit(self, lease: Lease, tokens: np.ndarray) -> None:
        if len(tokens) > lease.num_tokens:
            raise ValueError(f"commit: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        self._register_full_blocks(lease.handle, tokens, lease.requester)
        lease.cached = lease.handle.registered * self.block_size

    def _register_full_blocks(self, handle: _Handle, tokens: np.ndarray,
                              requester: Requester | None) -> None:
        """Give every full block of ``tokens`` not yet registered its key (vLLM's cache_blocks)."""
        handle.keys = self.block_keys(tokens, known=handle.keys[: len(tokens) // self.block_size])
        for i in range(handle.registered, len(handle.keys)):
            self._register(handle.blocks[i], handle.keys[i], i * self.block_size, requester)
        handle.registered = max(handle.registered, len(handle.keys))

    def evict(self, num_tokens: int) -> int:
        """Drop keys of cached free blocks in policy order until ``num_tokens`` are freed."""
        freed = 0
        while freed < num_tokens:
            popped = self._free.pop_keyed()
            if popped is None:
                break
            self._forget(*popped)
            self._free.push_unkeyed(popped[0], head=False)
            freed += self.block_size
        return freed

    # ---------------------------------------------------------------- block bookkeeping
    def _mint(self, head: bool) -> None:
        self._free.push_unkeyed(self._minted, head=head)
        self._minted += 1

    def _take(self, block: int, requester: Requester | None) -> None:
        """A request hits a cached block: it leaves the free queue if it was there."""
        if self._ref.get(block, 0) == 0:
            self._free.remove_keyed(block)
            self._protected_tokens += self.block_size
        self._ref[block] = self._ref.get(block, 0) + 1
        if self._free.fifo:  # plain LRU needs no statistics
            return
        stats = self._stats[block]
        stats.access_count += 1
        if requester is not None:
            stats.priority = min(stats.priority, requester.priority)
        self.policy.on_hit(stats)

    def _register(self, block: int, key: int, start: int, requester: Requester | None) -> None:
        assert block not in self._key_of, "only freshly popped blocks are registered"
        self._key_of[block] = key
        self._blocks_of.setdefault(key, {})[block] = None
        self._cached_tokens += self.block_size
        self._protected_tokens += self.block_size  # registered while the request still holds it
        self._clock += 1
        if self._free.fifo:
            return
        stats = BlockStats(id=block, created=self._clock, last_access=self._clock, start=start,
                           size=self.block_size,
                           priority=requester.priority if requester else 0,
                           category=requester.category if requester else None)
        self._stats[block] = stats
        self.policy.on_create(stats)

    def _forget(self, block: int, evict_key: Any = None) -> None:
        stats = self._stats.pop(block, None)
        if evict_key is not None and stats is not None:
            self.policy.on_evict(stats, evict_key)
        key = self._key_of.pop(block)
        holders = self._blocks_of[key]
        del holders[block]
        if not holders:
            del self._blocks_of[key]
        self._cached_tokens -= self.block_size

    def _slots(self, blocks: list[int], start: int, end: int) -> np.ndarray:
        """Token-level slot ids of token positions ``start..end-1`` (slot 0 stays reserved)."""
        b = self.block_size
        positions = np.arange(start, end)
        owners = np.asarray(blocks, dtype=SLOT_DTYPE)[positions // b]
        return (owners * b + 1 + positions % b).astype(SLOT_DTYPE)

    # ---------------------------------------------------------------- checks
    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        in_use = {b for b, r in self._ref.items() if r > 0}
        assert all(r >= 0 for r in self._ref.values()), "negative block ref count"
        free = self._free.blocks()
        assert len(set(free)) == len(free), "a block is free twice"
        assert not in_use & set(free), "a block is both free and in use"
        assert len(in_use) + len(free) == self._minted, "a block is lost"
        held = [b for lease in leases for b in lease.handle.blocks]
        for b in set(held):
            assert self._ref.get(b, 0) == held.count(b), f"block {b}: ref count != holders"
        assert set(held) == in_use, "in-use blocks not accounted for by the leases"
        assert self._cached_tokens == len(self._key_of) * self.block_size
        protected = sum(self.block_size for b in self._key_of if b in in_use)
        assert protected == self._protected_tokens, "protected accounting drifted"
        for key, holders in self._blocks_of.items():
            assert holders and all(self._key_of[b] == key for b in holders), "key index drifted"
