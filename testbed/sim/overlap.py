"""The host's work per step, priced apart from the device's, so the simulator can price overlap.

A serving step costs the device its forward (what the cost model prices: fitted to the engine's
device time, `testbed.calibrate`) and the host its scheduling and bookkeeping: forming the batch,
matching and inserting in the radix tree, filling the step's buffers, launching, reading tokens
back, applying them. `HostCost` prices the latter per step and kind: a prefill ``prefill_s +
prefill_request_s × requests + prefill_token_s × new tokens`` (admission matches and inserts
each request's prompt), a decode ``decode_s + decode_request_s × requests``; and it says whether
the device runs beside the host (``concurrent``: a GPU, whose steps the host launches and returns
from) or is the host (a CPU engine, which computes inside launch).

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

PREFILL = ("prefill_s", "prefill_request_s", "prefill_token_s")
DECODE = ("decode_s", "decode_request_s")
TERMS = PREFILL + DECODE


@dataclass(frozen=True)
class HostCost:
    prefill_s: float = 0.0
    prefill_request_s: float = 0.0
    prefill_token_s: float = 0.0
    decode_s: float = 0.0
    decode_request_s: float = 0.0
    concurrent: bool = True  # the device runs beside the host (a GPU); False: a CPU engine

    def host_time(self, batch: Batch) -> float:
        """Host seconds ``batch``'s step costs."""
        return self.price(batch.kind, batch.size, batch.num_new_tokens)

    def price(self, kind: str, requests: int, new_tokens: int) -> float:
        if kind == "decode":
            return self.decode_s + self.decode_request_s * requests
        return self.prefill_s + self.prefill_request_s * requests \
            + self.prefill_token_s * new_tokens

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


def fit_host_cost(steps: Iterable[Any], concurrent: bool = True,
                  outlier: float = 10.0) -> HostCost:
    """Non-negative least squares of the steps' ``host_s``, per kind, on (1, requests, new
    tokens) for prefills and (1, requests) for decodes: the records of an engine run
    (`testbed.serving.driver.StepRecord`). A kind without steps is priced 0. A step whose host
    time is over ``outlier`` times its kind's median is left out: a garbage collection or a
    one-off compile that landed in it is not a cost of steps like it."""
    rows: dict[str, list] = {"prefill": [], "decode": []}
    for s in steps:
        features = (1.0, len(s.new), float(sum(s.new)))
        rows[s.kind].append((features if s.kind == "prefill" else features[:2], s.host_s))
    coef: dict[str, float] = {}
    for kind, names in (("prefill", PREFILL), ("decode", DECODE)):
        if rows[kind]:
            median = float(np.median([h for _, h in rows[kind]]))
            kept = [(f, h) for f, h in rows[kind] if h <= outlier * median] or rows[kind]
            a = np.asarray([f for f, _ in kept])
            y = np.asarray([h for _, h in kept])
            coef.update(zip(names, map(float, nnls(a, y))))
    if not coef:
        raise ValueError("no steps to fit the host's time to")
    return HostCost(**coef, concurrent=concurrent)
