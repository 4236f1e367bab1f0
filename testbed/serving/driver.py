"""The serving loop, shared by the simulator and the engine: arrivals, program dependencies,
think times, and one step loop per replica, in SimPy's virtual time.

Each replica's steps are turns of the one step cycle the server's thread runs too
(`testbed.serving.step_cycle.StepCycle`: form, launch, read back, apply); virtual time advances as
its timeline says, from what each step cost the device and the host, whoever computed it (a cost
model or a timed model step). A call is submitted at its arrival time or, if later, ``think_time_s`` after the last of its
dependencies finished; with ``max_in_flight`` at most that many programs run at once (a closed
loop), the next starting when one finishes; with ``max_concurrency`` at most that many calls are
outstanding at once, across programs (bench_serving's ``--max-concurrency``): a ready call waits
in a FIFO for a slot before it is submitted, and its record's arrival is when it got one. A
request that can never fit in the KV cache is aborted at submission and counts as finished for
its dependents. The program bookkeeping is `testbed.workloads.graph.ProgramGraph`, shared with
the live-server client (`testbed.remote.driver`).

`Driver` serves one replica; `testbed.serving.cluster.ClusterDriver` puts a router in front of N
and changes only where a call goes (routing, the trip there) and the load it keeps per replica:
the step loop below is the same code for one replica and for many.

With lower cache tiers, each load-back the scheduler starts runs as its own process on its
replica's copy engines (one per link: the SSD, PCIe), so it overlaps compute and queues behind
other loads; the request rejoins the queue when its copy is done. The cache's planner says how
long each stage takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import simpy
from tqdm import tqdm

from testbed.scheduler.batch import Batch
from testbed.scheduler.beam import BeamCalls
from testbed.scheduler.decode_groups import SharedReads
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.serving.executor import Executor
from testbed.serving.observer import RunObserver
from testbed.serving.step_cycle import Formed, StepCycle, Stepped, Wait
from testbed.workloads.graph import ProgramGraph
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
    """One executed step: what ran (kind, request ids, tokens per entry) and how long it took
    on the timeline (``duration_s``: from the end of the step before, or its forming if later, to
    its results), what it cost the device (``gpu_s``) and the host (``host_s``: forming,
    launching, reading back, applying; `testbed.serving.step_cycle`); ``reread``: in a decode
    step, the cached tokens its requests read after another of them read the same KV (a prefix
    they share; `testbed.sim.step_shape.StepShape.reread`), counted when it was formed."""

    kind: str
    ids: tuple[str, ...]
    new: tuple[int, ...]
    context: tuple[int, ...]
    duration_s: float
    reread: int = 0
    gpu_s: float | None = None
    host_s: float = 0.0


@dataclass
class DriverResult:
    reqs: list[Req]  # in submission order
    stats: StepStats
    end_s: float
    steps: list[StepRecord] = field(default_factory=list)  # with record_steps=True
    observer: RunObserver | None = None  # steps and request phases, when one watched
    beams: BeamCalls | None = None  # the beam calls' searches, when the workload had any


class Replica:
    """One replica's serving state: its scheduler, step totals, the requests it was sent, the
    event its idle step loop waits on, and its copy engines (one per link)."""

    def __init__(self, index: int, scheduler: Scheduler, env: simpy.Environment) -> None:
        self.index = index
        self.scheduler = scheduler
        self.env = env
        self.stats = StepStats()
        self.reqs: list[Req] = []
        self.wake: simpy.Event | None = None
        self.links: dict[str, simpy.Resource] = {}

    def notify(self) -> None:
        """Wake the step loop if it is idle."""
        if self.wake is not None and not self.wake.triggered:
            self.wake.succeed()

    def link(self, name: str) -> simpy.Resource:
        if name not in self.links:
            self.links[name] = simpy.Resource(self.env, capacity=1)
        return self.links[name]


class Driver:
    def __init__(self, requests: list[Request], scheduler: Scheduler | list[Scheduler],
                 executor: Executor, max_in_flight: int | None = None, generate: bool = False,
                 progress: bool = False, record_steps: bool = False,
                 observer: RunObserver | None = None,
                 check_prompt: Callable[[Request, np.ndarray], None] | None = None,
                 max_concurrency: int | None = None) -> None:
        """``scheduler``: one replica's, or a list, one per replica (a subclass routes among
        them). ``check_prompt``: called on each prompt rebuilt from real outputs before its call
        is submitted (the engine refuses one its model cannot take). ``max_concurrency``: calls
        outstanding at once (None: unlimited)."""
        self.env = simpy.Environment()
        self.requests = requests
        schedulers = scheduler if isinstance(scheduler, list) else [scheduler]
        self.replicas = [Replica(i, s, self.env) for i, s in enumerate(schedulers)]
        self.executor = executor
        self.max_in_flight = max_in_flight
        self.generate = generate  # rebuild prompts from actual outputs (the engine generating)
        self.record_steps = record_steps
        self._shared = SharedReads() if record_steps else None  # a record's reread
        self.observer = observer  # watches steps and request phases; decides nothing
        self.check_prompt = check_prompt
        self.reqs: list[Req] = []
        self.steps: list[StepRecord] = []
        self._outputs: dict[str, np.ndarray] = {}
        self.graph = ProgramGraph(requests)
        self._started = 0
        self._in_flight = 0
        self._slot_free: simpy.Event | None = None
        # max_concurrency: a FIFO of calls waiting for one of N slots, each held until its call
        # finishes (the slot's request by call id)
        self._call_slots = None if max_concurrency is None else \
            simpy.Resource(self.env, capacity=max_concurrency)
        self._slot_of: dict[str, Any] = {}
        self._bar = tqdm(total=len(requests), desc="simulate", unit="req",
                         disable=None if progress else True)
        # beam calls (testbed/scheduler/beam.py): rounds of requests, stopping at the model's EOS
        self.beams = BeamCalls(self.replicas[0].scheduler.eos_token_ids)

    # ------------------------------------------------------------------ processes
    def run(self) -> DriverResult:
        self._serve()
        return DriverResult(self.reqs, self.replicas[0].stats, self.env.now, self.steps,
                            self.observer, self.beams if self.beams.searches else None)

    def _serve(self) -> None:
        """Run arrivals and every replica's step loop until every request has finished."""
        self.env.process(self._start_programs())
        loops = [self.env.process(self._step_loop(rep)) for rep in self.replicas]
        try:
            self.env.run(until=loops[0] if len(loops) == 1 else self.env.all_of(loops))
        except RuntimeError as e:
            if not str(e).startswith("No scheduled events left"):
                raise
            # every replica idles with work left and nothing will wake it: a scheduler defect
            stuck = [f"replica {rep.index}: {len(rep.scheduler.waiting)} waiting, "
                     f"{len(rep.scheduler.running)} running" for rep in self.replicas]
            raise RuntimeError(f"the step loops stalled at t={self.env.now:.6g} s with "
                               f"requests unfinished ({'; '.join(stuck)}): no step could be "
                               f"formed and nothing is left to wake them") from None
        self._bar.close()

    def _start_programs(self):
        """Start programs in arrival order, at most ``max_in_flight`` at once."""
        programs = self.graph.programs
        while self._started < len(programs):
            if self.max_in_flight is not None and self._in_flight >= self.max_in_flight:
                self._slot_free = self.env.event()
                yield self._slot_free
                continue
            program = programs[self._started]
            self._started += 1
            self._in_flight += 1
            for call in self.graph.roots[program]:
                self.env.process(self._submit_at(call, call.arrival_s))
            if self._started < len(programs):
                nxt = self.graph.first_arrival(self._started)
                if nxt > self.env.now:
                    yield self.env.timeout(nxt - self.env.now)

    def _submit_at(self, call: Request, when: float):
        """Submit ``call`` at ``when``, once a call slot is free (``max_concurrency``)."""
        if when > self.env.now:
            yield self.env.timeout(when - self.env.now)
        if self._call_slots is not None:
            slot = self._call_slots.request()
            yield slot
            self._slot_of[call.id] = slot
        yield from self._dispatch(call)

    def _dispatch(self, call: Request):
        """Send a ready ``call`` to its replica (here the one replica, at once)."""
        self._submit(self.replicas[0], call)
        yield from ()

    def _submit(self, rep: Replica, call: Request, routed_s: float | None = None) -> None:
        """Hand ``call`` to ``rep``'s scheduler now (routed at ``routed_s``, default now)."""
        prompt = materialize(call.segments, self._outputs) if self.generate and call.segments else None
        if prompt is not None and self.check_prompt is not None:
            self.check_prompt(call, prompt)
        if call.beam_width is not None:  # its first round stands for it
            for first in self.beams.start(call, call.prompt if prompt is None else prompt):
                self._submit(rep, first, routed_s)
            return
        req = rep.scheduler.submit(call, self.env.now, prompt=prompt)
        self.reqs.append(req)
        rep.reqs.append(req)
        if self.observer is not None:
            self.observer.arrived(req, self.env.now, replica=rep.index, routed_s=routed_s)
        if req.finished:  # aborted: it can never fit
            self._aborted(rep, call)
            self._on_finish(req)
        rep.notify()

    def _step_loop(self, rep: Replica):
        """One replica's loop: turns of its `StepCycle` (form and launch a step, read back and
        apply one), virtual time advancing as the cycle's timeline says; idle until a
        submission or a load-back wakes it."""
        cycle = StepCycle(rep.scheduler, self.executor, lambda: self.env.now)
        launched: dict[int, tuple[Any, int]] = {}  # id(batch) -> (_before_step's, reread)
        while True:
            formed = False
            for event in cycle.turn():
                if isinstance(event, Wait):
                    yield self.env.timeout(event.seconds)
                elif isinstance(event, Formed):
                    formed |= event.batch is not None
                    self._formed(rep, event, launched)
                else:
                    self._stepped(rep, event, launched.pop(id(event.batch)))
            if not formed and not cycle.in_flight:
                if self.graph.all_finished:
                    return
                rep.wake = self.env.event()
                yield rep.wake

    def _formed(self, rep: Replica, event: Formed, launched: dict) -> None:
        """A turn formed a step (or none): finishes and load-backs the scheduler reports, and
        what the step's record and `_after_step` need from before it runs."""
        for req in event.finished:
            self._on_finish(req)
        for req in event.loads:
            if self.observer is not None:
                self.observer.load_started(req, self.env.now)
            self.env.process(self._load_back(rep, req))
        if self.observer is not None:
            self.observer.formed(event.batch, self.env.now, replica=rep.index)
        batch = event.batch
        if batch is not None:
            reread = self._shared(batch.entries) if self.record_steps else 0
            launched[id(batch)] = (self._before_step(batch), reread)

    def _stepped(self, rep: Replica, event: Stepped, launched: tuple[Any, int]) -> None:
        """A step's results are applied: beams, records, totals, finishes."""
        batch, outcome = event.batch, event.outcome
        before, reread = launched
        if outcome.logprobs:  # (a plain decode step's entries are not made for nothing)
            for entry, top in zip(batch.entries, outcome.logprobs):
                if top is not None and self.beams.owns(entry.req.id):
                    self.beams.observe(entry.req.id, *top)
        if self.record_steps:
            new, context = batch.shape()
            self.steps.append(StepRecord(batch.kind, tuple(e.req.id for e in batch.entries),
                                         new, context, event.duration_s, reread,
                                         event.gpu_s, event.host_s))
        rep.stats.add(batch.kind, batch.num_new_tokens, event.duration_s)
        self._after_step(rep, batch, outcome.tokens, before)
        for req in event.finished:
            self._on_finish(req)
        if self.observer is not None:
            self.observer.stepped(batch, event, replica=rep.index)

    def _load_back(self, rep: Replica, req: Req):
        """Copy a request's lower-tier KV to the GPU, stage by stage, then let it be admitted."""
        issued = self.env.now
        planner = getattr(rep.scheduler.cache, "planner", None)
        for link, seconds in planner.stages(req.lease.loaded) if planner is not None else ():
            with rep.link(link).request() as turn:
                yield turn
                yield self.env.timeout(seconds)
        yield self.env.timeout(0)
        rep.scheduler.load_done(req, self.env.now - issued)
        if self.observer is not None:
            self.observer.load_done(req, self.env.now)
        rep.notify()

    def _on_finish(self, req: Req) -> None:
        if self.observer is not None:
            self.observer.finished(req, self.env.now)
        if self.beams.owns(req.id):  # a beam call's request: its next round, or the call's end
            search, following = self.beams.finished(req.id, aborted=req.aborted)
            if following:
                self.env.process(self._submit_beams(following))
            elif search.done:
                self._call_done(search.call, search.best)
            return
        call = req.request
        self._call_done(call, call.output if req.aborted
                        else np.asarray(req.output, dtype=TOKEN_DTYPE))

    def _submit_beams(self, requests: list[Request]):
        """A beam search's next round, to the one replica (the engine serves beam calls, and it
        runs no cluster)."""
        for r in requests:
            self._submit(self.replicas[0], r)
        yield from ()

    def _call_done(self, call: Request, output: np.ndarray) -> None:
        """``call`` is over (its output as ran, or the workload's if it was aborted): its program
        and dependents move on."""
        program_done, ready = self.graph.finish(call, self.env.now)
        self._outputs[call.id] = output
        if not self._bar.disable:  # the simulated clock beside requests done, rate, time left
            self._bar.set_postfix_str(f"clock {self.env.now:,.0f} s", refresh=False)
        self._bar.update(1)
        if call.id in self._slot_of:
            self._call_slots.release(self._slot_of.pop(call.id))
        if program_done:
            self._in_flight -= 1
            if self._slot_free is not None and not self._slot_free.triggered:
                self._slot_free.succeed()
        for dep, when in ready:
            self.env.process(self._submit_at(dep, when))
        if self.graph.all_finished:  # idle replicas can stop now
            for rep in self.replicas:
                rep.notify()

    # ------------------------------------------------------------------ hooks (ClusterDriver)
    def _before_step(self, batch: Batch) -> Any:
        """Read before ``batch`` runs what `_after_step` needs (nothing here)."""
        return None

    def _after_step(self, rep: Replica, batch: Batch, tokens: list, before: Any) -> None:
        """``batch`` has run on ``rep`` and the scheduler has its results (nothing here)."""

    def _aborted(self, rep: Replica, call: Request) -> None:
        """``call`` was aborted at submission to ``rep`` (nothing here)."""
