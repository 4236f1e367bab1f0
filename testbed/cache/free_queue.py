"""The block-hash cache's free queue: which free block is reused next.

Free blocks without a key (never cached, or whose key was dropped) are reused first, most recently
freed first, as vLLM puts them at the head of its queue. Free blocks that still hold cached KV follow,
in the eviction policy's order; with LRU (the key is the time the block was freed) this is exactly
vLLM's FIFO free queue. Keyed entries are invalidated lazily, as in the radix cache's heap.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from dataclasses import dataclass
from itertools import count
from typing import Any

from testbed.cache.eviction import LRU, EvictionPolicy


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


class FreeBlockQueue:
    def __init__(self, policy: EvictionPolicy) -> None:
        self.policy = policy
        # Plain LRU keys (free times) only grow: the heap would be a FIFO queue, so keep one.
        self.fifo = type(policy) is LRU
        self._fifo: OrderedDict[int, None] = OrderedDict()
        self._unkeyed: deque[int] = deque()
        self._heap: list[tuple[Any, int, int]] = []
        self._keyed: dict[int, int] = {}  # free keyed block -> version of its live heap entry
        self._versions = count()

    def __len__(self) -> int:
        return len(self._unkeyed) + len(self._keyed) + len(self._fifo)

    def blocks(self) -> list[int]:
        return [*self._unkeyed, *self._keyed, *self._fifo]

    def head_is_keyed(self) -> bool:
        """Whether the next block to reuse still holds cached KV (reusing it evicts)."""
        return not self._unkeyed and bool(self._keyed or self._fifo)

    def push_unkeyed(self, block: int, head: bool = True) -> None:
        if head:
            self._unkeyed.appendleft(block)
        else:
            self._unkeyed.append(block)

    def push_keyed(self, block: int, stats: BlockStats | None) -> None:
        """A cached block is freed (``stats`` may be None in FIFO mode)."""
        if self.fifo:
            self._fifo[block] = None
            return
        version = next(self._versions)
        self._keyed[block] = version
        heapq.heappush(self._heap, (self.policy.priority(stats), version, block))
        if len(self._heap) > 2 * len(self._keyed) + 1024:
            self._heap = [e for e in self._heap if self._keyed.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def remove_keyed(self, block: int) -> None:
        """A cached free block is hit: it leaves the queue (its heap entry goes stale)."""
        if self.fifo:
            del self._fifo[block]
        else:
            del self._keyed[block]

    def pop(self) -> tuple[int, Any]:
        """The next block to reuse and, if it still holds cached KV, its eviction key (else None)."""
        if self._unkeyed:
            return self._unkeyed.popleft(), None
        popped = self.pop_keyed()
        if popped is None:
            raise IndexError("pop from an empty free queue")
        return popped

    def pop_keyed(self) -> tuple[int, Any] | None:
        if self.fifo:  # the key of a FIFO entry is its position: report 0, never None
            return (self._fifo.popitem(last=False)[0], 0) if self._fifo else None
        while self._heap:
            key, version, block = heapq.heappop(self._heap)
            if self._keyed.get(block) == version:
                del self._keyed[block]
                return block, key
        return None
