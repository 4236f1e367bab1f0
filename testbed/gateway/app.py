"""`make_router_app`: the live router's OpenAI-compatible API (FastAPI) in front of the replicas.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (routed and passed through,
streamed or not: `testbed.gateway.proxy`), ``GET /v1/models`` (the replicas' model), ``GET
/health`` (200 while a replica is in rotation, else 503), ``GET /debug/state`` (the policy, each
replica's state and load, the replica of each request in routing order, the policy's decisions
and its own figures, the events read). Everything runs in one event loop: the handlers, the
health watch and the event feeds call the policy in turn, so it needs no lock. The watch and the
feeds start with the app and stop with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from testbed.api.app import json_body
from testbed.api.protocol import ApiError
from testbed.gateway.events_feed import EventsFeed
from testbed.gateway.proxy import Proxy
from testbed.gateway.replicas import Replica, Replicas, session_get
from testbed.gateway.settings import RouteSettings
from testbed.router import Router


def make_router_app(urls: list[str], router: Router, settings: RouteSettings, tokenizer: Any,
                    model_name: str) -> FastAPI:
    router.bind(len(urls))
    get = session_get(lambda: proxy.upstream)  # the health checks' and the event feeds' GETs
    replicas = Replicas([Replica(i, u) for i, u in enumerate(urls)], router, get,
                        settings.health_interval_s, settings.health_timeout_s,
                        settings.idle_health_interval_s)
    proxy = Proxy(replicas, router, tokenizer, settings.retries, settings.stall_timeout_s,
                  settings.connect_timeout_s)
    feed = EventsFeed(replicas, router, get, settings.events_wait_s,
                      settings.health_interval_s) \
        if getattr(router, "wants_cache_events", False) else None

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        proxy.start()
        await asyncio.gather(*(replicas.probe(r) for r in replicas.members))  # in rotation now
        tasks = [asyncio.create_task(replicas.watch())]
        if feed is not None:
            tasks += [asyncio.create_task(feed.follow(r)) for r in replicas.members]
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await proxy.close()

    app = FastAPI(title=f"testbed.route: {router.name}", lifespan=lifespan)
    app.state.proxy, app.state.replicas, app.state.feed = proxy, replicas, feed

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(await _object(request), chat=False,
                                  request_id=request.headers.get("x-request-id"))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(await _object(request), chat=True,
                                  request_id=request.headers.get("x-request-id"))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                             "owned_by": "testbed.route"}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        up = sum(r.up for r in replicas.members)
        return JSONResponse({"status": "ok" if up else "error", "replicas_up": up,
                             "replicas": len(replicas.members)}, status_code=200 if up else 503)

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        out = {"router": router.name, "replicas": [r.state() for r in replicas.members],
               "decisions": dict(sorted(router.decisions.items())),
               "router_info": router.info(), "routed": list(proxy.routed),
               "routing": [list(x) for x in proxy.routing],
               "counts": dict(proxy.counts)}
        if feed is not None:
            index = router.index
            out["events"] = {"seq": list(index.seq), "synced": list(index.synced),
                             "applied": index.applied, "resyncs": index.resyncs,
                             "breaks": feed.breaks}
        return out

    return app


async def _object(request: Request) -> dict:
    body = await json_body(request)
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body
