"""The backends behind ``backend=``: assembling a run from config and serving the workload.

- ``replay``: requests one at a time in arrival order, no time (hit-rate studies);
- ``sim``: the shared scheduler and cache in SimPy, steps timed by a cost model;
- ``engine``: the same scheduler and cache, steps run by the real model and timed.

KV capacity for ``sim`` and ``engine`` is ``cache.capacity_tokens`` when given, else what the
model and hardware leave for KV: ``(memory × mem_fraction − weights) / kv_bytes_per_token``; the
engine on CUDA measures instead what the device has free once the weights are loaded
(``torch.cuda.mem_get_info``), and caps either at the tokens the workload could ever hold, so a
tiny model does not allocate gigabytes of KV buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf

from testbed.cache import PrefixCache, RadixCache, make_cache, make_policy
from testbed.cache.tiers import make_tiered_cache
from testbed.metrics import RequestRecord, add_tier_fields
from testbed.replay import replay
from testbed.workloads import Request
from testbed.workloads.request import refuse_generating

BACKENDS = ("sim", "engine", "replay")


@dataclass
class BackendResult:
    records: list[RequestRecord]
    preemptions: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # backend-specific summary fields
    notes: list[str] = field(default_factory=list)  # printed last: what the reader must not miss
    observer: Any = None  # sim and engine: the run's `RunObserver` (steps, request phases)
    # the ideal hit rate when the run itself reached it (replay, unlimited radix cache, page 1)
    ideal_hit_rate: float | None = None


def container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def run_backend(cfg: DictConfig, requests: list[Request]) -> BackendResult:
    backend = cfg.backend.name
    if backend != "engine":
        refuse_generating(requests, backend)
    if backend == "replay" and cfg.get("replicas", 1) != 1:
        raise ValueError("replicas > 1 needs backend=sim (replay serves one cache)")
    if backend == "replay":
        capacity = cfg.cache.get("capacity_tokens")
        cache = build_cache(cfg, capacity, requests)
        sizes = (len(r.prompt) + len(r.output) for r in requests)
        unfit = [] if cfg.cache.name == "none" else [n for n in sizes if not cache.fits(n)]
        note = unfit_note(cfg, unfit, len(requests), capacity, cache.available_size)
        records = replay(requests, cache, save_token_ids=cfg.save_token_ids, progress=cfg.progress)
        return BackendResult(records, extra=tier_extra(cache), notes=note,
                             ideal_hit_rate=own_hit_rate_is_ideal(cache, records))
    if backend in ("sim", "engine"):
        return _serve(cfg, requests, engine=backend == "engine")
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")


def own_hit_rate_is_ideal(cache: PrefixCache, records: list[RequestRecord]) -> float | None:
    """The hit rate of a replay through an unlimited radix cache of page size 1 without lower
    tiers: it keeps every sequence whole, so it is the ideal hit rate (docs/design.md §3) and
    needs no recount. None for any other cache."""
    if type(cache) is not RadixCache or cache.page_size != 1 or not cache.pool.unbounded:
        return None
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else 0.0


def build_cache(cfg: DictConfig, capacity: int | None, requests: list[Request],
                planner=None, record_transfers: bool = False) -> PrefixCache:
    c = cfg.cache
    policy = make_policy(container(cfg.eviction), requests, cost_fn=recompute_cost(cfg))
    tiered = make_tiered_cache(container(c), capacity, policy, planner=planner,
                               record_transfers=record_transfers)  # cache.host/disk_tokens > 0
    if tiered is not None:
        return tiered
    return make_cache(c.name, capacity_tokens=capacity, page_size=c.get("page_size", 1),
                      block_size=c.get("block_size", 16), policy=policy)


def unfit_note(cfg: DictConfig, sizes: list[int], total: int, capacity: int | None,
               pool_tokens: float, replicas: int = 1) -> list[str]:
    """One line when requests could never fit in the KV pool (``sizes``: their prompt + output
    lengths): how many, the largest, the pool, and which key to change. The sim and the engine
    abort such a request (`Scheduler.submit`); replay serves it uncached."""
    if not sizes:
        return []
    what = "served uncached (no hit, nothing inserted)" if cfg.backend.name == "replay" \
        else "aborted (not served)"
    pool = "each replica's KV pool" if replicas > 1 else "the KV pool"
    if cfg.cache.get("capacity_tokens") is None:
        source = (f"what model={cfg.model.name} leaves on hardware={cfg.hardware.name}); set "
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
    return [r.prompt_tokens + planned[r.id] for r in records if r.aborted]


def tier_extra(cache: PrefixCache) -> dict[str, Any]:
    """Summary figures of the lower cache tiers (none without them)."""
    return cache.tier_summary() if cache.lower_tiers else {}


def has_lower_tiers(cfg: DictConfig) -> bool:
    return bool(cfg.cache.get("host_tokens") or cfg.cache.get("disk_tokens"))


def recompute_cost(cfg: DictConfig):
    """Seconds to recompute ``size`` tokens after ``start`` cached ones (the GDSF policy's cost):
    the roofline floor of that prefill on the configured model and hardware."""
    from testbed.sim.cost_model import RooflineCostModel, StepShape
    from testbed.sim.specs import hardware_spec, model_spec

    floor = RooflineCostModel(model_spec(container(cfg.model)),
                              hardware_spec(container(cfg.hardware))).floor
    return lambda start, size: floor(StepShape(new=(max(size, 1),), context=(start,)))


def max_in_flight(cfg: DictConfig) -> int | None:
    """Programs allowed at once: ``arrival.max_in_flight``, else the workload's own setting."""
    value = cfg.arrival.get("max_in_flight")
    return value if value is not None else cfg.workload.get("max_in_flight")


def _serve(cfg: DictConfig, requests: list[Request], engine: bool) -> BackendResult:
    from testbed.sim.simulate import records_of, serve
    from testbed.sim.specs import hardware_spec, kv_capacity_tokens, mem_fraction, model_spec

    model, hw = model_spec(container(cfg.model)), hardware_spec(container(cfg.hardware))
    capacity = cfg.cache.get("capacity_tokens")
    fraction = mem_fraction(container(cfg.hardware))
    if engine:
        executor = _engine_executor(cfg, capacity, requests, model, hw, fraction)
        capacity = executor.runner.num_slots
    else:
        if capacity is None:
            capacity = kv_capacity_tokens(model, hw, fraction)
        executor = _sim_executor(cfg, model, hw)
    replicas = cfg.get("replicas", 1)
    if replicas != 1:  # data-parallel replicas behind a router (testbed/sim/cluster.py)
        if engine:
            raise ValueError(f"replicas={replicas} needs backend=sim; the engine serves one replica")
        if has_lower_tiers(cfg):
            raise ValueError("cache.host_tokens / cache.disk_tokens need replicas=1")
        return _serve_cluster(cfg, requests, executor, capacity, replicas, model, hw)
    planner = None
    if has_lower_tiers(cfg):
        from testbed.sim.transfer import make_planner
        planner = make_planner(container(cfg.cache), model, hw)
    cache = build_cache(cfg, capacity, requests, planner=planner, record_transfers=engine)
    pool_tokens = cache.available_size  # capacity in whole pages, before anything is cached
    if engine and cache.lower_tiers:
        from testbed.engine.host_kv import TieredEngineExecutor
        executor = TieredEngineExecutor(executor, cache)
    scheduler, result = serve(requests, cache, container(cfg.scheduler), executor, seed=cfg.seed,
                              max_in_flight=max_in_flight(cfg),
                              generate=engine and not cfg.get("forced", True),
                              progress=cfg.progress, observe=True,
                              eos_token_ids=executor.runner.model.config.eos_token_ids
                              if engine else ())
    s = result.stats
    extra = {"scheduler": cfg.scheduler.name, "model": model.name, "hardware": hw.name,
             "kv_capacity_tokens": capacity, "prefill_steps": s.prefill_steps,
             "decode_steps": s.decode_steps, "busy_s": s.busy_s,
             "mean_decode_batch": s.decode_tokens / s.decode_steps if s.decode_steps else None}
    if engine:
        extra |= {"device": str(executor.runner.device), "attention": cfg.get("attention"),
                  "forced": bool(cfg.get("forced", True))}
        if executor.forced_tokens:
            extra["forced_agreement"] = executor.forced_agreed / executor.forced_tokens
    records = records_of(result.reqs, cfg.save_token_ids)
    if cache.lower_tiers:
        add_tier_fields(records, scheduler.tier_hits)
    extra |= tier_extra(cache)
    note = unfit_note(cfg, aborted_sizes(records, requests), len(records), capacity, pool_tokens)
    return BackendResult(records, scheduler.preemptions, extra, note, result.observer)


def _serve_cluster(cfg: DictConfig, requests: list[Request], executor, capacity: int,
                   replicas: int, model, hw) -> BackendResult:
    """``replicas`` simulated replicas, each with its own cache and scheduler, behind the
    ``router`` group's policy; the summary gains ``replicas``, ``imbalance``, ``router_decisions``."""
    from testbed.router import cluster_delays, make_router
    from testbed.sim.cluster import cluster_records, cluster_summary, simulate_cluster

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    router_cfg = container(cfg.router)
    network_delay_s, transfer_s_per_token = cluster_delays(router_cfg)
    result = simulate_cluster(
        requests, lambda: build_cache(cfg, capacity, requests), container(cfg.scheduler),
        executor, make_router(router_cfg, seed=cfg.seed, kv_capacity=capacity),
        replicas=replicas, seed=cfg.seed, max_in_flight=max_in_flight(cfg),
        network_delay_s=network_delay_s, transfer_s_per_token=transfer_s_per_token,
        progress=cfg.progress, observe=True)
    extra = {"scheduler": cfg.scheduler.name, "model": model.name, "hardware": hw.name,
             "kv_capacity_tokens": capacity, "router": cfg.router.name, **cluster_summary(result)}
    records = cluster_records(result, cfg.save_token_ids)
    sizes = aborted_sizes(records, requests)
    note = unfit_note(cfg, sizes, len(records), capacity,
                      build_cache(cfg, capacity, requests).available_size if sizes else capacity,
                      replicas)
    return BackendResult(records, result.preemptions, extra, note, result.observer)


def _sim_executor(cfg: DictConfig, model, hw):
    from testbed.sim.cost_model import make_cost_model
    from testbed.sim.executor import SimExecutor

    return SimExecutor(make_cost_model(container(cfg.cost_model), model, hw))


def _engine_executor(cfg: DictConfig, capacity: int | None, requests: list[Request], model, hw,
                     fraction: float):
    """The engine with ``capacity`` KV slots; None: on CUDA what free memory leaves after the
    weights load, elsewhere what the model leaves of the hardware preset's memory; either capped
    at the tokens the workload could ever hold."""
    from testbed.engine import default_device, make_engine_executor
    from testbed.sim.specs import kv_capacity_tokens

    device = cfg.get("device") or default_device()
    most = sum(len(r.prompt) + r.output_limit for r in requests) + 1
    if capacity is None and not device.startswith("cuda"):
        capacity = min(kv_capacity_tokens(model, hw, fraction), most)
    return make_engine_executor(container(cfg.model), num_slots=capacity, max_slots=most,
                                mem_fraction=fraction, device=device, dtype=cfg.get("dtype"),
                                attention=cfg.get("attention"), seed=cfg.seed,
                                forced=bool(cfg.get("forced", True)),
                                temperature=float(cfg.get("temperature", 0.0)),
                                top_p=float(cfg.get("top_p", 1.0)))


def fit_vocabulary(cfg: DictConfig) -> str | None:
    """On the engine, a generated workload's token ids must exist in the model's vocabulary:
    shrink ``workload.vocab_size`` to the model's. Returns a note when it did."""
    vocab = cfg.model.get("vocab_size")
    wanted = cfg.workload.get("vocab_size")
    if cfg.backend.name != "engine" or vocab is None or wanted is None or wanted <= vocab:
        return None
    OmegaConf.update(cfg, "workload.vocab_size", vocab, force_add=False)
    return f"note: workload.vocab_size {wanted} > model vocabulary {vocab}; using {vocab}"
