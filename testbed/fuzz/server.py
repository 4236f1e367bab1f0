"""The live servers ``backend=server`` configs are sent to: ``python -m testbed.serve`` on the
tiny model (the fuzzer's checkpoint, whose tokenizer reads ``server.prompt_format=text``
prompts), started by the fuzzer in a process of its own (in the background as the fuzz run
starts, so that its seconds of loading overlap the first configs) on a free loopback port
(polled until ``/health`` answers, `testbed.api.server.start_server`), and stopped at the end of
the fuzz run; and the live router (``python -m testbed.route``, `FuzzRouter`) in front of that
server and a second one of the same config, started on the first config that draws it.

Its own config (cache, eviction, scheduler, the engine's CPU kernels) is drawn once per fuzz run
from the run's seed (`server_config`), with ``debug.check_invariants=true``: a broken invariant
inside the server fails its calls, which the fuzzer reports. It serves every server config of the
run in turn, so its cache holds what earlier configs sent.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from testbed.fuzz.group_space import ROUTER_KEYS, ROUTERS, Table, choice, keys_of

URL = "FUZZ_SERVER"  # the ``server.url`` a draw writes: the live server's, once it runs
ROUTER_URL = "FUZZ_ROUTER"  # the live router's, in front of two such servers
SERVED = ["model=tiny", "device=cpu", "debug.check_invariants=true"]
# the live router's own keys (conf/route.yaml; its replicas and port are the fuzzer's)
ROUTE_KEYS: Table = (("model_name", ["null", "tiny"], 0.3),
                     ("health_interval_s", [0.05, 0.25, 2.0], 0.3),
                     ("health_timeout_s", [0.5, 1.0], 0.2),
                     ("idle_health_interval_s", [0.05, 10.0], 0.3),
                     ("connect_timeout_s", [0.5, 2.0], 0.2),
                     ("stall_timeout_s", [5.0, 60.0], 0.2), ("retries", [0, 1, 2], 0.3),
                     ("events_wait_s", [0.05, 1.0], 0.3),
                     ("log_level", ["warning", "error", "critical"], 0.2))


def server_config(seed: int, checkpoint: Path | None = None) -> list[str]:
    """The server's overrides for the fuzz run of ``seed`` (a stream of its own); ``checkpoint``:
    the fuzzer's tiny checkpoint with its tokenizer (`testbed.fuzz.fixtures`)."""
    rng = np.random.default_rng([seed, 58])
    model = [f"model.path={checkpoint}"] if checkpoint is not None else []
    return [*SERVED, *model, f"cache.page_size={choice(rng, [1, 1, 4])}",
            f"cache.capacity_tokens={choice(rng, ['null', 2000])}",
            f"eviction={choice(rng, ['lru', 'lfu', 'slru', 'priority'])}",
            f"scheduler={choice(rng, ['lpm', 'fcfs', 'dfs_weight'])}",
            f"scheduler.overlap={choice(rng, ['true', 'false'])}",
            f"engine.cpu_kernels={choice(rng, ['native', 'torch'])}",
            f"engine.attention={choice(rng, ['torch', 'cascade'])}",
            # without cache.capacity_tokens: the pool in GiB (2 GiB is 4M of the tiny model's
            # tokens, zeroed at start-up: the default's path, at a size the machine can spare)
            f"engine.cpu_kv_cache_gib={choice(rng, [0.25, 0.01, 0.001])}"]


@dataclass
class FuzzServer:
    overrides: list[str]
    handle: object | None = field(default=None, repr=False)
    _starting: Future | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start it in the background (it loads for seconds): `url` waits for it."""
        from testbed.api.server import start_server

        if self.handle is None and self._starting is None:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fuzz-server")
            self._starting = pool.submit(start_server, self.overrides, in_process=False)
            pool.shutdown(wait=False)

    @property
    def url(self) -> str:
        """The server's URL, once it answers (started here if `start` was not called)."""
        if self.handle is None:
            self.start()
            starting, self._starting = self._starting, None
            self.handle = starting.result()
        return self.handle.url

    def command(self) -> str:
        """The command line that starts this server where the failing config expects it."""
        port = self.handle.url.rpartition(":")[2] if self.handle is not None else "PORT"
        return " ".join(["python -m testbed.serve", *self.overrides, f"serve.port={port}"])

    def stop(self) -> None:
        if self._starting is not None:  # started, never used
            try:
                self.handle = self._starting.result()
            except Exception:  # noqa: BLE001 - it failed to start: nothing to stop
                pass
            self._starting = None
        if self.handle is not None:
            self.handle.stop()
            self.handle = None


def router_config(seed: int) -> list[str]:
    """The live router's overrides for the fuzz run of ``seed``: a policy of the ``router`` group
    with its keys, and ``route.`` keys (a stream of its own)."""
    rng = np.random.default_rng([seed, 59])
    name = choice(rng, ROUTERS[:3] + ["cache_aware", "cache_aware", "kv_events", "kv_events"])
    return [f"router={name}", *keys_of(rng, "router", ROUTER_KEYS.get(name, ())),
            *keys_of(rng, "route", ROUTE_KEYS)]


@dataclass
class FuzzRouter:
    """``python -m testbed.route`` (in a thread of the fuzzer) in front of the fuzzer's server and
    a second server of its config, both its replicas; started on first use."""
    overrides: list[str]
    first: FuzzServer
    second: FuzzServer = field(init=False)
    handle: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.second = FuzzServer(self.first.overrides)

    @property
    def url(self) -> str:
        if self.handle is None:
            from testbed.gateway.launch import start_router

            self.second.start()
            self.handle = start_router([self.first.url, self.second.url], self.overrides)
        return self.handle.url

    def command(self) -> str:
        """The command lines that start the second server and this router as the failing config
        expects them (after the first server's, `FuzzServer.command`)."""
        urls = [s.handle.url if s.handle is not None else "URL" for s in (self.first, self.second)]
        port = self.handle.url.rpartition(":")[2] if self.handle is not None else "PORT"
        return " & ".join([self.second.command(), " ".join(
            ["python -m testbed.route", *self.overrides, f"route.urls=[{','.join(urls)}]",
             f"route.port={port}"])])

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.stop()
            self.handle = None
        self.second.stop()
