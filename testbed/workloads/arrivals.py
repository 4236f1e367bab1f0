"""Arrival processes: when each program arrives (its calls then follow their dependencies).

- ``offline``: everything at t=0 (a batch job; ``max_in_flight`` makes it a closed loop in the
  simulator: at most N programs running at once);
- ``poisson``: programs arrive as a Poisson process of ``rate`` programs per second;
- ``trace``: the trace's own timestamps, multiplied by ``time_scale``;
- ``auto``: ``trace`` for recorded traces, ``offline`` for generated workloads.

``max_in_flight`` bounds the programs running at once (a closed loop), ``max_concurrency`` the
calls outstanding at once, across programs (bench_serving's ``--max-concurrency``); the serving
loops (sim, engine, server) apply both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping

import numpy as np

from testbed.errors import BadInput, check_choice
from testbed.config.group_values import check_setting
from testbed.workloads.request import Request

ARRIVALS = ("auto", "offline", "poisson", "trace")
#: the keys of the ``arrival`` config group
ARRIVAL_KEYS = ("kind", "rate", "time_scale", "max_in_flight", "max_concurrency")


@dataclass(frozen=True)
class Arrival:
    """The ``arrival`` group, read and checked (`from_mapping`) before anything is generated;
    `apply` then sets the requests' arrival times. ``kind`` is resolved (never ``auto``)."""

    kind: str
    rate: float | None = None
    time_scale: float = 1.0
    max_in_flight: int | None = None
    max_concurrency: int | None = None  # calls outstanding at once (None: unlimited)

    @classmethod
    def from_mapping(cls, arrival: Mapping[str, Any] | None, is_trace: bool) -> "Arrival":
        """The group's values checked: its keys, ``kind``, and the values the kind uses."""
        arrival = dict(arrival or {})
        unknown = sorted(set(arrival) - set(ARRIVAL_KEYS))
        if unknown:
            raise BadInput(f"arrival.{unknown[0]} is not a setting of arrival; allowed: "
                           f"{', '.join(ARRIVAL_KEYS)}")
        kind = arrival.get("kind") or "auto"
        rate = check_setting("arrival.rate", "float", arrival.get("rate"))
        time_scale = check_setting("arrival.time_scale", "float", arrival.get("time_scale"))
        max_in_flight = check_setting("arrival.max_in_flight", "int", arrival.get("max_in_flight"))
        check_choice("arrival.kind", kind, ARRIVALS)
        if max_in_flight is not None and max_in_flight < 1:
            raise BadInput(f"arrival.max_in_flight must be >= 1 or null, got {max_in_flight}")
        max_concurrency = check_setting("arrival.max_concurrency", "int",
                                        arrival.get("max_concurrency"))
        if max_concurrency is not None and max_concurrency < 1:
            raise BadInput(f"arrival.max_concurrency must be >= 1 or null, got {max_concurrency}")
        if kind == "auto":
            kind = "trace" if is_trace else "offline"
        time_scale = 1.0 if time_scale is None else time_scale
        if kind == "trace" and time_scale < 0:
            raise BadInput(f"arrival.time_scale must be >= 0, got {time_scale}")
        if kind == "poisson" and (rate is None or rate <= 0):
            raise BadInput(f"arrival.rate must be > 0 for arrival.kind=poisson, got {rate}")
        return cls(kind, rate, time_scale, max_in_flight, max_concurrency)

    def apply(self, requests: list[Request], seed: int = 0) -> list[Request]:
        """Requests with ``arrival_s`` set by the arrival process (all calls of a program share
        their program's arrival; requests without a program are programs of their own)."""
        if self.kind == "trace":
            return [replace(r, arrival_s=r.arrival_s * self.time_scale) for r in requests]
        if self.kind == "offline":
            return [replace(r, arrival_s=0.0) for r in requests]
        programs = list(dict.fromkeys(r.program_id for r in requests))
        gaps = np.random.default_rng(seed).exponential(1.0 / self.rate, size=len(programs))
        start = dict(zip(programs, np.cumsum(gaps) - gaps[0] if len(gaps) else []))
        return [replace(r, arrival_s=float(start[r.program_id])) for r in requests]

