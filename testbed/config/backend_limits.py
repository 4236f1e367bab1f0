"""What a backend cannot serve, refused by `testbed.config.assembly.assemble` before anything
is built.

Replicas run only in the simulator, one cache each, without lower tiers or reuse beyond exact
prefixes (`check_replicas`); ``backend=server`` leaves cache and scheduler to the server, so what
they would decide is refused, and its ``server`` block is checked (`check_server`).
"""

from __future__ import annotations

from typing import Any

from testbed.config import group_values
from testbed.cache import ReuseConfig
from testbed.cache.tier_config import has_lower_tiers
from testbed.errors import BadInput

REPLAY = "replay"  # the backend without an executor: requests one at a time, no time
SERVER = "server"  # nor has this one: a live OpenAI-compatible server serves (testbed/remote/)


def check_replicas(config: dict[str, Any], backend: str, reuse: ReuseConfig) -> None:
    """Replicas run only in the simulator, one cache each, without lower tiers or reuse beyond
    prefixes (checked before anything is generated)."""
    replicas = config.get("replicas") or 1
    if replicas == 1:
        return
    if backend == REPLAY:
        raise BadInput("replicas > 1 needs backend=sim (replay serves one cache)")
    if backend == "engine":
        raise BadInput(f"replicas={replicas} needs backend=sim; the engine serves one replica")
    if backend == SERVER:
        raise BadInput(f"replicas={replicas} needs backend=sim; backend=server sends to one "
                       "server (server.url)")
    c = config["cache"]
    if has_lower_tiers(c):
        raise BadInput("cache.host_tokens / cache.disk_tokens need replicas=1")
    if reuse.active:
        raise BadInput("cache.reuse=blend / cache.match=semantic need replicas=1")
    check_cache_events(config)


def check_cache_events(config: dict[str, Any]) -> None:
    """``router=kv_events`` reads the replicas' radix trees' changes: cache=radix only."""
    cache = config["cache"].get("target") or config["cache"].get("name")
    if (config.get("router") or {}).get("name") == "kv_events" and cache != "radix":
        raise BadInput(f"router=kv_events needs cache=radix (the replicas publish their radix "
                       f"tree's changes); got cache={cache}")


def check_server(config: dict[str, Any], backend: str, reuse: ReuseConfig, timeline: bool):
    """backend=server: the ``server`` block checked (`testbed.remote.settings`), and what the
    server's own cache and scheduler decide refused: reuse beyond prefixes, lower tiers, a
    timeline (the client sees no steps). Other backends ignore the block."""
    if backend != SERVER:
        return None
    from testbed.remote.settings import ServerSettings

    if reuse.active or has_lower_tiers(config["cache"]):
        raise BadInput("cache.reuse / cache.match / cache.host_tokens / cache.disk_tokens do not "
                       "apply to backend=server: its cache is the server's")
    if timeline:
        raise BadInput("timeline=true needs backend=sim or backend=engine (backend=server sees "
                       "no steps)")
    for key, default in (("temperature", 0.0), ("top_p", 1.0)):  # sent with every call
        group_values.number(config, key, "", default)
    return ServerSettings.from_mapping(config.get("server"))
