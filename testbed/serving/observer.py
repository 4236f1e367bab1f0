"""`RunObserver`: what a simulated (or engine) run looked like, step by step and request by request.

The driver reports to it; it reads the scheduler's and the cache's state and never changes them,
so a run decides exactly the same with or without it. It keeps two things:

- **steps**: one `StepRow` per executed step (the lines of ``steps.jsonl``, docs/design.md §3):
  what ran, and the replica's queue and KV pool right after it;
- **lives**: per request, its phases from arrival to finish, each a `Span` (the request tracks of
  ``timeline.json``). Phases tile the life: ``network`` (router to replica, with a delay),
  ``queued`` (waiting for admission; again after a retraction or a load-back), ``load`` (its
  lower-tier prefix being copied back), ``prefill`` (from admission to the token that ends it,
  chunks included), ``decode`` (from that token to finish, or to a retraction).

Phases follow from state the scheduler exposes, observed at the points the driver calls: a
request in a prefill batch that was queued has been admitted; one in ``prefill`` whose outputs
grew has its token; one active whose lease is gone (a retraction leaves it none) is queued again;
load-backs and finishes are reported by the driver. Everything is in virtual seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

from testbed.scheduler.batch import Batch
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler

PHASES = ("network", "queued", "load", "prefill", "decode")


@dataclass(slots=True)
class StepRow:
    """One executed step and the replica's state right after it (one line of ``steps.jsonl``)."""

    replica: int
    start_s: float  # when the step before it ended (or it formed, if later)
    duration_s: float  # to when its results were in: its share of the timeline
    gpu_s: float  # what it cost the device (testbed.serving.step_cycle)
    host_s: float  # what it cost the host: forming, launching, reading back, applying
    kind: str  # "prefill" or "decode"
    batch_size: int
    new_tokens: int  # positions filled in the step (computed, or reused beyond exact prefixes)
    context_tokens: int  # KV the step's requests had before it (cached prefix, earlier chunks)
    admitted: int  # requests admitted for the first time in this step
    admitted_hit_tokens: int  # their prompt tokens hit at that admission (their cached_tokens)
    admitted_prompt_tokens: int  # their prompt tokens
    waiting: int  # requests in the queue
    running: int  # requests admitted and not finished (prefilling or decoding)
    loading: int  # requests waiting for a lower-tier load-back
    kv_used_tokens: int | None  # KV held by requests (their protected prefixes and own tokens)
    evictable_tokens: int  # cached KV no request protects
    free_tokens: int | None  # KV slots holding nothing; used + evictable + free = the pool
    tree_tokens: int  # tokens in the cache (evictable and protected)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in STEP_FIELDS}


STEP_FIELDS = tuple(f.name for f in fields(StepRow))


@dataclass(frozen=True, slots=True)
class Span:
    phase: str  # one of PHASES
    start_s: float
    end_s: float


@dataclass(slots=True)
class Life:
    """A request from arrival to finish, and the phases it went through."""

    req: Req
    replica: int
    arrival_s: float
    phase: str  # one of PHASES; "done" once finished
    since: float  # when the current phase began
    spans: list[Span] = field(default_factory=list)
    finish_s: float | None = None
    outputs_at_admission: int = 0
    admitted: bool = False  # counted in a step's admitted_* already

    def enter(self, phase: str, now: float) -> None:
        if phase == self.phase:
            return
        if now > self.since:  # an instant phase tiles nothing: left out
            self.spans.append(Span(self.phase, self.since, now))
        self.phase, self.since = phase, now


class _Replica:
    """The observer's view of one replica: its scheduler and who is active on it."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.capacity = scheduler.cache.available_size  # nothing held yet: the whole pool
        self.active: dict[str, Life] = {}  # prefilling or decoding
        self.prefilling: dict[str, Life] = {}
        self.preemptions = 0
        self.steps: dict[int, tuple[int, int, int]] = {}  # id(batch) formed, not yet done


class RunObserver:
    """Collects `StepRow`s and request `Life`s from a driver's run over ``schedulers`` (one per
    replica, in replica order)."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.replicas = [_Replica(s) for s in schedulers]
        self.rows: list[StepRow] = []
        self.lives: dict[str, Life] = {}  # in arrival order

    # ------------------------------------------------------------------ request events
    def arrived(self, req: Req, now: float, replica: int = 0,
                routed_s: float | None = None) -> None:
        """``req`` was submitted to ``replica`` at ``now``; routed at ``routed_s`` (default now)."""
        now = float(now)
        start = now if routed_s is None else float(routed_s)
        life = Life(req, replica, start, "network", start)
        life.enter("queued", now)
        self.lives[req.id] = life

    def finished(self, req: Req, now: float) -> None:
        life = self.lives[req.id]
        life.enter("done", float(now))
        life.finish_s = float(now)
        rep = self.replicas[life.replica]
        rep.active.pop(req.id, None)
        rep.prefilling.pop(req.id, None)

    def load_started(self, req: Req, now: float) -> None:
        self.lives[req.id].enter("load", float(now))

    def load_done(self, req: Req, now: float) -> None:
        self.lives[req.id].enter("queued", float(now))

    # ------------------------------------------------------------------ steps
    def formed(self, batch: Batch | None, now: float, replica: int = 0) -> None:
        """The replica's scheduler formed ``batch`` (or nothing) at ``now``."""
        rep, now = self.replicas[replica], float(now)
        self._poll(rep, now)
        if batch is None:
            return
        admitted = hit = prompt = 0
        if batch.kind == "prefill":
            for e in batch.entries:
                life = self.lives[e.req.id]
                if life.phase != "queued":
                    continue  # a chunked request goes on
                life.enter("prefill", now)
                life.outputs_at_admission = len(e.req.output)
                rep.active[e.req.id] = rep.prefilling[e.req.id] = life
                if not life.admitted and e.req.cached_tokens is not None:
                    life.admitted = True
                    admitted += 1
                    hit += e.req.cached_tokens
                    prompt += len(e.req.prompt)
        rep.steps[id(batch)] = (admitted, hit, prompt)

    def stepped(self, batch: Batch, step: Any, replica: int = 0) -> None:
        """``batch`` has run and its results are applied; ``step`` says when
        (`testbed.serving.step_cycle.Stepped`: ``start_s``, ``duration_s``, ``gpu_s``,
        ``host_s``, ``applied_s``).
        With overlap the next batch formed before this."""
        rep, now = self.replicas[replica], float(step.applied_s)
        self._poll(rep, now)
        admitted, hit, prompt = rep.steps.pop(id(batch))
        start, duration = float(step.start_s), float(step.duration_s)
        cache, scheduler = rep.scheduler.cache, rep.scheduler
        available, evictable = cache.available_size, cache.evictable_size
        bounded = not math.isinf(rep.capacity)
        self.rows.append(StepRow(
            replica=replica, start_s=start, duration_s=duration,
            gpu_s=float(step.gpu_s), host_s=float(step.host_s), kind=batch.kind,
            batch_size=batch.size, new_tokens=batch.num_new_tokens,
            context_tokens=sum(batch.shape()[1]), admitted=admitted,
            admitted_hit_tokens=hit, admitted_prompt_tokens=prompt,
            waiting=len(scheduler.waiting), running=len(rep.active),
            loading=len(scheduler.loading),
            kv_used_tokens=int(rep.capacity - available) if bounded else None,
            evictable_tokens=evictable,
            free_tokens=int(available - evictable) if bounded else None,
            tree_tokens=cache.total_size))

    def _poll(self, rep: _Replica, now: float) -> None:
        """Retractions since the last look (queued again) and prefills that produced their token
        (decoding now) or were put back in the queue."""
        if rep.scheduler.preemptions != rep.preemptions:
            rep.preemptions = rep.scheduler.preemptions
            for rid, life in list(rep.active.items()):
                if life.req.lease is None and not life.req.finished:
                    life.enter("queued", now)
                    del rep.active[rid]
                    rep.prefilling.pop(rid, None)
        for rid, life in list(rep.prefilling.items()):
            if len(life.req.output) > life.outputs_at_admission:
                life.enter("decode", now)
                del rep.prefilling[rid]
            elif life.req.lease is None:  # put back: its chunk found no room (no retraction)
                life.enter("queued", now)
                del rep.active[rid], rep.prefilling[rid]
