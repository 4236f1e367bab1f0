"""Routing requests across data-parallel replicas: policies and the cache-aware approximate tree.

`make_router` builds a policy from the ``router`` config group (``conf/router/``). The keys
``network_delay_s`` and ``transfer_s_per_token`` of that group belong to the cluster (the
simulator's delay between the router and a replica), not to the policy; `cluster_delays` reads
them.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping

from testbed.router.approx_tree import ApproxTree
from testbed.router.base import LOAD_UNITS, Loads, Router, is_imbalanced, least_loaded
from testbed.router.policies import (CacheAware, LeastLoad, Oracle, RandomRouter, RoundRobin,
                                     peek_match)

ROUTERS: dict[str, type[Router]] = {
    "round_robin": RoundRobin,
    "random": RandomRouter,
    "least_load": LeastLoad,
    "cache_aware": CacheAware,
    "oracle": Oracle,
}
CLUSTER_KEYS = ("network_delay_s", "transfer_s_per_token")

__all__ = ["ApproxTree", "CLUSTER_KEYS", "CacheAware", "LOAD_UNITS", "LeastLoad", "Loads",
           "Oracle", "ROUTERS", "RandomRouter", "RoundRobin", "Router", "cluster_delays",
           "is_imbalanced", "least_loaded", "make_router", "peek_match"]


def make_router(cfg: Mapping[str, Any] | str, seed: int = 0,
                kv_capacity: int | None = None) -> Router:
    """The router of the ``router`` config (a mapping with ``name``, or a name). ``seed`` feeds
    ``random``; ``kv_capacity`` (a replica's KV tokens) is ``cache_aware``'s ``max_tree_size``
    when that is null."""
    params = {"name": cfg} if isinstance(cfg, str) else dict(cfg)
    name = params.pop("name", "round_robin")
    for key in CLUSTER_KEYS:
        params.pop(key, None)
    if name not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {name!r}")
    cls = ROUTERS[name]
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(params) - set(allowed))
    if unknown:
        raise ValueError(f"router.{unknown[0]} is not a setting of router={name}; allowed: "
                         f"{', '.join(['name', *allowed, *CLUSTER_KEYS])}")
    if "seed" in allowed:
        params.setdefault("seed", seed)
    if name == "cache_aware" and params.get("max_tree_size") is None:
        params["max_tree_size"] = kv_capacity
    return cls(**params)


def cluster_delays(cfg: Mapping[str, Any] | str) -> tuple[float, float]:
    """(``network_delay_s``, ``transfer_s_per_token``) of the ``router`` config, validated."""
    params = {} if isinstance(cfg, str) else dict(cfg)
    out = []
    for key in CLUSTER_KEYS:
        value = float(params.get(key) or 0.0)
        if value < 0:
            raise ValueError(f"router.{key} must be >= 0, got {value}")
        out.append(value)
    return out[0], out[1]
