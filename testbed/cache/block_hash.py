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

Every step works on a request's blocks at once: keys are computed once per sequence
(`testbed.cache.block_keys`: each block's digest, chained by one vectorised recurrence), per-block
state lives in arrays indexed by block id (reference counts, keys), the key index is a dict updated
with bulk operations, and the free queue (`testbed.cache.free_queue`) takes and gives arrays of
blocks. `replay_one` serves a replay request with these steps directly, without a lease.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from testbed.cache.base import Lease, PrefixCache, Released
from testbed.cache.block_keys import NO_KEYS, block_digests, block_forms, chain_keys
from testbed.cache.eviction import LRU, EvictionPolicy, Requester
from testbed.cache.free_queue import BLOCK_DTYPE, BlockStats, FreeBlockQueue
from testbed.cache.key_index import KeyIndex
from testbed.cache.pool import SLOT_DTYPE
from testbed.cache.token_runs import TOKEN_BYTES, as_bytes, joined_bytes
from testbed.errors import BadInput

NO_BLOCKS = np.zeros(0, BLOCK_DTYPE)


@dataclass
class _Handle:
    blocks: list[int] = field(default_factory=list)
    keys: np.ndarray = field(default_factory=lambda: NO_KEYS)  # chained keys of its full blocks
    registered: int = 0  # leading blocks whose keys are in the cache (hits, then committed)


class BlockHashCache(PrefixCache):
    """Hash-keyed KV blocks with a FIFO free queue (vLLM V1). ``capacity`` in tokens; None means
    unbounded (fresh blocks are minted instead of reusing cached ones)."""

    name = "block_hash"

    def __init__(self, capacity: int | None = None, block_size: int = 16,
                 policy: EvictionPolicy | None = None) -> None:
        if block_size < 1:
            raise BadInput(f"cache.block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = None if capacity is None else capacity // block_size
        self.policy = policy if policy is not None else LRU()
        self._free = FreeBlockQueue(self.policy)
        self._fifo = self._free.fifo  # plain LRU: no per-block statistics
        self._forms = block_forms(block_size)
        self._minted = 0
        self._clock = 0
        self._ref = np.zeros(0, np.int32)  # block id -> running requests using it
        self._key = np.zeros(0, np.uint64)  # block id -> its key, where _keyed
        self._keyed = np.zeros(0, bool)  # block id -> whether it holds cached KV
        self._grow(self.num_blocks or 1024)
        if self.num_blocks is not None:
            self._free.push_unkeyed(list(range(self.num_blocks)), head=False)
            self._minted = self.num_blocks
        self._stats: dict[int, BlockStats] = {}  # block id -> statistics (policies but LRU)
        # key -> the blocks holding it, the earliest registered first (lookups use it)
        self._index = KeyIndex(self.num_blocks or 1024)
        self._cached_tokens = 0
        self._protected_tokens = 0

    # ---------------------------------------------------------------- keys
    def block_keys(self, tokens: np.ndarray, known: np.ndarray | None = None) -> np.ndarray:
        """Chained keys of the full blocks of ``tokens``; ``known`` are already computed keys of
        its leading blocks (a prompt's, when keying prompt + output)."""
        b, n = self.block_size, len(tokens) // self.block_size
        start = 0 if known is None else min(len(known), n)
        if start == n:
            return NO_KEYS if known is None else known[:n]
        keys = self._keys(as_bytes(tokens[start * b : n * b]), int(known[start - 1]) if start else 0)
        return np.concatenate([known[:start], keys]) if start else keys

    def _keys(self, kb: bytes, prev: int) -> np.ndarray:
        """Keys of the whole blocks of the token bytes ``kb``, following a block keyed ``prev``."""
        return chain_keys(block_digests(kb, self.block_size, self._forms), prev)

    def _lookup(self, keys: np.ndarray, prompt_len: int, limit: int | None = None) -> np.ndarray:
        """Blocks of the leading cached keys, among the first (prompt_len - 1) // B (and covering
        at most ``limit`` tokens)."""
        eligible = max(prompt_len - 1, 0)
        if limit is not None:
            eligible = min(eligible, limit)
        end = eligible // self.block_size
        return self._index.leading(keys[:end]) if end else NO_BLOCKS

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

    def peek(self, tokens: np.ndarray, limit: int | None = None) -> tuple[int, int]:
        """A look-up, as `match`: (hit tokens, how many of the hit's blocks sit in the free
        queue), the blocks that taking the hit would take from it (vLLM's admission counts them:
        ``SingleTypeKVCacheManager.get_num_blocks_to_allocate``, ``_get_num_evictable_blocks``)."""
        hits = self._lookup(self.block_keys(tokens), len(tokens), limit)
        return len(hits) * self.block_size, int((self._ref[hits] == 0).sum())

    @property
    def free_blocks(self) -> int | None:
        """Blocks in the free queue (cached or not); None when unbounded."""
        return None if self.num_blocks is None else len(self._free)

    @property
    def available_size(self) -> float:
        return math.inf if self.num_blocks is None else len(self._free) * self.block_size

    def acquire(self, prompt: np.ndarray, limit: int | None = None,
                requester: Requester | None = None) -> Lease:
        self.policy.on_access(requester)
        handle = _Handle(keys=self.block_keys(prompt))
        hits = self._lookup(handle.keys, len(prompt), limit)
        self._take(hits, requester)
        handle.blocks = hits.tolist()
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
        blocks, evicted = self._pop(need)
        handle.blocks += blocks.tolist()
        lease.append(self._slots(handle.blocks, lease.num_tokens, total))
        return evicted

    def extension_cost(self, lease: Lease, num_tokens: int) -> int:
        blocks = -(-(lease.num_tokens + num_tokens) // self.block_size) - len(lease.handle.blocks)
        return blocks * self.block_size

    def truncate(self, lease: Lease, num_tokens: int) -> int:
        """Shorten the lease to ``num_tokens`` slots; the blocks past its last one go back
        (unkeyed: only full blocks of verified tokens are ever registered, at commit or
        release, so a block holding a rejected draft never got a key)."""
        if num_tokens >= lease.num_tokens:
            return 0
        handle: _Handle = lease.handle
        keep = -(-num_tokens // self.block_size)
        if keep < handle.registered:
            raise ValueError(f"truncate to {num_tokens} tokens inside registered blocks")
        dropped = np.asarray(handle.blocks[keep:], BLOCK_DTYPE)
        handle.blocks = handle.blocks[:keep]
        self._give_back(dropped)
        lease.reset(lease.slots[:num_tokens], lease.cached)
        return len(dropped) * self.block_size

    def rewind(self, lease: Lease, num_tokens: int) -> None:
        """Shorten the lease to ``num_tokens`` slots and keep every block it holds: vLLM's
        rejected drafts (``update_from_output`` rolls ``num_computed_tokens`` back; the
        request's blocks stay allocated, and its next step's tokens take their slots again).
        Nothing is registered or freed; the blocks past the last kept token go back with the
        rest at release, unkeyed."""
        handle: _Handle = lease.handle
        if num_tokens >= lease.num_tokens:
            return
        if num_tokens < handle.registered * self.block_size:
            raise ValueError(f"rewind to {num_tokens} tokens inside registered blocks")
        lease.reset(lease.slots[:num_tokens], lease.cached)

    def release(self, lease: Lease, tokens: np.ndarray, insert: bool = True) -> Released:
        handle: _Handle = lease.handle
        if insert and len(tokens) > lease.num_tokens:
            raise ValueError(f"release: {len(tokens)} tokens for a lease of {lease.num_tokens} slots")
        if insert:
            self._register_full_blocks(handle, tokens, lease.requester)
        self._give_back(np.asarray(handle.blocks, BLOCK_DTYPE))
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
        handle.keys = self.block_keys(tokens, known=handle.keys)
        first = handle.registered
        if first < len(handle.keys):
            self._register(np.asarray(handle.blocks[first : len(handle.keys)], BLOCK_DTYPE),
                           handle.keys[first:], first, requester)
        handle.registered = max(handle.registered, len(handle.keys))

    def evict(self, num_tokens: int) -> int:
        """Drop keys of cached free blocks in policy order until ``num_tokens`` are freed."""
        blocks, keys = self._free.pop_keyed(-(-num_tokens // self.block_size))
        self._forget(blocks, keys)
        self._free.push_unkeyed(blocks.tolist(), head=False)
        return len(blocks) * self.block_size

    def replay_one(self, prompt: np.ndarray, output: np.ndarray,
                   requester: Requester | None = None) -> tuple[int, int, bool, dict | None]:
        """`PrefixCache.replay_one` in the steps of docs/design.md §4, each on all the request's
        blocks at once: the keys of the whole sequence computed once, the hit blocks taken out of
        the free queue, ``nb - k`` blocks popped, the new full blocks registered, all given back
        last to first."""
        b = self.block_size
        kb = joined_bytes(prompt, output)
        n = len(kb) // TOKEN_BYTES
        if self.num_blocks is not None and -(-n // b) > self.num_blocks:
            return 0, 0, False, None
        self.policy.on_access(requester)
        keys = self._keys(kb, 0)
        hits = self._lookup(keys, len(prompt))
        k = len(hits)
        self._take(hits, requester)
        fresh, evicted = self._pop(-(-n // b) - k)
        blocks = np.concatenate([hits, fresh])
        if k < len(keys):
            self._register(blocks[k : len(keys)], keys[k:], k, requester)
        self._give_back(blocks)
        return k * b, evicted, True, None

    # ---------------------------------------------------------------- block bookkeeping
    def _grow(self, size: int) -> None:
        """Per-block arrays for block ids below ``size``."""
        if size <= len(self._ref):
            return
        size = max(size, 2 * len(self._ref))
        for name, dtype in (("_ref", np.int32), ("_key", np.uint64), ("_keyed", bool)):
            old = getattr(self, name)
            new = np.zeros(size, dtype)
            new[: len(old)] = old
            setattr(self, name, new)
        self._free.reserve(size)

    def _take(self, blocks: np.ndarray, requester: Requester | None) -> None:
        """A request hits cached blocks: those free leave the free queue."""
        if not len(blocks):
            return
        idle = blocks[self._ref[blocks] == 0]
        if len(idle):
            self._free.remove_keyed(idle)
            self._protected_tokens += len(idle) * self.block_size
        self._ref[blocks] += 1  # a request's blocks are distinct
        if self._fifo:  # plain LRU needs no statistics
            return
        for block in blocks.tolist():
            stats = self._stats[block]
            stats.access_count += 1
            if requester is not None:
                stats.priority = min(stats.priority, requester.priority)
            self.policy.on_hit(stats)

    def _pop(self, n: int) -> tuple[np.ndarray, int]:
        """``n`` blocks for a request (reference count 1) from the free queue's head, and the
        tokens evicted: popped blocks that still held a key lose it. Unbounded, fresh blocks are
        minted once no unkeyed one is left, so nothing cached is ever reused."""
        if n <= 0:
            return np.zeros(0, BLOCK_DTYPE), 0
        if self.num_blocks is None:
            reused = self._free.pop_unkeyed(n)
            fresh = np.arange(self._minted, self._minted + n - len(reused), dtype=BLOCK_DTYPE)
            self._minted += len(fresh)
            self._grow(self._minted)
            out = np.concatenate([reused, fresh])
            evicted = 0
        else:
            unkeyed, keyed, keys = self._free.pop(n)
            self._forget(keyed, keys)
            out = np.concatenate([unkeyed, keyed]) if len(unkeyed) else keyed
            evicted = len(keyed) * self.block_size
        self._ref[out] = 1
        return out, evicted

    def _register(self, blocks: np.ndarray, keys: np.ndarray, first: int,
                  requester: Requester | None) -> None:
        """Key freshly popped blocks (block ``first`` of its sequence and on), even where the key
        is already cached on another block: both are kept, lookups use the older."""
        assert not self._keyed[blocks].any(), "only freshly popped blocks are registered"
        self._key[blocks] = keys
        self._keyed[blocks] = True
        self._index.add(keys, blocks)
        m = len(blocks) * self.block_size
        self._cached_tokens += m
        self._protected_tokens += m  # registered while the request still holds them
        if self._fifo:
            self._clock += len(blocks)
            return
        for i, block in enumerate(blocks.tolist()):
            self._clock += 1
            stats = BlockStats(id=block, created=self._clock, last_access=self._clock,
                               start=(first + i) * self.block_size, size=self.block_size,
                               priority=requester.priority if requester else 0,
                               category=requester.category if requester else None)
            self._stats[block] = stats
            self.policy.on_create(stats)

    def _forget(self, popped: np.ndarray, evict_keys: list | None) -> None:
        """Popped cached blocks lose their keys (``evict_keys``: their eviction keys, or None)."""
        if not len(popped):
            return
        self._keyed[popped] = False
        self._cached_tokens -= len(popped) * self.block_size
        self._index.remove(popped, self._key[popped])  # a later holder of a key takes it over
        if not self._fifo:
            for block, key in zip(popped.tolist(), evict_keys):
                self.policy.on_evict(self._stats.pop(block), key)

    def _give_back(self, blocks: np.ndarray) -> None:
        """A request lets go of its blocks, last to first (a sequence's tail is reused first):
        those no other request holds are freed, keyed ones to the queue's tail, unkeyed ones to
        its head."""
        if not len(blocks):
            return
        ids = blocks[::-1]
        self._ref[ids] -= 1
        idle = ids[self._ref[ids] == 0]
        keyed = self._keyed[idle]
        cached = idle[keyed]
        if len(cached):
            self._protected_tokens -= len(cached) * self.block_size
            stats = None
            if not self._fifo:
                stats = []
                for block in cached.tolist():
                    self._clock += 1
                    s = self._stats[block]
                    s.last_access = self._clock
                    stats.append(s)
            else:
                self._clock += len(cached)
            self._free.push_keyed(cached, stats)
        if len(cached) < len(idle):
            self._free.push_unkeyed(idle[~keyed].tolist(), head=True)

    def _slots(self, blocks: list[int], start: int, end: int) -> np.ndarray:
        """Token-level slot ids of token positions ``start..end-1`` (slot 0 stays reserved)."""
        b = self.block_size
        positions = np.arange(start, end)
        owners = np.asarray(blocks, dtype=SLOT_DTYPE)[positions // b]
        return (owners * b + 1 + positions % b).astype(SLOT_DTYPE)

    # ---------------------------------------------------------------- checks
    def check_invariants(self, leases: Iterable[Lease] = ()) -> None:
        ref = self._ref[: self._minted]
        in_use = set(np.flatnonzero(ref > 0).tolist())
        assert (ref >= 0).all(), "negative block ref count"
        free = self._free.blocks()
        assert len(set(free)) == len(free), "a block is free twice"
        assert not in_use & set(free), "a block is both free and in use"
        assert len(in_use) + len(free) == self._minted, "a block is lost"
        assert self._free.num_keyed == sum(1 for b in free if self._keyed[b]), "queue miscounted"
        assert not any(self._keyed[b] for b in free[: len(free) - self._free.num_keyed]), \
            "a keyed block among the unkeyed free ones"
        held = [b for lease in leases for b in lease.handle.blocks]
        for b in set(held):
            assert self._ref[b] == held.count(b), f"block {b}: ref count != holders"
        assert set(held) == in_use, "in-use blocks not accounted for by the leases"
        cached = np.flatnonzero(self._keyed[: self._minted])
        assert self._cached_tokens == len(cached) * self.block_size
        protected = sum(self.block_size for b in cached.tolist() if b in in_use)
        assert protected == self._protected_tokens, "protected accounting drifted"
        holders: dict[int, list[int]] = {}
        for b in cached.tolist():
            holders.setdefault(int(self._key[b]), []).append(b)
        index = self._index.holders()
        assert len(self._index) == len(index) and set(index) == set(holders), "key index drifted"
        assert all(sorted(index[k]) == sorted(v) for k, v in holders.items()), "key index drifted"
        if not self._fifo:
            assert set(self._stats) == set(cached.tolist()), "statistics of uncached blocks"
