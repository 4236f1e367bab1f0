"""Data-parallel replicas behind a router, in one SimPy environment.

Each replica is the single-replica stack: its own `Scheduler` over its own cache, and the
`Driver`'s step loop driving the (shared, stateless) executor. Arrivals, program dependencies,
think times, the closed loop, the step loop and load-backs are the `Driver`'s own code:
`ClusterDriver` subclasses it and replaces only where a call goes (route, travel, submit to the
chosen replica) and adds the load each replica carries (taken off as its steps complete) and the
router's updates when a request finishes.

A request ready at time t is routed at t (the router sees every replica's load then), counts
towards the chosen replica's load from that moment, and reaches the replica at ``t +
network_delay_s + transfer_s_per_token × prompt length``. Its record's ``arrival_s`` is t, so
latencies include the trip. With one replica and no delay the run is event for event the
single-replica driver's.

A router that reads the replicas' cache events (``wants_cache_events``: ``router=kv_events``)
gets each replica's radix cache built with an `EventLog` (``make_cache(events=log)``); every
change is handed to the router ``router.event_delay_s`` after the step that made it.

Load (see `testbed.router.base`): outstanding tokens, prompt tokens not yet prefilled (a cache
hit counts as prefilled at admission; re-prefill after a retraction is not counted again) plus
output tokens not yet generated; and outstanding requests. With ``router.load_seen=stream`` a
prompt's tokens count until its request ends instead, as a router in front of HTTP servers sees
them (testbed.route, SGLang's gateway: a prompt + ``max_tokens`` less the tokens streamed).
**Imbalance** is max/mean of the replicas' outstanding tokens over the run: ``imbalance`` =
∫max dt / ∫mean dt (the time average of max/mean weighted by load, so idle moments do not
dominate), ``imbalance_unweighted`` = the plain time average of max/mean over the time some work
is outstanding. 1 is perfect balance,
N = everything on one replica.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import numpy as np

from testbed.cache import PrefixCache
from testbed.cache.events import CacheEvent, EventLog
from testbed.results.metrics import RequestRecord, ideal_hit_rate, summarize
from testbed.errors import check_choice
from testbed.router.base import LOAD_SEEN, Loads, Router
from testbed.scheduler.batch import Batch
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.scheduler.build import build_scheduler
from testbed.scheduler.vllm_config import scheduler_config
from testbed.serving.driver import Driver, Replica, StepStats
from testbed.serving.executor import Executor
from testbed.serving.observer import RunObserver
from testbed.serving.serve import records_of
from testbed.workloads.request import TOKEN_DTYPE, Request


@dataclass
class ClusterRecord(RequestRecord):
    """A request's record plus the replica that served it (a ``replica`` column in
    requests.jsonl)."""

    replica: int = -1


@dataclass
class ReplicaResult:
    index: int
    scheduler: Scheduler
    reqs: list[Req]  # in routing order
    stats: StepStats
    mean_load_tokens: float  # time-averaged outstanding tokens

    @property
    def cache(self) -> PrefixCache:
        return self.scheduler.cache


@dataclass
class ClusterResult:
    reqs: list[Req]  # every request, in routing order
    replica_of: list[int]  # the replica that served reqs[i]
    routed_s: list[float]  # when reqs[i] was routed (its arrival at the router)
    replicas: list[ReplicaResult]
    end_s: float
    imbalance: float
    imbalance_unweighted: float
    router: Router
    final_loads: Loads  # every replica's load at the end (all zero unless accounting is wrong)
    observer: RunObserver | None = None  # steps and request phases, when one watched

    @property
    def preemptions(self) -> int:
        return sum(r.scheduler.preemptions for r in self.replicas)

    @property
    def decisions(self) -> dict[str, int]:
        return dict(sorted(self.router.decisions.items()))


class ClusterDriver(Driver):
    """The single-replica `Driver` with N replicas and a router in front."""

    def __init__(self, requests: list[Request], schedulers: list[Scheduler], executor: Executor,
                 router: Router, max_in_flight: int | None = None, network_delay_s: float = 0.0,
                 transfer_s_per_token: float = 0.0, progress: bool = False,
                 observer: RunObserver | None = None, max_concurrency: int | None = None,
                 load_seen: str = "progress") -> None:
        super().__init__(requests, schedulers, executor, max_in_flight=max_in_flight,
                         progress=progress, observer=observer, max_concurrency=max_concurrency)
        if network_delay_s < 0 or transfer_s_per_token < 0:
            raise ValueError("router.network_delay_s and router.transfer_s_per_token must be >= 0, "
                             f"got {network_delay_s} and {transfer_s_per_token}")
        check_choice("router.load_seen", load_seen, LOAD_SEEN, error=ValueError)
        self.router = router
        self.prefill_seen = load_seen == "progress"  # else a prompt counts until it finishes
        self._routed_prompt: dict[str, int] = {}  # id -> prompt tokens its routing added (stream)
        self.network_delay_s = network_delay_s
        self.transfer_s_per_token = transfer_s_per_token
        n = len(schedulers)
        self.prompt_left: list[dict[int, int]] = [{} for _ in range(n)]  # id(req) -> not prefilled
        self.load_tokens = [0] * n
        self.load_requests = [0] * n
        self._route: dict[str, tuple[int, float, int]] = {}  # id -> (replica, routed_s, order)
        self._in_transit: deque[tuple[int, CacheEvent]] = deque()  # cache events, oldest first
        self._t = 0.0  # load integrals up to this time
        self._int_load = [0.0] * n
        self._int_max = self._int_mean = self._int_ratio = self._busy_t = 0.0

    # ------------------------------------------------------------------ load bookkeeping
    def _integrate(self) -> None:
        dt = self.env.now - self._t
        if dt <= 0:
            return
        loads = self.load_tokens
        hi, total = max(loads), sum(loads)
        self._int_max += hi * dt
        self._int_mean += total / len(loads) * dt
        if total > 0:
            self._int_ratio += hi * len(loads) / total * dt
            self._busy_t += dt
        for i, load in enumerate(loads):
            self._int_load[i] += load * dt
        self._t = self.env.now

    def _add_load(self, i: int, tokens: int, requests: int = 0) -> None:
        self._integrate()
        self.load_tokens[i] += tokens
        self.load_requests[i] += requests

    def _before_step(self, batch: Batch) -> list[int]:
        """The output tokens each prefill entry still had to generate before the step."""
        return [e.req.remaining_new_tokens for e in batch.entries] if batch.kind == "prefill" \
            else []

    def _after_step(self, rep: Replica, batch: Batch, tokens: list,
                    remaining_before: list[int]) -> None:
        """Take a completed step's progress off the replica's outstanding tokens."""
        if batch.kind == "decode":
            self._add_load(rep.index, -(len(tokens) - tokens.count(None)))
            return
        delta = 0
        for e, before in zip(batch.entries, remaining_before):
            req = e.req
            delta += req.remaining_new_tokens - before
            if not self.prefill_seen:
                continue
            n = len(req.prompt)
            prompt_left = self.prompt_left[rep.index]
            left = prompt_left.get(id(req), n)
            now_left = min(left, max(0, n - (e.context + e.new)))
            prompt_left[id(req)] = now_left
            delta += now_left - left
        self._add_load(rep.index, delta)

    # ------------------------------------------------------------------ processes
    def run(self) -> ClusterResult:
        self._serve()
        self._integrate()
        while self._in_transit:  # cache events still on their way when the last request ended
            self._apply_event(*self._in_transit.popleft())
        order = sorted(self.reqs, key=lambda r: self._route[r.id][2])
        end = self.env.now
        return ClusterResult(
            reqs=order, replica_of=[self._route[r.id][0] for r in order],
            routed_s=[self._route[r.id][1] for r in order],
            replicas=[ReplicaResult(rep.index, rep.scheduler,
                                    sorted(rep.reqs, key=lambda r: self._route[r.id][2]),
                                    rep.stats, self._int_load[rep.index] / end if end > 0 else 0.0)
                      for rep in self.replicas],
            end_s=end,
            imbalance=self._int_max / self._int_mean if self._int_mean > 0 else 1.0,
            imbalance_unweighted=self._int_ratio / self._busy_t if self._busy_t > 0 else 1.0,
            router=self.router,
            final_loads=Loads(tuple(self.load_tokens), tuple(self.load_requests)),
            observer=self.observer)

    def _dispatch(self, call: Request):
        """Route a ready ``call`` now and submit it where the trip ends."""
        loads = Loads(tuple(self.load_tokens), tuple(self.load_requests))
        w = self.router.route(call.prompt, loads, self.env.now)
        if not 0 <= w < len(self.replicas):
            raise RuntimeError(f"router {self.router.name} chose replica {w} "
                               f"of {len(self.replicas)}")
        routed_s = self.env.now
        self._route[call.id] = (w, routed_s, len(self._route))
        self._add_load(w, len(call.prompt) + len(call.output), 1)
        if not self.prefill_seen:
            self._routed_prompt[call.id] = len(call.prompt)
        delay = self.network_delay_s + self.transfer_s_per_token * len(call.prompt)
        if delay > 0:
            yield self.env.timeout(delay)
        self._submit(self.replicas[w], call, routed_s=routed_s)

    def _aborted(self, rep: Replica, call: Request) -> None:
        self._add_load(rep.index, -(len(call.prompt) + len(call.output)))
        self._routed_prompt.pop(call.id, None)

    def _on_finish(self, req: Req) -> None:
        w = self._route[req.id][0]
        # under load_seen=stream its prompt leaves with it (what a router in front of a server sees)
        self._add_load(w, -self._routed_prompt.pop(req.id, 0), -1)
        self.prompt_left[w].pop(id(req), None)
        super()._on_finish(req)
        if self.router.wants_completions:
            output = None if req.aborted else np.asarray(req.output, dtype=TOKEN_DTYPE)
            if self.router.update_delay_s > 0:
                self.env.process(self._report(w, req.prompt, output, self.router.update_delay_s))
            else:
                self.router.on_complete(w, req.prompt, output, self.env.now)

    def _report(self, worker: int, prompt: np.ndarray, output: np.ndarray | None, delay: float):
        yield self.env.timeout(delay)
        self.router.on_complete(worker, prompt, output, self.env.now)

    def cache_event(self, worker: int, event: CacheEvent) -> None:
        """A replica's cache changed: the router learns it after its ``event_delay_s``."""
        delay = self.router.event_delay_s
        if delay > 0:  # one delay for all: they arrive in the order sent
            self._in_transit.append((worker, event))
            self.env.process(self._deliver(delay))
        else:
            self._apply_event(worker, event)

    def _deliver(self, delay: float):
        yield self.env.timeout(delay)
        if self._in_transit:
            self._apply_event(*self._in_transit.popleft())

    def _apply_event(self, worker: int, event: CacheEvent) -> None:
        if not self.router.on_cache_events(worker, [event]):
            raise RuntimeError(f"router {self.router.name}: replica {worker}'s event "
                               f"{event.seq} is out of step")


def simulate_cluster(requests: list[Request], make_cache: Callable[[], PrefixCache],
                     scheduler_cfg: Mapping[str, Any], executor: Executor, router: Router,
                     replicas: int, seed: int = 0, max_in_flight: int | None = None,
                     network_delay_s: float = 0.0, progress: bool = False,
                     transfer_s_per_token: float = 0.0, observe: bool = False,
                     check_invariants: bool = False,
                     max_concurrency: int | None = None,
                     decode_groups: Callable[[], Any] | None = None,
                     load_seen: str = "progress") -> ClusterResult:
    """Serve ``requests`` on ``replicas`` replicas (each with a fresh ``make_cache()`` and its own
    scheduler, seeded ``seed + i``) behind ``router``, in virtual time (a router that reads
    cache events: ``make_cache(events=log)``, see the module docstring); with ``observe`` the
    result carries a `RunObserver`'s steps and request phases; with ``check_invariants`` every
    scheduler checks its cache after every step; ``decode_groups()``: each replica's cascade
    groups (`testbed.scheduler.decode_groups.DecodeGroups`, or None without cascade);
    ``load_seen``: ``progress`` or ``stream``, what the router sees of each replica's load
    (`testbed.router.LOAD_SEEN`, module docstring)."""
    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    config = scheduler_config(scheduler_cfg)
    logs = [EventLog(capacity=0) for _ in range(replicas)] \
        if getattr(router, "wants_cache_events", False) else None
    caches = [make_cache(events=log) for log in logs] if logs else \
        [make_cache() for _ in range(replicas)]
    if len({id(c) for c in caches}) != replicas:
        raise ValueError("make_cache must build a new cache on every call")
    router.bind(replicas, caches)
    schedulers = [build_scheduler(c, config, seed=seed + i, check_invariants=check_invariants,
                                  decode_groups=decode_groups() if decode_groups else None)
                  for i, c in enumerate(caches)]
    driver = ClusterDriver(requests, schedulers, executor, router, max_in_flight=max_in_flight,
                           network_delay_s=network_delay_s,
                           transfer_s_per_token=transfer_s_per_token, progress=progress,
                           observer=RunObserver(schedulers) if observe else None,
                           max_concurrency=max_concurrency, load_seen=load_seen)
    for i, log in enumerate(logs or ()):
        log.listeners.append(lambda event, i=i: driver.cache_event(i, event))
    result = driver.run()
    for scheduler in schedulers if check_invariants else ():
        scheduler.check_drained()
    return result


# ---------------------------------------------------------------------- results
def cluster_records(result: ClusterResult, save_token_ids: bool = False) -> list[ClusterRecord]:
    """One record per request in routing (arrival) order; ``arrival_s`` is when it was routed,
    ``replica`` the replica that served it."""
    names = [f.name for f in fields(RequestRecord)]
    return [ClusterRecord(**{n: getattr(rec, n) for n in names} | {"arrival_s": t, "replica": w})
            for rec, t, w in zip(records_of(result.reqs, save_token_ids), result.routed_s,
                                 result.replica_of)]


def cluster_summary(result: ClusterResult, ideal: bool = True) -> dict[str, Any]:
    """The summary.json additions of a cluster run: ``replicas`` (per-replica summaries from
    `summarize` over that replica's records, with its ``ideal_hit_rate`` when ``ideal``),
    ``imbalance``, ``imbalance_unweighted``, ``router_decisions`` and step totals."""
    records = cluster_records(result)
    per: list[list[RequestRecord]] = [[] for _ in result.replicas]
    for rec, w in zip(records, result.replica_of):
        per[w].append(rec)
    replicas = []
    for rep, recs in zip(result.replicas, per):
        s = rep.stats
        summary = summarize(recs, ideal=ideal_hit_rate([r.request for r in rep.reqs]) if ideal
                            else None, wall_s=0.0, preemptions=rep.scheduler.preemptions)
        del summary["wall_s"]
        replicas.append({"replica": rep.index, **summary,
                         "prefill_steps": s.prefill_steps, "decode_steps": s.decode_steps,
                         "mean_decode_batch": s.decode_tokens / s.decode_steps
                         if s.decode_steps else None,
                         "busy_s": s.busy_s,
                         "utilization": s.busy_s / result.end_s if result.end_s > 0 else None,
                         "mean_load_tokens": rep.mean_load_tokens})
    steps = [r.stats for r in result.replicas]
    decode_steps = sum(s.decode_steps for s in steps)
    return {
        "router": result.router.name,
        "num_replicas": len(result.replicas),
        "imbalance": result.imbalance,
        "imbalance_unweighted": result.imbalance_unweighted,
        "router_decisions": result.decisions,
        "router_info": result.router.info(),
        "prefill_steps": sum(s.prefill_steps for s in steps),
        "decode_steps": decode_steps,
        "mean_decode_batch": sum(s.decode_tokens for s in steps) / decode_steps
        if decode_steps else None,
        "busy_s": sum(s.busy_s for s in steps),
        "replicas": replicas,
    }
