"""The backends behind ``backend=``: serving the workload with the objects a run assembled.

- ``replay``: requests one at a time in arrival order, no time (hit-rate studies);
- ``sim``: the shared scheduler and cache in SimPy, steps timed by a cost model;
- ``engine``: the same scheduler and cache, steps run by the real model and timed; with reuse
  beyond exact prefixes the records carry the quality the engine measured (`add_quality_fields`);
- ``custom``: the shared scheduler and cache, steps run by ``backend.target`` (an executor);
- ``server``: a live OpenAI-compatible server at ``server.url`` (`testbed.remote`, imported only
  for it).

KV capacity for ``sim`` and ``engine`` is ``cache.capacity_tokens`` when given, else what the
model and hardware leave for KV: ``(memory × mem_fraction − weights) / kv_bytes_per_token``; the
engine on CUDA measures instead what the device has free once the weights are loaded
(``torch.cuda.mem_get_info``), and caps either at the tokens the workload could ever hold, so a
tiny model does not allocate gigabytes of KV buffers. Every object is built by the run's
`testbed.config.builders.Assembly`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from testbed.config.assembly import REPLAY, SERVER, Assembly
from testbed.cache import PrefixCache, RadixCache
from testbed.results.metrics import RequestRecord, add_quality_fields, add_tier_fields
from testbed.backends.replay import replay
from testbed.workloads import Request
from testbed.workloads.request import refuse_beams, refuse_generating

@dataclass
class BackendResult:
    records: list[RequestRecord]
    preemptions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific summary fields
    notes: list[str] = field(default_factory=list)  # printed last: what the reader must not miss
    observer: Any = None  # sim and engine: the run's `RunObserver` (steps, request phases)
    # the ideal hit rate when the backend knows it: replay through an unlimited radix cache of
    # page 1 reached it; a server's run counts it over the calls as they ran
    ideal_hit_rate: float | None = None
    beams: Any = None  # the engine's beam calls (`testbed.scheduler.beam.BeamCalls`), if any


def run_backend(run: Assembly, requests: list[Request]) -> BackendResult:
    if run.backend not in ("engine", SERVER):
        refuse_generating(requests, run.backend)
    if run.backend != "engine":
        refuse_beams(requests, run.backend)
    if run.backend == SERVER:
        from testbed.remote import run_server
        done = run_server(run, requests)
        return BackendResult(done.records, extra=done.extra, notes=done.notes,
                             ideal_hit_rate=done.ideal_hit_rate)
    if run.backend == REPLAY:
        capacity = run.capacity_tokens
        cache = run.build_cache(capacity, requests)
        sizes = (len(r.prompt) + len(r.output) for r in requests)
        unfit = [] if run.cache.label == "none" else [n for n in sizes if not cache.fits(n)]
        note = unfit_note(run, unfit, len(requests), capacity, cache.available_size)
        records = replay(requests, cache, save_token_ids=run.get("save_token_ids", False),
                         progress=run.get("progress", False),
                         check_invariants=run.check_invariants)
        return BackendResult(records, extra=tier_extra(cache), notes=note,
                             ideal_hit_rate=own_hit_rate_is_ideal(cache, records))
    return _serve(run, requests, engine=run.backend == "engine")


def own_hit_rate_is_ideal(cache: PrefixCache, records: list[RequestRecord]) -> float | None:
    """The hit rate of a replay through an unlimited radix cache of page size 1 without lower
    tiers: it keeps every sequence whole, so it is the ideal hit rate (docs/design.md §3) and
    needs no recount. None for any other cache."""
    if type(cache) is not RadixCache or cache.page_size != 1 or not cache.pool.unbounded:
        return None
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else 0.0


def unfit_note(run: Assembly, sizes: list[int], total: int, capacity: int | None,
               pool_tokens: float, replicas: int = 1) -> list[str]:
    """One line when requests could never fit in the KV pool (``sizes``: their prompt + output
    lengths): how many, the largest, the pool, and which key to change. The sim and the engine
    abort such a request (`Scheduler.submit`); replay serves it uncached."""
    if not sizes:
        return []
    what = "served uncached (no hit, nothing inserted)" if run.backend == REPLAY \
        else "aborted (not served)"
    pool = "each replica's KV pool" if replicas > 1 else "the KV pool"
    if run.capacity_tokens is None:
        source = (f"what model={run.config['model'].get('name')} leaves on "
                  f"hardware={run.config['hardware'].get('name')}); set "
                  "cache.capacity_tokens higher, take larger hardware")
    elif capacity is not None and pool_tokens != capacity:
        source = f"cache.capacity_tokens={capacity:,} in whole pages); raise it"
    else:
        source = "cache.capacity_tokens); raise it"
    return [f"{len(sizes):,} of {total:,} requests {what}: their prompt + output (up to "
            f"{max(sizes):,} tokens) exceeds {pool} of {int(pool_tokens):,} tokens ({source} or "
            "shorten the workload"]


def aborted_sizes(records: list[RequestRecord], requests: list[Request]) -> list[int]:
    """Prompt + planned output of the aborted requests (their records hold no output)."""
    planned = {r.id: r.output_limit for r in requests}
    return [r.prompt_tokens + planned.get(r.id, 0)  # a beam call's request: prompt only
            for r in records if r.aborted]


def tier_extra(cache: PrefixCache) -> dict[str, Any]:
    """Summary figures of the lower cache tiers (none without them)."""
    return cache.tier_summary() if cache.lower_tiers else {}


def _serve(run: Assembly, requests: list[Request], engine: bool) -> BackendResult:
    from testbed.serving.serve import rebuilds_prompts, records_of, serve

    if run.replicas != 1:  # data-parallel replicas behind a router (testbed/serving/cluster.py)
        # (assemble refused replicas with replay, the engine, lower tiers or reuse)
        capacity = run.capacity_tokens or run.kv_capacity()
        return _serve_cluster(run, requests, run.build_executor(capacity, requests), capacity)
    generate = engine and not run.engine.forced
    check_prompt, quality, eos = None, None, ()
    if engine:
        from testbed.backends.engine_assembly import build_engine_parts
        parts = build_engine_parts(run, run.capacity_tokens, requests)
        executor, cache, capacity = parts.executor, parts.cache, parts.capacity
        quality, eos = parts.quality, parts.eos_token_ids
        # what its model can take: refused before the first step (BadInput)
        parts.limits.check_workload(requests, rebuilt=rebuilds_prompts(requests, generate),
                                    forced=not generate)
        check_prompt = parts.limits.check_submitted
    else:
        capacity = run.capacity_tokens if run.capacity_tokens is not None else run.kv_capacity()
        executor = run.build_executor(capacity, requests)
        grid = (getattr(executor.cost_model, "meta", None) or {}).get("grid")
        if grid:  # which steps a fitted model priced beyond its grid
            from testbed.sim.grid_reach import GridReach
            executor.reach = GridReach(grid, run.config["cost_model"].get("path"))
        planner = None
        if run.has_lower_tiers:
            from testbed.sim.transfer import make_planner
            planner = make_planner(run.config["cache"], run.model_shape, run.hardware)
        cache = run.build_cache(capacity, requests, planner=planner)
    pool_tokens = cache.available_size  # capacity in whole pages, before anything is cached
    scheduler, result = serve(requests, cache, run.scheduler, executor, seed=run.seed,
                              max_in_flight=run.max_in_flight, generate=generate,
                              max_concurrency=run.max_concurrency,
                              progress=run.get("progress", False), observe=True,
                              eos_token_ids=eos, reuse=run.reuse, check_prompt=check_prompt,
                              check_invariants=run.check_invariants,
                              decode_groups=run.decode_groups(),
                              speculative=run.speculative)
    s = result.stats
    extra = {**_served_by(run, capacity), "prefill_steps": s.prefill_steps,
             "decode_steps": s.decode_steps, "busy_s": s.busy_s,
             "mean_decode_batch": s.decode_tokens / s.decode_steps if s.decode_steps else None}
    if getattr(scheduler, "spec", None) is not None:
        extra |= scheduler.spec.stats.summary()
    if not engine:
        extra |= _sim_attention(run, executor)
    if engine:
        extra |= {"device": str(executor.device), "attention": run.attention,
                  "forced": run.engine.forced, **executor.graph_summary()}
        if executor.forced_tokens:
            extra["forced_agreement"] = executor.forced_agreed / executor.forced_tokens
    records = records_of(result.reqs, run.get("save_token_ids", False),
                         speculative=run.speculative.active)
    if cache.lower_tiers:
        add_tier_fields(records, scheduler.tier_hits)
    if quality is not None and run.reuse.active:  # requests that reused KV, against exact
        add_quality_fields(records, {rid: q.fields() for rid, q in quality.records().items()})
    extra |= tier_extra(cache)
    note = unfit_note(run, aborted_sizes(records, requests), len(records), capacity, pool_tokens)
    if getattr(executor, "reach", None) is not None and executor.reach.warning():
        note.append(executor.reach.warning())
    ideal = ideal_as_ran(result.reqs) if rebuilds_prompts(requests, generate) else None
    return BackendResult(records, scheduler.preemptions, extra, note, result.observer,
                         ideal_hit_rate=ideal, beams=result.beams)


def ideal_as_ran(reqs: list) -> float:
    """The ideal hit rate of the calls as the engine ran them (its generated outputs, the prompts
    rebuilt from them), in submission order: the workload's own outputs are not what ran."""
    from testbed.results.metrics import ideal_hit_rate
    from testbed.workloads.request import TOKEN_DTYPE

    return ideal_hit_rate(Request(r.id, r.prompt, np.asarray(r.output, dtype=TOKEN_DTYPE))
                          for r in reqs)


def _sim_attention(run: Assembly, executor: Any) -> dict[str, Any]:
    """The simulator's ``attention``, set or its hardware preset's (cascade* prices cascade
    decoding), and the share of the decode steps' cached KV its groups left
    unread."""
    if run.attention is None:
        return {}
    out = {"attention": run.attention}
    if getattr(executor, "cascade_saved", None) is not None:
        out["cascade_saved_kv"] = executor.cascade_saved
    return out


def _served_by(run: Assembly, capacity: int) -> dict[str, Any]:
    return {"scheduler": run.scheduler.target or run.scheduler.name,
            "model": run.model_shape.name,
            "hardware": run.hardware.name, "kv_capacity_tokens": capacity}


def _serve_cluster(run: Assembly, requests: list[Request], executor, capacity: int
                   ) -> BackendResult:
    """``replicas`` simulated replicas, each with its own cache and scheduler, behind the
    ``router`` group's policy; the summary gains ``replicas``, ``imbalance``, ``router_decisions``."""
    from testbed.serving.cluster import cluster_records, cluster_summary, simulate_cluster

    if run.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {run.replicas}")
    network_delay_s, transfer_s_per_token = run.cluster_delays()
    result = simulate_cluster(
        requests, lambda events=None: run.build_cache(capacity, requests, events=events),
        run.scheduler,
        executor, run.build_router(capacity), replicas=run.replicas, seed=run.seed,
        max_in_flight=run.max_in_flight, max_concurrency=run.max_concurrency,
        network_delay_s=network_delay_s,
        transfer_s_per_token=transfer_s_per_token, progress=run.get("progress", False),
        observe=True, check_invariants=run.check_invariants, decode_groups=run.decode_groups,
        load_seen=run.cluster_load_seen())
    extra = {**_served_by(run, capacity), **cluster_summary(result), "router": run.router.label,
             **_sim_attention(run, executor)}
    records = cluster_records(result, run.get("save_token_ids", False))
    sizes = aborted_sizes(records, requests)
    note = unfit_note(run, sizes, len(records), capacity,
                      run.build_cache(capacity, requests).available_size if sizes else capacity,
                      run.replicas)
    return BackendResult(records, result.preemptions, extra, note, result.observer)
