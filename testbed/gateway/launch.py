"""Running the live router: `route_forever` (``python -m testbed.route``: local replicas started
when ``route.urls`` is null, the router served until SIGINT/SIGTERM, the replicas stopped after
it) and `start_router` (tests, studies: in this process, in a thread, on a free loopback port,
returned once ``/health`` answers).

Local replicas are ``python -m testbed.serve`` processes with the command line's overrides less
the router's own (`testbed.gateway.settings.replica_overrides`), started side by side on free
loopback ports (`start_replicas`); each is stopped by SIGTERM.
"""

from __future__ import annotations

import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

import httpx

from testbed.api.server import (ServerHandle, Stopped, bind, healthy_or_stopped, load_tokenizer,
                                start_server, stop_signal)
from testbed.config.assembly import compose_config
from testbed.errors import BadInput
from testbed.gateway.settings import RoutePlan, assemble_route


def start_replicas(n: int, overrides: Sequence[str], timeout_s: float) -> list[ServerHandle]:
    """``n`` local ``testbed.serve`` subprocesses, started side by side; all or none."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(start_server, list(overrides), 0, False, timeout_s)
                   for _ in range(n)]
        handles, failure = [], None
        for f in futures:
            try:
                handles.append(f.result())
            except Exception as e:  # noqa: BLE001 - stop the others, then report this one
                failure = failure or e
    if failure is not None:
        for h in handles:
            h.stop()
        raise BadInput(f"a local replica did not start: {failure}")
    return handles


def served_model(urls: Sequence[str], name: str | None) -> str:
    """``name``, else the first model the first answering replica lists."""
    if name:
        return name
    for url in urls:
        try:
            return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
            continue
    raise BadInput(f"no replica of {list(urls)} lists a model at /v1/models; name one with "
                   "route.model_name=ID")


def router_server(plan: RoutePlan, urls: Sequence[str]) -> Any:
    import uvicorn

    from testbed.gateway.app import make_router_app

    app = make_router_app(list(urls), plan.router.build(seed=plan.seed, max_tree_size=None),
                          plan.settings, load_tokenizer(plan.tokenizer_path),
                          served_model(urls, plan.settings.model_name))
    config = uvicorn.Config(app, log_level=plan.settings.log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def route_forever(plan: RoutePlan, replica_argv: Sequence[str]) -> None:
    """Start the local replicas (when ``route.urls`` is null), serve the router until
    SIGINT/SIGTERM (uvicorn's graceful shutdown, then `Stopped`), stop the replicas."""
    s = plan.settings
    local = [] if s.urls else start_replicas(plan.replicas, replica_argv, s.start_timeout_s)
    urls = list(s.urls or [h.url for h in local])
    found = {sig: signal.signal(sig, stop_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server = router_server(plan, urls)
        sock = bind(s.host, s.port)
        print(f"routing on http://{s.host}:{sock.getsockname()[1]} with router="
              f"{plan.router.label} in front of {len(urls)} replicas: {' '.join(urls)}",
              flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            sock.close()
    except Stopped:
        pass
    finally:
        for sig, handler in found.items():
            signal.signal(sig, handler)
        for h in local:
            h.stop()


@dataclass
class RouterHandle:
    url: str
    app: Any
    _server: Any
    _thread: threading.Thread
    _sock: Any

    def state(self) -> dict:
        return httpx.get(self.url + "/debug/state", timeout=30).json()

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()


def start_router(urls: Sequence[str], overrides: Sequence[str] = (),
                 timeout_s: float = 60.0) -> RouterHandle:
    """The router of ``conf/route.yaml`` with ``overrides`` in front of ``urls``, in this
    process (a thread), on a free loopback port, once its ``/health`` answers 200."""
    plan = assemble_route(compose_config([*overrides, f"route.urls=[{','.join(urls)}]",
                                          "route.port=0"], name="route"))
    server = router_server(plan, urls)
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="router",
                              daemon=True)
    thread.start()
    handle = RouterHandle(f"http://127.0.0.1:{sock.getsockname()[1]}", server.config.app,
                          server, thread, sock)
    return healthy_or_stopped(handle, timeout_s)
