"""The ``cache`` config group's lower-tier settings, read and checked: the keyword arguments that
`testbed.cache.tiers.make_tiered_cache` builds a `TieredRadixCache` with (``host_tokens``,
``disk_tokens``, ``write_policy``, ``write_threshold`` and each lower tier's eviction policy).
"""

from __future__ import annotations

from typing import Any, Mapping

from testbed.cache.eviction import EVICTION, EvictionPolicy
from testbed.cache.tier_state import WRITE_POLICIES
from testbed.errors import BadInput, check_choice


def has_lower_tiers(cache_cfg: Mapping[str, Any]) -> bool:
    """Whether the ``cache`` config group asks for a host or disk tier (a size above 0)."""
    return bool(cache_cfg.get("host_tokens") or cache_cfg.get("disk_tokens"))


def check_tier_values(host_tokens: Any, disk_tokens: Any, write_policy: Any,
                      write_threshold: Any) -> None:
    """The lower tiers' sizes and write settings, or BadInput naming the key."""
    for key, value in (("cache.host_tokens", host_tokens), ("cache.disk_tokens", disk_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadInput(f"{key} must be an integer >= 0 (0: no such tier), got {value!r}")
    check_choice("cache.write_policy", write_policy, WRITE_POLICIES)
    if isinstance(write_threshold, bool) or not isinstance(write_threshold, int) \
            or write_threshold < 1:
        raise BadInput(f"cache.write_threshold must be an integer >= 1, got {write_threshold!r}")


def tier_options(cache_cfg: Mapping[str, Any]) -> dict[str, Any] | None:
    """The tier arguments the ``cache`` config group asks for (``host_tokens``, ``disk_tokens``,
    ``write_policy``, ``write_threshold``, ``host_eviction``, ``disk_eviction``: a policy name or
    an ``eviction``-style mapping; the oracle is GPU-only), or None when it asks for no lower
    tier."""
    if not has_lower_tiers(cache_cfg):
        return None
    host, disk = cache_cfg.get("host_tokens") or 0, cache_cfg.get("disk_tokens") or 0
    if cache_cfg.get("name") != "radix":
        raise BadInput(f"cache.host_tokens / cache.disk_tokens need cache=radix, got "
                       f"cache={cache_cfg.get('name')}")
    if (cache_cfg.get("evict_unit") or "node") != "node":  # lower tiers demote whole nodes
        raise BadInput("cache.evict_unit=page needs cache.host_tokens=0 and cache.disk_tokens=0 "
                       "(lower tiers evict whole nodes)")
    if (cache_cfg.get("split_recency") or "refresh") != "refresh":
        raise BadInput("cache.split_recency=keep needs cache.host_tokens=0 and "
                       "cache.disk_tokens=0 (the tiers' bookkeeping follows SGLang's rule)")

    def tier_policy(key: str) -> EvictionPolicy:
        cfg = cache_cfg.get(key) or "lru"
        if (cfg if isinstance(cfg, str) else cfg.get("name")) == "oracle":
            raise BadInput(f"cache.{key}=oracle is not supported (the oracle is GPU-only)")
        try:
            return EVICTION.build(cfg)
        except BadInput as e:  # eviction.KEY ... of this tier's policy
            raise BadInput(f"cache.{key}: {e}") from None

    write_policy = cache_cfg.get("write_policy") or "write_through"
    write_threshold = cache_cfg.get("write_threshold") or 2
    check_tier_values(host, disk, write_policy, write_threshold)
    return {"host_tokens": host, "disk_tokens": disk,
            "write_policy": write_policy, "write_threshold": write_threshold,
            "host_policy": tier_policy("host_eviction"),
            "disk_policy": tier_policy("disk_eviction")}
