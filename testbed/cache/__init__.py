"""Prefix caches shared by every backend: radix tree, block hash (vLLM baseline), none.

`CACHES` builds the cache the ``cache`` config group names (the radix tree follows the insert
rule of the run's ``scheduler.sglang``, offered as context), `EVICTION` its eviction policy from the
``eviction`` group (the oracle needs the workload, GDSF a recompute-cost function); both are
registries (testbed/config/registry.py), so ``cache=custom cache.target=module.Class`` takes a class
of your own with `PrefixCache`'s methods. The group's lower-tier keys (``host_tokens`` ...) are read
by `testbed.cache.tiers.make_tiered_cache` instead, its reuse keys (``reuse``, ``match`` ...) by
`ReuseConfig` (testbed/cache/reuse.py) for the scheduler.
"""

from __future__ import annotations

from testbed.cache.base import Lease, PrefixCache, Released
from testbed.cache.block_hash import BlockHashCache
from testbed.cache.eviction import EVICTION, LRU, EvictionPolicy, Requester
from testbed.cache.none import NoCache
from testbed.cache.oracle import Oracle
from testbed.cache.pool import KVSlotPool
from testbed.cache.radix import SGLANG_RELEASES, RadixCache
from testbed.cache.reuse import REUSE_KEYS, ReuseConfig
from testbed.errors import BadInput
from testbed.config.registry import Registry

#: keys of the ``cache`` group that configure lower tiers (testbed/cache/tiers.py,
#: testbed/sim/transfer.py), not the GPU cache itself
TIER_KEYS = ("host_tokens", "disk_tokens", "write_policy", "write_threshold", "host_eviction",
             "disk_eviction", "load_back", "host_link", "disk_link", "host_link_overrides",
             "disk_link_overrides")

CACHES = Registry("cache", methods=("fits", "match", "acquire", "extend", "release", "commit",
                                    "evict", "check_invariants"),
                  run_keys=("capacity_tokens", *TIER_KEYS, *REUSE_KEYS),
                  context_keys=("policy", "sglang"),
                  what="a prefix cache")

__all__ = ["BlockHashCache", "CACHES", "EVICTION", "EvictionPolicy", "KVSlotPool", "Lease",
           "NoCache", "PrefixCache", "RadixCache", "Released", "Requester", "ReuseConfig",
           "TIER_KEYS"]


@CACHES.register("radix")
def radix(capacity_tokens: int | None = None, page_size: int = 1,
          policy: EvictionPolicy | None = None, evict_unit: str = "node",
          split_recency: str = "refresh", sglang: str = SGLANG_RELEASES[0]) -> RadixCache:
    # sglang: the run's scheduler.sglang (a context key, not a setting of the cache group)
    return RadixCache(capacity_tokens, page_size=page_size, policy=policy or LRU(),
                      evict_unit=evict_unit, split_recency=split_recency, sglang=sglang)


@CACHES.register("block_hash")
def block_hash(capacity_tokens: int | None = None, block_size: int = 16,
               policy: EvictionPolicy | None = None) -> BlockHashCache:
    if isinstance(policy, Oracle):
        raise BadInput("eviction=oracle works with cache=radix only")
    return BlockHashCache(capacity_tokens, block_size=block_size, policy=policy or LRU())


@CACHES.register("none")
def none(capacity_tokens: int | None = None) -> NoCache:
    return NoCache(capacity_tokens)
