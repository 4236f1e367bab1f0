"""The one assembly step: a composed run config in, the checked plan of a run out.

`assemble(cfg)` reads the config once (Hydra's ``DictConfig`` or a plain mapping): it resolves the
model group (``model.path=DIR``), fits a generated workload's vocabulary to the served model, checks
every family's choice against its registry (testbed/config/registry.py: the workload, the cache and
its eviction policy, the scheduler and its queue policy, the router, the cost model and the
executor), checks the run keys (seed, replicas, timeline, debug, arrival, programs in flight) and
the combinations a backend cannot serve (replicas × backend, lower tiers, reuse beyond prefixes),
and builds once what needs no workload (`Assembly.check_builds`). A bad name, value or combination,
a key an entry does not take, or a user class without the family's methods stops the run there, in
one line, before anything is generated. The `Assembly` it returns (testbed/config/builders.py)
builds the objects: ``requests()``, ``build_cache(...)``, ``build_executor(...)``,
``build_router(...)``, ``build_cost_model()``. `testbed.execute`, `testbed.calibrate`, `testbed.viz` and the experiments
all build through it; scripts compose a config as the command line does with `compose_config`.
"""

from __future__ import annotations

from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from testbed.cache import CACHES, EVICTION, ReuseConfig
from testbed.cache.tier_config import has_lower_tiers
from testbed.config import group_values
from testbed.config.backend_limits import REPLAY, SERVER, check_replicas, check_server
from testbed.config.builders import Assembly
from testbed.config.engine_config import EngineConfig
from testbed.config.group_values import check_setting
from testbed.config.model_group import resolve_model_group
from testbed.config.overrides import compose_config  # noqa: F401 - for scripts (re-exported)
from testbed.config.registry import CUSTOM, group_label
from testbed.errors import BadInput, check_choice
from testbed.router import ROUTERS
from testbed.scheduler.speculative import SpeculativeConfig, check_draft_layers, \
    check_speculative, check_tree
from testbed.scheduler.vllm_config import check_vllm_cache, scheduler_config
from testbed.serving.executor import EXECUTORS
from testbed.sim.acceptance import load_recorded
from testbed.sim.cost_model import COST_MODELS
from testbed.workloads import WORKLOADS
from testbed.workloads.arrivals import Arrival


def plain(node: Any) -> Any:
    """A config node as plain Python values (interpolations resolved); an interpolation that does
    not resolve is BadInput naming its key."""
    if not isinstance(node, DictConfig):
        return node
    try:
        return OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None)
        what = str(getattr(e, "msg", None) or e).strip().splitlines()[0]
        raise BadInput(f"{key}: {what}" if key else what) from None


def check_device(device: Any) -> None:
    """The engine's ``device``, checked before anything loads: a CUDA device torch cannot see is
    refused in one line (the engine would otherwise load the model first)."""
    if device is None or not str(device).startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise BadInput(f"device={device}: torch sees no CUDA device on this machine; use "
                       "device=cpu (or leave device unset: CUDA where present, else the CPU)")
    index = str(device).partition(":")[2]
    if index and (not index.isdigit() or int(index) >= count):
        raise BadInput(f"device={device}: torch sees {count} CUDA device(s), cuda:0 to "
                       f"cuda:{count - 1}; use one of them")


def fit_vocabulary(config: dict[str, Any]) -> str | None:
    """Where a model reads the token ids (the engine; a live server, whose model the ``model``
    group names), a generated workload's ids must exist in the model's vocabulary: shrink
    ``workload.vocab_size`` to the model's. Returns a note when it did."""
    vocab = config["model"].get("vocab_size")
    wanted = config["workload"].get("vocab_size")
    if config["backend"].get("name") not in ("engine", SERVER) or vocab is None \
            or wanted is None or wanted <= vocab:
        return None
    config["workload"]["vocab_size"] = vocab
    return f"note: workload.vocab_size {wanted} > model vocabulary {vocab}; using {vocab}"


def programs_in_flight(config: dict[str, Any], arrival: Arrival) -> int | None:
    """Programs allowed at once: ``arrival.max_in_flight``, else the workload's own."""
    if arrival.max_in_flight is not None:
        return arrival.max_in_flight
    value = check_setting("workload.max_in_flight", "int",
                          config["workload"].get("max_in_flight"))
    if value is not None and value < 1:
        raise BadInput(f"workload.max_in_flight must be >= 1 or null, got {value}")
    return value


def assemble(cfg: DictConfig | Mapping[str, Any]) -> Assembly:
    """Read and check a composed run config (module docstring)."""
    config = dict(plain(cfg))
    for group in ("backend", "workload", "cache", "eviction", "scheduler", "model", "hardware",
                  "cost_model", "router"):
        found = config.get(group) or {}
        if not isinstance(found, Mapping):
            raise BadInput(f"{group} must be a config group (a mapping), got {found!r}")
        config[group] = dict(found)
    backend = config["backend"].get("name")
    engine = EngineConfig.from_config(config)
    if backend == "engine":
        check_device(engine.device)
    # the simulator and replay price or ignore the preset's shape: no model download for them
    config["model"] = resolve_model_group(config["model"],
                                          need_checkpoint=backend not in ("sim", REPLAY, SERVER))
    if backend in (REPLAY, SERVER):
        executor = None
    else:
        check_choice("backend", backend, [*EXECUTORS, REPLAY, SERVER, CUSTOM])
        executor = EXECUTORS.resolve(config["backend"])
    group_values.integer(config, "seed", "", minimum=0, default=0)
    group_values.integer(config, "replicas", "", minimum=1, default=1)
    capacity = config["cache"].get("capacity_tokens")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)
                                 or capacity < 0):
        raise BadInput(f"cache.capacity_tokens must be >= 0 or null, got {capacity!r}")
    if capacity == 0 and backend == "engine":
        raise BadInput("cache.capacity_tokens=0 leaves the engine no KV slot: it needs >= 1 (null: "
                       "what the workload can use)")
    debug = config.get("debug") or {}
    if not isinstance(debug, dict) or set(debug) - {"check_invariants"}:
        raise BadInput(f"debug takes only check_invariants (true or false), got {debug!r}")
    check_setting("debug.check_invariants", "bool", debug.get("check_invariants"))
    notes = [note] if (note := fit_vocabulary(config)) else []
    c = config["cache"]
    reuse = ReuseConfig.from_mapping(c)
    reuse.check_cache(c.get("target") or c.get("name"), c.get("page_size") or 1,
                      has_lower_tiers(c))
    if reuse.active and backend == REPLAY:
        raise BadInput("cache.reuse=blend / cache.match=semantic need backend=sim or engine "
                       "(replay has no prefill steps to reuse KV in)")
    check_replicas(config, backend, reuse)
    check_vllm_cache(scheduler_config(config["scheduler"]), c.get("target") or c.get("name"),
                     reuse.active)
    timeline = check_setting("timeline", "bool", config.get("timeline")) or False
    if timeline and backend == REPLAY:
        raise BadInput("timeline=true needs backend=sim or backend=engine (replay has no time)")
    server = check_server(config, backend, reuse, timeline)
    speculative = SpeculativeConfig.from_mapping(config.get("speculative"))
    check_speculative(speculative, scheduler_config(config["scheduler"]), backend,
                      config.get("replicas") or 1)
    if backend == "engine":
        check_draft_layers(speculative, config["model"].get("num_layers"))
    if backend == "sim" and speculative.active and speculative.acceptance == "recorded":
        load_recorded(speculative.acceptance_path)  # its file read and checked now, not at the run
    if speculative.active and engine.temperature > 0 and engine.top_p < 1:
        raise BadInput(f"speculative.method={speculative.method} samples by the rejection rule "
                       f"over the whole distribution: engine.top_p must be 1 with temperature "
                       f"> 0; got top_p={engine.top_p}")
    arrival = Arrival.from_mapping(config.get("arrival"),
                                   is_trace=config["workload"].get("name") == "trace")
    run = Assembly(
        config=config, backend=group_label(config["backend"]),
        workload=WORKLOADS.resolve(config["workload"]),
        eviction=EVICTION.resolve(config["eviction"]),
        cache=CACHES.resolve(config["cache"]),
        scheduler=scheduler_config(config["scheduler"]),
        router=ROUTERS.resolve(config["router"]),
        cost_model=COST_MODELS.resolve(config["cost_model"]),
        executor=executor, notes=notes, reuse=reuse, timeline=timeline, arrival=arrival,
        max_in_flight=programs_in_flight(config, arrival),
        max_concurrency=arrival.max_concurrency, server=server, engine=engine,
        speculative=speculative)
    check_tree(speculative, c.get("target") or c.get("name"), c.get("page_size") or 1,
               run.attention if backend == "engine" else None, engine.temperature)
    run.check_builds()
    return run

