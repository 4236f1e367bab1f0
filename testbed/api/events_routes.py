"""The server's cache events over HTTP (``router=kv_events``; `testbed.cache.events`).

- ``GET /kv_events?since=N[&epoch=E][&wait_s=S]``: the events numbered after ``N`` as JSON
  ``{"epoch", "seq", "events": [{"seq", "kind", "tokens", "keep"}, ...]}``, answered as soon as
  there is one, or empty after ``wait_s`` seconds (default 1, at most 10; a long poll: each
  answer is short, so a reader holds no connection open across a server's shutdown). 409
  ``resync`` when those events are no longer kept (the reader fell more than 4,096 behind) or
  ``epoch`` is not this log's (the server restarted): the reader must re-read the snapshot.
- ``GET /kv_events/snapshot``: the whole cache, read between steps, with the number of the last
  event it includes: ``{"epoch", "seq", "nodes": [[parent, [tokens]], ...]}``, every node of the
  radix tree, parents first (``parent`` -1: the root), the tokens of its edge.

A server whose cache publishes nothing (``cache=block_hash``, ``none``, lower tiers) answers
both with 404 ``no_events``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable

import numpy as np
from fastapi import FastAPI

from testbed.api.protocol import ApiError
from testbed.cache.events import EventLog
from testbed.cache.token_runs import TOKEN_DTYPE

POLL_S = 0.01  # how often a waiting long poll looks at the log (the loop thread appends to it)
MAX_WAIT_S = 10.0


def add_event_routes(app: FastAPI, events: EventLog | None, cache_label: str,
                     in_loop: Callable[[Callable[[Any], Any]], Awaitable[Any]]) -> None:
    def log() -> EventLog:
        if events is None:
            raise ApiError(404, f"this server's cache ({cache_label}) publishes no events; "
                           "serve cache=radix without lower tiers", code="no_events")
        return events

    @app.get("/kv_events/snapshot")
    async def snapshot() -> dict[str, Any]:
        found = log()
        return await in_loop(lambda engine: {"epoch": found.epoch, "seq": found.seq,
                                             "nodes": tree_nodes(engine.scheduler.cache)})

    @app.get("/kv_events")
    async def kv_events(since: int = 0, epoch: str | None = None,
                        wait_s: float = 1.0) -> dict[str, Any]:
        found = log()
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ApiError(400, f"wait_s must be in [0, {MAX_WAIT_S:g}], got {wait_s}",
                           param="wait_s")
        deadline = time.monotonic() + wait_s
        while True:
            batch = found.since(since) if epoch in (None, found.epoch) else None
            if batch is None:
                raise ApiError(409, f"events after {since} of epoch {epoch} are not kept "
                               f"(this log: epoch {found.epoch}, last event {found.seq}); "
                               "re-read GET /kv_events/snapshot", code="resync")
            if batch or time.monotonic() >= deadline:
                return {"epoch": found.epoch, "seq": found.seq,
                        "events": [e.as_dict() for e in batch]}
            await asyncio.sleep(POLL_S)


def tree_nodes(cache: Any) -> list[list[Any]]:
    """Every node of a radix cache, parents first: ``[parent index (-1: the root), tokens]``."""
    out: list[list[Any]] = []
    index = {id(cache.root): -1}
    for node in cache.nodes():  # parents before children
        index[id(node)] = len(out)
        out.append([index[id(node.parent)], np.frombuffer(node.kb, TOKEN_DTYPE).tolist()])
    return out


def leaf_paths(nodes: list[list[Any]]) -> list[np.ndarray]:
    """The paths of the leaves of a snapshot's ``nodes`` (what the cache holds, longest first
    per branch): `testbed.cache.events.cached_sequences` of the cache it was read from."""
    paths: list[list[int]] = []
    has_child = [False] * len(nodes)
    for parent, tokens in nodes:
        paths.append((paths[parent] if parent >= 0 else []) + list(tokens))
        if parent >= 0:
            has_child[parent] = True
    return [np.asarray(p, TOKEN_DTYPE) for p, inner in zip(paths, has_child) if not inner]
