"""`StepCycle`: the step loop of one replica, the same code for the simulator's SimPy driver and
the server's thread (`testbed.serving.driver`, `testbed.api.online`); only the clock and the way
of waiting differ.

One turn (`StepCycle.turn`), SGLang's ``event_loop_overlap`` / ``event_loop_normal``:

1. form the next step (`Scheduler.form`) and launch it (`testbed.serving.executor`);
2. read back a step's results and hand them to the scheduler (`Scheduler.complete`): with
   ``scheduler.overlap`` the step launched in the turn before, so the device runs the new step
   while the host reads the old one; without, the step just launched;
3. under overlap, when no step formed in 1 and 2 applied results, form and launch again at once
   (the scheduler's rule: those results may have freed what a step needed).

So under overlap nothing reads a step's tokens back before the next step is launched: the engine
keeps them on the device, where the next step reads its inputs (`testbed.engine.slot_table`).

A turn is a generator of events for its driver: `Formed` (a step formed, or none: requests
finished by results applied, load-backs started), `Wait` (time passes until a step's results
are in) and `Stepped` (a step's results were applied). The SimPy driver turns a `Wait` into a
timeout; the server's thread ignores it (its waiting happened inside ``result()``, on the wall
clock).

The timeline (`Timeline`) says when each step ends, from what it cost the host and the device:
the host forms and launches (``form`` and ``apply`` timed with the executor's ``step_clock``
where it has one: the engine's; the simulator prices the host's work into ``launch_s``), an
asynchronous device (a GPU; ``executor.asynchronous``) starts a step when the host has launched
it and the step before has ended, and a synchronous one (the CPU) does the work inside launch.
Without host time this is the old loop's timeline exactly: each step ends its device time after
the one before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator

from testbed.scheduler.batch import Batch, StepOutcome
from testbed.scheduler.request_state import Req
from testbed.serving.executor import launcher


@dataclass(frozen=True)
class Formed:
    """The scheduler formed ``batch`` (None: no step now) at ``now``; ``finished``: requests
    ended by results applied meanwhile; ``loads``: load-backs it started."""

    batch: Batch | None
    finished: list[Req]
    loads: list[Req]
    now: float


@dataclass(frozen=True)
class Wait:
    """Let ``seconds`` pass before the next event (virtual time; on the wall clock, passed)."""

    seconds: float


@dataclass(frozen=True)
class Stepped:
    """A step's results were applied: its outcome, the requests it finished, and its place on
    the timeline (``start_s``: when the step before it ended, or when the host began forming it
    if later; ``duration_s``: to its end on the device, plus reading its results back and
    applying them: the steps tile the busy timeline), with the host seconds it took (forming, launching,
    reading back, applying) and the device's (``gpu_s``)."""

    batch: Batch
    outcome: StepOutcome
    finished: list[Req]
    start_s: float
    duration_s: float
    host_s: float
    gpu_s: float
    applied_s: float  # when its results were applied (a synchronous device under overlap: after
    #                   the next step's work, done inside that step's launch)

    @property
    def end_s(self) -> float:
        return self.start_s + self.duration_s


Event = Formed | Wait | Stepped


@dataclass
class _Flight:
    """A launched step whose results are not read back yet."""

    batch: Batch
    handle: Any
    formed_s: float  # timeline time at which the host began forming it
    launched_s: float  # timeline time at which the host had launched it
    host_s: float  # host seconds so far: forming and launching
    # a synchronous device's step ended at ``base + span`` (its launch): known at launch
    ended: tuple[float, float] | None = None


def _after(base: float, span: float, origin: float) -> float:
    """``base + span − origin``, exactly ``span`` when ``base`` is ``origin``: the simulator's
    virtual times then add up as the old loop's did, bit for bit."""
    return span if base == origin else base + span - origin


@dataclass
class Timeline:
    """The host's and the device's clocks of one replica (seconds on the driver's time axis)."""

    host: float = 0.0  # the host is busy until then
    device_free: float = 0.0  # the device has ended every step launched
    last_end: float = 0.0  # the last step read back ended then


def _no_clock() -> float:
    return 0.0


class StepCycle:
    def __init__(self, scheduler: Any, executor: Any, now: Callable[[], float]) -> None:
        """``now``: the driver's time (SimPy's ``env.now``, or seconds on the wall clock)."""
        self.scheduler = scheduler
        self.executor = launcher(executor)
        self.now = now
        self.overlap = bool(getattr(getattr(scheduler, "config", None), "overlap", False))
        self.asynchronous = bool(getattr(self.executor, "asynchronous", False))
        self.clock = getattr(executor, "step_clock", None) or _no_clock
        self.timeline = Timeline()
        self._flight: _Flight | None = None  # overlap: launched in the last turn, not read back

    @property
    def in_flight(self) -> bool:
        """A step was launched and its results are not read back yet (overlap)."""
        return self._flight is not None

    def turn(self) -> Generator[Event, None, None]:
        """One turn of the loop (module docstring)."""
        batch = yield from self._form()
        flight = self._launch(batch) if batch is not None else None
        if not self.overlap:
            if flight is not None:
                yield from self._read(flight)
            return
        previous, self._flight = self._flight, flight
        if previous is None:
            return
        yield from self._read(previous)
        if batch is None:  # results applied: a step may form now (SGLang's loop goes round)
            batch = yield from self._form()
            if batch is not None:
                self._flight = self._launch(batch)

    # ------------------------------------------------------------------ the parts of a turn
    def _form(self) -> Generator[Event, None, Batch | None]:
        s, tl = self.scheduler, self.timeline
        # Host work since the last wait (applying results) is not waited for here but in the
        # next wait: a request submitted as those results finished its parent then joins the
        # step after next, as it always has (and as the simulator's priced host keeps it).
        tl.host = max(tl.host, self.now())  # idle time moves the host along
        self._form_start = tl.host
        start = self.clock()
        batch = s.form(self.now())
        finished = s.take_finished()
        loads = s.take_loads()
        self._form_s = self.clock() - start
        tl.host += self._form_s
        yield Formed(batch, finished, loads, self.now())
        return batch

    def _launch(self, batch: Batch) -> _Flight:
        tl = self.timeline
        handle = self.executor.launch(batch)
        before = tl.host
        tl.host += handle.launch_s
        flight = _Flight(batch, handle, self._form_start, tl.host, self._form_s)
        if not self.asynchronous:  # the work was done inside launch: the device is the host
            flight.ended = (before, handle.launch_s)
            tl.device_free = tl.host
        return flight

    def _read(self, flight: _Flight) -> Generator[Event, None, None]:
        s, tl = self.scheduler, self.timeline
        start = self.clock()
        outcome = flight.handle.result()
        read_s = max(self.clock() - start - outcome.wait_s, 0.0)
        if flight.ended is not None:
            base, span = flight.ended
        else:  # the device starts it once it is launched and the device is free
            base, span = max(flight.launched_s, tl.device_free), outcome.device_s
            tl.device_free = base + span
        end = base + span
        now = self.now()
        if tl.host > end:  # the host was still busy (launching the next step) when it ended
            wait = tl.host - now + read_s
        else:
            wait = _after(base, span, now) + read_s
        tl.host = max(tl.host, end) + read_s
        yield Wait(max(wait, 0.0))
        start = self.clock()
        now = self.now()
        finished = s.take_finished() + s.complete(flight.batch, outcome.tokens, now)
        apply_s = self.clock() - start
        tl.host += apply_s
        # its share of the timeline: from the end of the step before (or from when the host
        # began forming it, if later) to its end on the device, plus reading and applying it
        begin = max(tl.last_end, min(flight.formed_s, end))
        duration = _after(base, span, begin) + read_s + apply_s
        tl.last_end = begin + duration
        host_s = flight.host_s + outcome.host_s + read_s + apply_s
        yield Stepped(flight.batch, outcome, finished, begin, duration, host_s,
                      outcome.device_s, now)
