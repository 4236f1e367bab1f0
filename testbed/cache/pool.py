"""KV-slot pool: an allocator of integer slot ids in whole pages, shared by the simulator and engine.

Slot ``0`` is reserved (the engine's padding slot). With ``page_size`` P, page ``p`` covers the
slots ``p*P+1 .. p*P+P``; the pool hands out and takes back whole pages only, as SGLang's
``PagedTokenToKVPoolAllocator`` does, so a sequence of ``n`` tokens occupies ``ceil(n/P)`` pages.
A capacity that is not a multiple of P is rounded down to whole pages. With ``P == 1`` a page is a
slot: a pool of capacity ``C`` hands out ids ``1..C``.

The free list is one integer array of pages (each named by its first slot id) used as a stack, so
``alloc(n)`` is a single vectorised slice whatever ``n`` is. Freed pages wait apart (``free``
appends them to a released list) until an allocation finds the stack short; then the two are
merged and sorted, lowest page on top, as SGLang's allocators do under ``need_sort``
(``merge_and_sort_free``, mem_cache/allocator/base.py in the 0.5.23 wheel). Why: the CPU's decode
kernel reads each request's KV where its slots lie, and slots handed out in freeing order scatter
a request over the pool as a server lives on (30 layers of decode attention, 16 requests of 448
tokens: 12.9 ms on ascending slots, 75.7 ms on randomly placed ones; `python -m
experiments.benchmarks.slot_order`); sorted, a request's slots run ascending through the holes.
``capacity=None`` makes an unbounded pool that mints fresh pages when its free list runs dry (the
replay backend's "unlimited cache").
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput

SLOT_DTYPE = np.int32


class OutOfSlots(RuntimeError):
    """Raised when more slots are requested than the pool has free."""


class KVSlotPool:
    """Allocator of KV slot ids ``1..capacity`` in pages of ``page_size`` (unbounded when
    ``capacity`` is None). Counts are in slots (tokens) throughout; they are multiples of
    ``page_size``."""

    def __init__(self, capacity: int | None, page_size: int = 1) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"pool capacity must be >= 0 or None, got {capacity}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise BadInput(f"cache.page_size must be an integer >= 1, got {page_size!r}")
        self.page_size = page_size
        self.capacity = None if capacity is None else capacity - capacity % page_size
        # Stack of the first slot ids of free pages; the top is at index `_top - 1`. Laid out so
        # the first allocation returns 1, 2, 3, ... which keeps traces of slot ids easy to read.
        pages = self.capacity // page_size if self.capacity is not None else 1024
        self._stack = np.zeros(pages, dtype=SLOT_DTYPE)
        self._top = 0  # free pages on the stack
        self._released: list[np.ndarray] = []  # freed pages (first slot ids), not yet merged
        self._num_released = 0
        self._minted = 0  # pages ever handed out or put on the stack
        if self.capacity is not None:
            self._stack[:] = self._firsts(pages, 0)
            self._top = pages
            self._minted = pages

    @property
    def unbounded(self) -> bool:
        return self.capacity is None

    @property
    def num_free(self) -> int:
        """Free slots on the free list, whole pages (an unbounded pool can always mint more)."""
        return (self._top + self._num_released) * self.page_size

    @property
    def num_minted(self) -> int:
        """Slot ids in existence: ``capacity`` for a bounded pool, the high-water mark otherwise."""
        return self._minted * self.page_size

    def round_up(self, num_tokens: int) -> int:
        """Slots of the whole pages that ``num_tokens`` tokens occupy."""
        return -(-num_tokens // self.page_size) * self.page_size

    def can_alloc(self, n: int) -> bool:
        """Whether the free pages hold ``n`` slots (an unbounded pool always can)."""
        return self.capacity is None or n <= self.num_free

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free slots, a multiple of ``page_size``: ``n / page_size`` whole pages, each
        page's slots ascending (ascending throughout on a fresh pool). Raises OutOfSlots if not
        available."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots: {n}")
        if n % self.page_size:
            raise ValueError(f"alloc of {n} slots is not whole pages of {self.page_size}")
        k = n // self.page_size
        if k > self._top and self._num_released:
            self._merge_released()
        if k > self._top:
            if self.capacity is not None:
                raise OutOfSlots(f"asked for {n} slots, {self.num_free} free of {self.capacity}")
            self._mint(k - self._top)
        firsts = self._stack[self._top - k : self._top][::-1]
        self._top -= k
        return self._expand(firsts)

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the pool: whole pages (asserted), each page's slots in order. Caller
        guarantees they were allocated and not yet freed."""
        if len(slots) == 0:
            return
        if self.page_size > 1:
            self.assert_whole_pages(slots)
            slots = slots[:: self.page_size]
        self._released.append(np.array(slots, dtype=SLOT_DTYPE))
        self._num_released += len(slots)

    def free_slots(self) -> np.ndarray:
        """A copy of the free list, slot by slot (for invariant checks)."""
        return self._expand(np.concatenate([self._stack[: self._top], *self._released]))

    def _merge_released(self) -> None:
        """The released pages onto the stack, all free pages sorted, the lowest on top."""
        merged = np.sort(np.concatenate([self._stack[: self._top], *self._released]))[::-1]
        self._ensure_room(len(merged))
        self._stack[: len(merged)] = merged
        self._top = len(merged)
        self._released, self._num_released = [], 0

    def check_ownership(self, owned: list[np.ndarray]) -> None:
        """Assert that every slot id in existence is free xor in exactly one of ``owned``."""
        everything = np.concatenate(owned + [self.free_slots()])
        assert len(everything) == self.num_minted, \
            f"{len(everything)} slots accounted for, {self.num_minted} exist"
        assert np.array_equal(np.sort(everything), np.arange(1, self.num_minted + 1)), \
            "a slot is owned twice or lost"

    def assert_whole_pages(self, slots: np.ndarray) -> None:
        """Assert that ``slots`` are whole pages, each page's slots in order."""
        p = self.page_size
        if p == 1:
            return
        assert len(slots) % p == 0, f"{len(slots)} slots are not whole pages of {p}"
        pages = np.asarray(slots).reshape(-1, p)
        assert np.all((pages[:, 0] - 1) % p == 0), "a page does not start at a page boundary"
        assert np.array_equal(pages - pages[:, :1], np.broadcast_to(np.arange(p), pages.shape)), \
            "a page's slots are not its contiguous run"

    def _firsts(self, n: int, above: int) -> np.ndarray:
        """First slot ids of pages ``above + n - 1`` down to ``above`` (stack order: top last)."""
        return (np.arange(above + n - 1, above - 1, -1, dtype=SLOT_DTYPE) * self.page_size
                + 1).astype(SLOT_DTYPE)

    def _expand(self, firsts: np.ndarray) -> np.ndarray:
        """Every slot of the pages whose first slots are ``firsts``, page by page."""
        if self.page_size == 1:
            return firsts.copy()
        offsets = np.arange(self.page_size, dtype=SLOT_DTYPE)
        return (firsts[:, None] + offsets).ravel().astype(SLOT_DTYPE)

    def _mint(self, n: int) -> None:
        # Fresh pages go under the existing free ones so that recycled pages are reused first.
        self._ensure_room(self._top + n)
        fresh = self._firsts(n, self._minted)
        self._stack[n : n + self._top] = self._stack[: self._top].copy()
        self._stack[:n] = fresh
        self._top += n
        self._minted += n

    def _ensure_room(self, size: int) -> None:
        if size > len(self._stack):
            grown = np.zeros(max(size, 2 * len(self._stack)), dtype=SLOT_DTYPE)
            grown[: self._top] = self._stack[: self._top]
            self._stack = grown
