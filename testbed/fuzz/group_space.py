"""The fuzzer's draws of the config groups other than the workload and the engine: cache,
eviction, scheduler, router, hardware, cost model and the simulator's host block, each option
with its keys (conf/GROUP/OPTION.yaml), and ``GROUP=custom GROUP.target=...`` naming a built-in
class by its import path (the path a user's own class takes, docs/extending.md).

Each key is drawn with some probability from a few values: the default, the edges of its range
(0, 1, tiny budgets) and sometimes a value the run must refuse in one line. The hardware and
cost-model presets are machines described by numbers: a drawn key of theirs is the preset's own
value scaled (`scaled`), so a key added to a preset is drawn from its first day.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from testbed.config.cli import CONF_DIR

Table = Sequence[tuple[str, Sequence[Any], float]]  # (key, values, probability of drawing it)

EVICTIONS = ["lru", "fifo", "filo", "gdsf", "learned", "lfu", "mru", "oracle", "priority",
             "size_aware", "slru", "tlru", "wlfu", "workload_aware"]
HITS = ["insert", "match", "none"]
EVICTION_KEYS: dict[str, Table] = {
    "learned": (("retrain_every", [1, 5, 500], 0.5), ("window", [8, 50, 20000], 0.5),
                ("horizon", [1, 10, 1000], 0.5), ("min_train", [1, 5, 1000], 0.6),
                ("max_depth", [1, 2, 6], 0.3), ("min_samples_leaf", [1, 5, 50], 0.3),
                ("scale", [1.0, 10.0, 5000.0], 0.3), ("seed", [0, 1], 0.2),
                ("refit", ["true", "false"], 0.2)),
    "lfu": (("hits", HITS, 0.6),),
    "size_aware": (("hits", HITS, 0.6),),
    "slru": (("protected_threshold", [0, 1, 2, 5], 0.5), ("hits", HITS, 0.5)),
    "tlru": (("threshold", [0, 4, 64], 0.7), ("next_prompt_estimate", [0, 8, 128], 0.7)),
    "wlfu": (("alpha", [0.0, 0.5, 2.0], 0.5), ("hits", HITS, 0.5)),
    "workload_aware": (("tau", [1.0, 100.0, 20000.0], 0.5),),
}
SCHEDULERS = ["fcfs", "lpm", "dfs_weight", "lof", "random", "hrrn"]
SCHEDULER_KEYS: Table = (
    ("sglang", ["0.5.23", "0.4.10"], 0.3),
    ("enable_priority_scheduling", ["true", "false"], 0.15),
    ("disable_priority_preemption", ["true", "false"], 0.1),
    ("priority_preemption_threshold", [0, 1, 10], 0.1),
    ("max_running_requests", [1, 2, 8, "null"], 0.2),
    ("max_prefill_tokens", [16, 64], 0.15),
    ("chunked_prefill_size", [16, 64, "null"], 0.3),
    ("lpm_fallback_threshold", [1, 2, 128], 0.1),
    ("in_batch_prefix_caching", ["true", "false"], 0.15),
    ("in_batch_check_threshold", [0, 4, 32], 0.1),
    ("in_batch_deprioritize_threshold", [0, 4, 32], 0.1),
    ("in_batch_hold", ["true", "false"], 0.2),
    ("lpm_aging", [0.0, 10.0, 1000.0], 0.2),
    ("overlap", ["true", "false"], 0.4),
    ("init_new_token_ratio", [0.0, 0.7, 1.0], 0.1),
    ("min_new_token_ratio_factor", [0.0, 0.14, 1.0], 0.1),
    ("new_token_ratio_decay_steps", [1, 600], 0.1),
    ("clip_max_new_tokens", [1, 4096], 0.1),
    ("retract_decode_steps", [1, 20], 0.1),
    ("retract_order", ["newest", "longest_prompt", "most_remaining"], 0.2))
ROUTERS = ["round_robin", "random", "least_load", "cache_aware", "oracle", "kv_events"]
BALANCE: Table = (("cache_threshold", [0.0, 0.5, 1.0], 0.3), ("load", ["requests", "tokens"], 0.3),
                  ("balance_abs_threshold", [0, 32], 0.2),
                  ("balance_rel_threshold", [1.0001, 2.0], 0.2),
                  ("tie_break", ["index", "fewest_sent"], 0.2))
ROUTER_KEYS: dict[str, Table] = {
    "cache_aware": (*BALANCE, ("fallback", ["least_load", "smallest_tree"], 0.3),
                    ("max_tree_size", ["null", 16, 256], 0.2),
                    ("eviction_interval_s", [0.0, 0.01, 60.0], 0.2),
                    ("update_on_complete", ["true", "false"], 0.2),
                    ("update_delay_s", [0.0, 0.01], 0.2)),
    "least_load": (("load", ["requests", "tokens"], 0.5),),
    "oracle": (*BALANCE, ("in_flight", ["true", "false"], 0.3)),
    # events reach the router a step or more after the cache changed, or at once
    "kv_events": (*BALANCE, ("in_flight", ["true", "false"], 0.3),
                  ("event_delay_s", [0.0, 0.01], 0.4)),
}
CLUSTER_KEYS: Table = (("network_delay_s", [0.0, 0.0005], 0.2),
                       ("transfer_s_per_token", [0.0, 4e-8], 0.2),
                       ("load_seen", ["progress", "stream", "null"], 0.3))
HOST_KEYS: Table = (("prefill_s", [0.0, 1e-3], 0.1), ("prefill_request_s", [0.0, 1e-4], 0.1),
                    ("prefill_token_s", [0.0, 1e-6], 0.1), ("decode_s", [0.0, 1e-3], 0.1),
                    ("decode_request_s", [0.0, 1e-4], 0.1), ("concurrent", ["true", "false"], 0.1))
# GROUP=custom GROUP.target=...: a built-in by its import path, as a user's class is named
CUSTOM_TARGETS = {
    # the built-ins' factories (which take capacity_tokens), and a class that does not: refused
    "cache": ["testbed.cache.radix", "testbed.cache.block_hash", "testbed.cache.none",
              "testbed.cache.NoCache"],
    "eviction": ["testbed.cache.eviction.LRU", "testbed.cache.eviction.GDSF",
                 "testbed.cache.eviction.SLRU"],
    "scheduler": ["testbed.scheduler.policy.FCFS", "testbed.scheduler.policy.LongestPrefixMatch",
                  "testbed.scheduler.policy.HighestResponseRatio"],
    "router": ["testbed.router.policies.RoundRobin", "testbed.router.policies.CacheAware"],
    "cost_model": ["testbed.sim.cost_model.RooflineCostModel"],
    "backend": ["testbed.sim.executor.SimExecutor"],
}
HARDWARE = ["a100", "a10g", "cpu", "h100", "h200"]
FITTED = ["conf/calibration/tiny_cpu.yaml", "conf/calibration/smollm2_135m_cpu.yaml"]
VIDUR_PROFILE = "data:vidur_a100_codellama34b_tp2"


def choice(rng: np.random.Generator, values: Sequence[Any]) -> Any:
    return values[int(rng.integers(len(values)))]


def keys_of(rng: np.random.Generator, prefix: str, table: Table) -> list[str]:
    """``prefix.KEY=VALUE`` (no prefix: ``KEY=VALUE``) for each key of ``table`` drawn, each
    with its probability."""
    out = []
    for key, values, p in table:
        if rng.random() < p:
            out.append(f"{prefix}.{key}={choice(rng, values)}" if prefix
                       else f"{key}={choice(rng, values)}")
    return out


def custom(rng: np.random.Generator, group: str) -> list[str]:
    return [f"{group}=custom", f"{group}.target={choice(rng, CUSTOM_TARGETS[group])}"]


@lru_cache(maxsize=None)
def preset(group: str, option: str) -> dict[str, Any]:
    """The keys of ``conf/GROUP/OPTION.yaml`` itself (its defaults list and name left out)."""
    data = yaml.safe_load((Path(CONF_DIR) / group / f"{option}.yaml").read_text()) or {}
    return {k: v for k, v in data.items() if k not in ("defaults", "name")}


def scaled(rng: np.random.Generator, group: str, option: str, p: float) -> list[str]:
    """Each numeric key of a preset, with probability ``p``, at its value times 0.001, 0.5 or 2
    (an integer at least 1; a utilisation or fraction: 0.5 or 1.0; null: 0.001 or 1e9), a
    boolean flipped."""
    out = []
    for key, value in preset(group, option).items():
        if rng.random() >= p or key.endswith(("path", "dir")) \
                or not isinstance(value, (int, float, type(None))):
            continue
        if isinstance(value, bool):
            out.append(f"{group}.{key}={str(not value).lower()}")
            continue
        if value is None:  # a time or a bandwidth the preset leaves to another
            new: Any = choice(rng, [1e-3, 1e9])
        elif (0 < value <= 1 and "fraction" in key) or key.endswith("mfu") or key == "mbu":
            new = choice(rng, [0.5, 1.0])
        else:
            new = value * choice(rng, [0.001, 0.5, 2.0])
            new = max(int(new), 1) if isinstance(value, int) else float(new)
        out.append(f"{group}.{key}={new}")
    return out


def cache_overrides(rng: np.random.Generator, backend: str) -> list[str]:
    """A cache and its keys (its capacity is drawn later, against the workload's requests)."""
    if rng.random() < 0.03:
        return custom(rng, "cache")
    kind = choice(rng, ["radix", "radix", "radix", "block_hash", "none"])
    out = [f"cache={kind}"]
    if kind == "radix":
        out.append(f"cache.page_size={choice(rng, [1, 1, 4, 16])}")
        out += keys_of(rng, "cache", (("evict_unit", ["node", "page"], 0.3),
                                      ("split_recency", ["refresh", "keep"], 0.3)))
        if rng.random() < 0.15:
            out += [f"cache.host_tokens={choice(rng, [16, 64, 512])}",
                    f"cache.disk_tokens={choice(rng, [0, 0, 256, 2048])}",
                    "cache.write_policy=" + choice(rng, ["write_through",
                                                         "write_through_selective", "write_back"]),
                    f"cache.load_back={choice(rng, ['cost', 'always'])}"]
            out += keys_of(rng, "cache", (
                ("write_threshold", [1, 2, 3], 0.4), ("host_eviction", EVICTIONS, 0.4),
                ("disk_eviction", EVICTIONS, 0.4), ("host_link", ["null", "pcie4", "pcie5"], 0.3),
                ("disk_link", ["nvme_pcie4", "nvme_pcie5"], 0.3)))
        reuse_p = 0.35 if backend == "engine" else 0.15
        if backend != "replay" and rng.random() < reuse_p:
            out += reuse_overrides(rng, out)
    elif kind == "block_hash":
        out.append(f"cache.block_size={choice(rng, [4, 16])}")
    if kind != "radix" and rng.random() < 0.05:  # radix only: refused in one line
        out += [f"cache.reuse={choice(rng, ['prefix', 'blend'])}",
                f"cache.match={choice(rng, ['exact', 'semantic'])}"]
    return out


def reuse_overrides(rng: np.random.Generator, radix: list[str]) -> list[str]:
    """Blend or semantic reuse, now and then both (refused: they are not combined); mostly on
    pages of one token (the only page size they take: ``radix``'s page size is set to it)."""
    mode = choice(rng, ["blend", "blend", "semantic", "both"])
    if mode != "both" and rng.random() < 0.9:
        radix[:] = [o for o in radix if not o.startswith("cache.page_size=")]
        radix.append("cache.page_size=1")
    return [f"cache.reuse={'prefix' if mode == 'semantic' else 'blend'}",
            f"cache.match={'exact' if mode == 'blend' else 'semantic'}",
            f"cache.recompute_ratio={choice(rng, [0.0, 0.15, 1.0])}",
            f"cache.chunk_boundaries={choice(rng, ['segments', '4'])}",
            *keys_of(rng, "cache", (("similarity_threshold", [0.0, 0.5, 0.9], 0.3),))]


def eviction_overrides(rng: np.random.Generator) -> list[str]:
    if rng.random() < 0.03:
        return custom(rng, "eviction")
    name = choice(rng, EVICTIONS)
    return [f"eviction={name}", *keys_of(rng, "eviction", EVICTION_KEYS.get(name, ()))]


def scheduler_overrides(rng: np.random.Generator) -> list[str]:
    """An SGLang-rule scheduler (a queue policy, or a built-in one by import path) and its
    settings."""
    out = custom(rng, "scheduler") if rng.random() < 0.03 else \
        [f"scheduler={choice(rng, SCHEDULERS)}"]
    return out + keys_of(rng, "scheduler", SCHEDULER_KEYS)


def vllm_overrides(rng: np.random.Generator) -> list[str]:
    """``scheduler=vllm`` with small budgets, so that prompts are chunked and steps mixed."""
    budget = int(choice(rng, [8, 16, 64, 2048]))
    out = ["scheduler=vllm", f"scheduler.max_num_batched_tokens={budget}",
           f"scheduler.max_num_seqs={min(budget, int(choice(rng, [1, 2, 8, 128])))}"]
    return out + keys_of(rng, "scheduler", (
        ("long_prefill_token_threshold", [0, 4], 0.3),
        ("scheduler_reserve_full_isl", ["true", "false"], 0.3),
        ("enable_chunked_prefill", ["true", "false"], 0.15)))


def router_overrides(rng: np.random.Generator) -> list[str]:
    """``replicas`` and a router in front of them, with the router's keys (the simulator)."""
    out = [f"replicas={int(rng.integers(2, 5))}"]
    if rng.random() < 0.05:
        out += custom(rng, "router")
    else:
        name = choice(rng, ROUTERS)
        out += [f"router={name}", *keys_of(rng, "router", ROUTER_KEYS.get(name, ()))]
    return out + keys_of(rng, "router", CLUSTER_KEYS)


def hardware_overrides(rng: np.random.Generator) -> list[str]:
    name = choice(rng, HARDWARE)
    out = [f"hardware={name}", *scaled(rng, "hardware", name, 0.08)]
    if name == "cpu" and rng.random() < 0.3:
        out.append(f"hardware.attention={choice(rng, ['torch', 'cascade', 'null'])}")
    return out


def cost_model_overrides(rng: np.random.Generator, vidur: bool) -> list[str]:
    """A cost model for the simulator; ``vidur``: Vidur's profile is in the data folder (then
    ``cost_model=vidur`` is drawn too, with the model and hardware it was measured on)."""
    u = rng.random()
    if u < 0.6:
        return []  # roofline, the default
    if u < 0.75:
        return ["cost_model=roofline", *scaled(rng, "cost_model", "roofline", 0.5)]
    if u < 0.85:
        name = choice(rng, ["fitted", "fitted_tiny_cpu", "fitted_smollm2_cpu"])
        out = [f"cost_model={name}"]
        if name == "fitted" or rng.random() < 0.2:
            out.append(f"cost_model.path={choice(rng, FITTED)}")
        if name == "fitted" and rng.random() < 0.3:
            out.append(f"cost_model.interconnect_bw={choice(rng, ['null', 1.0e9])}")
        return out
    if u < 0.95 or not vidur:
        return custom(rng, "cost_model")
    return ["cost_model=vidur", f"cost_model.profile_dir={VIDUR_PROFILE}", "model=codellama_34b",
            "hardware=a100", *scaled(rng, "cost_model", "vidur", 0.3)]


def host_overrides(rng: np.random.Generator) -> list[str]:
    """The simulator's price of the host's work per step."""
    return keys_of(rng, "host", HOST_KEYS)
