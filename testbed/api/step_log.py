"""`StepLog`: the steps a server's engine loop ran, as it timed them (``GET /debug/steps``).

A client sees a step only as the burst of tokens it delivers (`testbed.calibration.server_steps`
recovers steps from those), which cannot tell what the server spent on the engine from what it spent
elsewhere. The loop thread therefore records each step it applies (`ServedStep`): the step's place
on its timeline and its device and host time (`testbed.serving.step_cycle.Stepped`, by the engine's
step clock: on a CPU by default the loop thread's CPU seconds, `testbed.config.engine_timing`), and
beside them what the loop's turn around it cost: its wall time (``turn_s``: forming, the forward,
applying, handing the tokens to the HTTP side; ``handing_s`` the last), the CPU time the loop thread
got in it (``thread_cpu_s``: ``turn_s`` less this is time the thread waited), how much of that wait
was for a core, runnable while other processes or threads held both (``runqueue_s``, the kernel's
run delay: the machine's load; the rest of the wait it slept, for the interpreter's lock or
another), the whole process's CPU time (``process_cpu_s``: the HTTP side's work ran beside it), and
the wall time since the turn before ended (``idle_s``: reading the inbox, waiting for work).

The log keeps the last `CAPACITY` steps; the loop thread appends, any thread reads (one lock).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

CAPACITY = 4096  # a closed loop of 16 at ~0.2 s a step: ~14 minutes of steps


@dataclass(frozen=True)
class ServedStep:
    """One step the server ran (times in seconds; ``*_s`` on the engine's clock since start)."""

    step: int  # its number, from 0
    kind: str  # prefill | decode
    requests: int  # entries in the batch
    new_tokens: int
    context_tokens: int  # tokens already in the KV its entries read
    start_s: float  # its place on the loop's timeline (`Stepped.start_s`, `duration_s`)
    duration_s: float
    gpu_s: float  # the forward by the engine's step clock (on a CPU by default the loop
    #               thread's CPU seconds in the launch, its whole work: the `clock` key)
    host_s: float  # forming, reading back, applying (the same clock)
    turn_s: float  # the loop's turn around it: wall time, the tokens handed on included
    handing_s: float  # the part of turn_s spent handing tokens and finishes to the HTTP side
    thread_cpu_s: float  # CPU time the loop thread got in that turn
    process_cpu_s: float  # CPU time the whole server process got in that turn
    runqueue_s: float | None  # the loop thread's wait for a core in that turn (None: unknown)
    idle_s: float  # wall time between the turn before and this one

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_delay_s() -> float | None:
    """Seconds the calling thread has waited runnable for a core since it began (Linux's
    /proc/thread-self/schedstat, its second field), or None where the kernel does not say."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class StepLog:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._steps: deque[ServedStep] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.recorded = 0  # steps recorded so far (the next step's number)

    def add(self, step: ServedStep) -> None:
        with self._lock:
            self._steps.append(step)
            self.recorded += 1

    def since(self, first: int = 0) -> list[ServedStep]:
        """The steps numbered ``first`` and later that are still kept, in order."""
        with self._lock:
            return [s for s in self._steps if s.step >= first]
