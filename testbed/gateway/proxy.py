"""One request through the live router: routed by the policy, streamed through, retried on
another replica while nothing has been streamed, else ended with a clear error.

The policy is asked (`Router.route`) with the prompt's tokens (`testbed.gateway.prompts`) and
every replica's load, only replicas in rotation and not yet tried for this request counting as
available. The request goes to the chosen replica unchanged, except that a policy that learns
from finished requests (``wants_completions``) gets the output token ids it needs: the router asks
for them (``return_token_ids``, vLLM's and testbed.serve's) and takes them out of the answer
again when the client did not ask.

*Commit point.* A streamed answer is held back until its first chunk that carries output (or
finishes, or ``[DONE]``): a chat's first chunk carries only the role. Until then a failure (no
connection, an error status of 500 and above, a stream broken, silent for ``stall_timeout_s`` or
ended early, an error chunk) is the replica's: it is retried on another replica, up to
``retries`` times (a refused connection, a broken stream, a 503 also take the replica out of
rotation). An answer of 400 to 499 is the client's and is passed on. Once committed the stream
is passed through chunk by chunk; a failure then ends it with an error chunk
(``{"error": {"code": "replica_failed", "message": "replica R (URL) failed after N output
tokens: ..."}}``) and ``data: [DONE]``, which the testbed's client records as the call's error.
No replica left: 503 ``no_replica`` naming each attempt's failure.

*Upstream client.* The calls to the replicas go through one aiohttp session, the client's
(`testbed.remote.openai_client.http_session`, reads limited by ``stall_timeout_s``), and so do
the health watch's checks and the event feeds' long polls (router=kv_events). A stream read to
its end goes back to the pool (`drain`); one abandoned is closed, which aborts the replica's
request.

Load: a request counts towards its replica from routing to its end (`Replica.requests`), and its
prompt plus ``max_tokens`` less the output tokens streamed so far (`Replica.tokens`; prefill
progress is not seen from here). At its end the policy is told (`Router.on_complete`) with the
output ids, or None when it failed (a retried attempt included).
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp
import numpy as np
from fastapi.responses import JSONResponse, Response

from testbed.api.app import AbortingStream
from testbed.api.protocol import ApiError
from testbed.gateway.prompts import route_tokens
from testbed.gateway.replicas import Replica, Replicas
from testbed.remote.openai_client import (
    HTTP_ERRORS, drain, error_message, http_session, stream_lines,
)
from testbed.router import NoWorker, Router
from testbed.workloads.request import TOKEN_DTYPE

ROUTED_KEPT = 100_000  # /debug/state's `routed` and `routing`: the last this many


#: of `HTTP_ERRORS`, what says the replica is gone (refused, not accepted in time, reset, cut
#: mid-body): out of rotation until its health says otherwise (a stall, a timeout, is not)
GONE = (aiohttp.ClientOSError, aiohttp.ConnectionTimeoutError, aiohttp.ServerDisconnectedError,
        aiohttp.ClientPayloadError)


class ReplicaFailed(Exception):
    """The attempt failed before anything was streamed to the client: retry elsewhere."""


@dataclass
class Proxy:
    replicas: Replicas
    router: Router
    tokenizer: Any
    retries: int
    stall_timeout_s: float
    connect_timeout_s: float
    upstream: aiohttp.ClientSession | None = None  # `start` makes it in the running loop
    t0: float = field(default_factory=time.monotonic)
    routed: deque = field(default_factory=lambda: deque(maxlen=ROUTED_KEPT))
    # every decision as made (a retry's too): (the call's X-Request-Id or None, replica, seconds
    # since the router started): the order and times the router received the calls in, which a
    # client's own send times need not show under concurrency (a simulator twin replays these)
    routing: deque = field(default_factory=lambda: deque(maxlen=ROUTED_KEPT))
    counts: Counter = field(default_factory=Counter)  # retried, failed_mid_stream, no_replica

    def now(self) -> float:
        return time.monotonic() - self.t0

    def start(self) -> None:
        self.upstream = http_session(self.connect_timeout_s, self.stall_timeout_s)

    async def close(self) -> None:
        if self.upstream is not None:
            await self.upstream.close()

    async def handle(self, body: Any, chat: bool, request_id: str | None = None) -> Response:
        tokens = route_tokens(body, chat, self.tokenizer)  # 400 as the replica would answer
        stream = body.get("stream") is True
        inject = self.router.wants_completions and body.get("return_token_ids") is not True
        sent = {**body, "return_token_ids": True} if inject else body
        asked = body.get("max_completion_tokens" if chat and "max_completion_tokens" in body
                         else "max_tokens")
        max_tokens = asked if isinstance(asked, int) and not isinstance(asked, bool) else 0
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: set[int] = set()
        errors: list[str] = []
        for attempt in range(self.retries + 1):
            now = self.now()
            try:
                w = self.router.route(tokens, self.replicas.loads(exclude=tried), now)
            except NoWorker:
                break
            self.routing.append((request_id, w, round(now, 6)))
            call = Call(self, self.replicas.members[w], tokens, max(0, max_tokens), inject)
            try:
                answer = await call.open(path, sent, stream)
            except ReplicaFailed as e:
                call.end(None)
                call.replica.failed += 1
                errors.append(f"replica {w} ({call.replica.url}): {e}")
                tried.add(w)
                self.counts["retried" if attempt < self.retries else "gave_up"] += 1
                continue
            self.routed.append(w)
            return answer
        self.counts["no_replica"] += 1
        raise ApiError(503, "no replica could serve the request: " + (
            "; ".join(errors) if errors else "none is in rotation"), code="no_replica",
            kind="server_error")


class Call:
    """One attempt at one replica: its load, its answer read, its end told to the policy."""

    def __init__(self, proxy: Proxy, replica: Replica, tokens: np.ndarray, max_tokens: int,
                 inject: bool) -> None:
        self.proxy, self.replica, self.tokens, self.inject = proxy, replica, tokens, inject
        self.output: list[int] | None = []  # None: the replica sends no ids
        self.carried = 0  # output tokens (or token-carrying chunks) seen
        self.committed = self.done = self.ended = False
        self.left = len(tokens) + max_tokens
        replica.requests += 1
        replica.tokens += self.left
        replica.routed += 1

    # ------------------------------------------------------------------ the attempt
    async def open(self, path: str, body: dict, stream: bool) -> Response:
        p = self.proxy
        try:
            resp = await p.upstream.post(self.replica.url + path, json=body)
        except HTTP_ERRORS as e:
            raise self._failed(e) from None
        if resp.status == 200:
            self.replica.seen = time.monotonic()  # it answers: alive (`Replicas.unheard`)
        else:
            content = await self._read_all(resp)
            if resp.status >= 500:
                if resp.status == 503:
                    p.replicas.leave(self.replica, "answered 503")
                raise ReplicaFailed(f"HTTP {resp.status}: "
                                    f"{error_message(resp.status, content.decode())}")
            self.end(None)  # the client's error (4xx): passed on, not retried
            return Response(content, resp.status, media_type=resp.headers.get("content-type"))
        if not stream:
            return self._whole(await self._read_all(resp))
        lines = stream_lines(resp)
        held: list[str] = []
        try:
            async for line in lines:
                out = self._chunk(line)
                if out is not None:
                    held.append(out)
                if self.committed:
                    break
        except HTTP_ERRORS as e:
            resp.close()
            raise self._failed(e) from None
        except ReplicaFailed:
            resp.close()
            raise
        if not self.committed:
            resp.close()
            raise ReplicaFailed("the stream ended before its first token")
        # the stream passed through; abandoned however it ends (a no-op after a normal end: the
        # attempt has ended then)
        return AbortingStream(self._rest(resp, lines, held), lambda: self._abandoned(resp))

    async def _read_all(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except HTTP_ERRORS as e:
            resp.close()
            raise self._failed(e) from None
        finally:
            resp.release()

    def _failed(self, e: Exception) -> ReplicaFailed:
        why = f"{type(e).__name__}: {e}".rstrip(": ")
        if isinstance(e, GONE):  # gone: out of rotation until its health says
            self.proxy.replicas.leave(self.replica, why)
        return ReplicaFailed(why)

    def _whole(self, content: bytes) -> Response:
        try:
            doc = json.loads(content)
            choice = doc["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise ReplicaFailed(f"the answer is not a completion: {content[:200]!r}") from None
        ids = choice.get("token_ids")
        self.output = [int(t) for t in ids] if isinstance(ids, list) else None
        if self.inject:
            _strip(doc)
        self.end(self._output())
        return JSONResponse(doc)

    async def _rest(self, resp: aiohttp.ClientResponse, lines: AsyncIterator[str],
                    held: list[str]) -> AsyncIterator[str]:
        """The held chunks, then the rest of the replica's stream as it comes."""
        ok = False
        try:
            for out in held:
                yield self._before(out)
            try:
                while not self.done:
                    line = await lines.__anext__()
                    out = self._chunk(line)
                    if out is not None:
                        yield self._before(out)
                ok = self.error is None
            except StopAsyncIteration:
                yield self._error_chunk("the stream ended before its last chunk ([DONE])")
            except (*HTTP_ERRORS, ReplicaFailed) as e:
                if not isinstance(e, ReplicaFailed):
                    self._failed(e)
                yield self._error_chunk(f"the stream broke: {type(e).__name__}: {e}".rstrip(": "))
        finally:
            if ok:
                await drain(resp)  # the connection back to the pool
            else:
                resp.close()
            self.end(self._output() if ok else None)

    def _before(self, out: str) -> str:
        """``out`` about to go to the client: at ``[DONE]`` the attempt ends first, so the
        policy has heard of it before the client can send its next request."""
        if self.done:
            self.end(self._output() if self.error is None else None)
        return out

    async def _abandoned(self, resp: aiohttp.ClientResponse) -> None:
        """However the client's stream ended (even before its first chunk was asked for): the
        replica's stream closed (it aborts the request; a stream read to its end is back in the
        pool already) and the attempt ended."""
        resp.close()
        self.end(None)

    def _error_chunk(self, why: str) -> str:
        self.proxy.counts["failed_mid_stream"] += 1
        self.replica.failed += 1
        r = self.replica
        body = {"error": {"message": f"replica {r.index} ({r.url}) failed after {self.carried} "
                          f"output tokens: {why}", "type": "server_error", "param": None,
                          "code": "replica_failed"}}
        return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n"

    # ------------------------------------------------------------------ reading chunks
    error: str | None = None

    def _chunk(self, line: str) -> str | None:
        """One line of the replica's stream: the text to pass on (None: nothing), with what it
        says noted (tokens, finish, error). Before the commit point an error chunk fails the
        attempt."""
        self.replica.seen = time.monotonic()  # a line streamed: alive (`Replicas.unheard`)
        if not line.startswith("data:"):
            return None
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            self.done = self.committed = True
            return "data: [DONE]\n\n"
        try:
            chunk = json.loads(data)
        except ValueError:
            raise ReplicaFailed(f"a stream line is not JSON: {data[:200]!r}") from None
        if isinstance(chunk, dict) and chunk.get("error") is not None:
            self.error = error_message(None, data)
            if not self.committed:
                raise ReplicaFailed(f"error chunk: {self.error}")
            return f"data: {data}\n\n"
        new = 0
        for choice in (chunk.get("choices") or ()) if isinstance(chunk, dict) else ():
            ids = choice.get("token_ids")
            if ids:
                new += len(ids)
                if self.output is not None:
                    self.output.extend(int(t) for t in ids)
            elif choice.get("text") or (choice.get("delta") or {}).get("content"):
                new += 1
                self.output = None if ids is None else self.output
            if choice.get("finish_reason") is not None:
                self.committed = True
        if new:
            self.committed = True
            self.carried += new
            self._produced(new)
        if self.inject:
            _strip(chunk)
            data = json.dumps(chunk, separators=(",", ":"))
        return f"data: {data}\n\n"

    def _produced(self, n: int) -> None:
        n = min(n, self.left)
        self.left -= n
        self.replica.tokens -= n

    def _output(self) -> np.ndarray:
        return np.asarray(self.output or [], dtype=TOKEN_DTYPE)

    def end(self, output: np.ndarray | None) -> None:
        """The attempt is over: its load off the replica, the policy told (once)."""
        if self.ended:
            return
        self.ended = True
        self.replica.requests -= 1
        self.replica.tokens -= self.left
        self.left = 0
        router = self.proxy.router
        if router.wants_completions:
            router.on_complete(self.replica.index, self.tokens, output, self.proxy.now())


def _strip(doc: dict) -> None:
    """Take out the token ids the router asked for on the client's behalf."""
    doc.pop("prompt_token_ids", None)
    for choice in doc.get("choices") or ():
        choice.pop("token_ids", None)
        choice.pop("prompt_token_ids", None)
