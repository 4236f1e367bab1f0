"""The router seam: a policy picks a data-parallel replica (worker) for each request.

The cluster driver calls `Router.route` when a request is ready to be served, with the prompt and
every worker's current load, and `Router.on_complete` when a worker reports a finished request
(after the router's ``update_delay_s``). Routers never look at the clock except through ``now``,
so the simulator drives them in virtual time.

**Load** is what a worker still has to do for the requests routed to it: with ``load=tokens`` (the
default here) its *outstanding tokens*, prompt tokens not yet prefilled (a queued request counts
its whole prompt, its cache hit being unknown until admission) plus output tokens not yet
generated (the request's output length, as a client's ``max_tokens`` would say); with
``load=requests`` the number of routed, unfinished requests (SGLang's router counts these).
Requests on their way to a worker count towards its load from the moment they are routed.

**Availability** (the live router, `testbed.gateway`): ``Loads.available`` marks the workers in
rotation (None: all, as in the simulator). Every built-in policy chooses among them only (round
robin skips the others, random draws among them, the load and cache rules compare them only);
a policy of your own that picks one out of rotation is overridden by `Router.route` (the least
loaded one in rotation, reason ``unavailable``). `Router.forget_worker` tells a policy that a
worker's cache was lost (it restarted).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from testbed.cache.base import PrefixCache

LOAD_UNITS = ("tokens", "requests")
#: what a router sees of a replica's outstanding tokens (``router.load_seen``): ``progress``, a
#: prompt's tokens leave as they are prefilled; ``stream``, a prompt counts until its request ends
LOAD_SEEN = ("progress", "stream")
#: how a tie of loads is broken (``router.tie_break`` of the cache-aware policies): the lowest
#: index, as SGLang's router takes the first of its workers; or the worker this router has sent
#: the fewest requests so far (then the lowest index), so that a tie does not always favour one
TIE_BREAKS = ("index", "fewest_sent")


@dataclass(frozen=True)
class Loads:
    """Every worker's load, in both units (see the module docstring)."""

    tokens: Sequence[float]
    requests: Sequence[int]
    available: Sequence[bool] | None = None  # the workers in rotation; None: every one

    def of(self, unit: str) -> Sequence[float]:
        return self.tokens if unit == "tokens" else self.requests

    def up(self) -> list[int] | None:
        """The workers in rotation, in order (None: every one)."""
        if self.available is None:
            return None
        return [w for w, ok in enumerate(self.available) if ok]


class NoWorker(RuntimeError):
    """Every worker is out of rotation: nothing can be routed."""


def least_loaded(load: Sequence[float], among: Sequence[int] | None = None,
                 sent: Sequence[int] | None = None) -> int:
    """The worker with the smallest load (ties: the one sent the fewest requests, given
    ``sent``; then the lowest index)."""
    candidates = range(len(load)) if among is None else among
    return min(candidates, key=lambda w: (load[w], 0 if sent is None else sent[w], w))


def is_imbalanced(load: Sequence[float], abs_threshold: float, rel_threshold: float,
                  among: Sequence[int] | None = None) -> bool:
    """SGLang's rule: imbalanced when ``max - min > abs_threshold`` and ``max > min ×
    rel_threshold`` (both), over the workers ``among`` (None: all)."""
    values = load if among is None else [load[w] for w in among]
    hi, lo = max(values), min(values)
    return hi - lo > abs_threshold and hi > lo * rel_threshold


class Router(ABC):
    """A routing policy. ``decisions`` counts why each request went where it went."""

    #: the config name (``router=NAME``)
    name: str = ""
    #: seconds between a worker finishing a request and `on_complete` being called
    update_delay_s: float = 0.0
    #: whether `on_complete` does anything (the driver skips the calls otherwise)
    wants_completions: bool = False

    def __init__(self) -> None:
        self.num_workers = 0
        self.decisions: Counter[str] = Counter()
        self.requests_sent: Counter[int] = Counter()  # requests routed to each worker

    def bind(self, num_workers: int, caches: Sequence[PrefixCache] = ()) -> None:
        """Attach the router to ``num_workers`` workers (and their real caches, which only the
        oracle reads). Resets any state from an earlier run."""
        if num_workers < 1:
            raise ValueError(f"replicas must be >= 1, got {num_workers}")
        self.num_workers = num_workers
        self.decisions = Counter()
        self.requests_sent = Counter()  # retries included; 0 for a worker sent none

    def route(self, tokens: np.ndarray, loads: Loads, now: float) -> int:
        """The worker that serves a request with prompt ``tokens``, one in rotation (`NoWorker`
        when none is)."""
        up = loads.up()
        if up is not None and not up:
            raise NoWorker("no replica is in rotation")
        worker, why = self._choose(tokens, loads, now)
        if up is not None and worker not in up:  # a policy that ignores availability
            worker, why = least_loaded(loads.requests, up), "unavailable"
        self.decisions[why] += 1
        self.requests_sent[worker] += 1
        return worker

    @abstractmethod
    def _choose(self, tokens: np.ndarray, loads: Loads, now: float) -> tuple[int, str]:
        """(worker, reason) for one request."""

    def on_complete(self, worker: int, prompt: np.ndarray, output: np.ndarray | None,
                    now: float) -> None:
        """``worker`` finished the request routed with ``prompt`` (the same array `route` got);
        ``output`` is what it generated, None if it was aborted (never served)."""

    def forget_worker(self, worker: int) -> None:
        """``worker``'s cache was lost (it restarted, or left the rotation for good): whatever
        the policy believes it holds is void."""

    def info(self) -> dict[str, Any]:
        """Router state worth reporting at the end of a run."""
        return {}
