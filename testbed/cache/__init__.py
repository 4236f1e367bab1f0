"""Prefix caches shared by every backend: radix tree, block hash (vLLM baseline), none.

`make_cache` builds one from the ``cache`` config group and an eviction policy; `make_policy`
builds the policy from the ``eviction`` group (the oracle needs the workload, GDSF a recompute-cost
function).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from testbed.cache.base import Lease, PrefixCache, Released
from testbed.cache.block_hash import BlockHashCache
from testbed.cache.eviction import ALL_POLICIES, LRU, EvictionPolicy, Requester, make_eviction_policy
from testbed.cache.none import NoCache
from testbed.cache.oracle import Oracle
from testbed.cache.pool import KVSlotPool
from testbed.cache.radix import RadixCache

CACHES = ("radix", "block_hash", "none")

__all__ = ["ALL_POLICIES", "BlockHashCache", "CACHES", "EvictionPolicy", "KVSlotPool", "Lease",
           "NoCache", "PrefixCache", "RadixCache", "Released", "Requester", "make_cache",
           "make_policy"]


def make_policy(cfg: Mapping[str, Any] | str, requests: Sequence[Any] = (),
                cost_fn: Callable[[int, int], float] | None = None) -> EvictionPolicy:
    """The eviction policy of the ``eviction`` config (a mapping with ``name``, or a name)."""
    params = {"name": cfg} if isinstance(cfg, str) else dict(cfg)
    name = params.pop("name", "lru")
    if name == "oracle":
        return Oracle(requests)
    if name == "gdsf" and cost_fn is not None:
        params.setdefault("cost_fn", cost_fn)
    return make_eviction_policy(name, **params)


def make_cache(name: str, capacity_tokens: int | None = None, page_size: int = 1,
               block_size: int = 16, policy: EvictionPolicy | str | None = None) -> PrefixCache:
    """Build the cache called ``name``; bad values raise ValueError naming the config key."""
    if capacity_tokens is not None and (not isinstance(capacity_tokens, int) or capacity_tokens < 0):
        raise ValueError(f"cache.capacity_tokens must be >= 0 or null, got {capacity_tokens!r}")
    if policy is None or isinstance(policy, str):
        policy = make_policy(policy or "lru")
    if name == "radix":
        return RadixCache(capacity_tokens, page_size=page_size, policy=policy)
    if name == "block_hash":
        if isinstance(policy, Oracle):
            raise ValueError("eviction=oracle works with cache=radix only")
        return BlockHashCache(capacity_tokens, block_size=block_size, policy=policy)
    if name == "none":
        return NoCache(capacity_tokens)
    raise ValueError(f"cache must be one of {', '.join(CACHES)}; got {name!r}")
