"""`LoadBacks`: the scheduler's book of requests waiting for a lower-tier load-back.

With host or disk tiers below the GPU (`testbed.cache.tiers`), a request whose match continues
below the GPU may have that run copied back before it is admitted. It then leaves the queue, its
lease protecting the run, until the driver reports the copy done; it rejoins the queue and is
admitted as usual, its prefix now a GPU hit. This module keeps who is loading, which loads the
driver has not started yet, and, per request, what was loaded from each tier and how long it
waited, until its first admission records them (`tier_hits`, read by the run's records).
"""

from __future__ import annotations

from testbed.cache.base import Lease, PrefixCache
from testbed.scheduler.request_state import Req


class LoadBacks:
    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache
        self.loading: list[Req] = []  # copies in flight; they hold leases
        self._new: list[Req] = []  # started since the driver last took them
        # per request id at first admission: (hit, loaded per tier, load wait)
        self.tier_hits: dict[str, tuple[int, dict[str, int] | None, float | None]] = {}
        self._loaded: dict[str, tuple[dict[str, int], float]] = {}  # before first admission

    def start(self, req: Req, lease: Lease) -> bool:
        """Start loading the lease's lower-tier run back to the GPU; False when the cache gives it
        up instead (recomputing is faster, or no room): the lease then covers the GPU part. The
        caller takes the request out of its queue when this returns True."""
        evicted = self.cache.load_back(lease)
        if evicted is None:
            return False
        req.evicted_tokens += evicted
        req.lease = lease
        self.loading.append(req)
        self._new.append(req)
        if req.cached_tokens is None:
            loads, waited = self._loaded.get(req.id, ({}, 0.0))
            self._loaded[req.id] = ({k: loads.get(k, 0) + v for k, v in lease.loaded.items()},
                                    waited)
        return True

    def take_new(self) -> list[Req]:
        out, self._new = self._new, []
        return out

    def done(self, req: Req, waited_s: float) -> None:
        """The copy of ``req`` finished after ``waited_s``: it gives its lease up (nothing holds
        KV while it waits in the queue again)."""
        self.loading.remove(req)
        self.cache.release(req.lease, req.fill(), insert=False)
        req.lease = None
        if req.id in self._loaded:
            loads, waited = self._loaded[req.id]
            self._loaded[req.id] = (loads, waited + waited_s)

    def record_first_admission(self, req: Req) -> None:
        """How much of the hit was loaded from each tier (what was loaded for it, capped by the
        hit: a loaded run evicted again before admission is not counted)."""
        loads, waited = self._loaded.pop(req.id, (None, None))
        left = req.cached_tokens
        if loads:
            loads = dict(loads)
            for tier in loads:
                loads[tier] = min(loads[tier], left)
                left -= loads[tier]
        self.tier_hits[req.id] = (req.cached_tokens, loads, waited)
