"""The ``route`` block of ``python -m testbed.route`` (conf/route.yaml), checked with the groups
the router reads from the run config it shares: ``router`` (the policy: the simulator's, built by
the same registry), ``model`` (the checkpoint whose tokenizer turns text prompts into the tokens
the policy routes on), ``seed`` and ``replicas`` (how many local ``testbed.serve`` to start when
``route.urls`` names none; ignored when it names some). Each value is refused in one line naming the key and what is
allowed (docs/design.md §3 "Routing live"). Imports no web framework and no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from omegaconf import DictConfig

from testbed.config import group_values
from testbed.api.settings import listening
from testbed.config.assembly import plain
from testbed.errors import BadInput
from testbed.config.model_group import resolve_model_group
from testbed.config.registry import Resolved
from testbed.remote.settings import _base_url
from testbed.router import ROUTERS, cluster_load_seen

ROUTE_KEYS = ("urls", "host", "port", "model_name", "health_interval_s", "health_timeout_s",
              "idle_health_interval_s", "connect_timeout_s", "stall_timeout_s", "retries",
              "events_wait_s", "log_level", "start_timeout_s")
SECONDS = {"health_interval_s": 0.25, "health_timeout_s": 1.0, "idle_health_interval_s": 10.0,
           "connect_timeout_s": 2.0, "stall_timeout_s": 60.0, "events_wait_s": 1.0,
           "start_timeout_s": 600.0}


@dataclass(frozen=True)
class RouteSettings:
    """The ``route`` block, checked (conf/route.yaml says what each key means)."""

    urls: tuple[str, ...] | None = None  # None: start `replicas` local testbed.serve
    host: str = "127.0.0.1"
    port: int = 8100
    model_name: str | None = None
    health_interval_s: float = 0.25
    health_timeout_s: float = 1.0
    idle_health_interval_s: float = 10.0
    connect_timeout_s: float = 2.0
    stall_timeout_s: float = 60.0
    retries: int = 2
    events_wait_s: float = 1.0
    log_level: str = "warning"
    start_timeout_s: float = 600.0


@dataclass(frozen=True)
class RoutePlan:
    """What `assemble_route` read: the settings, the policy to build, the tokenizer's
    checkpoint (None: route text on its bytes), how many replicas to start, the seed."""

    settings: RouteSettings
    router: Resolved
    tokenizer_path: str | None
    replicas: int
    seed: int


def assemble_route(cfg: DictConfig | Mapping[str, Any]) -> RoutePlan:
    config = dict(plain(cfg))
    block = config.get("route") or {}
    if not isinstance(block, Mapping):
        raise BadInput(f"route must be a mapping of {', '.join(ROUTE_KEYS)}, got {block!r}")
    unknown = sorted(set(block) - set(ROUTE_KEYS))
    if unknown:
        raise BadInput(f"route.{unknown[0]} is not a route key; allowed: {', '.join(ROUTE_KEYS)}")
    urls = block.get("urls")
    if urls is not None:
        if isinstance(urls, str) or not isinstance(urls, (list, tuple)) or not urls:
            raise BadInput(f"route.urls must be a list of http://HOST:PORT or null, got {urls!r}")
        urls = tuple(_route_url(u) for u in urls)
        if len(set(urls)) != len(urls):
            raise BadInput(f"route.urls names a replica twice: {list(urls)}")
    host, port, name, level = listening(block, "route", 8100)
    seconds = {}
    for key, default in SECONDS.items():
        value = block.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise BadInput(f"route.{key} must be a number of seconds > 0, got {value!r}")
        seconds[key] = float(value)
    settings = RouteSettings(
        urls=urls, host=host, port=port, model_name=name,
        retries=group_values.integer(block, "retries", "route", minimum=0, default=2),
        log_level=level, **seconds)
    replicas = group_values.integer(config, "replicas", "", minimum=1, default=2)
    router = ROUTERS.resolve(config.get("router") or {})
    cluster_load_seen(config.get("router") or {}, live=True)  # it sees streams, nothing else
    if router.label == "oracle":
        raise BadInput("router=oracle reads the replicas' caches in the simulator's process; "
                       "live, router=kv_events routes on what the replicas report they hold")
    seed = group_values.integer(config, "seed", "", minimum=0, default=0)
    router.build(seed=seed, max_tree_size=None)  # a bad router value stops here, in one line
    model = resolve_model_group(config.get("model") or {}, need_checkpoint=False)
    path = model.get("path")
    return RoutePlan(settings, router, str(path) if path and not str(path).startswith("data:")
                     else None, len(urls) if urls else replicas, seed)


def _route_url(url: Any) -> str:
    try:
        return _base_url(url)
    except BadInput:
        raise BadInput(f"route.urls must list URLs like http://HOST:PORT, got {url!r}") from None


def replica_overrides(argv: list[str]) -> list[str]:
    """The command line's overrides the local replicas take: all but the router's own
    (``route.*``, ``router=``, ``router.*``, ``replicas=``) and Hydra's."""
    own = ("route.", "router=", "router.", "+router.", "++router.", "replicas=", "hydra.",
           "hydra/", "-")
    return [a for a in argv if not a.startswith(own)]
