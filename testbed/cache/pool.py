"""KV-slot pool: an allocator of integer slot ids in whole pages, shared by the simulator and engine.

Slot ``0`` is reserved (the engine's padding slot). With ``page_size`` P, page ``p`` covers the
slots ``p*P+1 .. p*P+P``; the pool hands out and takes back whole pages only, as SGLang's
``PagedTokenToKVPoolAllocator`` does, so a sequence of ``n`` tokens occupies ``ceil(n/P)`` pages.
A capacity that is not a multiple of P is rounded down to whole pages. With ``P == 1`` a page is a
slot: a pool of capacity ``C`` hands out ids ``1..C``.

The free list is one integer array of pages (each named by its first slot id) used as a stack, so
``alloc(n)`` is a single vectorised slice whatever ``n`` is. Freed pages wait apart (``free`` marks
them released) until an allocation finds the stack short; then every free page goes back onto it,
sorted, lowest page on top, as SGLang's allocators do under ``need_sort``
(``merge_and_sort_free``, mem_cache/allocator/base.py in the 0.5.23 wheel). Why: the CPU's decode
kernel reads each request's KV where its slots lie, and slots handed out in freeing order scatter
a request over the pool as a server lives on (30 layers of decode attention, 16 requests of 448
tokens: 12.9 ms on ascending slots, 75.7 ms on randomly placed ones; `python -m
experiments.benchmarks.slot_order`); sorted, a request's slots run ascending through the holes.

Where the executor reads the KV where it lies (the engine; ``keep_runs``), a decode step's one
new token per request comes from ``alloc_after`` (page size 1): the slot
after the request's last one where it is free, else the start of a free block of `RUN_SLOTS`
taken from the top of the pool down. Handed out in turn instead, a batch's decoded tokens would
interleave, one slot per request: over a served chat run's decode steps the CPU kernel took
1.2x as long on them as on runs (1.4x at batch 1; `python -m experiments.benchmarks.slot_order
--workload sharegpt_chat`); with runs,
a radix cache's KV lies much as a block cache's pages do. From the first `alloc_after` on, every
page's state (on the stack, released, taken) is kept, so a page taken where it lies leaves a stale
stack entry that popping skips. A pool that never hands out runs (the simulator's, the replay's)
keeps no per-page state: its freed pages wait in a list, and the merge sorts them with what is
left on the stack, so a merge costs the free pages, not the pool (a simulated full cache merges
about once per eviction; the replay, which holds no KV, counts its slots instead:
`testbed.cache.slot_count`). ``capacity=None`` makes an unbounded pool that mints fresh pages when
its free list runs dry (the replay backend's "unlimited cache").
"""

from __future__ import annotations

import numpy as np

from testbed.errors import BadInput

SLOT_DTYPE = np.int32

#: a page's state: on the free stack, freed but not yet merged back onto it, or taken
ON_STACK, RELEASED, TAKEN = 0, 1, 2

#: `KVSlotPool.alloc_after`'s blocks: where a sequence's decoded tokens start a new run
RUN_SLOTS = 32
#: blocks searched below the cursor before the whole pool is
RUN_WINDOW = 64


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
        self._top = 0  # entries on the stack, `_stale` of them pages a run took meanwhile
        self._stale = 0
        # Pages freed and not yet merged back (first slot ids, in freeing order; with page
        # states, some may have been taken since: those are skipped by their state).
        self._released: list[np.ndarray] = []
        self._num_released = 0
        # Each page's state (index: page number, first slot - 1 over page_size): on the stack,
        # released or taken; None until the first `alloc_after` (`_keep_states`). A page that
        # `alloc_after` takes where it lies leaves a stale entry on the stack, skipped when popped.
        self._state: np.ndarray | None = None
        self._minted = 0  # pages ever handed out or put on the stack
        self._run_cursor = 0  # the block below which `alloc_after` looks for a new run first
        # decode steps take their slots from `alloc_after` (set for an executor that reads the
        # pool where it lies: `testbed.serving.serve.keep_runs_for`); else from `alloc`
        self.keep_runs = False
        if self.capacity is not None:
            self._stack[:] = self._firsts(pages, 0)
            self._top = pages
            self._minted = pages
            self._run_cursor = pages // RUN_SLOTS - 1

    @property
    def unbounded(self) -> bool:
        return self.capacity is None

    @property
    def num_free(self) -> int:
        """Free slots on the free list, whole pages (an unbounded pool can always mint more)."""
        return (self._top - self._stale + self._num_released) * self.page_size

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

    def alloc_split(self, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``alloc(n)`` cut after its first ``k`` slots, as two arrays of their own: two views of
        one array would keep a third array header alive beside theirs for as long as either
        lives (112 bytes, a fifth of what a replayed request's nodes hold)."""
        top = self._top
        if self.page_size == 1 and self._state is None and 0 <= k <= n <= top:
            self._top = top - n  # (as `alloc`'s usual case, read from the stack's top down)
            down = self._stack[::-1]
            at = len(down) - top
            return down[at : at + k].copy(), down[at + k : at + n].copy()
        if not 0 <= k <= n:
            raise ValueError(f"alloc_split: cannot cut {n} slots after {k}")
        slots = self.alloc(n)
        return slots[:k].copy(), slots[k:].copy()

    def alloc(self, n: int) -> np.ndarray:
        """Take ``n`` free slots, a multiple of ``page_size``: ``n / page_size`` whole pages, each
        page's slots ascending (ascending throughout on a fresh pool). Raises OutOfSlots if not
        available."""
        top = self._top
        if self.page_size == 1 and self._state is None and 0 <= n <= top:
            # the usual case, in a few operations: slots off the stack, no stale entries to skip
            self._top = top - n
            return self._stack[top - n : top][::-1].copy()
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of slots: {n}")
        if n % self.page_size:
            raise ValueError(f"alloc of {n} slots is not whole pages of {self.page_size}")
        k = n // self.page_size
        if k > self._top - self._stale and self._num_released:
            self._merge_released()
        if k > self._top - self._stale:
            if self.capacity is not None:
                raise OutOfSlots(f"asked for {n} slots, {self.num_free} free of {self.capacity}")
            self._mint(k - self._top + self._stale)
        return self._expand(self._pop(k))

    def alloc_after(self, last_slots: np.ndarray) -> np.ndarray:
        """One free slot for each sequence whose KV ends at ``last_slots[i]`` (0: none yet), as
        `alloc(len(last_slots))` does, but placed so each sequence's KV runs on: the slot right
        after its last one where that is free (the first of sequences ending alike gets it);
        else the first slot of a block of `RUN_SLOTS` free slots, taken from the top of the pool
        down (`alloc` hands out the lowest); else, in a full pool, the first slot of one of the
        longest runs of free slots among the lowest `RUN_WINDOW` × `RUN_SLOTS`, a run per
        sequence. Page size 1 only (pages keep runs themselves); an unbounded pool hands out
        `alloc`'s. Which slots a request holds changes no count (free slots, hits, evictions),
        only where the CPU's decode kernel reads: handed out in turn, a batch's decoded tokens
        interleave one slot per request, and a served chat run's decode attention took 1.2x as
        long on them (`python -m experiments.benchmarks.slot_order --workload sharegpt_chat`)."""
        n = len(last_slots)
        if self.page_size != 1:
            raise ValueError(f"alloc_after hands out single slots, not pages of {self.page_size}")
        if self.capacity is None or n == 0:
            return self.alloc(n)
        if n > self.num_free:
            raise OutOfSlots(f"asked for {n} slots, {self.num_free} free of {self.capacity}")
        self._keep_states()
        # page p holds slot p + 1, so the page after slot s is page s
        after = np.asarray(last_slots, dtype=np.int64)
        ok = (after >= 1) & (after < self.capacity)
        ok[ok] = self._state[after[ok]] != TAKEN
        if n > 1 and np.count_nonzero(ok) > 1:
            _, first = np.unique(np.where(ok, after, -1 - np.arange(n)), return_index=True)
            once = np.zeros(n, dtype=bool)
            once[first] = True
            ok &= once
        out = np.empty(n, dtype=SLOT_DTYPE)
        self._take(after[ok])
        out[ok] = after[ok] + 1
        if ok.all():
            return out
        rest = np.flatnonzero(~ok)
        starts = self._free_blocks(len(rest)) * RUN_SLOTS
        self._take(starts)
        if len(starts) < len(rest):
            more = self._run_starts(len(rest) - len(starts))
            self._take(more)
            starts = np.concatenate([starts, more])
        out[rest[: len(starts)]] = starts + 1
        if len(starts) < len(rest):
            out[rest[len(starts):]] = self.alloc(len(rest) - len(starts))
        return out

    def _free_blocks(self, m: int) -> np.ndarray:
        """Up to ``m`` blocks (aligned runs of `RUN_SLOTS` pages) wholly free among the
        `RUN_WINDOW` at and below the cursor, the highest first. The cursor moves below the last
        one taken, or, finding too few, a window down (wrapping round to the top): a full pool is
        searched a window a step, not all at once."""
        blocks = self._minted // RUN_SLOTS
        if blocks == 0:
            return np.zeros(0, dtype=np.int64)
        cursor = min(self._run_cursor, blocks - 1)
        low = max(0, cursor - RUN_WINDOW + 1)
        states = self._state[low * RUN_SLOTS : (cursor + 1) * RUN_SLOTS]
        whole = low + np.flatnonzero((states.reshape(-1, RUN_SLOTS) != TAKEN).all(axis=1))
        found = whole[::-1][:m]
        below = int(found[-1]) - 1 if len(found) == m else low - 1
        self._run_cursor = below if below >= 0 else blocks - 1
        return found

    def _run_starts(self, m: int) -> np.ndarray:
        """The first pages of up to ``m`` runs of free pages on the stack, among its lowest
        `RUN_WINDOW` × `RUN_SLOTS` entries, the longest runs first (the lowest of equals)."""
        top = self._stack[max(0, self._top - RUN_WINDOW * RUN_SLOTS) : self._top][::-1] - 1
        top = top[self._state[top] == ON_STACK]
        if len(top) == 0:
            return np.zeros(0, dtype=np.int64)
        begins = np.flatnonzero(np.diff(top, prepend=-2) != 1)
        lengths = np.diff(begins, append=len(top))
        return top[begins[np.argsort(-lengths, kind="stable")[:m]]].astype(np.int64)

    def _take(self, pages: np.ndarray) -> None:
        """Mark free ``pages`` taken where they lie (stack entries go stale, released pages
        leave the released count)."""
        states = self._state[pages]
        self._stale += int(np.count_nonzero(states == ON_STACK))
        self._num_released -= int(np.count_nonzero(states == RELEASED))
        self._state[pages] = TAKEN

    def _pop(self, k: int) -> np.ndarray:
        """The ``k`` top valid pages of the stack (first slot ids), skipping stale entries."""
        if self._state is None:  # no page states, no stale entries
            top = self._stack[self._top - k : self._top][::-1].copy()
            self._top -= k
            return top
        out: list[np.ndarray] = []
        while k:
            top = self._stack[self._top - k : self._top][::-1]
            self._top -= k
            valid = self._state[(top - 1) // self.page_size] == ON_STACK
            self._stale -= k - int(np.count_nonzero(valid))
            top = top[valid]
            self._state[(top - 1) // self.page_size] = TAKEN
            out.append(top)
            k -= len(top)
        return np.concatenate(out) if out else np.zeros(0, dtype=SLOT_DTYPE)

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the pool: whole pages (asserted), each page's slots in order. Caller
        guarantees they were allocated and not yet freed."""
        if len(slots) == 0:
            return
        if self.page_size > 1:
            self.assert_whole_pages(slots)
            slots = slots[:: self.page_size]
        firsts = np.array(slots, dtype=SLOT_DTYPE)  # a copy: the caller's array may change
        self._released.append(firsts)
        self._num_released += len(firsts)
        if self._state is not None:
            self._state[(firsts - 1) // self.page_size] = RELEASED
            if len(self._released) > self._minted:  # entries of pages taken since: drop them
                pages = np.unique(np.concatenate(self._released))
                self._released = [pages[self._state[(pages - 1) // self.page_size] == RELEASED]]

    def free_slots(self) -> np.ndarray:
        """The free slots, ascending (for invariant checks)."""
        return self._expand(self._free_pages())

    def _free_pages(self) -> np.ndarray:
        """First slot ids of the free pages (on the stack or released), ascending: the released
        ones and the stack's, less those taken where they lay (with page states). The stack's
        run ascends from its top and a freed node's slots mostly do too, so a stable sort (which
        finds runs) costs about the copy (10 us, not 250, for 12,000 pages in 6 runs)."""
        pages = np.concatenate([self._stack[: self._top][::-1], *self._released])
        pages.sort(kind="stable")
        if self._state is None:
            return pages
        if len(pages) > 1:  # a page taken from the stack, then freed, is listed twice
            pages = pages[np.concatenate(([True], pages[1:] != pages[:-1]))]
        return pages[self._state[(pages - 1) // self.page_size] != TAKEN]

    def _merge_released(self) -> None:
        """The released pages onto the stack, all free pages sorted, the lowest on top."""
        merged = self._free_pages()[::-1]
        self._ensure_room(len(merged))
        self._stack[: len(merged)] = merged
        self._top = len(merged)
        self._stale = 0
        if self._state is not None:
            self._state[(merged - 1) // self.page_size] = ON_STACK
        self._released = []
        self._num_released = 0

    def _keep_states(self) -> None:
        """Start keeping every page's state (`alloc_after` takes pages where they lie): taken,
        but for the stack's (on it) and the released ones."""
        if self._state is not None:
            return
        self._state = np.full(max(self._minted, len(self._stack)), TAKEN, dtype=np.int8)
        self._state[(self._stack[: self._top] - 1) // self.page_size] = ON_STACK
        for firsts in self._released:
            self._state[(firsts - 1) // self.page_size] = RELEASED

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
        if self._state is not None:
            if self._minted + n > len(self._state):
                grown = np.full(max(self._minted + n, 2 * len(self._state)), TAKEN, dtype=np.int8)
                grown[: self._minted] = self._state[: self._minted]
                self._state = grown
            self._state[self._minted : self._minted + n] = ON_STACK
        self._minted += n

    def _ensure_room(self, size: int) -> None:
        if size > len(self._stack):
            grown = np.zeros(max(size, 2 * len(self._stack)), dtype=SLOT_DTYPE)
            grown[: self._top] = self._stack[: self._top]
            self._stack = grown
