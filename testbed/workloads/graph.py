"""The bookkeeping of programs every serving loop shares: which calls start a program, which wait
for which, when a waiting call becomes ready, and when a program is done.

The simulator's `testbed.serving.driver.Driver` (SimPy's virtual time) and the live-server client's
`testbed.remote.driver.RemoteDriver` (the wall clock) both keep it here, so the two apply the same
rules: programs in order of first appearance, a call with no ``after`` inside the workload is a
root submitted at its ``arrival_s``, a waiting call is ready at ``max(arrival_s, last dependency's
finish + think_time_s)``.
"""

from __future__ import annotations

from testbed.workloads.request import Request


class ProgramGraph:
    """Programs of ``requests`` (in order), their roots and the calls still waiting."""

    def __init__(self, requests: list[Request]) -> None:
        self.total = len(requests)
        self.programs: list[str] = []  # in order of first appearance (arrival order)
        self.roots: dict[str, list[Request]] = {}
        self.finish_s: dict[str, float] = {}  # call id -> when it finished
        self._calls_left: dict[str, int] = {}
        self._dependents: dict[str, list[Request]] = {}
        self._waiting_on: dict[str, int] = {}
        ids = {r.id for r in requests}
        for r in requests:
            program = r.program_id
            if program not in self._calls_left:
                self.programs.append(program)
                self._calls_left[program] = 0
                self.roots[program] = []
            self._calls_left[program] += 1
            deps = [a for a in r.after if a in ids]
            self._waiting_on[r.id] = len(deps)
            for a in deps:
                self._dependents.setdefault(a, []).append(r)
            if not deps:
                self.roots[program].append(r)

    def first_arrival(self, index: int) -> float:
        """When the ``index``-th program's first root arrives."""
        return min(r.arrival_s for r in self.roots[self.programs[index]])

    @property
    def all_finished(self) -> bool:
        return len(self.finish_s) == self.total

    def finish(self, call: Request, now: float) -> tuple[bool, list[tuple[Request, float]]]:
        """``call`` finished at ``now``: whether that ended its program, and the calls it made
        ready (each with the time it is to be submitted), in workload order."""
        self.finish_s[call.id] = now
        program = call.program_id
        self._calls_left[program] -= 1
        ready = []
        for dep in self._dependents.get(call.id, []):
            self._waiting_on[dep.id] -= 1
            if self._waiting_on[dep.id] == 0:
                last = max(self.finish_s[a] for a in dep.after if a in self.finish_s)
                ready.append((dep, max(dep.arrival_s, last + dep.think_time_s)))
        return self._calls_left[program] == 0, ready
