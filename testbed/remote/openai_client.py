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
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

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


async def drain(lines: AsyncIterator[str]) -> None:
    """Read what a stream sends after ``data: [DONE]`` (the end of its chunked body, at once from
    any server that ends the stream there), so its connection goes back to the client's pool:
    httpx drops a connection closed with bytes unread, and every call would then open one of its
    own, a TCP handshake and a server-side set-up each. A server that holds a stream open past
    ``[DONE]`` is not waited for longer than `DRAIN_S`."""
    try:
        async with asyncio.timeout(DRAIN_S):
            async for _ in lines:
                pass
    except (TimeoutError, httpx.HTTPError):
        pass


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
        self._http: httpx.AsyncClient | None = None

    async def __aenter__(self) -> "OpenAIClient":
        logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per call (Hydra: INFO)
        timeout = httpx.Timeout(None, connect=self.settings.connect_timeout_s)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._http.aclose()

    def unreachable(self, error: Exception) -> ServerUnreachable:
        reason = str(error) or type(error).__name__
        return ServerUnreachable(f"cannot reach the server at {self.url}: {reason}")

    async def first_model(self) -> str:
        """The first model id ``GET /v1/models`` lists."""
        try:
            resp = await self._http.get(f"{self.url}/v1/models",
                                        timeout=self.settings.connect_timeout_s)
        except httpx.HTTPError as e:
            raise self.unreachable(e) from None
        if resp.status_code != 200:
            raise BadInput(f"the server at {self.url} answered GET /v1/models with "
                           f"{resp.status_code}: {error_message(resp.status_code, resp.text)}")
        try:
            return str(resp.json()["data"][0]["id"])
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
        except TimeoutError:
            done.error = f"timed out after {limit:g} s (server.timeout_s)"
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise self.unreachable(e) from None
        except httpx.HTTPError as e:  # the connection broke mid-stream
            done.error = f"the stream broke: {type(e).__name__}: {e}".rstrip(": ")
        done.finish = time.perf_counter()
        return done

    async def _stream(self, body: dict[str, Any], done: Completion,
                      headers: dict[str, str] | None = None) -> None:
        async with self._http.stream("POST", f"{self.url}/v1/completions", json=body,
                                     headers=headers) as resp:
            done.status = resp.status_code
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                done.error = error_message(resp.status_code, text)
                return
            ended = False
            lines = resp.aiter_lines()
            async for line in lines:
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    ended = True
                    await drain(lines)
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
