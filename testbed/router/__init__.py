"""Routing requests across data-parallel replicas: policies and the cache-aware approximate tree.

`ROUTERS` builds a policy from the ``router`` config group (``conf/router/``; the run offers
``seed`` and, as ``max_tree_size``, a replica's KV capacity); ``router=custom
router.target=module.Class`` takes a `Router` of your own (docs/extending.md). The keys
``network_delay_s``, ``transfer_s_per_token`` and ``load_seen`` of that group belong to the
cluster (the simulator's delay between the router and a replica, and what the router sees of a
replica's load), not to the policy; `cluster_delays` and `cluster_load_seen` read them.
"""

from __future__ import annotations

from typing import Any, Mapping

from testbed.errors import BadInput, check_choice
from testbed.config.group_values import check_setting
from testbed.config.registry import Registry
from testbed.router.approx_tree import ApproxTree
from testbed.router.base import (LOAD_SEEN, LOAD_UNITS, Loads, NoWorker, Router, is_imbalanced,
                                 least_loaded)
from testbed.router.kv_events import KvEvents, KvIndex
from testbed.router.policies import (CacheAware, LeastLoad, Oracle, RandomRouter, RoundRobin,
                                     peek_match)

DELAY_KEYS = ("network_delay_s", "transfer_s_per_token")  # `cluster_delays`
CLUSTER_KEYS = (*DELAY_KEYS, "load_seen")

ROUTERS = Registry("router", methods=("bind", "route", "on_complete", "info"),
                   run_keys=CLUSTER_KEYS, what="a router (testbed.router.Router)")
for _name, _router in (("round_robin", RoundRobin), ("random", RandomRouter),
                       ("least_load", LeastLoad), ("cache_aware", CacheAware),
                       ("oracle", Oracle), ("kv_events", KvEvents)):
    ROUTERS.register(_name, _router)

__all__ = ["ApproxTree", "CLUSTER_KEYS", "CacheAware", "DELAY_KEYS", "KvEvents", "KvIndex",
           "LOAD_SEEN", "LOAD_UNITS", "LeastLoad", "Loads", "NoWorker", "Oracle", "ROUTERS",
           "RandomRouter", "RoundRobin", "Router", "cluster_delays", "cluster_load_seen",
           "is_imbalanced", "least_loaded", "peek_match"]


def cluster_delays(cfg: Mapping[str, Any] | str) -> tuple[float, float]:
    """(``network_delay_s``, ``transfer_s_per_token``) of the ``router`` config, validated."""
    params = {} if isinstance(cfg, str) else dict(cfg)
    out = []
    for key in DELAY_KEYS:
        value = float(check_setting(f"router.{key}", "float", params.get(key)) or 0.0)
        if value < 0:
            raise BadInput(f"router.{key} must be >= 0, got {value}")
        out.append(value)
    return out[0], out[1]


def cluster_load_seen(cfg: Mapping[str, Any] | str, live: bool = False) -> str:
    """``router.load_seen``, checked: null is ``progress`` in the simulator and ``stream`` live
    (``live``: testbed.route, which sees a replica's work only as it streams and refuses
    ``progress``)."""
    value = None if isinstance(cfg, str) else cfg.get("load_seen")
    if value is None:
        return "stream" if live else "progress"
    check_choice("router.load_seen", value, LOAD_SEEN)
    if live and value == "progress":
        raise BadInput("router.load_seen=progress: testbed.route sees a replica's work only as it "
                       "streams (a prompt counts until its request ends); use stream or null")
    return value
