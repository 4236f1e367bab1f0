"""The entry point: ``python -m testbed.run [overrides]`` (Hydra; ``-m`` sweeps).

Composes the config (``conf/``), builds the workload and the cache, runs the chosen backend, writes
``summary.json`` and ``requests.jsonl`` into the Hydra run directory and prints the summary. A bad
config value stops the run with one line naming the key and the allowed values.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from testbed.cli import check_group_choices

from testbed.cache import make_cache
from testbed.metrics import RequestRecord, ideal_hit_rate, summarize
from testbed.replay import replay
from testbed.rundir import format_summary, write_run
from testbed.workloads import Request, build_workload

BACKENDS = ("sim", "replay")


def _container(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def execute(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run one configuration and write its results; returns the summary."""
    started = time.perf_counter()
    backend = cfg.backend.name
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    requests = build_workload(_container(cfg.workload), seed=cfg.seed,
                              arrival=_container(cfg.arrival))
    extra: dict[str, Any] = {}
    if backend == "replay":
        records = replay(requests, _make_cache(cfg, cfg.cache.get("capacity_tokens")),
                         save_token_ids=cfg.save_token_ids, progress=cfg.progress)
        preemptions = 0
    else:
        records, preemptions, extra = _simulate(cfg, requests)
    summary = summarize(records, ideal=ideal_hit_rate(requests),
                        wall_s=time.perf_counter() - started, preemptions=preemptions)
    summary |= {"backend": backend, "workload": cfg.workload.name, "cache": cfg.cache.name,
                "eviction": cfg.eviction.name, "capacity_tokens": cfg.cache.get("capacity_tokens")}
    summary |= extra
    write_run(run_dir, summary, records, config=_container(cfg))
    return summary


def _make_cache(cfg: DictConfig, capacity: int | None):
    c = cfg.cache
    return make_cache(c.name, capacity_tokens=capacity, page_size=c.get("page_size", 1),
                      block_size=c.get("block_size", 16), eviction=cfg.eviction.name)


def max_in_flight(cfg: DictConfig) -> int | None:
    """Programs allowed at once: ``arrival.max_in_flight``, else the workload's own setting."""
    value = cfg.arrival.get("max_in_flight")
    return value if value is not None else cfg.workload.get("max_in_flight")


def _simulate(cfg: DictConfig, requests: list[Request]) -> tuple[list[RequestRecord], int, dict]:
    from testbed.sim.cost_model import make_cost_model
    from testbed.sim.executor import SimExecutor
    from testbed.sim.simulate import records_of, serve
    from testbed.sim.specs import hardware_spec, kv_capacity_tokens, mem_fraction, model_spec

    model, hw = model_spec(_container(cfg.model)), hardware_spec(_container(cfg.hardware))
    capacity = cfg.cache.get("capacity_tokens")
    if capacity is None:
        capacity = kv_capacity_tokens(model, hw, mem_fraction(_container(cfg.hardware)))
    executor = SimExecutor(make_cost_model(_container(cfg.cost_model), model, hw))
    scheduler, result = serve(requests, _make_cache(cfg, capacity), _container(cfg.scheduler),
                              executor, seed=cfg.seed, max_in_flight=max_in_flight(cfg),
                              progress=cfg.progress)
    s = result.stats
    extra = {"scheduler": cfg.scheduler.name, "model": model.name, "hardware": hw.name,
             "kv_capacity_tokens": capacity, "prefill_steps": s.prefill_steps,
             "decode_steps": s.decode_steps, "mean_decode_batch":
             s.decode_tokens / s.decode_steps if s.decode_steps else None, "busy_s": s.busy_s}
    return records_of(result.reqs, cfg.save_token_ids), scheduler.preemptions, extra


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = execute(cfg, run_dir)
    except ValueError as e:  # bad config values and malformed traces: one clear line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    head = [f"backend={summary['backend']}", f"workload={summary['workload']}",
            f"cache={summary['cache']}", f"eviction={summary['eviction']}"]
    if summary["backend"] != "replay":
        head += [f"scheduler={summary['scheduler']}", f"model={summary['model']}",
                 f"hardware={summary['hardware']}",
                 f"kv_capacity_tokens={summary['kv_capacity_tokens']}"]
    else:
        head.append(f"capacity_tokens={summary['capacity_tokens']}")
    print(" · ".join(head))
    print(format_summary(summary))
    print(f"results in {run_dir}")


if __name__ == "__main__":
    check_group_choices(sys.argv[1:])
    main()
