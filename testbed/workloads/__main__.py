"""``python -m testbed.workloads [overrides]``: describe (and with ``save=FILE`` save) a workload."""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from testbed.config.assembly import assemble
from testbed.config.cli import check_group_choices, exit_on_bad_input
from testbed.workloads import save_tokens
from testbed.workloads.describe import describe, format_table


@hydra.main(version_base=None, config_path="../../conf", config_name="describe")
def main(cfg: DictConfig) -> None:
    with exit_on_bad_input():
        requests = assemble(cfg).requests()
    print(f"workload={cfg.workload.name} seed={cfg.seed}")
    print(format_table(describe(requests)))
    if cfg.save:
        save_tokens(requests, cfg.save)
        print(f"saved {len(requests)} requests to {cfg.save}")


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], name="describe")
    main()
