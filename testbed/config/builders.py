"""What `testbed.config.assembly.assemble` returns: a run's config, checked, and the builders of
its objects.

An `Assembly` reads the run's settings off the plain config (seed, replicas, the engine's device
and attention, the cascade rule, the cache's capacity and tiers, the SGLang release) and builds
what a backend serves with: ``requests()``, ``build_cache(...)``, ``build_executor(...)``,
``build_router(...)``, ``build_cost_model()``. `check_builds` builds once what needs no workload,
so that a bad value in any group stops the run before one is generated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from testbed.cache import PrefixCache, ReuseConfig
from testbed.cache.radix import SGLANG_RELEASES
from testbed.cache.tier_config import has_lower_tiers, tier_options
from testbed.config.backend_limits import REPLAY, SERVER
from testbed.config.engine_config import EngineConfig, check_kernels_run_here
from testbed.config.engine_timing import apply_timing, check_fit_timing, timing_settings
from testbed.config.registry import Lazy, Resolved
from testbed.errors import BadInput
from testbed.router import cluster_delays, cluster_load_seen
from testbed.scheduler.cascade_rule import CascadeRule
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.decode_groups import DecodeGroups, cascades, default_attention
from testbed.scheduler.speculative import SpeculativeConfig
from testbed.scheduler.vllm_config import VllmSchedulerConfig
from testbed.workloads import Request, build_workload
from testbed.workloads.arrivals import Arrival

@dataclass
class Assembly:
    """A run's config, read and checked once, and the builders of its objects."""

    config: dict[str, Any]  # the whole run config, plain
    backend: str  # sim | engine | replay | custom
    workload: Resolved
    eviction: Resolved
    cache: Resolved
    scheduler: SchedulerConfig | VllmSchedulerConfig
    router: Resolved
    cost_model: Resolved
    executor: Resolved | None  # None: replay, server
    reuse: ReuseConfig = field(default_factory=ReuseConfig)  # beyond exact prefixes (scheduler)
    timeline: bool = False  # write timeline.json (Perfetto)
    arrival: Arrival | None = None  # the arrival group, checked (None: the workload's default)
    max_in_flight: int | None = None  # programs at once: arrival.max_in_flight, else the workload's
    max_concurrency: int | None = None  # calls outstanding at once: arrival.max_concurrency
    notes: list[str] = field(default_factory=list)  # printed before the run
    server: Any = None  # backend=server: the server block, checked (`ServerSettings`)
    engine: EngineConfig = field(default_factory=EngineConfig)  # the engine block, checked
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # checked

    # ------------------------------------------------------------------ run settings
    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key, default)
        return default if value is None else value

    @property
    def seed(self) -> int:
        return self.get("seed", 0)

    @property
    def cascade_min_saved(self) -> int:
        return self.engine.cascade_min_saved

    @property
    def engine_device(self) -> str:
        """``engine.device``, or where null the engine's default (CUDA when present, else the
        CPU)."""
        from testbed.engine import default_device
        return self.engine.device or default_device()

    @property
    def attention(self) -> str | None:
        """``engine.attention``; where null, the kernels the run's device runs by default: the
        engine's `default_attention` of its device, the simulator's the hardware preset's
        ``attention`` (absent: plain decode, as the engine's Triton kernels on a GPU)."""
        chosen = self.engine.attention
        if chosen is not None:
            return chosen
        if self.backend == "engine":
            return default_attention(self.engine_device)
        return self.config["hardware"].get("attention")

    def decode_groups(self) -> DecodeGroups | None:
        """A fresh `DecodeGroups` for a scheduler when the run decodes in cascade (the engine
        plans, the simulator prices, the groups it puts on each batch); else None."""
        if not cascades(self.attention):
            return None
        return DecodeGroups(min_saved=self.cascade_min_saved, rule=self.cascade_rule)

    @cached_property
    def cascade_rule(self) -> CascadeRule:
        """Where cascade's groups form (``engine.cascade_rule``): for the model on this run's
        device, whose grid is the engine's own device (its SMs on CUDA, none on the CPU) or the
        simulator's hardware preset (``hardware.sm_count``; none on ``hardware=cpu``)."""
        if self.backend == "engine":
            from testbed.engine.cascade import device_slots
            slots = device_slots(self.engine_device)
        else:
            slots = self.hardware.sm_count
        shape = self.model_shape
        return CascadeRule.build(self.engine.cascade_rule, slots,
                                 num_heads=max(1, shape.num_heads // shape.tp),
                                 kv_heads=shape.kv_heads_per_gpu)

    @property
    def check_invariants(self) -> bool:
        """``debug.check_invariants``: the cache checked after every step (checked in assemble)."""
        return bool((self.config.get("debug") or {}).get("check_invariants", False))

    @property
    def replicas(self) -> int:
        return self.get("replicas", 1)

    @property
    def capacity_tokens(self) -> int | None:
        """``cache.capacity_tokens`` as given (None: from the model and hardware, or unlimited)."""
        return self.config["cache"].get("capacity_tokens")

    @property
    def has_lower_tiers(self) -> bool:
        return has_lower_tiers(self.config["cache"])

    def labels(self) -> dict[str, Any]:
        """The summary's names of the run's choices (a user class by its import path); a
        server's cache and eviction are its own, named ``server``."""
        if self.backend == SERVER:
            return {"backend": SERVER, "workload": self.workload.label, "cache": SERVER,
                    "eviction": SERVER}
        return {"backend": self.backend, "workload": self.workload.label,
                "cache": self.cache.label, "eviction": self.eviction.label}

    # ------------------------------------------------------------------ objects
    def requests(self) -> list[Request]:
        return build_workload(self.config["workload"], seed=self.seed, arrival=self.arrival)

    @cached_property
    def model_shape(self):
        from testbed.sim.specs import model_spec
        return model_spec(self.config["model"])

    @cached_property
    def hardware(self):
        from testbed.sim.specs import hardware_spec
        return hardware_spec(self.config["hardware"])

    @cached_property
    def mem_fraction(self) -> float:
        from testbed.sim.specs import mem_fraction
        return mem_fraction(self.config["hardware"])

    def kv_capacity(self) -> int:
        """KV tokens the model leaves of the hardware's memory (docs/design.md §5)."""
        from testbed.sim.specs import kv_capacity_tokens
        return kv_capacity_tokens(self.model_shape, self.hardware, self.mem_fraction)

    def recompute_cost(self) -> Callable[[int, int], float]:
        """Seconds to recompute ``size`` tokens after ``start`` cached ones (GDSF's cost): the
        roofline floor of that prefill on the configured model and hardware."""
        from testbed.sim.cost_model import RooflineCostModel
        from testbed.sim.step_shape import StepShape

        floor = RooflineCostModel(self.model_shape, self.hardware).floor
        return lambda start, size: floor(StepShape(new=(max(size, 1),), context=(start,)))

    def build_policy(self, requests: list[Request]):
        return self.eviction.build(requests=requests, cost_fn=Lazy(self.recompute_cost))

    def build_cache(self, capacity: int | None, requests: list[Request], planner: Any = None,
                    record_transfers: bool = False, events: Any = None) -> PrefixCache:
        """A fresh cache of ``capacity`` tokens (None: unlimited) with its own eviction policy;
        the tiered radix cache when the group asks for lower tiers. ``events``: an
        `testbed.cache.events.EventLog` the radix cache publishes its changes to (its policy
        wrapped to do so; another cache is refused)."""
        from testbed.cache.events import publishing
        from testbed.cache.tiers import make_tiered_cache

        policy = self.build_policy(requests)
        if events is not None:
            if self.cache.label != "radix" or tier_options(self.config["cache"]) is not None:
                raise BadInput(f"cache events need cache=radix without lower tiers; got "
                               f"cache={self.cache.label}")
            policy = publishing(policy, events)
        tiered = make_tiered_cache(self.config["cache"], capacity, policy, planner=planner,
                                   record_transfers=record_transfers, sglang=self.sglang)
        if tiered is not None:
            return tiered
        return self.cache.build(capacity_tokens=capacity, policy=policy, sglang=self.sglang)

    @property
    def sglang(self) -> str:
        """The SGLang release whose rules the scheduler and the radix cache follow
        (``scheduler.sglang``; vLLM's scheduler has none: the default, which its block-hash
        cache does not read)."""
        return getattr(self.scheduler, "sglang", SGLANG_RELEASES[0])

    def build_cost_model(self):
        """The run's cost model (built once: cost models keep no state between steps)."""
        return self._cost_model

    @cached_property
    def _cost_model(self):
        return self.cost_model.build(model=self.model_shape, hw=self.hardware)

    def check_builds(self) -> None:
        """Build what needs no workload, so that a bad value in any group stops the run before
        one is generated: the eviction policy and the cache (which must take its capacity as
        ``capacity_tokens``; unbounded here: nothing allocated; the lower tiers' settings), the
        model, hardware and cost model of a backend that times steps (and, without
        ``cache.capacity_tokens``, the KV pool the hardware's memory leaves, except on CUDA where
        the engine measures it), and the router of replicas."""
        policy = self.build_policy([])
        if not self.cache.takes("capacity_tokens"):  # it would be built unlimited
            raise BadInput(f"cache={self.cache.label} takes no capacity_tokens: the run gives "
                           f"every cache its KV pool's size under that name (docs/extending.md)")
        if tier_options(self.config["cache"]) is None:  # tiers: their settings checked
            self.cache.build(capacity_tokens=None, policy=policy, sglang=self.sglang)
        if self.backend not in (REPLAY, SERVER):
            self.model_shape, self.hardware, self.mem_fraction  # noqa: B018 - parsed and checked
            if self.capacity_tokens is None and not (self.backend == "engine"
                                                     and self.engine_device.startswith("cuda")):
                self.kv_capacity()  # the KV pool the preset's memory leaves: the model must fit
            if self.engine.attention is None and self.backend != "engine":
                cascades(self.attention, key="hardware.attention")
            if self.backend == "engine":
                timing_settings(self.config, self.engine_device)
                check_kernels_run_here(self.attention, self.engine_device,
                                       self.model_shape.head_dim)
            else:  # a fit measured on the CPU predicts an engine timed as it was
                cost_model = self.build_cost_model()
                check_fit_timing(getattr(cost_model, "meta", None) or {}, self.config,
                                 self.config["cost_model"].get("path"))
                self.host_cost  # noqa: B018 - the host block checked
        if self.replicas > 1:
            self.cluster_delays()
            self.cluster_load_seen()
            self.build_router(None)

    def build_executor(self, capacity: int | None, requests: list[Request] | None = None):
        """The executor of ``backend`` for a KV pool of ``capacity`` tokens. The engine's None:
        on CUDA what free memory leaves after the weights load, elsewhere what the model leaves
        of the hardware preset's memory; either capped at what ``requests`` could ever hold."""
        c = self.config
        if self.executor is None:
            raise ValueError(f"backend={self.backend} has no executor")
        most = None if requests is None else \
            sum(r.most_kv_tokens for r in requests) + 1
        e = self.engine
        device = e.device
        if self.backend == "engine":
            device = self.engine_device
            if capacity is None and not device.startswith("cuda"):
                capacity = self.kv_capacity() if most is None else min(self.kv_capacity(), most)
        executor = self.executor.build(
            cost_model=Lazy(self.build_cost_model), model=c["model"], num_slots=capacity,
            max_slots=most, mem_fraction=self.mem_fraction, device=device, dtype=e.dtype,
            attention=self.attention, cascade_min_saved=e.cascade_min_saved,
            cascade_rule=Lazy(lambda: self.cascade_rule),
            cuda_graph=e.cuda_graph, cuda_graph_max_batch=e.cuda_graph_max_batch,
            cpu_kernels=e.cpu_kernels, seed=self.seed, forced=e.forced,
            temperature=e.temperature, top_p=e.top_p, host_cost=self.host_cost,
            speculative=self.speculative, requests=requests)
        if self.backend == "engine":  # threads and step clock as a calibration's (engine_timing)
            apply_timing(executor, *timing_settings(c, device))
        return executor

    @cached_property
    def host_cost(self):
        """The simulator's price of the host's work per step (the ``host`` block)."""
        from testbed.sim.overlap import HostCost
        return HostCost.from_config(self.config.get("host"))

    def build_router(self, kv_capacity: int | None):
        """The router of ``replicas`` (``max_tree_size`` null: a replica's KV capacity)."""
        return self.router.build(seed=self.seed, max_tree_size=kv_capacity)

    def cluster_delays(self) -> tuple[float, float]:
        return cluster_delays(self.config["router"])

    def cluster_load_seen(self) -> str:
        return cluster_load_seen(self.config["router"])
