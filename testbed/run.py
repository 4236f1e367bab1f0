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

from testbed.cache import make_cache
from testbed.metrics import ideal_hit_rate, summarize
from testbed.replay import replay
from testbed.rundir import format_summary, write_run
from testbed.workloads import build_workload

BACKENDS = ("replay",)


def execute(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """Run one configuration and write its results; returns the summary."""
    started = time.perf_counter()
    backend = cfg.backend.name
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    requests = build_workload(OmegaConf.to_container(cfg.workload, resolve=True), seed=cfg.seed,
                              arrival=OmegaConf.to_container(cfg.arrival, resolve=True))
    c = cfg.cache
    cache = make_cache(c.name, capacity_tokens=c.get("capacity_tokens"),
                       page_size=c.get("page_size", 1), block_size=c.get("block_size", 16),
                       eviction=cfg.eviction.name)
    records = replay(requests, cache, save_token_ids=cfg.save_token_ids, progress=cfg.progress)
    ideal = ideal_hit_rate(requests)
    summary = summarize(records, ideal=ideal, wall_s=time.perf_counter() - started)
    summary |= {"backend": backend, "workload": cfg.workload.name, "cache": c.name,
                "eviction": cfg.eviction.name, "capacity_tokens": c.get("capacity_tokens")}
    write_run(run_dir, summary, records, config=OmegaConf.to_container(cfg, resolve=True))
    return summary


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        summary = execute(cfg, run_dir)
    except ValueError as e:  # bad config values and malformed traces: one clear line
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{summary['backend']} · workload={summary['workload']} · cache={summary['cache']} · "
          f"eviction={summary['eviction']} · capacity_tokens={summary['capacity_tokens']}")
    print(format_summary(summary))
    print(f"results in {run_dir}")


if __name__ == "__main__":
    main()
