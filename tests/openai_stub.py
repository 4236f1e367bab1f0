"""A small OpenAI-compatible server for the tests of ``backend=server`` (not a model server).

It answers ``GET /health``, ``GET /v1/models`` and streamed ``POST /v1/completions`` of token ids with deterministic
output ids derived from the prompt, one token a chunk, each choice carrying ``token_ids`` as vLLM's
``return_token_ids`` does. Its ``cached_tokens`` is a brute-force longest-prefix match of the
prompt against every prompt + output it produced before, which is exactly the ideal hit (so a
run one call at a time reaches the ideal hit rate). Options make it misbehave: omit the cached
tokens or the token ids, stop early at its EOS unless told to ignore it, fail chosen calls (by
order of receipt) with a status and message, cut their stream or wait before answering. It
records every body it
received and the connection (the caller's port) it came on. Runs in a thread on a free loopback port (`StubServer.start`).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

MODEL = "stub-model"
EOS = 2


def output_ids(prompt: list[int], n: int) -> list[int]:
    """The stub's deterministic output of ``n`` tokens for ``prompt`` (never EOS)."""
    seed = sum(prompt) * 31 + len(prompt)
    return [1000 + (seed + 7 * i) % 997 for i in range(n)]


@dataclass
class StubOptions:
    report_cached: bool = True  # usage.prompt_tokens_details.cached_tokens
    send_token_ids: bool = True  # choices[].token_ids
    eos_after: int | None = None  # without ignore_eos: EOS as this many-th token, ending the call
    fail: dict[int, tuple[int, str]] = field(default_factory=dict)  # receipt index -> status, msg
    delay_s: dict[int, float] = field(default_factory=dict)  # receipt index -> wait first
    break_after: dict[int, int] = field(default_factory=dict)  # receipt index -> tokens, then cut
    refuse_zero: bool = False  # max_tokens 0 answered 400, as vLLM does


class StubServer:
    def __init__(self) -> None:
        self.options = StubOptions()
        self.received: list[dict[str, Any]] = []
        self.peers: list[int] = []  # each received call's connection (the caller's port)
        self.history: list[list[int]] = []  # prompt + output of every answered call
        self.cached: list[int] = []  # cached_tokens of each answered call, in answer order
        self.app = self._app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def reset(self, **options: Any) -> "StubServer":
        self.options = StubOptions(**options)
        self.received.clear()
        self.peers.clear()
        self.history.clear()
        self.cached.clear()
        return self

    # ------------------------------------------------------------------ the OpenAI API
    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.get("/health")
        async def health() -> dict[str, Any]:  # as vLLM's: no epoch
            return {}

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await request.json()
            index = len(self.received)
            self.received.append(body)
            self.peers.append(request.client.port)
            if index in self.options.delay_s:
                await asyncio.sleep(self.options.delay_s[index])
            if self.options.refuse_zero and body["max_tokens"] == 0:
                return JSONResponse({"error": {"message": "max_tokens must be at least 1, "
                                               "got 0.", "code": 400}}, 400)
            if index in self.options.fail:
                status, message = self.options.fail[index]
                return JSONResponse({"error": {"message": message, "code": status}}, status)
            return StreamingResponse(self._stream(body, self.options.break_after.get(index)),
                                     media_type="text/event-stream")

        return app

    def _hit(self, prompt: list[int]) -> int:
        best = 0
        for seq in self.history:
            n = 0
            for a, b in zip(prompt, seq):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def _stream(self, body: dict[str, Any], cut: int | None = None):
        prompt = list(body["prompt"])
        n = body["max_tokens"]
        out = output_ids(prompt, n)
        if not body.get("ignore_eos") and self.options.eos_after is not None \
                and self.options.eos_after <= n:
            out = out[:self.options.eos_after - 1] + [EOS]
        cached = self._hit(prompt)
        self.history.append(prompt + out)
        self.cached.append(cached)
        for i, token in enumerate(out):
            if i == cut:  # the connection drops mid-answer
                raise ConnectionResetError("the stub cut this stream")
            choice = {"index": 0, "text": f"<{token}>",
                      "finish_reason": None if i < len(out) - 1 else
                      ("stop" if token == EOS else "length")}
            if self.options.send_token_ids:
                choice["token_ids"] = [token]
            yield f"data: {json.dumps({'object': 'text_completion', 'choices': [choice]})}\n\n"
        usage: dict[str, Any] = {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                                 "total_tokens": len(prompt) + len(out)}
        if self.options.report_cached:
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------------ running it
    def start(self) -> "StubServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        config = uvicorn.Config(self.app, log_level="error", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the stub server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


def free_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
