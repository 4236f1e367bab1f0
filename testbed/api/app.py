"""`make_app`: the OpenAI-compatible HTTP API (FastAPI) in front of an `OnlineEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (streamed as server-sent events
with ``stream: true``), ``GET /v1/models``, ``GET /health``, ``GET /debug/state`` (the scheduler
and cache, read between steps: counts, locks, invariants), ``GET /debug/steps`` (the steps the
loop ran, as it timed them: `testbed.api.step_log`), ``GET /metrics`` (Prometheus text:
`testbed.api.metrics`) and the cache's events (``GET /kv_events``, ``/kv_events/snapshot``:
`testbed.api.events_routes`). A request is parsed and checked here
(`testbed.api.protocol`), then handed to the engine with a sink that runs in this event loop (the
engine hands each step's updates over in one call); a client that goes away (a stream cancelled by
Starlette, or a non-streaming client found disconnected, answered 499) has its request aborted, its
KV released at the next step boundary. Errors are OpenAI's JSON ``{"error": {...}}`` with a 4xx/5xx
status, whatever the body (docs/design.md §3 "Serving over HTTP"); the endpoints read between steps
answer 503 when the loop is busy past `BETWEEN_STEPS_WAIT_S`.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from testbed.api.answers import AnswerCounts, CountAnswers
from testbed.api.events_routes import add_event_routes
from testbed.api.online import EngineBusy, EngineDead, OnlineEngine, Update, generating_request
from testbed.api.protocol import (ApiError, Generation, ServerFacts, choice, envelope, parse,
                                  usage)
from testbed.api.text import Detokenizer

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is there
# How long /debug/state and /reset_prefix_cache wait for a step boundary before answering 503
# (engine busy): a step takes milliseconds on the tiny model, up to a second or so for SmolLM2
# on a CPU (docs/results/serve.md); one far longer is a stall worth reporting, not waiting out.
BETWEEN_STEPS_WAIT_S = 5.0
CLIENT_CLOSED = 499  # nginx's "client closed request": nobody reads it


def make_app(engine: OnlineEngine, facts: ServerFacts) -> FastAPI:
    app = FastAPI(title=f"testbed.serve: {facts.model_name}")
    answers = AnswerCounts()
    app.add_middleware(CountAnswers, counts=answers)

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.alive:
            return JSONResponse({"status": "error", "error": engine.error or "engine stopped"},
                                status_code=503)
        epoch = engine.events.epoch if engine.events is not None else None
        return JSONResponse({"status": "ok", "model": facts.model_name, "live": engine.live,
                             "epoch": epoch})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": facts.model_name, "object": "model", "created": 0, "owned_by": "testbed",
            "max_model_len": facts.limits.context}]}

    async def in_loop(fn: Callable[[OnlineEngine], Any]) -> Any:
        """``fn(engine)`` run in the loop thread between steps; 503 when the loop is dead, or
        busy past `BETWEEN_STEPS_WAIT_S` (then ``fn`` never runs)."""
        try:
            return await run_in_threadpool(engine.inspect, fn, BETWEEN_STEPS_WAIT_S)
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead", kind="server_error") from None
        except EngineBusy as e:
            raise ApiError(503, f"the engine is busy: {e.seconds:.1f} s in its current step "
                           "(since its loop last came between steps); this is answered between "
                           "steps, retry later", code="engine_busy", kind="server_error") from None

    @app.get("/debug/state")
    async def debug_state() -> dict[str, Any]:
        return {**await in_loop(engine_state), **answers.snapshot()}

    @app.get("/metrics")
    async def metrics() -> Response:
        # read at once, not between steps: the loop thread keeps the figures (one lock)
        return PlainTextResponse(engine.metrics.exposition(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    add_event_routes(app, engine.events, facts.cache_label, in_loop)

    @app.get("/debug/steps")
    async def debug_steps(since: int = 0) -> dict[str, Any]:
        # the log has its own lock: read at once, not between steps
        return {"recorded": engine.steps.recorded,
                "steps": [s.as_dict() for s in engine.steps.since(since)]}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, Any]:
        return await in_loop(empty_cache)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, chat=True)

    async def generate(request: Request, chat: bool) -> Response:
        gen = parse(await json_body(request), facts, chat)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[Update] = asyncio.Queue()
        req = generating_request(rid, gen.prompt, gen.max_tokens, ignore_eos=gen.ignore_eos,
                                 min_tokens=gen.min_tokens, stop_token_ids=gen.stop_token_ids)
        try:
            taken = engine.submit(req, updates.put_nowait, loop)
        except EngineDead as e:
            raise ApiError(503, str(e), code="engine_dead", kind="server_error") from None
        if not taken:
            raise ApiError(429, f"the server holds {engine.max_live} requests already "
                           "(serve.max_queue); retry later", code="queue_full",
                           kind="rate_limit_error")
        if gen.stream:
            return AbortingStream(stream(gen, rid, updates), lambda: engine.abort(rid))
        return await whole(request, gen, rid, updates)

    async def whole(request: Request, gen: Generation, rid: str,
                    updates: asyncio.Queue[Update]) -> Response:
        async def collect() -> tuple[list[int], Update]:
            ids: list[int] = []
            while True:
                u = await updates.get()
                ids += u.tokens
                if u.finish_reason is not None:
                    return ids, u

        async def client_gone() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(DISCONNECT_POLL_S)

        answer = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            # decided here: a cancelled task reads as cancelled only once the loop has run it
            abandoned = not answer.done()  # the client went away, or the server is stopping
            if abandoned:
                answer.cancel()
                engine.abort(rid)
        if abandoned:
            return Response(status_code=CLIENT_CLOSED)
        ids, last = answer.result()
        if last.finish_reason == "error":
            raise ApiError(500, f"the engine failed: {last.error}", code="engine_error",
                           kind="server_error")
        detok = Detokenizer(facts.tokenizer)
        text = detok.feed(ids) + detok.finish()
        body = envelope(gen, rid, facts.model_name,
                        [choice(gen, text, ids, last.finish_reason, stream=False)], stream=False)
        body["usage"] = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return JSONResponse(body)

    async def stream(gen: Generation, rid: str,
                     updates: asyncio.Queue[Update]) -> AsyncIterator[str]:
        done, first = False, True
        detok = Detokenizer(facts.tokenizer)
        if gen.chat:  # the assistant's role first, as OpenAI streams it
            yield sse(envelope(gen, rid, facts.model_name, [choice(gen, "", [], None, True)],
                               stream=True, first=True))
            first = False
        while not done:
            u = await updates.get()
            if u.finish_reason == "error":
                yield sse(ApiError(500, f"the engine failed: {u.error}", code="engine_error",
                                   kind="server_error").body())
                break
            done = u.finish_reason is not None
            piece = detok.feed(u.tokens) + (detok.finish() if done else "")
            yield sse(envelope(gen, rid, facts.model_name,
                               [choice(gen, piece, list(u.tokens), u.finish_reason, True)],
                               stream=True, first=first))
            first = False
            if done and gen.include_usage:
                chunk = envelope(gen, rid, facts.model_name, [], stream=True)
                chunk["usage"] = usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                yield sse(chunk)
        yield "data: [DONE]\n\n"

    return app


class AbortingStream(StreamingResponse):
    """A server-sent event stream that aborts its request however it ends: Starlette cancels it
    when the client disconnects, even before its first chunk. (After a normal end the abort
    finds the request finished and does nothing.) ``abort`` may return an awaitable, awaited
    then (the router's: the replica's stream closed, `testbed.gateway.proxy`)."""

    def __init__(self, content: AsyncIterator[str], abort: Callable[[], Any]) -> None:
        super().__init__(content, media_type="text/event-stream")
        self.abort = abort

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            ended = self.abort()
            if inspect.isawaitable(ended):
                await ended


async def json_body(request: Request) -> Any:
    """The body as JSON: 400 when it is not (nested too deeply for the parser too), 499 when the
    client went away before sending all of it."""
    try:
        raw = await request.body()
    except ClientDisconnect:
        raise ApiError(CLIENT_CLOSED, "the client closed the connection before its request was "
                       "read", code="client_closed") from None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:  # json's parser recurses once per level of nesting
        raise ApiError(400, "the request body is not valid JSON: nested too deeply") from None


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def empty_cache(engine: OnlineEngine) -> dict[str, Any]:
    """Evict every cached entry (``POST /reset_prefix_cache``, as vLLM's and SGLang's
    ``/flush_cache``): only while no request is held, since a held request's KV is in use;
    ``success`` false otherwise, and nothing changes."""
    if engine.live:
        return {"success": False, "evicted_tokens": 0, "live": engine.live}
    cache = engine.scheduler.cache
    evicted = cache.evict(int(cache.evictable_size)) if cache.evictable_size else 0
    return {"success": cache.evictable_size == 0 and cache.protected_size == 0,
            "evicted_tokens": int(evicted), "live": 0}


def engine_state(engine: OnlineEngine) -> dict[str, Any]:
    """The scheduler and cache as the loop thread sees them between steps (``/debug/state``):
    requests held, locks and leases, and whether the cache's invariants hold (their message when
    not)."""
    s = engine.scheduler
    cache = s.cache
    try:
        cache.check_invariants(s.leases())
        invariants = "ok"
    except AssertionError as e:
        invariants = f"violated: {e}"
    pool = cache.pool
    return {"live": engine.live, **engine.counts,
            "waiting": len(s.waiting), "running": sum(not r.finished for r in s.running),
            "leases": len(s.leases()), "protected_tokens": int(cache.protected_size),
            "evictable_tokens": int(cache.evictable_size),
            "free_tokens": None if pool is None or pool.unbounded else int(pool.num_free),
            "preemptions": s.preemptions, "has_work": s.has_work, "invariants": invariants,
            "counters": engine.metrics.counters(),
            "kv_events_seq": None if engine.events is None else engine.events.seq}
