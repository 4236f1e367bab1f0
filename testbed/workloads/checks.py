"""What every workload must be before anything runs, on every backend alike: calls with ids of
their own, ``after`` naming calls of the same program and never forming a cycle, and prompts of at
least one token.

`check_workload` is called once by `testbed.workloads.build_workload` for every workload (generated,
a user's function, or a trace) and by the token-trace loader, which names each call by its file
and line (``where``), so a trace's refusal says where to look. A refusal is one line
(`WorkloadRefused`). Without these checks a duplicate id or a cycle left the serving loops waiting
for a call that never comes (SimPy's "No scheduled events left"), and replay ran it as if nothing
were wrong.
"""

from __future__ import annotations

from typing import Sequence

from testbed.errors import WorkloadRefused
from testbed.workloads.request import OutputRef, Request


def check_workload(requests: Sequence[Request], where: Sequence[str] | None = None) -> None:
    """Refuse, in one line, the first problem found (in this order): two calls with one id, an
    ``after`` naming no call, a call waiting for another program's, calls that wait for each
    other in a cycle (a call waiting for itself too), an empty prompt. ``where[i]`` names request
    ``i``'s source (a trace's ``FILE:LINE``) at the start of the message."""
    at = [f"{w}: " for w in where] if where is not None else [""] * len(requests)
    first: dict[str, int] = {}
    for i, r in enumerate(requests):
        if r.id in first:
            j = first[r.id]
            seen = where[j] if where is not None else f"call {j} of the workload"
            raise WorkloadRefused(f"{at[i]}duplicate request id {r.id!r} (first at {seen}); "
                                  "every call needs an id of its own")
        first[r.id] = i
    _check_after(requests, first, at)
    _check_acyclic(requests, first, at)
    _check_prompts(requests, at)


def _check_after(requests: Sequence[Request], index: dict[str, int], at: list[str]) -> None:
    """Every ``after`` names a call of the workload, of the caller's own program: programs start
    as units (a closed loop counts them), so a program needs a call that waits for none of
    another's."""
    for i, r in enumerate(requests):
        mine = r.program_id
        for a in r.after:
            if a not in index:
                raise WorkloadRefused(f"{at[i]}request {r.id} waits for {a!r} ('after'), but no "
                                      "request has that id")
            theirs = requests[index[a]].program_id
            if theirs != mine:
                raise WorkloadRefused(
                    f"{at[i]}request {r.id} waits for {a} ('after') of another program "
                    f"({theirs!r}, not {mine!r}); calls that wait for each other must share a "
                    "'program'")


def _check_acyclic(requests: Sequence[Request], index: dict[str, int], at: list[str]) -> None:
    """No call waits, through others, for itself. Kahn's order takes every call whose
    dependencies are all taken; what is left waits on a cycle, and following ``after`` among
    those from the first of them (in workload order) must come back round."""
    waiting = [len(set(r.after)) for r in requests]
    dependents: list[list[int]] = [[] for _ in requests]
    for i, r in enumerate(requests):
        for a in set(r.after):
            dependents[index[a]].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    while ready:
        for d in dependents[ready.pop()]:
            waiting[d] -= 1
            if waiting[d] == 0:
                ready.append(d)
    left = [i for i, n in enumerate(waiting) if n > 0]
    if not left:
        return
    path, on_path, i = [], {}, left[0]
    while i not in on_path:  # each call left waits for at least one other call left
        on_path[i] = len(path)
        path.append(i)
        i = next(index[a] for a in requests[i].after if waiting[index[a]] > 0)
    cycle = path[on_path[i]:]
    start = cycle.index(min(cycle))  # told from the call that comes first in the workload
    cycle = cycle[start:] + cycle[:start]
    ids = " → ".join(requests[j].id for j in [*cycle, cycle[0]])
    raise WorkloadRefused(f"{at[cycle[0]]}request {requests[cycle[0]].id} waits for itself "
                          f"('after': {ids}); no call of a cycle can ever start")


def _check_prompts(requests: Sequence[Request], at: list[str]) -> None:
    """A served call computes at least one prompt token (its prefill makes the first output);
    replay holds to it too, so that a workload runs on every backend or on none. A prompt that
    splices in a generated output is known only once that call ran (the engine checks it then)."""
    generated = {r.id for r in requests if r.generates}
    for i, r in enumerate(requests):
        if len(r.prompt) == 0 and not any(isinstance(s, OutputRef) and s.call in generated
                                          for s in r.segments or ()):
            raise WorkloadRefused(f"{at[i]}request {r.id}: empty prompt (a call is served by "
                                  "prefilling at least one prompt token)")
