"""KV-slot pool: a token-granular allocator of integer slot ids, shared by the simulator and engine.

Slot ``0`` is reserved (the engine's padding slot), so a pool of capacity ``C`` hands out ids
``1..C``. The free list is one integer array used as a stack, so ``alloc(n)`` and ``free(slots)``
are single vectorised slice operations whatever ``n`` is. ``capacity=None`` makes an unbounded pool
that mints fresh ids when its free list runs dry (the replay backend's "unlimited cache").
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int32


class OutOfSlots(RuntimeError):
    """Raised when more slots are requested than the pool has free."""


class KVSlotPool:
    """Allocator of KV slot ids ``1..capacity`` (or unbounded when ``capacity`` is None)."""

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"pool capacity must be >= 0 or None, got {capacity}")
        self.capacity = capacity
        # Stack of free ids; the top is at index `_top - 1`. Laid out so the first allocation
        # returns 1, 2, 3, ... which keeps traces of slot ids easy to read.
        size = capacity if capacity is not None else 1024
        self._stack = np.zeros(size, dtype=SLOT_DTYPE)
        self._top = 0
        self._minted = 0  # highest id ever handed out or put on the stack
        if capacity is not None:
            self._stack[:] = np.arange(capacity, 0, -1, dtype=SLOT_DTYPE)
            self._top = capacity
            self._minted = capacity

    @property
    def unbounded(self) -> bool:
        return self.capacity is None

    @property
    def num_free(self) -> int:
        """Free slots on the free list (an unbounded pool can always mint more)."""
        return self._top

    @property
    def num_minted(self) -> int:
        """Ids in existence: ``capacity`` for a bounded pool, the high-water mark otherwise."""
        return self._minted

    def can_alloc(self, n: int) -> bool:
        return self.capacity is None or n <= self._top

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free slots (ascending on a fresh pool); raises OutOfSlots if not available."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots: {n}")
        if n > self._top:
            if self.capacity is not None:
                raise OutOfSlots(f"asked for {n} slots, {self._top} free of {self.capacity}")
            self._mint(n - self._top)
        out = self._stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        return out

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the pool. Caller guarantees they were allocated and not yet freed."""
        k = len(slots)
        if k == 0:
            return
        self._ensure_room(self._top + k)
        self._stack[self._top : self._top + k] = slots[::-1]
        self._top += k

    def free_slots(self) -> np.ndarray:
        """A copy of the free list (for invariant checks)."""
        return self._stack[: self._top].copy()

    def check_ownership(self, owned: list[np.ndarray]) -> None:
        """Assert that every slot id in existence is free xor in exactly one of ``owned``."""
        everything = np.concatenate(owned + [self.free_slots()])
        assert len(everything) == self._minted, \
            f"{len(everything)} slots accounted for, {self._minted} exist"
        assert np.array_equal(np.sort(everything), np.arange(1, self._minted + 1)), \
            "a slot is owned twice or lost"

    def _mint(self, n: int) -> None:
        # Fresh ids go under the existing free ones so that recycled slots are reused first.
        self._ensure_room(self._top + n)
        fresh = np.arange(self._minted + n, self._minted, -1, dtype=SLOT_DTYPE)
        self._stack[n : n + self._top] = self._stack[: self._top].copy()
        self._stack[:n] = fresh
        self._top += n
        self._minted += n

    def _ensure_room(self, size: int) -> None:
        if size > len(self._stack):
            grown = np.zeros(max(size, 2 * len(self._stack)), dtype=SLOT_DTYPE)
            grown[: self._top] = self._stack[: self._top]
            self._stack = grown
