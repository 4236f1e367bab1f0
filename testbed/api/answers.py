"""The server's HTTP answers counted by status, and the requests being handled, for
``/debug/state`` (``http_answered``, ``http_in_progress``): `AnswerCounts` holds the counts,
`CountAnswers` (an ASGI middleware around the endpoints, inside Starlette's error handler) keeps
them.

An answer nobody reads (a 499 to a client that went away) is counted too, and so is an exception
that escapes an endpoint (Starlette answers it 500 and logs a traceback): a load test reads here
whether the server ever failed, which a client that left cannot see, and waits until the server
has handled every request it sent. One event loop runs the middleware: no lock.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

NO_ANSWER = 0  # the status counted for a request that ended without one (cancelled at shutdown)


class AnswerCounts:
    """HTTP answers by status code, and the requests in progress."""

    def __init__(self) -> None:
        self.answered: Counter[int] = Counter()
        self.in_progress = 0

    def snapshot(self) -> dict[str, Any]:
        """``http_in_progress`` (the request asking included) and ``http_answered`` (status ->
        count, the status a string as JSON keys are, in status order)."""
        return {"http_in_progress": self.in_progress,
                "http_answered": {str(k): v for k, v in sorted(self.answered.items())}}


class CountAnswers:
    """The ASGI middleware that keeps an `AnswerCounts` (``app.add_middleware(CountAnswers,
    counts=...)``)."""

    def __init__(self, app: ASGIApp, counts: AnswerCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = NO_ANSWER

        async def counted(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        self.counts.in_progress += 1
        try:
            await self.app(scope, receive, counted)
        except Exception:
            status = 500  # what Starlette's error handler answers it with
            raise
        finally:
            self.counts.in_progress -= 1
            self.counts.answered[status] += 1
