"""The SimPy driver: arrivals, program dependencies, think times and the step loop.

Virtual time advances by each step's duration, whoever computed it (a cost model or a timed GPU
step). A call is submitted at its arrival time or, if later, ``think_time_s`` after the last of its
dependencies finished; with ``max_in_flight`` at most that many programs run at once (a closed
loop), the next starting when one finishes. A request that can never fit in the KV cache is
aborted at submission and counts as finished for its dependents.

With lower cache tiers, each load-back the scheduler starts runs as its own process on copy-engine
resources (one per link: the SSD, PCIe), so it overlaps compute and queues behind other loads; the
request rejoins the queue when its copy is done. The cache's planner says how long each stage takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import simpy
from tqdm import tqdm

from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.sim.executor import Executor
from testbed.sim.observer import RunObserver
from testbed.workloads.request import TOKEN_DTYPE, Request, materialize


@dataclass
class StepStats:
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0

    def add(self, kind: str, tokens: int, duration: float) -> None:
        if kind == "prefill":
            self.prefill_steps += 1
            self.prefill_tokens += tokens
        else:
            self.decode_steps += 1
            self.decode_tokens += tokens
        self.busy_s += duration


@dataclass(frozen=True)
class StepRecord:
    """One executed step: what ran (kind, request ids, tokens per entry) and how long it took."""

    kind: str
    ids: tuple[str, ...]
    new: tuple[int, ...]
    context: tuple[int, ...]
    duration_s: float


@dataclass
class DriverResult:
    reqs: list[Req]  # in submission order
    stats: StepStats
    end_s: float
    steps: list[StepRecord] = field(default_factory=list)  # with record_steps=True
    observer: RunObserver | None = None  # steps and request phases, when one watched


class Driver:
    def __init__(self, requests: list[Request], scheduler: Scheduler, executor: Executor,
                 max_in_flight: int | None = None, generate: bool = False,
                 progress: bool = False, record_steps: bool = False,
                 observer: RunObserver | None = None,
                 check_prompt: Callable[[Request, np.ndarray], None] | None = None) -> None:
        """``check_prompt``: called on each prompt rebuilt from real outputs before its call is
        submitted (the engine refuses one its model cannot take)."""
        self.env = simpy.Environment()
        self.requests = requests
        self.scheduler = scheduler
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.generate = generate  # rebuild prompts from actual outputs (the engine generating)
        self.record_steps = record_steps
        self.observer = observer  # watches steps and request phases; decides nothing
        self.check_prompt = check_prompt
        self.stats = StepStats()
        self.reqs: list[Req] = []
        self.steps: list[StepRecord] = []
        self._outputs: dict[str, np.ndarray] = {}
        self._finish_s: dict[str, float] = {}
        self._dependents: dict[str, list[Request]] = {}
        self._waiting_on: dict[str, int] = {}
        self._calls_left: dict[str, int] = {}
        self._programs: list[str] = []  # in order of arrival
        self._roots: dict[str, list[Request]] = {}
        self._started = 0
        self._in_flight = 0
        self._wake: simpy.Event | None = None
        self._slot_free: simpy.Event | None = None
        self._links: dict[str, simpy.Resource] = {}  # copy engines for load-backs, by link
        self._bar = tqdm(total=len(requests), desc="simulate", unit="req",
                         disable=None if progress else True)
        self._index()

    def _index(self) -> None:
        ids = {r.id for r in self.requests}
        for r in self.requests:
            program = r.program_id
            if program not in self._calls_left:
                self._programs.append(program)
                self._calls_left[program] = 0
                self._roots[program] = []
            self._calls_left[program] += 1
            deps = [a for a in r.after if a in ids]
            self._waiting_on[r.id] = len(deps)
            for a in deps:
                self._dependents.setdefault(a, []).append(r)
            if not deps:
                self._roots[program].append(r)

    # ------------------------------------------------------------------ processes
    def run(self) -> DriverResult:
        self.env.process(self._start_programs())
        loop = self.env.process(self._step_loop())
        self.env.run(until=loop)
        self._bar.close()
        return DriverResult(self.reqs, self.stats, self.env.now, self.steps, self.observer)

    def _start_programs(self):
        """Start programs in arrival order, at most ``max_in_flight`` at once."""
        while self._started < len(self._programs):
            if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                self._slot_free = self.env.event()
                yield self._slot_free
                continue
            program = self._programs[self._started]
            self._started += 1
            self._in_flight += 1
            for call in self._roots[program]:
                self.env.process(self._submit_at(call, call.arrival_s))
            if self._started < len(self._programs):
                nxt = min(r.arrival_s for r in self._roots[self._programs[self._started]])
                if nxt > self.env.now:
                    yield self.env.timeout(nxt - self.env.now)

    def _submit_at(self, call: Request, when: float):
        if when > self.env.now:
            yield self.env.timeout(when - self.env.now)
        prompt = materialize(call.segments, self._outputs) if self.generate and call.segments else None
        if prompt is not None and self.check_prompt is not None:
            self.check_prompt(call, prompt)
        req = self.scheduler.submit(call, self.env.now, prompt=prompt)
        self.reqs.append(req)
        if self.observer is not None:
            self.observer.arrived(req, self.env.now)
        if req.finished:  # aborted: it can never fit
            self._on_finish(req)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _step_loop(self):
        total = len(self.requests)
        while True:
            batch = self.scheduler.next_batch(self.env.now)
            for req in self.scheduler.take_finished():
                self._on_finish(req)
            for req in self.scheduler.take_loads():
                if self.observer is not None:
                    self.observer.load_started(req, self.env.now)
                self.env.process(self._load_back(req))
            if self.observer is not None:
                self.observer.formed(batch, self.env.now)
            if batch is None:
                if len(self._finish_s) == total:
                    return
                self._wake = self.env.event()
                yield self._wake
                continue
            outcome = self.executor.execute(batch)
            if self.record_steps:
                new, context = batch.shape()
                self.steps.append(StepRecord(batch.kind, tuple(e.req.id for e in batch.entries),
                                             new, context, outcome.duration_s))
            yield self.env.timeout(outcome.duration_s)
            self.stats.add(batch.kind, batch.num_new_tokens, outcome.duration_s)
            for req in self.scheduler.complete(batch, outcome.tokens, self.env.now):
                self._on_finish(req)
            if self.observer is not None:
                self.observer.stepped(self.env.now)

    def _load_back(self, req: Req):
        """Copy a request's lower-tier KV to the GPU, stage by stage, then let it be admitted."""
        issued = self.env.now
        planner = getattr(self.scheduler.cache, "planner", None)
        for link, seconds in planner.stages(req.lease.loaded) if planner is not None else ():
            if link not in self._links:
                self._links[link] = simpy.Resource(self.env, capacity=1)
            with self._links[link].request() as turn:
                yield turn
                yield self.env.timeout(seconds)
        yield self.env.timeout(0)
        self.scheduler.load_done(req, self.env.now - issued)
        if self.observer is not None:
            self.observer.load_done(req, self.env.now)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()

    def _on_finish(self, req: Req) -> None:
        call = req.request
        self._finish_s[call.id] = self.env.now
        if self.observer is not None:
            self.observer.finished(req, self.env.now)
        self._outputs[call.id] = (call.output if req.aborted
                                  else np.asarray(req.output, dtype=TOKEN_DTYPE))
        self._bar.update(1)
        program = call.program_id
        self._calls_left[program] -= 1
        if self._calls_left[program] == 0:
            self._in_flight -= 1
            if self._slot_free is not None and not self._slot_free.triggered:
                self._slot_free.succeed()
        for dep in self._dependents.get(call.id, []):
            self._waiting_on[dep.id] -= 1
            if self._waiting_on[dep.id] == 0:
                ready = max(self._finish_s[a] for a in dep.after if a in self._finish_s)
                self.env.process(self._submit_at(dep, max(dep.arrival_s, ready + dep.think_time_s)))
