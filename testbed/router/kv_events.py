"""``router=kv_events``: routing on what each replica's cache really holds, as it reports it.

Each replica publishes its radix cache's changes (`testbed.cache.events`: sequences stored,
leaves removed or cut, numbered); `KvIndex` applies them to an exact index, one radix tree
(`ApproxTree`, here fed by events instead of guesses) where a replica is on a node exactly when
its cache holds that node's path. An event whose number is not the next one (a gap: an event
lost, a replica restarted with a new epoch) or that does not fit the index (a removal of a path
the index lacks) makes `apply` refuse it: the replica's part is then void until its whole state
is read again (`load`). In the simulator the caches hand their events over in the same step
(after ``event_delay_s``); live, `testbed.gateway` reads each replica's ``GET /kv_events``
stream and re-reads ``GET /kv_events/snapshot`` at (re)connection and after a gap.

`KvEvents` routes as the oracle (`testbed.router.policies.Oracle`) does, with the index in place
of the real caches: the imbalance rule first, then the replica holding the longest prefix of the
prompt (or, with ``in_flight``, about to: a prompt routed there and not finished) if it covers
more than ``cache_threshold`` of it, else the least loaded. Beyond SGLang's HTTP router, as
llm-d's precise prefix-cache scorer reads vLLM's KV events.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

from testbed.cache.base import PrefixCache
from testbed.cache.events import CacheEvent
from testbed.errors import BadInput
from testbed.router.approx_tree import ApproxTree
from testbed.router.policies import Oracle


class KvIndex:
    """Every replica's cached sequences, exactly, from its events (module docstring)."""

    def __init__(self, num_workers: int) -> None:
        self.tree = ApproxTree(num_workers)
        self.seq = [0] * num_workers  # the last event applied per replica
        self.epoch: list[str | None] = [None] * num_workers
        self.synced = [True] * num_workers  # False: void until `load` (a gap, a break)
        self.applied = 0
        self.resyncs = 0

    def apply(self, worker: int, events: Iterable[CacheEvent]) -> bool:
        """Apply ``worker``'s events in order; False at the first that is out of step (its
        number not the next, or a removal the index cannot place): the replica's part is then
        cleared and void until `load`."""
        if not self.synced[worker]:
            return False
        for e in events:
            ok = e.seq == self.seq[worker] + 1
            if ok and e.kind == "stored":
                self.tree.insert(e.tokens, worker)
            elif ok:
                ok = self.tree.remove_below(e.tokens, e.keep, worker, branch=e.kind == "removed")
            if not ok:
                self.drop(worker)
                return False
            self.seq[worker] = e.seq
            self.applied += 1
        return True

    def load(self, worker: int, epoch: str, seq: int, sequences: Iterable[np.ndarray]) -> None:
        """Replace ``worker``'s part by its whole state, read at its event number ``seq``."""
        self.tree.remove_worker(worker)
        for s in sequences:
            if len(s):
                self.tree.insert(np.asarray(s), worker)
        self.epoch[worker], self.seq[worker], self.synced[worker] = epoch, seq, True
        self.resyncs += 1

    def drop(self, worker: int) -> None:
        """``worker``'s part is void (not trusted) until the next `load`."""
        self.tree.remove_worker(worker)
        self.synced[worker] = False

    def match(self, tokens: np.ndarray) -> list[int]:
        return self.tree.match(tokens)


class KvEvents(Oracle):
    """The oracle's rules on an index fed by the replicas' cache events (module docstring).
    ``event_delay_s``: in the simulator, how long after a cache change the router applies it."""

    name = "kv_events"
    wants_cache_events = True

    def __init__(self, cache_threshold: float = 0.0, balance_abs_threshold: float = 64,
                 balance_rel_threshold: float = 1.5, load: str = "requests",
                 in_flight: bool = True, event_delay_s: float = 0.0,
                 tie_break: str = "index") -> None:
        super().__init__(cache_threshold, balance_abs_threshold, balance_rel_threshold, load,
                         in_flight, tie_break)
        if event_delay_s < 0:
            raise BadInput(f"router.event_delay_s must be >= 0, got {event_delay_s}")
        self.event_delay_s = event_delay_s

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        super(Oracle, self).bind(num_workers, caches)  # the caches are not read: events are
        self.index = KvIndex(num_workers)
        self._pending = [{} for _ in range(num_workers)]

    def held(self, tokens: np.ndarray, limit: int) -> list[int]:
        return [min(n, limit) for n in self.index.match(tokens[:limit])]

    def on_cache_events(self, worker: int, events: Iterable[CacheEvent]) -> bool:
        """Apply ``worker``'s events; False when they are out of step (its part is void until
        the caller re-reads its state into ``self.index``)."""
        return self.index.apply(worker, events)

    def forget_worker(self, worker: int) -> None:
        self.index.drop(worker)
        self._pending[worker].clear()

    def info(self) -> dict[str, Any]:
        return {"in_flight": self.in_flight, "events_applied": self.index.applied,
                "resyncs": self.index.resyncs, "index_tokens": list(self.index.tree.size)}
