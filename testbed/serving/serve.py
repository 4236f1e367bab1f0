"""Serving a workload on one replica: `serve` builds the shared scheduler over a built cache and
executor and runs the serving loop (`testbed.serving.driver`), the simulator's and the engine's
runs alike; `records_of` turns the served requests into run records. (The KV capacity and the
objects come from `testbed.config.assembly` and `testbed.backends.dispatch`.)
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import numpy as np

from testbed.cache import PrefixCache, ReuseConfig
from testbed.results.metrics import RequestRecord
from testbed.scheduler.request_state import Req
from testbed.scheduler.scheduler import Scheduler
from testbed.scheduler.build import build_scheduler
from testbed.scheduler.decode_groups import DecodeGroups
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.serving.driver import Driver, DriverResult
from testbed.serving.executor import Executor
from testbed.serving.observer import RunObserver
from testbed.workloads.request import Request


def keep_runs_for(executor: Any, cache: PrefixCache) -> None:
    """Have the cache's pool keep each request's decoded tokens in runs
    (`KVSlotPool.alloc_after`) if ``executor`` reads the KV where it lies (``reads_kv_in_place``:
    the engine, whose CPU decode kernel took 1.2x as long on a served chat run's decode steps
    with their tokens handed out in turn, interleaved across the batch).
    The simulator reads nothing, and slot ids change no decision, so it saves itself the work."""
    pool = getattr(cache, "pool", None)
    if pool is not None and pool.page_size == 1 and getattr(executor, "reads_kv_in_place", False):
        pool.keep_runs = True


def serve(requests: list[Request], cache: PrefixCache, scheduler_cfg: Mapping[str, Any],
          executor: Executor, seed: int = 0, max_in_flight: int | None = None,
          generate: bool = False, progress: bool = False, record_steps: bool = False,
          observe: bool = False, eos_token_ids: Collection[int] = (),
          reuse: ReuseConfig | None = None,
          check_prompt: Callable[[Request, np.ndarray], None] | None = None,
          check_invariants: bool = False,
          max_concurrency: int | None = None,
          decode_groups: DecodeGroups | None = None,
          speculative: SpeculativeConfig | None = None) -> tuple[Scheduler, DriverResult]:
    """Serve ``requests`` through the shared scheduler and ``executor`` in virtual time; with
    ``observe`` the result carries a `RunObserver`'s steps and request phases.

    ``generate``: the executor generates every output (the engine with ``forced=false``); calls
    with ``max_new_tokens`` and no output are generated in any case. Prompts that splice in
    earlier outputs are then rebuilt from the real ones, and a generated token in
    ``eos_token_ids`` ends its request. ``reuse``: the cache group's reuse keys (beyond exact
    prefixes). ``check_prompt``: called on each prompt rebuilt from real outputs before its call is
    submitted (the engine refuses one its model cannot take: `testbed.engine.limits`).
    ``check_invariants``: the scheduler checks the cache after every step (``debug.``).
    ``max_concurrency``: calls outstanding at once (``arrival.``; None: unlimited).
    ``decode_groups``: cascade decoding's groups, put on each formed batch (None: none).
    ``speculative``: decode steps verify drafts (the ``speculative`` block; None: plain)."""
    keep_runs_for(executor, cache)
    scheduler = build_scheduler(cache, scheduler_cfg, seed=seed, eos_token_ids=eos_token_ids,
                                eos_for_all=generate, reuse=reuse,
                                check_invariants=check_invariants, decode_groups=decode_groups,
                                speculative=speculative)
    driver = Driver(requests, scheduler, executor, max_in_flight=max_in_flight,
                    generate=rebuilds_prompts(requests, generate), progress=progress,
                    record_steps=record_steps,
                    observer=RunObserver([scheduler]) if observe else None,
                    check_prompt=check_prompt, max_concurrency=max_concurrency)
    result = driver.run()
    if check_invariants:
        scheduler.check_drained()
    return scheduler, result


def rebuilds_prompts(requests: list[Request], generate: bool) -> bool:
    """Whether prompts that splice in earlier outputs are rebuilt from the real ones: when the
    executor generates every output, or some call generates its own."""
    return generate or any(r.generates for r in requests)


def records_of(reqs: list[Req], save_token_ids: bool = False,
               speculative: bool = False) -> list[RequestRecord]:
    """One record per request, in submission (arrival) order; ``speculative``: with each
    request's accepted drafts per verification step (``spec_accepted``, [] where none)."""
    return [RequestRecord(
        id=r.id, program=r.request.program, arrival_s=r.submitted_s,
        first_token_s=r.first_token_s, finish_s=r.finish_s, prompt_tokens=len(r.prompt),
        cached_tokens=r.cached_tokens or 0, approx_hit_tokens=r.approx_hit_tokens,
        recomputed_tokens=r.recomputed_tokens, output_tokens=len(r.output),
        evicted_tokens=r.evicted_tokens, inserted=r.inserted, preemptions=r.preemptions,
        aborted=r.aborted,
        prompt_ids=r.prompt.tolist() if save_token_ids else None,
        output_ids=list(r.output) if save_token_ids else None,
        spec_accepted=list(r.spec_accepted or ()) if speculative else None,
    ) for r in reqs]
