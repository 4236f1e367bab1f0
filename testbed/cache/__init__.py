"""Prefix caches shared by every backend: radix tree, block hash (vLLM baseline), none.

`make_cache` builds one from the ``cache`` and ``eviction`` config groups.
"""

from __future__ import annotations

from testbed.cache.base import Lease, PrefixCache, Released
from testbed.cache.block_hash import BlockHashCache
from testbed.cache.eviction import make_eviction_policy
from testbed.cache.none import NoCache
from testbed.cache.pool import KVSlotPool
from testbed.cache.radix import RadixCache

CACHES = ("radix", "block_hash", "none")

__all__ = ["BlockHashCache", "CACHES", "KVSlotPool", "Lease", "NoCache", "PrefixCache", "RadixCache",
           "Released", "make_cache"]


def make_cache(name: str, capacity_tokens: int | None = None, page_size: int = 1,
               block_size: int = 16, eviction: str = "lru") -> PrefixCache:
    """Build the cache called ``name``; bad values raise ValueError naming the config key."""
    if capacity_tokens is not None and (not isinstance(capacity_tokens, int) or capacity_tokens < 0):
        raise ValueError(f"cache.capacity_tokens must be >= 0 or null, got {capacity_tokens!r}")
    policy = make_eviction_policy(eviction)
    if name == "radix":
        return RadixCache(capacity_tokens, page_size=page_size, policy=policy)
    if name == "block_hash":
        if policy.name != "lru":
            raise ValueError(f"cache=block_hash supports eviction=lru only, got {policy.name!r}")
        return BlockHashCache(capacity_tokens, block_size=block_size)
    if name == "none":
        return NoCache(capacity_tokens)
    raise ValueError(f"cache must be one of {', '.join(CACHES)}; got {name!r}")
