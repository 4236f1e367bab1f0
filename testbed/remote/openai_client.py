"""One OpenAI-compatible server as the testbed calls it: ``GET /v1/models`` and one streamed
``POST /v1/completions`` at a time, with token ids in and out.

A call sends its prompt as a list of token ids (or, with ``server.prompt_format=text``, their
text), ``max_tokens``, ``stream`` with
``stream_options.include_usage`` (the last chunk carries ``usage``), vLLM's ``return_token_ids``
(each choice of a chunk then carries the ids it adds as ``token_ids``) and the run's
``temperature`` / ``top_p``; a call forced to its workload's output length also sends
``ignore_eos`` and ``min_tokens`` (vLLM's and SGLang's extensions). The response is read as
server-sent events (``data: {...}`` lines, ending with ``data: [DONE]``); each chunk that carries
tokens is timed with ``time.perf_counter`` as it arrives (the first is the first token, the gaps
between them the inter-token latencies). ``usage.prompt_tokens_details.cached_tokens`` is the
server's prefix-cache hit (None when it does not report it: vLLM reports it with
``--enable-prompt-tokens-details``, SGLang with ``--enable-cache-report``).

A call that fails (an HTTP error status, an error chunk, a broken or cut stream, the
``server.timeout_s`` limit) is returned with its status and message; a refused connection raises
`ServerUnreachable` (a `BadInput`: the run stops with one line naming the URL).

The calls go through one aiohttp session (`http_session`: its HTTP parser in C, connections kept
alive and reused; testbed.route's proxy uses the same), each stream read to its end so that its
connection goes back to the pool (`drain`).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import aiohttp

from testbed.errors import BadInput
from testbed.remote.settings import ServerSettings


#: after ``data: [DONE]``: how long the rest of a stream is read for (`drain`)
DRAIN_S = 0.5


class ServerUnreachable(BadInput):
    """The server refused the connection or did not accept it in time."""


@dataclass
class Completion:
    """What one streamed call returned; times are ``time.perf_counter()`` seconds."""

    sent: float
    token_times: list[float] = field(default_factory=list)  # each chunk that carried tokens
    output_ids: list[int] | None = field(default_factory=list)  # None: the server sent no ids
    text: list[str] = field(default_factory=list)  # the choice's text pieces
    prompt_ids: list[int] | None = None  # the prompt as the server tokenized it, if it said
    chunks_with_tokens: int = 0
    usage_output_tokens: int | None = None  # usage.completion_tokens
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    finish: float | None = None
    finish_reason: str | None = None
    status: int | None = None  # the HTTP status (None: no response)
    error: str | None = None  # why the call failed (None: it did not)

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def output_tokens(self) -> int:
        """Output tokens received: the ids' count, else the usage block's, else the chunks'."""
        if self.output_ids is not None:
            return len(self.output_ids)
        if self.usage_output_tokens is not None:
            return self.usage_output_tokens
        return self.chunks_with_tokens


def completion_body(model: str, prompt: list[int] | str, max_tokens: int, forced: bool,
                    temperature: float, top_p: float) -> dict[str, Any]:
    """The JSON of one call; ``forced``: exactly ``max_tokens`` tokens, EOS ignored."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                            "stream": True, "stream_options": {"include_usage": True},
                            "return_token_ids": True, "temperature": temperature,
                            "top_p": top_p}
    if forced:
        body |= {"ignore_eos": True, "min_tokens": max_tokens}
    return body


def error_message(status: int | None, text: str) -> str:
    """The message of an error body (OpenAI's ``{"error": {"message"}}``, vLLM's older
    ``{"message"}``, FastAPI's ``{"detail"}``), else its text."""
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for found in (err, doc.get("message"), doc.get("detail")):
            if isinstance(found, str) and found:
                return found
            if found:
                return json.dumps(found)
    text = text.strip()
    return text[:500] if text else f"HTTP {status}"


#: what a failed call raises (aiohttp's timeouts are TimeoutErrors)
HTTP_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
#: of those, what says the server could not be reached (refused, or not accepted in time)
UNREACHABLE = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
LINE_BYTES = 1 << 20  # the longest stream line read (aiohttp's default is 64 KB)


def http_session(connect_timeout_s: float, read_timeout_s: float | None = None
                 ) -> aiohttp.ClientSession:
    """An aiohttp session (made inside the running loop) for streamed calls: its HTTP parser in
    C, no limit on connections, kept alive and reused; connecting may take ``connect_timeout_s``
    and a read wait ``read_timeout_s`` (None: no limit). httpx's pure-Python HTTP/1.1 layers
    took 86-109 us of CPU a streamed chunk against aiohttp's 26-35 us (2026-12-07, one stub
    read side by side)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s,
                                      sock_read=read_timeout_s),
        read_bufsize=LINE_BYTES, auto_decompress=False)


async def stream_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """The lines of a streamed answer, without their line ends."""
    async for raw in resp.content:
        yield raw.decode(errors="replace").rstrip("\r\n")


async def drain(resp: aiohttp.ClientResponse) -> None:
    """Read what a stream sends after ``data: [DONE]`` (the end of its chunked body, at once from
    any server that ends the stream there), so its connection goes back to the pool: a
    connection given back with bytes unread is closed, and every call would then open one of its
    own, a TCP handshake and a server-side set-up each. A server that holds a stream open past
    ``[DONE]`` is not waited for longer than `DRAIN_S`; its connection is closed."""
    try:
        await asyncio.wait_for(resp.content.read(), DRAIN_S)
    except (*HTTP_ERRORS, ValueError):
        resp.close()
    else:
        resp.release()


def read_chunk(done: Completion, chunk: dict[str, Any], now: float) -> None:
    """Add one streamed chunk to ``done``: its tokens (timed ``now``), usage, finish reason or
    error."""
    if chunk.get("error") is not None:
        done.error = error_message(done.status, json.dumps(chunk))
        return
    carried = False
    if isinstance(chunk.get("prompt_token_ids"), list) and done.prompt_ids is None:
        done.prompt_ids = [int(i) for i in chunk["prompt_token_ids"]]
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        if choice.get("text"):
            done.text.append(choice["text"])
        ids = choice.get("token_ids")
        if ids:
            carried = True
            if done.output_ids is not None:
                done.output_ids.extend(int(i) for i in ids)
        elif ids is None and choice.get("text"):
            carried = True
            done.output_ids = None  # this server does not send output ids
        done.finish_reason = choice.get("finish_reason") or done.finish_reason
    if carried:
        done.token_times.append(now)
        done.chunks_with_tokens += 1
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        done.usage_output_tokens = usage.get("completion_tokens", done.usage_output_tokens)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        done.cached_tokens = int(cached) if cached is not None else None


class OpenAIClient:
    """The server at ``settings.url`` (use as ``async with``)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.url = settings.url
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> "OpenAIClient":
        self._http = http_session(self.settings.connect_timeout_s)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._http.close()

    def unreachable(self, error: Exception) -> ServerUnreachable:
        reason = str(error) or type(error).__name__
        return ServerUnreachable(f"cannot reach the server at {self.url}: {reason}")

    async def first_model(self) -> str:
        """The first model id ``GET /v1/models`` lists."""
        try:
            async with self._http.get(f"{self.url}/v1/models", timeout=aiohttp.ClientTimeout(
                    total=self.settings.connect_timeout_s)) as resp:
                status, text = resp.status, await resp.text(errors="replace")
        except HTTP_ERRORS as e:
            raise self.unreachable(e) from None
        if status != 200:
            raise BadInput(f"the server at {self.url} answered GET /v1/models with "
                           f"{status}: {error_message(status, text)}")
        try:
            return str(json.loads(text)["data"][0]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            raise BadInput(f"the server at {self.url} lists no model at /v1/models; "
                           "name one with server.model=ID") from None

    async def complete(self, body: dict[str, Any], request_id: str | None = None) -> Completion:
        """Send one call and read its stream to the end (or the failure). ``request_id`` (the
        workload's call id) goes along as ``X-Request-Id``, the header servers and routers log
        a request by (testbed.route's ``/debug/state`` ``routing``)."""
        done = Completion(sent=time.perf_counter())
        limit = self.settings.timeout_s
        headers = {"X-Request-Id": request_id} if request_id is not None else None
        try:
            await asyncio.wait_for(self._stream(body, done, headers), limit)
        except UNREACHABLE as e:  # (before TimeoutError: a connect timeout is one)
            raise self.unreachable(e) from None
        except TimeoutError:
            done.error = f"timed out after {limit:g} s (server.timeout_s)"
        except aiohttp.ClientError as e:  # the connection broke mid-stream
            done.error = f"the stream broke: {type(e).__name__}: {e}".rstrip(": ")
        done.finish = time.perf_counter()
        return done

    async def _stream(self, body: dict[str, Any], done: Completion,
                      headers: dict[str, str] | None = None) -> None:
        async with self._http.post(f"{self.url}/v1/completions", json=body,
                                   headers=headers) as resp:
            done.status = resp.status
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                done.error = error_message(resp.status, text)
                return
            ended = False
            async for line in stream_lines(resp):
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    ended = True
                    await drain(resp)
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    done.error = f"the stream sent a line that is not JSON: {data[:200]!r}"
                    return
                read_chunk(done, chunk, time.perf_counter())
                if done.error is not None:
                    return
            if not ended and done.finish_reason is None:
                done.error = "the stream ended before its last chunk ([DONE])"
