"""The one engine assembly: a run's model, KV pool, cache and request limits, built together for
every caller that serves on the engine (`testbed.backends.dispatch` for ``backend=engine``, the HTTP
server's `testbed.api.server.build_engine`).

The engine is built first (its KV pool: ``capacity`` tokens, else what the device leaves,
`Assembly.build_executor`), then a cache of exactly the engine's slots; with lower cache tiers
the engine is wrapped to move KV between the tiers (`testbed.engine.host_kv`). The model's
limits (vocabulary, context) are what requests are checked against before any step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from testbed.config.assembly import Assembly
from testbed.cache import PrefixCache
from testbed.serving.serve import keep_runs_for
from testbed.workloads import Request


@dataclass
class EngineParts:
    executor: Any  # the engine (`testbed.engine.executor.EngineExecutor`, tier-wrapped)
    cache: PrefixCache  # of the engine's KV slots
    limits: Any  # `testbed.engine.limits.ModelLimits` of its model
    quality: Any  # the engine's `QualityMonitor` (requests that reused KV, against exact)
    eos_token_ids: tuple[int, ...]

    @property
    def capacity(self) -> int:
        return self.executor.num_slots


def build_engine_parts(run: Assembly, capacity: int | None, requests: list[Request],
                       events: Any = None) -> EngineParts:
    """``events``: an `testbed.cache.events.EventLog` the radix cache publishes its changes to
    (the HTTP server's ``GET /kv_events``)."""
    from testbed.engine.limits import ModelLimits

    executor = run.build_executor(capacity, requests)
    planner = None
    if run.has_lower_tiers:
        from testbed.sim.transfer import make_planner
        planner = make_planner(run.config["cache"], run.model_shape, run.hardware)
    cache = run.build_cache(executor.num_slots, requests, planner=planner, record_transfers=True,
                            events=events)
    keep_runs_for(executor, cache)
    quality = executor.quality
    if cache.lower_tiers:
        from testbed.engine.host_kv import TieredEngineExecutor
        executor = TieredEngineExecutor(executor, cache)
    model = executor.model.config
    return EngineParts(executor, cache, ModelLimits.for_group(run.config["model"],
                                                              model.vocab_size),
                       quality, tuple(model.eos_token_ids))
