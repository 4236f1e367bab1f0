"""A weighted mixture of generated workloads: programs drawn from components by weight."""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

import numpy as np

from testbed.errors import BadInput
from testbed.config.group_values import check_setting
from testbed.workloads.request import OutputRef, Request


def mix(components: Mapping[str, list[Request]], weights: Mapping[str, float],
        num_programs: int | None, seed: int) -> list[Request]:
    """Interleave whole programs of the ``components`` (name -> generated calls): each next
    program comes from a component chosen with probability ∝ its weight among those with programs
    left, until ``num_programs`` are taken (None: all). Program and call ids get the component's
    name as prefix, so ids stay unique."""
    unknown = set(weights) - set(components)
    if unknown:
        raise BadInput(f"workload.weights names {sorted(unknown)}, not among the components "
                       f"{sorted(components)}")
    for name, w in weights.items():
        if check_setting(f"workload.weights.{name}", "float", w) < 0:
            raise BadInput(f"workload.weights.{name} must be >= 0, got {w}")
    queues = {name: _programs(calls) for name, calls in components.items() if weights.get(name, 0) > 0}
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    taken = 0
    while queues and (num_programs is None or taken < num_programs):
        names = sorted(queues)
        p = np.array([weights[n] for n in names], dtype=float)
        name = names[int(rng.choice(len(names), p=p / p.sum()))]
        out += [_prefixed(name, call) for call in queues[name].pop(0)]
        taken += 1
        if not queues[name]:
            del queues[name]
    return out


def _programs(calls: list[Request]) -> list[list[Request]]:
    """Calls grouped by program, programs in order of first appearance, calls in given order."""
    groups: dict[str | None, list[Request]] = {}
    for call in calls:
        groups.setdefault(call.program if call.program is not None else call.id, []).append(call)
    return list(groups.values())


def _prefixed(name: str, call: Request) -> Request:
    def rename(x: str) -> str:
        return f"{name}:{x}"

    segments = None if call.segments is None else tuple(
        OutputRef(rename(s.call)) if isinstance(s, OutputRef) else s for s in call.segments)
    return replace(call, id=rename(call.id), after=[rename(a) for a in call.after],
                   program=rename(call.program) if call.program is not None else None,
                   segments=segments)
