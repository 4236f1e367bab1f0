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

from testbed.cache import make_cache, make_policy
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
        records = replay(requests, _make_cache(cfg, cfg.cache.get("capacity_tokens"), requests),
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


def _make_cache(cfg: DictConfig, capacity: int | None, requests: list[Request]):
    c = cfg.cache
    policy = make_policy(_container(cfg.eviction), requests, cost_fn=_recompute_cost(cfg))
    return make_cache(c.name, capacity_tokens=capacity, page_size=c.get("page_size", 1),
                      block_size=c.get("block_size", 16), policy=policy)


def _recompute_cost(cfg: DictConfig):
    """Seconds to recompute ``size`` tokens after ``start`` cached ones (the GDSF policy's cost):
    the roofline floor of that prefill on the configured model and hardware."""
    from testbed.sim.cost_model import RooflineCostModel, StepShape
    from testbed.sim.specs import hardware_spec, model_spec

    floor = RooflineCostModel(model_spec(_container(cfg.model)),
                              hardware_spec(_container(cfg.hardware))).floor
    return lambda start, size: floor(StepShape(new=(max(size, 1),), context=(start,)))


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
    scheduler, result = serve(requests, _make_cache(cfg, capacity, requests), _container(cfg.scheduler),
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
    """One run. In a sweep (``-m``) a run whose directory already has ``summary.json`` is
    skipped, and a failing run is recorded in ``failed.json`` while the sweep goes on; a single
    run records the failure too and exits non-zero (2 for a bad value, 1 otherwise)."""
    import json
    import traceback

    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweeping = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    done = run_dir / "summary.json"
    if sweeping and done.is_file():  # skip it if it ran this very config (progress aside)
        try:
            same = {**json.loads(done.read_text()).get("config", {}), "progress": None} == \
                {**_container(cfg), "progress": None}
        except Exception:  # unreadable summary, unresolvable config: run it again
            same = False
        if same:
            print(f"skip: {run_dir} already has summary.json")
            return
        print(f"rerun: {run_dir} has a summary.json of another config; replacing it")
        for stale in (done, run_dir / "requests.jsonl"):
            stale.unlink(missing_ok=True)
    failed = run_dir / "failed.json"
    try:
        summary = execute(cfg, run_dir)
    except Exception as e:  # recorded for the report; a sweep goes on with its other runs
        try:
            config = _container(cfg)
        except Exception:  # an unresolvable interpolation: the overrides still say what ran
            config = None
        run_dir.mkdir(parents=True, exist_ok=True)
        failed.write_text(json.dumps({
            "error_type": type(e).__name__, "message": str(e),
            "traceback": traceback.format_exc(), "overrides": overrides, "config": config},
            indent=2) + "\n")
        bad_value = isinstance(e, ValueError)  # bad config values, malformed traces: one line
        what = str(e) if bad_value else f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        if sweeping:
            print(f"error: {what} [{' '.join(overrides)}]; recorded in {failed}", file=sys.stderr)
            return
        print(f"error: {what}" if bad_value else f"error: run failed with {what}; see {failed}",
              file=sys.stderr)
        sys.exit(2 if bad_value else 1)
    failed.unlink(missing_ok=True)  # an earlier failure of this run, now superseded
    if sweeping:
        span = summary["makespan_s"]
        print(f"done: {' '.join(overrides)} · hit_rate {summary['hit_rate']:.4g}"
              + (f" · makespan_s {span:.4g}" if span is not None else "") + f" · {run_dir}")
        return
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
