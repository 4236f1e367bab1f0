"""The `PrefixCache` interface every cache implements, and the `Lease` a request holds on it.

A request's life in any cache, in the replay backend and (later) in the scheduler alike:

1. ``lease = cache.acquire(prompt)`` — find the longest cached prefix (``lease.hit`` tokens) and
   protect it from eviction while the request runs;
2. ``evicted = cache.extend(lease, n)`` — make room for ``n`` more tokens of KV, evicting if needed;
   returns the tokens evicted, or ``None`` when even evicting everything unprotected is not enough;
   (``cache.commit(lease, tokens)`` caches a partial sequence while the request goes on);
3. ``cache.release(lease, tokens)`` — offer the request's sequence to the cache (``insert=False``
   just frees it), give back duplicate or unused slots, and lift the protection.

How each step is carried out — tree walk and LRU leaves, hashed blocks and a free queue, or nothing
at all — is the cache's business. Callers only see hit lengths, evicted counts and slot ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from testbed.cache.eviction import Requester
from testbed.cache.pool import SLOT_DTYPE, KVSlotPool

EMPTY_SLOTS = np.zeros(0, dtype=SLOT_DTYPE)


class Lease:
    """A running request's hold on the cache.

    ``hit`` tokens of the prompt were found cached when the lease was taken; ``slots`` are the KV
    slots of the request's sequence so far (cached prefix first, then what ``extend`` added), of
    which the first ``cached`` belong to the cache (protected while the lease lives) and the rest
    to the request; ``handle`` is the cache's own marker of what it protects (a tree node, blocks).
    Slots grow geometrically, so a decode step's one-slot `append` costs O(1) amortised.

    With a paged pool (``page_size`` P > 1) the request holds whole pages: ``spare`` are the slots
    of its last page beyond its sequence (held capacity, owned by the request), which `grow` uses
    before any new page. Token ``i`` of the sequence sits at offset ``i % P`` of its page.

    With lower tiers (`testbed.cache.tiers`), ``lower`` more tokens of the prompt continue the hit
    in host memory or on disk: `PrefixCache.load_back` brings them to the GPU (then ``hit`` grows
    by them and ``loaded`` says how many came from each tier) or gives them up (recompute).
    """

    __slots__ = ("hit", "handle", "cached", "requester", "_buf", "_n", "spare", "lower", "loaded",
                 "inserted", "prompt")

    def __init__(self, hit: int, handle: Any = None, slots: np.ndarray = EMPTY_SLOTS,
                 cached: int | None = None, requester: Requester | None = None,
                 prompt: int = 0) -> None:
        self.hit = hit
        self.handle = handle
        self.requester = requester  # who holds it: what eviction policies may know
        self.cached = hit if cached is None else cached
        self._buf = np.array(slots, dtype=SLOT_DTYPE)
        self._n = len(slots)
        self.spare = EMPTY_SLOTS  # the unused tail of the last page
        self.lower = 0  # matched tokens below the GPU, not loaded yet
        self.loaded: dict[str, int] | None = None  # tokens loaded back, per lower tier
        self.inserted = 0  # tokens the holder inserted into the cache so far (chunks, SGLang's
        # ``cache_inserted_len``): a later insert counts no hit on them again
        self.prompt = prompt  # tokens of the sequence that are the request's own prompt (SGLang's
        # ``origin_input_ids``): the acquired key's length, which a holder that acquired more
        # (a fill with outputs, after a retraction) sets back; read by SGLang 0.5.23's insert rule

    @property
    def slots(self) -> np.ndarray:
        return self._buf[: self._n]

    @property
    def buffer(self) -> np.ndarray:
        """The array `slots` is the start of: its first `num_tokens` entries never change (a
        lease that ends or shrinks takes a new one), so holding it keeps a snapshot of them."""
        return self._buf

    @property
    def num_tokens(self) -> int:
        """Tokens of KV this lease covers (cached prefix plus extensions)."""
        return self._n

    def push(self, slot: int) -> None:
        """`append` of one slot (a decode step's), without making an array of it."""
        n = self._n
        if n == len(self._buf):
            grown = np.zeros(max(2 * n, 16), dtype=SLOT_DTYPE)
            grown[:n] = self._buf
            self._buf = grown
        self._buf[n] = slot
        self._n = n + 1

    def append(self, slots: np.ndarray) -> None:
        end = self._n + len(slots)
        if end > len(self._buf):
            grown = np.zeros(max(end, 2 * len(self._buf), 16), dtype=SLOT_DTYPE)
            grown[: self._n] = self._buf[: self._n]
            self._buf = grown
        self._buf[self._n : end] = slots
        self._n = end

    @property
    def owned(self) -> np.ndarray:
        """The slots the request owns (not the cache): its sequence's beyond the cached prefix,
        then the spare tail of its last page (whole pages when the pool is paged)."""
        return np.concatenate([self.slots[self.cached :], self.spare])

    def grow(self, num_tokens: int, fresh: np.ndarray) -> None:
        """Extend the sequence by ``num_tokens`` slots: the spare ones first, then ``fresh`` ones
        (newly allocated whole pages), whose unused rest becomes the new spare."""
        take = min(num_tokens, len(self.spare))
        need = num_tokens - take
        if len(fresh) < need or (len(fresh) and take < len(self.spare)):
            raise ValueError(f"grow by {num_tokens}: {len(self.spare)} spare and {len(fresh)} "
                             f"fresh slots do not make exactly the room")
        if take:
            self.append(self.spare[:take])
            self.spare = self.spare[take:]
        if len(fresh):
            self.append(fresh[:need])
            self.spare = fresh[need:]

    def reset(self, slots: np.ndarray, cached: int, spare: np.ndarray = EMPTY_SLOTS) -> None:
        """Replace the slots (after the cache took over ``cached`` of them) and the spare ones."""
        self._buf = np.array(slots, dtype=SLOT_DTYPE)
        self._n = len(slots)
        self.cached = cached
        self.spare = spare

    def __repr__(self) -> str:
        return (f"Lease(hit={self.hit}, cached={self.cached}, tokens={self._n}, "
                f"spare={len(self.spare)})")


@dataclass(frozen=True)
class Released:
    """What `PrefixCache.release` did: whether the sequence is now cached, and how much of it was
    already there (those tokens' fresh slots were duplicates and went back to the pool)."""

    inserted: bool
    already_cached: int


class PrefixCache(ABC):
    """A KV cache that can share prompt prefixes across requests."""

    #: the config name (``cache=NAME``)
    name: str = ""
    #: the KV-slot pool of a token-granular cache (None for block-granular ones)
    pool: KVSlotPool | None = None
    #: tiers below the GPU that keep evicted KV, fastest first (``("host", "disk")``); none here
    lower_tiers: tuple[str, ...] = ()

    def replay_one(self, prompt: np.ndarray, output: np.ndarray,
                   requester: Requester | None = None) -> tuple[int, int, bool, dict | None]:
        """Serve one request the replay backend's way (docs/design.md §4): match ``prompt`` and
        protect the hit, load back a lower-tier part of it, make room for the rest of prompt +
        output, insert prompt + output, unprotect. Returns (hit, tokens evicted, inserted, tokens
        loaded back per lower tier or None). A sequence that could never fit is served uncached:
        (0, 0, False, None), nothing changed. Caches may do the same in fewer steps."""
        seq = np.concatenate([prompt, output])
        if not self.fits(len(seq)):
            return 0, 0, False, None
        lease = self.acquire(prompt, requester=requester)
        evicted, loaded = 0, None
        if lease.lower:
            evicted = self.load_back(lease) or 0
            loaded = lease.loaded
        more = self.extend(lease, len(seq) - lease.hit)
        if more is None:  # fits() promised room with nothing else protected
            raise RuntimeError(f"{self.name}: no room for {len(seq)} tokens although they fit")
        inserted = self.release(lease, seq).inserted
        return lease.hit, evicted + more, inserted, loaded

    def load_back(self, lease: Lease) -> int | None:
        """Bring the lease's ``lower`` tokens back to the GPU. Returns the tokens evicted to make
        room, or None when they are recomputed instead (or there is nothing to load)."""
        return None

    @abstractmethod
    def fits(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever be held, with nothing else protected."""

    @abstractmethod
    def match(self, tokens: np.ndarray, limit: int | None = None,
              requester: Requester | None = None) -> int:
        """Length of the longest cached prefix of ``tokens`` usable as a hit (at most ``limit``),
        without protecting it: a look-up (a scheduler ordering its queue), not a use. It counts
        no hit or frequency for eviction policies and does not move the oracle's "now"; a radix
        tree refreshes the recency of the nodes it passes, as SGLang's ``match_prefix`` does."""

    @property
    @abstractmethod
    def available_size(self) -> float:
        """Tokens that could be allocated now, evicting every unprotected entry if need be
        (``math.inf`` for an unbounded cache)."""

    @abstractmethod
    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        """Match ``prompt`` and protect the matched prefix until `release`. The hit is at most
        ``limit`` tokens (a scheduler passes ``len(prompt) - 1``: one token must be computed to
        produce the next one)."""

    @abstractmethod
    def extend(self, lease: Lease, num_tokens: int) -> int | None:
        """Add ``num_tokens`` slots to the lease, evicting as needed. Returns the number of tokens
        evicted, or None (having changed nothing) if even evicting every unprotected token would
        not make the room."""

    def extend_each(self, leases: list[Lease], num_tokens: int) -> list[int]:
        """`extend` every lease by ``num_tokens`` in turn (a decode step); returns the tokens
        evicted for each. The caller has checked that the room exists. A slot-pool cache with
        enough free pages takes them all in one allocation (nothing to evict, nothing to
        attribute); each lease uses its spare slots first, then its share of the new pages.
        One token each comes from `KVSlotPool.alloc_after` where the pool keeps runs (the
        engine's: `keep_runs`), which keeps each lease's KV running on where it can."""
        pool = self.pool
        if pool is not None:
            # page size 1, one token (a plain decode step): no spare slots, one slot a lease
            single = num_tokens == 1 and pool.page_size == 1
            costs = None if single else [self.extension_cost(lease, num_tokens)
                                         for lease in leases]
            total = len(leases) if single else sum(costs)
            if pool.can_alloc(total):
                if num_tokens == 1 and pool.keep_runs:
                    fresh = pool.alloc_after(np.array(
                        [lease.slots[-1] if lease.num_tokens else 0 for lease in leases]))
                else:
                    fresh = pool.alloc(total)
                if single:  # `Lease.push`, inline: once per decoded token
                    for lease, slot in zip(leases, fresh.tolist()):
                        n, buf = lease._n, lease._buf
                        if n == len(buf):
                            lease.push(slot)
                        else:
                            buf[n] = slot
                            lease._n = n + 1
                else:
                    at = 0
                    for lease, cost in zip(leases, costs):
                        lease.grow(num_tokens, fresh[at : at + cost])
                        at += cost
                return [0] * len(leases)
        out = []
        for lease in leases:
            evicted = self.extend(lease, num_tokens)
            if evicted is None:
                raise RuntimeError("extend_each: the cache could not make room")
            out.append(evicted)
        return out

    def step_cost(self, leases: list[Lease], num_tokens: int = 1) -> int:
        """Σ `extension_cost` of ``num_tokens`` more for each lease (a decode step's room); at
        page size 1 a lease holds no spare slots, so each costs ``num_tokens``."""
        if self.pool is not None and self.pool.page_size == 1:
            return num_tokens * len(leases)
        return sum(self.extension_cost(lease, num_tokens) for lease in leases)

    def extension_cost(self, lease: Lease, num_tokens: int) -> int:
        """Capacity (in tokens) that `extend(lease, num_tokens)` takes from `available_size`: with
        a slot pool, the whole new pages beyond the lease's spare slots (0 when they suffice)."""
        if self.pool is None:
            return num_tokens
        return self.pool.round_up(max(0, num_tokens - len(lease.spare)))

    def truncate(self, lease: Lease, num_tokens: int) -> int:
        """Shorten the lease's sequence to its first ``num_tokens`` slots and give the rest back
        (a speculative step's rejected drafts: docs/design.md §4, "Speculative decoding").
        The slots dropped are the request's own (never the cached prefix's). With a paged pool
        the rest of the last kept page becomes ``spare`` and whole pages beyond it are freed.
        Returns the slots freed to the pool."""
        slots = lease.slots
        if num_tokens >= len(slots):
            return 0
        if num_tokens < lease.cached:
            raise ValueError(f"truncate to {num_tokens} tokens below the lease's cached "
                             f"prefix of {lease.cached}")
        if self.pool is None:
            raise NotImplementedError(f"{self.name}: truncate needs a slot pool")
        tail = np.concatenate([slots[num_tokens:], lease.spare])
        keep = self.pool.round_up(num_tokens) - num_tokens  # the rest of the last kept page
        self.pool.free(tail[keep:])
        lease.reset(slots[:num_tokens], lease.cached, tail[:keep])
        return len(tail) - keep

    def keep(self, lease: Lease, positions: np.ndarray) -> int:
        """Keep only the lease's slots at ``positions`` (ascending, the cached prefix's all
        among them), in that order, and free the others: a token tree's accepted branch moved
        next to its root (docs/design.md §4, "Speculative decoding"). Page size 1 only: with
        pages a token's slot is fixed by its position. Returns the slots freed."""
        if self.pool is None or self.pool.page_size != 1:
            raise NotImplementedError(f"{self.name}: keep needs a slot pool of page size 1")
        slots = lease.slots
        if len(positions) < lease.cached or (positions[: lease.cached]
                                             != np.arange(lease.cached)).any():
            raise ValueError("keep: the cached prefix's slots must all stay, first")
        dropped = np.ones(len(slots), dtype=bool)
        dropped[positions] = False
        self.pool.free(slots[dropped])
        lease.reset(slots[positions], lease.cached)
        return int(dropped.sum())

    @abstractmethod
    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        """End the lease. With ``insert`` the cache keeps ``tokens`` (the lease's sequence: at most
        ``lease.num_tokens``; slots past it, taken for a step still in flight, are freed); otherwise the slots the lease added are freed
        (the matched prefix stays cached) and ``tokens`` is ignored."""

    @abstractmethod
    def commit(self, lease: Lease, tokens: np.ndarray) -> None:
        """Cache the lease's sequence so far (``tokens``, one per slot from the first; slots past
        them stay the lease's) while the request goes on:
        other requests can hit it from now on, and the lease protects it (chunked prefill)."""

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` of unprotected cached KV if possible; returns tokens freed."""

    @property
    @abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens no running request protects."""

    @property
    @abstractmethod
    def protected_size(self) -> int:
        """Cached tokens some running request protects."""

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    @abstractmethod
    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        """Raise AssertionError unless the cache's bookkeeping is consistent; ``leases`` are the
        running requests, whose slots must be disjoint from the cache's and the free list's."""
