"""`OnlineEngine`: the shared scheduler and the engine stepped on wall-clock time, for the server.

One background thread owns the `Scheduler`, its cache and the executor; nothing else touches them.
It loops: take the inbox (submissions, aborts, inspections) in arrival order, then one turn of the
replica's `testbed.serving.step_cycle.StepCycle` (``now`` = seconds since the engine started,
`time.perf_counter`): form and launch the next step, read back and apply a step's results (with
``scheduler.overlap`` the step before, so the device runs the new one meanwhile), and hand each
request's new tokens and its finish to that request's ``sink`` (a callable the HTTP layer gives; it
must not block). A sink given with an asyncio event loop runs in that loop: the turn's updates for
one loop go to it in one call (``call_soon_threadsafe``) once the turn is done, not one per request
(each call writes the loop's wake-up pipe, and a woken event loop competes for the interpreter's
lock while this thread still hands tokens on). Each turn's step is logged with what the turn cost
(`testbed.api.step_log`, ``GET /debug/steps``). The cycle is the SimPy driver's
(`testbed.serving.driver`): the step's path from either loop to the forward is the same code; here
its waits happen inside the executor's ``result()``, on the wall clock. With nothing to do the
thread sleeps on the inbox's condition: no busy wait. Caching and scheduling stay in the scheduler
and the cache.

The loop also keeps the server's `ServerMetrics` (``GET /metrics``: each finished request's
counts and latencies, the queue and KV gauges after each turn) and, when the cache publishes its
changes, their `EventLog` (``events``; ``GET /kv_events``).

Other threads call `submit`, `abort` and `inspect`; each only appends to the inbox. An abort acts
at the next step boundary (`Scheduler.abort`; under overlap a step still running then has its token
for the request dropped). Lower-tier load-backs complete at once (no copy engine is modelled here:
the cache has already counted the loaded slots).
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from testbed.api.metrics import ServerMetrics
from testbed.api.step_log import ServedStep, StepLog, run_delay_s
from testbed.cache.events import EventLog
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.serving.step_cycle import Formed, StepCycle, Stepped
from testbed.workloads.request import Request


@dataclass(frozen=True)
class Update:
    """What a request's sink receives: tokens new since the last update, and at the end
    ``finish_reason`` (``stop``: a stop token, kept in ``tokens``; ``length``: max tokens;
    ``abort``; ``error``: the loop failed, ``error`` says how) with the counts usage reports."""

    tokens: tuple[int, ...] = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens hit at first admission
    error: str | None = None


Sink = Callable[[Update], None]


class EngineDead(RuntimeError):
    """The loop thread has stopped or failed: nothing can be submitted."""


class EngineBusy(RuntimeError):
    """An inspection found no step boundary in time: the loop has been busy (in a step) for
    ``seconds`` since it last read its inbox. The inspection was withdrawn: it never runs."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the engine loop has been busy for {seconds:.1f} s")
        self.seconds = seconds


@dataclass
class _Live:
    req: Req | None  # None until the loop thread submitted it
    sink: Sink
    loop: Any = None  # the asyncio event loop the sink runs in (None: this thread)
    sent: int = 0  # output tokens handed to the sink


class OnlineEngine:
    def __init__(self, scheduler: Scheduler, executor: Any, max_live: int,
                 idle_wait_s: float = 0.5, metrics: ServerMetrics | None = None,
                 events: EventLog | None = None) -> None:
        """``max_live``: requests held at once (waiting or running); `submit` refuses more.
        ``events``: the log the cache publishes its changes to (None: it publishes none)."""
        self.scheduler = scheduler
        self.metrics = metrics or ServerMetrics("")
        self.events = events
        available = scheduler.cache.available_size  # the empty pool: all of it
        self._kv_capacity = available if 0 < available < float("inf") else None
        self.executor = executor
        self.max_live = max_live
        self.idle_wait_s = idle_wait_s
        self.error: str | None = None  # set when the loop thread died
        self.counts = {"submitted": 0, "finished": 0, "aborted": 0, "steps": 0}
        self._inbox: deque[tuple[str, Any]] = deque()
        self._wake = threading.Condition()
        self._live: dict[str, _Live] = {}  # request id -> its state (both threads; under _wake)
        self._stop = False
        self._t0 = time.perf_counter()
        self._inbox_read = self._t0  # when the loop last took its inbox (a step boundary)
        self._turn_end = self._t0  # when the loop's last turn ended (`StepLog`'s idle_s)
        self._outbox: list[tuple[_Live, Update]] = []  # updates not handed on yet (this turn's)
        self.steps = StepLog()
        self._thread = threading.Thread(target=self._run, name="online-engine", daemon=True)
        self.cycle = StepCycle(scheduler, executor, self.now)

    # ------------------------------------------------------------------ any thread
    def start(self) -> "OnlineEngine":
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop after its current step and join it."""
        with self._wake:
            self._stop = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def live(self) -> int:
        """Requests submitted and not finished."""
        return len(self._live)

    def submit(self, request: Request, sink: Sink, loop: Any = None) -> bool:
        """Queue a generating request (``max_new_tokens`` set, no output), its updates to
        ``sink`` (run in the asyncio event loop ``loop`` when given); False when
        ``max_live`` requests are held already (the caller answers 429). Raises `EngineDead`
        when the loop is not running."""
        with self._wake:
            if self.error is not None or self._stop:
                raise self._dead()
            if len(self._live) >= self.max_live:
                return False
            if request.id in self._live:
                raise ValueError(f"request id {request.id} is already being served")
            self._live[request.id] = _Live(None, sink, loop)
            self._inbox.append(("submit", request))
            self._wake.notify()
        return True

    def abort(self, request_id: str) -> None:
        """End the request at the next step boundary, its KV released (no update is sent)."""
        self._post("abort", request_id)

    def inspect(self, fn: Callable[["OnlineEngine"], Any], timeout: float = 30.0) -> Any:
        """``fn(engine)`` run in the loop thread between steps (where the scheduler and the cache
        may be read); its result, or its exception raised here (`EngineDead` when the loop is
        not running). Not begun within ``timeout`` seconds (a long step): withdrawn, never to
        run, and `EngineBusy` raised saying for how long the loop has been busy."""
        if not self.alive:
            raise self._dead()
        future: Future = Future()
        self._post("inspect", (fn, future))
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.cancel():  # not begun: the loop skips it (a reset must not run late)
                if not self.alive:  # it died after the inspection was posted
                    raise self._dead() from None
                raise EngineBusy(time.perf_counter() - self._inbox_read) from None
            return future.result()  # begun just now, between steps

    def _dead(self) -> EngineDead:
        return EngineDead(f"the engine loop is not running ({self.error or 'stopped'})")

    def _post(self, kind: str, item: Any) -> None:
        with self._wake:
            self._inbox.append((kind, item))
            self._wake.notify()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while not (self._stop or self._inbox or self.scheduler.has_work):
                        self._wake.wait(self.idle_wait_s)
                    if self._stop:
                        self._fail_inspections("the engine stopped")
                        return
                    inbox, self._inbox = list(self._inbox), deque()
                    self._inbox_read = time.perf_counter()
                self._take(inbox)
                stepped = self.scheduler.has_work and self._step()
                self._gauges()
                if self.scheduler.has_work and not stepped:
                    with self._wake:  # work but no batch: wait for input rather than spin
                        if not (self._stop or self._inbox):
                            self._wake.wait(self.idle_wait_s / 50)
        except Exception as e:  # the server reports it: /health 503, requests end "error"
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._fail_all()

    def _take(self, inbox: list[tuple[str, Any]]) -> None:
        for kind, item in inbox:
            if kind == "submit":
                req = self.scheduler.submit(item, self.now())
                self.counts["submitted"] += 1
                with self._wake:
                    self._live[item.id].req = req
                if req.finished:  # could never fit the KV pool (the app checks it first)
                    self._finished(req, "abort")
            elif kind == "abort":
                live = self._live.get(item)
                if live is not None and live.req is not None \
                        and self.scheduler.abort(live.req, self.now()):
                    self.counts["aborted"] += 1
                    self.metrics.request_finished(live.req, "abort")
                    with self._wake:
                        self._live.pop(item, None)
            else:
                fn, future = item
                if not future.set_running_or_notify_cancel():
                    continue  # withdrawn by its caller (EngineBusy)
                try:
                    future.set_result(fn(self))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    future.set_exception(e)
        self._hand_on()

    def _step(self) -> bool:
        """One turn of the step cycle, its tokens and finishes handed on, its steps logged;
        False when no step formed and none is running."""
        s = self.scheduler
        start, thread_cpu, process_cpu, delay = time.perf_counter(), time.thread_time(), \
            time.process_time(), run_delay_s()
        formed, finished, stepped = False, [], []
        for event in self.cycle.turn():
            if isinstance(event, Formed):
                formed |= event.batch is not None
                finished += event.finished
                for req in event.loads:  # no copy engine here: the load-back is done at once
                    s.load_done(req)
            elif isinstance(event, Stepped):
                self.counts["steps"] += 1
                finished += event.finished
                stepped.append(event)
        handing = time.perf_counter()
        self._send_tokens()
        for req in finished:
            self._finished(req, self._reason(req))
        self._hand_on()
        end = time.perf_counter()
        runqueue = None if delay is None else run_delay_s() - delay
        for event in stepped:
            self._log(event, end - start, end - handing, time.thread_time() - thread_cpu,
                      time.process_time() - process_cpu, runqueue, start - self._turn_end)
        self._turn_end = end
        return formed or self.cycle.in_flight

    def _log(self, event: Stepped, turn_s: float, handing_s: float, thread_cpu_s: float,
             process_cpu_s: float, runqueue_s: float | None, idle_s: float) -> None:
        batch = event.batch
        self.steps.add(ServedStep(
            step=self.steps.recorded, kind=batch.kind, requests=batch.size,
            new_tokens=batch.num_new_tokens,
            context_tokens=sum(int(e.context) for e in batch.entries),
            start_s=event.start_s, duration_s=event.duration_s, gpu_s=event.gpu_s,
            host_s=event.host_s, turn_s=turn_s, handing_s=handing_s, thread_cpu_s=thread_cpu_s,
            process_cpu_s=process_cpu_s, runqueue_s=runqueue_s, idle_s=idle_s))

    def _send_tokens(self) -> None:
        """Each live request's output tokens not sent yet (a finished one's go with its end)."""
        with self._wake:
            lives = list(self._live.values())
        for live in lives:
            req = live.req
            if req is not None and not req.finished and len(req.output) > live.sent:
                new = tuple(req.output[live.sent:])
                live.sent = len(req.output)
                self._outbox.append((live, Update(tokens=new)))

    def _finished(self, req: Req, reason: str) -> None:
        with self._wake:
            live = self._live.pop(req.id, None)
        if live is None:
            return
        self.counts["finished"] += 1
        self.metrics.request_finished(req, reason)
        self._outbox.append((live, Update(
            tokens=tuple(req.output[live.sent:]), finish_reason=reason,
            prompt_tokens=len(req.prompt), completion_tokens=len(req.output),
            cached_tokens=req.cached_tokens or 0)))

    def _gauges(self) -> None:
        """The queue and the KV pool as `ServerMetrics` shows them, after a turn."""
        s = self.scheduler
        usage = 0.0 if self._kv_capacity is None else \
            max(0.0, 1.0 - s.cache.available_size / self._kv_capacity)
        self.metrics.engine_state(sum(not r.finished for r in s.running), len(s.waiting), usage)

    @staticmethod
    def _reason(req: Req) -> str:
        if req.aborted:
            return "abort"
        stopped = bool(req.output) and req.output[-1] in req.stop_token_ids \
            and len(req.output) > req.request.min_tokens
        return "stop" if stopped else "length"

    def _fail_all(self) -> None:
        """The loop died: every live request ends with ``error``; inspections waiting in the
        inbox fail."""
        with self._wake:
            lives, self._live = list(self._live.values()), {}
        self._outbox += [(live, Update(finish_reason="error", error=self.error))
                         for live in lives]
        self._hand_on()
        self._fail_inspections(f"the engine loop died: {self.error}")

    def _fail_inspections(self, why: str) -> None:
        """Inspections left in the inbox (the loop will not run them) raise ``why``."""
        with self._wake:
            inbox, self._inbox = list(self._inbox), deque()
        for kind, item in inbox:
            if kind == "inspect" and item[1].set_running_or_notify_cancel():
                item[1].set_exception(EngineDead(why))

    def _hand_on(self) -> None:
        """The updates gathered so far to their sinks: those of a sink without a loop now, in
        order; each event loop's in one call, in order."""
        outbox, self._outbox = self._outbox, []
        by_loop: dict[Any, list[tuple[Sink, Update]]] = {}
        for live, update in outbox:
            if live.loop is None:
                try:
                    live.sink(update)
                except RuntimeError:  # a sink that posts to a closed event loop
                    pass
            else:
                by_loop.setdefault(live.loop, []).append((live.sink, update))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # the HTTP side's event loop is closed (shutting down)
                pass


def _deliver(items: list[tuple[Sink, Update]]) -> None:
    for sink, update in items:
        sink(update)


def generating_request(request_id: str, prompt: np.ndarray, max_tokens: int, *,
                       ignore_eos: bool = False, min_tokens: int = 0,
                       stop_token_ids: tuple[int, ...] = ()) -> Request:
    """A server request as the scheduler takes it: generate mode, no output."""
    return Request(request_id, prompt, np.zeros(0, dtype=prompt.dtype), max_new_tokens=max_tokens,
                   ignore_eos=ignore_eos, min_tokens=min_tokens, stop_token_ids=stop_token_ids)
