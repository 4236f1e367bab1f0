"""The block-hash cache's free queue: which free block is reused next.

Free blocks without a key (never cached, or whose key was dropped) are reused first, most recently
freed first, as vLLM puts them at the head of its queue. Free blocks that still hold cached KV follow,
in the eviction policy's order; with LRU (the key is the time the block was freed) this is exactly
vLLM's FIFO free queue.

Blocks come and go in batches (a request's hits leave the queue together, its blocks come back
together), so every operation takes an array of blocks. With LRU the keyed blocks sit in a ring of
(block, stamp) entries in the order they were freed; an entry is live while the block's current
stamp is its stamp, so taking a block out is one vectorised store and popping the oldest ``n``
skips stale entries a slice at a time. Other policies keep a heap of (priority, version, block),
lazily invalidated the same way, fed one block at a time.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass
from itertools import count
from typing import Any

import numpy as np

from testbed.cache.eviction import LRU, EvictionPolicy

BLOCK_DTYPE = np.int64


@dataclass(slots=True)
class BlockStats:
    """What policies see of a cached block (the radix node's statistics, per block)."""

    id: int
    created: int
    last_access: int
    start: int  # tokens before the block on its sequence
    size: int
    access_count: int = 1
    priority: int = 0
    category: str | None = None

    # Blocks have no insert walk nor branch: a hit is a match (``eviction.hits`` reads the same
    # count either way), and a block's history is its own depth.
    @property
    def hits(self) -> int:
        return self.access_count

    @property
    def history(self) -> int:
        return self.start + self.size


class FreeBlockQueue:
    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        # Plain LRU keys (free times) only grow: the heap would be a FIFO queue, so keep one.
        self.fifo = type(policy) is LRU
        self._unkeyed: deque[int] = deque()
        self._keyed_count = 0
        # FIFO: the ring of keyed free blocks (live entries between head and tail) and the stamp
        # of each block's live entry (-1: not a keyed free block)
        self._ring = np.zeros(1024, BLOCK_DTYPE)
        self._ring_stamps = np.zeros(1024, np.int64)
        self._head = self._tail = 0
        self._stamp = np.full(0, -1, np.int64)
        self._next_stamp = 0
        # heap: (priority, version, block) entries; a block's live version
        self._heap: list[tuple[Any, int, int]] = []
        self._keyed: dict[int, int] = {}
        self._versions = count()

    def reserve(self, num_blocks: int) -> None:
        """Make room for block ids below ``num_blocks``."""
        if num_blocks > len(self._stamp):
            grown = np.full(max(num_blocks, 2 * len(self._stamp)), -1, np.int64)
            grown[: len(self._stamp)] = self._stamp
            self._stamp = grown

    def __len__(self) -> int:
        return len(self._unkeyed) + self._keyed_count

    @property
    def num_keyed(self) -> int:
        return self._keyed_count

    def blocks(self) -> list[int]:
        """Every free block, in the order they would be reused (for invariant checks)."""
        if self.fifo:
            ring = self._ring[self._head : self._tail]
            live = self._stamp[ring] == self._ring_stamps[self._head : self._tail]
            keyed = ring[live].tolist()
        else:
            keyed = [b for _, v, b in sorted(self._heap) if self._keyed.get(b) == v]
        return [*self._unkeyed, *keyed]

    def head_is_keyed(self) -> bool:
        """Whether the next block to reuse still holds cached KV (reusing it evicts)."""
        return not self._unkeyed and self._keyed_count > 0

    def push_unkeyed(self, blocks: list[int], head: bool = True) -> None:
        """Blocks without a key are freed: to the head (reused next), the first given first, as
        vLLM's ``FreeKVCacheBlockQueue.prepend_n`` puts them, or to the tail of the unkeyed
        ones."""
        if head:
            self._unkeyed.extendleft(reversed(blocks))
        else:
            self._unkeyed.extend(blocks)

    def pop_unkeyed(self, n: int) -> np.ndarray:
        """Up to ``n`` unkeyed blocks from the head."""
        u = min(n, len(self._unkeyed))
        return np.fromiter((self._unkeyed.popleft() for _ in range(u)), BLOCK_DTYPE, u)

    def push_keyed(self, blocks: np.ndarray, stats: list | None = None) -> None:
        """Cached blocks are freed, in this order (``stats``, one per block, unused by FIFO)."""
        m = len(blocks)
        if not m:
            return
        self._keyed_count += m
        if not self.fifo:
            for block, s in zip(blocks.tolist(), stats):
                version = next(self._versions)
                self._keyed[block] = version
                heapq.heappush(self._heap, (self.policy.priority(s), version, block))
            if len(self._heap) > 2 * len(self._keyed) + 1024:
                self._heap = [e for e in self._heap if self._keyed.get(e[2]) == e[1]]
                heapq.heapify(self._heap)
            return
        if self._tail + m > len(self._ring):
            self._compact(m)
        stamps = np.arange(self._next_stamp, self._next_stamp + m, dtype=np.int64)
        self._ring[self._tail : self._tail + m] = blocks
        self._ring_stamps[self._tail : self._tail + m] = stamps
        self._stamp[blocks] = stamps
        self._tail += m
        self._next_stamp += m

    def remove_keyed(self, blocks: np.ndarray) -> None:
        """Cached free blocks are hit: they leave the queue (their entries go stale)."""
        self._keyed_count -= len(blocks)
        if self.fifo:
            self._stamp[blocks] = -1
        else:
            for block in blocks.tolist():
                del self._keyed[block]

    def pop(self, n: int) -> tuple[np.ndarray, np.ndarray, list | None]:
        """The next ``n`` blocks to reuse: (those without a key, in order; those that still hold
        cached KV, in eviction order; their eviction keys, None for FIFO). The caller checked
        that ``n`` are free."""
        unkeyed = self.pop_unkeyed(n)
        keyed, keys = self.pop_keyed(n - len(unkeyed))
        if len(unkeyed) + len(keyed) < n:
            raise IndexError(f"pop of {n} blocks from a free queue of {len(unkeyed) + len(keyed)}")
        return unkeyed, keyed, keys

    def pop_keyed(self, n: int) -> tuple[np.ndarray, list | None]:
        """Up to ``n`` keyed blocks in eviction order, and their keys (None for FIFO)."""
        n = min(n, self._keyed_count)
        if n <= 0:
            return np.zeros(0, BLOCK_DTYPE), None if self.fifo else []
        self._keyed_count -= n
        if not self.fifo:
            out, keys = [], []
            while len(out) < n:
                key, version, block = heapq.heappop(self._heap)
                if self._keyed.get(block) == version:
                    del self._keyed[block]
                    out.append(block)
                    keys.append(key)
            return np.asarray(out, BLOCK_DTYPE), keys
        parts, need = [], n
        while need:
            if self._head == self._tail:
                raise RuntimeError("free queue: fewer live keyed blocks than counted")
            end = min(self._tail, self._head + max(2 * need, 64))
            ring = self._ring[self._head : end]
            live = (self._stamp[ring] == self._ring_stamps[self._head : end]).nonzero()[0]
            if len(live) >= need:
                live = live[:need]
                self._head += int(live[-1]) + 1
            else:
                self._head = end
            parts.append(ring[live])
            need -= len(live)
        out = np.concatenate(parts) if len(parts) > 1 else parts[0]
        self._stamp[out] = -1
        return out, None

    def _compact(self, extra: int) -> None:
        """Drop stale entries (and grow the ring if it is still too small for ``extra`` more)."""
        ring = self._ring[self._head : self._tail]
        stamps = self._ring_stamps[self._head : self._tail]
        live = self._stamp[ring] == stamps
        ring, stamps = ring[live], stamps[live]
        size = len(self._ring)
        while len(ring) + extra > size // 2:
            size *= 2
        if size != len(self._ring):
            self._ring = np.zeros(size, BLOCK_DTYPE)
            self._ring_stamps = np.zeros(size, np.int64)
        self._ring[: len(ring)] = ring
        self._ring_stamps[: len(ring)] = stamps
        self._head, self._tail = 0, len(ring)
