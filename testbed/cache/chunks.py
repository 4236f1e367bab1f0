"""Chunks in the radix tree: finding a chunk's cached KV and storing a freshly computed one.

A chunk (a run of prompt tokens reusable at any position, `cache.reuse=blend`) is cached under the
key ``[CHUNK_MARK] + chunk`` of the same `RadixCache` that holds exact prefixes, so chunks share
its pool, locks, eviction policy and invariants (docs/design.md §4). The mark is the first token of
every chunk key: the chunks hang under one mark node, whose single slot no executor reads; chunk
token ``i`` sits at tree position ``i + 1`` and its KV is rotated for chunk-local position ``i``.
"""

from __future__ import annotations

import numpy as np

from testbed.cache.base import EMPTY_SLOTS
from testbed.cache.eviction import Requester
from testbed.cache.radix import RadixCache, TreeNode
from testbed.cache.reuse import KVCopy, chunk_key


def find_chunk(cache: RadixCache, tokens: np.ndarray, requester: Requester | None = None
               ) -> tuple[int, TreeNode, np.ndarray]:
    """The longest cached prefix of chunk ``tokens``, as a use (hits counted, recency refreshed):
    (its length in chunk tokens, the deepest node to lock while reading it, its slots). Nothing
    found: (0, the root, no slots)."""
    if len(tokens) == 0:
        return 0, cache.root, EMPTY_SLOTS
    n, node, slots = cache.match_prefix(chunk_key(tokens), requester)
    if n <= 1:  # the mark alone is no KV
        return 0, cache.root, EMPTY_SLOTS
    return n - 1, node, slots[1:]


def store_chunk(cache: RadixCache, tokens: np.ndarray, src_slots: np.ndarray, start: int,
                requester: Requester | None = None) -> tuple[KVCopy | None, int]:
    """Cache chunk ``tokens``, whose KV sits in ``src_slots`` rotated for prompt positions
    ``start ..``: the part not cached yet gets new pool slots (evicting unlocked entries if need
    be) and a `KVCopy` from ``src_slots`` shifted by ``-start`` to chunk-local positions, which the
    caller has the executor run. A chunk cached whole only has its recency refreshed (a look-up).
    Returns (the copy or None, tokens evicted); no room even after evicting: (None, 0), nothing
    stored."""
    if len(tokens) != len(src_slots):
        raise ValueError(f"store_chunk: {len(tokens)} tokens but {len(src_slots)} slots")
    if len(tokens) == 0:
        return None, 0
    key = chunk_key(tokens)
    present, node, _ = cache.match_prefix(key, requester, lookup=True)
    need = len(key) - present
    if need == 0:
        return None, 0
    pool = cache.pool
    evicted = 0
    cache.lock(node)  # the cached part must survive the eviction below
    try:
        if not pool.can_alloc(need):
            if pool.num_free + cache.evictable_size < need:
                return None, 0
            evicted = cache.evict(need - pool.num_free)
        fresh = pool.alloc(need)
    finally:
        cache.unlock(node)
    slots = np.concatenate([np.zeros(present, dtype=fresh.dtype), fresh])
    already = cache.insert(key, slots, requester)
    if already != present:  # the walk is the same as the look-up's, on a locked path
        raise RuntimeError(f"store_chunk: {already} tokens cached, expected {present}")
    # Tree position p holds chunk token p - 1; the mark's slot (p = 0) has no source.
    first = max(present, 1)
    copy = KVCopy(src_slots[first - 1 :].copy(), slots[first:].copy(), -start)
    return (copy if len(copy) else None), evicted
