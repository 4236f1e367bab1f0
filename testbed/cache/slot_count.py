"""`SlotCount`: a KV pool that counts its slots instead of naming them, for a backend that holds
no KV (the replay, `testbed.backends.replay`).

What the replay asks of a pool is how many slots are free; it takes runs of slots for new
entries and gives back an evicted entry's run. Which ids those are changes no hit, eviction or
count. `KVSlotPool` names them: its free pages sit on a sorted stack, and freed pages are sorted
back onto it (SGLang's allocator, which the engine needs: its KV lies where the ids say). On the
Mooncake conversation trace at 1M tokens that bookkeeping (5,210 merges of about 24,000 pages,
and the copies of every run taken and given back) was two thirds of the replay's time: 0.57 s
against 0.19 s with counts, the same hits and evictions request by request (2026-12-07).

A `SlotCount` hands out ``range(n)``: a run of ``n`` placeholder ids that has a length, slices
in constant time and holds no memory, so the tree's nodes split and trim their runs as they do
arrays. `RadixCache.count_slots` switches a cache to it where the replay takes the one-walk path
(page size 1, no lower tiers) before anything is allocated; the replay backend asks for that.
"""

from __future__ import annotations

from testbed.cache.pool import OutOfSlots


class SlotCount:
    """A pool of ``capacity`` slots (None: unbounded) that counts what it hands out; page size 1.
    Counts as `KVSlotPool` counts (``num_free``, ``can_alloc``, `OutOfSlots`), ids it has none."""

    page_size = 1
    keep_runs = False  # (the engine's placement rule: nothing to place here)

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"pool capacity must be >= 0 or None, got {capacity}")
        self.capacity = capacity
        self.held = 0  # slots handed out and not given back

    @property
    def unbounded(self) -> bool:
        return self.capacity is None

    @property
    def num_free(self) -> int:
        """Slots not handed out (0 for an unbounded pool, which can always hand out more)."""
        return 0 if self.capacity is None else self.capacity - self.held

    @property
    def num_minted(self) -> int:
        return self.held if self.capacity is None else self.capacity

    def round_up(self, num_tokens: int) -> int:
        return num_tokens

    def can_alloc(self, n: int) -> bool:
        return self.capacity is None or n <= self.capacity - self.held

    def alloc(self, n: int) -> range:
        """``n`` slots, as a run of placeholder ids; OutOfSlots when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots: {n}")
        if self.capacity is not None and n > self.capacity - self.held:
            raise OutOfSlots(f"asked for {n} slots, {self.num_free} free of {self.capacity}")
        self.held += n
        return range(n)

    def alloc_split(self, n: int, k: int) -> tuple[range, range]:
        """`alloc(n)` cut after its first ``k`` slots."""
        if not 0 <= k <= n:
            raise ValueError(f"alloc_split: cannot cut {n} slots after {k}")
        self.alloc(n)
        return range(k), range(n - k)

    def free(self, slots) -> None:
        self.held -= len(slots)

    def assert_whole_pages(self, slots) -> None:
        """Every run is whole pages of one slot."""

    def check_ownership(self, owned: list) -> None:
        """Assert that the runs ``owned`` hold exactly the slots handed out (ids there are none
        to check)."""
        held = sum(len(run) for run in owned)
        assert held == self.held, f"{held} slots accounted for, {self.held} handed out"
