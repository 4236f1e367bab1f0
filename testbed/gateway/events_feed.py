"""``router=kv_events`` live: each replica's cache events, read into the policy's index.

For each replica in rotation: read its whole state (``GET /kv_events/snapshot``, taken between
its steps, with the number of the last event it includes) into the index, then follow its
events with long polls (``GET /kv_events?since=N&epoch=E``). The replica's part is re-read, not
trusted, whenever the stream breaks: a poll that fails (connection refused or reset, a timeout,
an error status, 409 ``resync``: the events were dropped or the replica restarted), or events
the index refuses (a number that is not the next: a gap). While a replica is out of rotation its
part is void (`KvIndex.drop`), so nothing is routed on a picture of a cache that may be gone.

The reads go through the health watch's `Get` (the router's aiohttp session): an idle replica
answers a poll a second (``route.events_wait_s``), a busy one one a step or so.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from urllib.parse import urlencode

from testbed.api.events_routes import leaf_paths
from testbed.cache.events import CacheEvent
from testbed.gateway.replicas import Get, Replica, Replicas
from testbed.remote.openai_client import HTTP_ERRORS
from testbed.router.kv_events import KvEvents


@dataclass
class EventsFeed:
    replicas: Replicas
    router: KvEvents
    get: Get  # the replicas' GETs (the health watch's)
    wait_s: float
    retry_s: float  # between attempts while a replica cannot be read
    breaks: int = 0  # streams broken or out of step, each followed by a re-read

    async def follow(self, replica: Replica) -> None:
        """Keep ``replica``'s part of the index in step, for ever (cancel to stop)."""
        while True:
            if not replica.up:
                self.router.index.drop(replica.index)
                await asyncio.sleep(self.retry_s)
                continue
            try:
                await self._read(replica)
            except (*HTTP_ERRORS, ValueError, KeyError, TypeError):
                pass  # the stream broke: re-read below
            self.breaks += 1
            self.router.index.drop(replica.index)
            await asyncio.sleep(self.retry_s)

    async def _read(self, replica: Replica) -> None:
        """The snapshot, then events until the stream breaks or falls out of step."""
        patience = self.wait_s + self.replicas.health_timeout_s + 5  # a poll's wait, and more
        status, body = await self.get(replica.url + "/kv_events/snapshot", patience)
        if status != 200:
            return  # not readable now: again after a pause
        snap = json.loads(body)
        epoch, seq = snap["epoch"], int(snap["seq"])
        self.router.index.load(replica.index, epoch, seq, leaf_paths(snap["nodes"]))
        while replica.up:
            query = urlencode({"since": seq, "epoch": epoch, "wait_s": self.wait_s})
            status, body = await self.get(f"{replica.url}/kv_events?{query}", patience)
            if status != 200:
                return  # 409 resync, or an error: re-read
            events = [CacheEvent.from_dict(e) for e in json.loads(body)["events"]]
            if not self.router.on_cache_events(replica.index, events):
                return  # a gap
            if events:
                seq = events[-1].seq
