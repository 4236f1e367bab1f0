"""The host's work per step, priced apart from the device's, so the simulator can price overlap.

A serving step costs the device its forward (what the cost model prices: fitted to the engine's
device time, `testbed.calibrate`) and the host its scheduling and bookkeeping: forming the batch,
matching and inserting in the radix tree, filling the step's buffers, launching, reading tokens
back, applying them. `HostCost` prices the latter per step, ``per_step_s + per_request_s ×
requests + per_token_s × new tokens``, and says whether the device runs beside the host
(``concurrent``: a GPU, whose steps the host launches and returns from) or is the host (a CPU
engine, which computes inside launch).

The serving loop's timeline (`testbed.serving.step_cycle`) places each step: the host forms and
launches it (the priced host seconds), a concurrent device starts it once launched and free.
Without ``scheduler.overlap`` the host waits for each step before forming the next: a step costs
host + device. With it the host forms and launches step N+1 while the device runs step N: a step
costs about max(host, device), the host's work hidden behind the device's. A CPU engine hides
nothing either way. All terms 0 (the default): the device's time alone, as before.

`fit_host_cost` fits the terms to an engine run's steps (their ``host_s``, `StepRecord`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import numpy as np

from testbed.errors import BadInput
from testbed.scheduler.batch import Batch
from testbed.sim.fit import nnls

TERMS = ("per_step_s", "per_request_s", "per_token_s")


@dataclass(frozen=True)
class HostCost:
    per_step_s: float = 0.0
    per_request_s: float = 0.0
    per_token_s: float = 0.0
    concurrent: bool = True  # the device runs beside the host (a GPU); False: a CPU engine

    def host_time(self, batch: Batch) -> float:
        """Host seconds ``batch``'s step costs."""
        return self.price(len(batch.entries), batch.num_new_tokens)

    def price(self, requests: int, new_tokens: int) -> float:
        return self.per_step_s + self.per_request_s * requests + self.per_token_s * new_tokens

    @property
    def priced(self) -> bool:
        return any(getattr(self, t) for t in TERMS)

    @classmethod
    def from_config(cls, block: Mapping[str, Any] | None, key: str = "host") -> HostCost:
        """From the run config's ``host`` block (None: nothing priced), each value checked."""
        block = dict(block or {})
        unknown = sorted(set(block) - {*TERMS, "concurrent"})
        if unknown:
            raise BadInput(f"{key}.{unknown[0]} is not a host key; allowed: "
                           f"{', '.join([*TERMS, 'concurrent'])}")
        values: dict[str, Any] = {}
        for term in TERMS:
            v = block.get(term)
            v = 0.0 if v is None else v
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise BadInput(f"{key}.{term} must be a number of seconds >= 0, got {v!r}")
            values[term] = float(v)
        concurrent = block.get("concurrent", True)
        if not isinstance(concurrent, bool):
            raise BadInput(f"{key}.concurrent must be true or false, got {concurrent!r}")
        return cls(**values, concurrent=concurrent)

    def to_config(self) -> dict[str, Any]:
        return {**{t: getattr(self, t) for t in TERMS}, "concurrent": self.concurrent}


def fit_host_cost(steps: Iterable[Any], concurrent: bool = True) -> HostCost:
    """Non-negative least squares of the steps' ``host_s`` on (1, requests, new tokens): the
    records of an engine run (`testbed.serving.driver.StepRecord`)."""
    rows, y = [], []
    for s in steps:
        rows.append((1.0, len(s.new), float(sum(s.new))))
        y.append(s.host_s)
    if not rows:
        raise ValueError("no steps to fit the host's time to")
    coef = nnls(np.asarray(rows), np.asarray(y))
    return HostCost(*map(float, coef), concurrent=concurrent)
