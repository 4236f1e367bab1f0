"""The replicas behind the live router: where each is, whether it is in rotation, what it holds
outstanding (the `Loads` the policy sees), and the health watch that takes a replica out and lets
it back.

A replica leaves the rotation when its ``GET /health`` fails (an error status, a refused
connection, no answer in ``health_timeout_s``) or when a request to it cannot connect or breaks
before its first token (`Replicas.leave`, at once); the watch asks every ``health_interval_s``,
so a killed replica is out within that (a refused connection needs no timeout). A replica in
rotation that has shown it is alive since the last round (an answer of 200, a streamed
line: `Replica.seen`) is not asked: under load the traffic is the health check, and the watch
neither spends the router's CPU nor takes the replica's (SGLang's gateway checks health every
60 s by default; this router's one-second exit for a killed replica needs the short interval, or
for an idle one the held connection below).
A stream that stops (a replica stalled or killed mid-answer) stops renewing it, so the next round
asks. It rejoins at its next good answer.

An idle replica (nothing outstanding) would be asked every round, each check taking CPU from the
cores its engine runs on. Instead the router holds one idle connection open to each replica in
rotation (`Replicas.hold`): a server sends nothing on a connection that asks nothing, and the
kernel closes it the moment the server's process exits, so the router reads its end at once and
asks at once. While that connection is open an idle replica is asked only every
``idle_health_interval_s``, which catches what a held connection cannot show (a process stopped
but not gone; a host lost without a word; a replica behind a proxy). A busy replica silent for
``health_interval_s`` is asked as before: that is how a stall shows.

A replica that comes back with another ``epoch`` (``testbed.serve`` names a new
one at every start) or that names none (another server: it may have restarted) has lost its cache:
the policy is told to forget what it believed it held (`Router.forget_worker`).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import aiohttp

from testbed.remote.openai_client import HTTP_ERRORS
from testbed.router import Loads, Router

#: a GET of ``url`` answered within ``timeout_s``: its status and body (raises `HTTP_ERRORS`)
Get = Callable[[str, float], Awaitable[tuple[int, bytes]]]


def session_get(session: Callable[[], aiohttp.ClientSession]) -> Get:
    """`Get` through the aiohttp session ``session()`` returns (the proxy's, made when the loop
    starts), for the health checks and the event feeds' reads: 0.4 ms of CPU a health check
    against httpx's 1.0–1.1 ms (2026-12-07, 300 GETs each from one local server)."""
    async def get(url: str, timeout_s: float) -> tuple[int, bytes]:
        async with session().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, await r.read()
    return get


@dataclass
class Replica:
    index: int
    url: str
    up: bool = False
    epoch: str | None = None  # its /health's (testbed.serve); None: not told
    requests: int = 0  # routed here and not finished
    tokens: int = 0  # their prompt + max_tokens less the output tokens streamed so far
    routed: int = 0
    failed: int = 0  # requests that failed here (retried elsewhere or not)
    left: int = 0  # times it left the rotation
    last_error: str | None = None
    left_at: float | None = None  # time.monotonic() when it last left
    seen: float = float("-inf")  # time.monotonic() of its last sign of life (an answer, a line)
    health_checks: int = 0  # GET /health asked of it
    held: bool = False  # the router holds an idle connection to it open (`Replicas.hold`)
    holds: int = 0  # such connections opened

    def state(self) -> dict[str, Any]:
        return {"index": self.index, "url": self.url, "up": self.up, "epoch": self.epoch,
                "outstanding_requests": self.requests, "outstanding_tokens": self.tokens,
                "routed": self.routed, "failed": self.failed, "left_rotation": self.left,
                "health_checks": self.health_checks, "held": self.held, "holds": self.holds,
                "last_error": self.last_error}


@dataclass
class Replicas:
    """Every replica, in ``route.urls`` order (the policy's worker indices)."""

    members: list[Replica]
    router: Router
    get: Get  # the health checks' GET
    health_interval_s: float
    health_timeout_s: float
    idle_health_interval_s: float = 10.0
    on_leave: list[Callable[[Replica], None]] = field(default_factory=list)
    on_join: list[Callable[[Replica], None]] = field(default_factory=list)

    def loads(self, exclude: set[int] = frozenset()) -> Loads:
        return Loads(tuple(r.tokens for r in self.members),
                     tuple(r.requests for r in self.members),
                     tuple(r.up and r.index not in exclude for r in self.members))

    def leave(self, replica: Replica, why: str) -> None:
        replica.last_error = why
        if not replica.up:
            return
        replica.up = False
        replica.left += 1
        replica.left_at = time.monotonic()
        for hook in self.on_leave:
            hook(replica)

    def join(self, replica: Replica, epoch: str | None) -> None:
        if replica.up:
            return
        if epoch is None or epoch != replica.epoch:  # a new (or unknown) cache
            self.router.forget_worker(replica.index)
        replica.up, replica.epoch = True, epoch
        for hook in self.on_join:
            hook(replica)

    async def probe(self, replica: Replica) -> None:
        """One health check: join on 200, leave otherwise."""
        replica.health_checks += 1
        try:
            status, body = await self.get(replica.url + "/health", self.health_timeout_s)
        except HTTP_ERRORS as e:
            self.leave(replica, f"GET /health: {type(e).__name__}: {e}".rstrip(": "))
            return
        if status != 200:
            self.leave(replica, f"GET /health answered {status}")
            return
        try:
            epoch = json.loads(body).get("epoch")
        except (ValueError, AttributeError):
            epoch = None
        replica.seen = time.monotonic()
        self.join(replica, epoch if isinstance(epoch, str) else None)

    def unheard(self, now: float) -> list[Replica]:
        """The replicas a round of the watch asks: those out of rotation, and those in it that
        have not shown they are alive (`Replica.seen`) for ``health_interval_s``, or for
        ``idle_health_interval_s`` if idle with a connection held open to it."""
        return [r for r in self.members if not r.up or now - r.seen >= (
            self.idle_health_interval_s if r.held and r.requests == 0
            else self.health_interval_s)]

    async def watch(self) -> None:
        """Every ``health_interval_s``, probe the `unheard` replicas, for ever (cancel to
        stop); meanwhile `hold` a connection to each replica."""
        holds = [asyncio.create_task(self.hold(r)) for r in self.members]
        try:
            while True:
                asked = self.unheard(time.monotonic())
                if asked:
                    await asyncio.gather(*(self.probe(r) for r in asked))
                await asyncio.sleep(self.health_interval_s)
        finally:
            for t in holds:
                t.cancel()
            await asyncio.gather(*holds, return_exceptions=True)

    async def hold(self, replica: Replica) -> None:
        """While ``replica`` is in rotation, keep an idle connection to it open; when the other
        end closes it (the process exited, or the server closes idle connections), ask its
        health at once. For ever (cancel to stop)."""
        parts = urlsplit(replica.url)
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        while True:
            if not replica.up:
                await asyncio.sleep(self.health_interval_s)
                continue
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(parts.hostname, port, ssl=https or None),
                    self.health_timeout_s)
            except (OSError, asyncio.TimeoutError):
                await asyncio.sleep(self.health_interval_s)  # the watch's rounds ask it
                continue
            replica.held, replica.holds = True, replica.holds + 1
            try:
                while await reader.read(4096):  # nothing comes unasked: its end
                    pass
            except OSError:
                pass
            finally:
                replica.held = False
                writer.close()
            await self.probe(replica)
            await asyncio.sleep(self.health_interval_s)  # a server that closes at once: no spin
