"""The live router's entry point: ``python -m testbed.route [overrides]``.

Composes ``conf/route.yaml`` (the run config with a ``route`` block), checks it
(`testbed.gateway.settings.assemble_route`), starts ``replicas`` local ``testbed.serve`` when
``route.urls`` names none, and routes with the ``router`` group's policy until SIGINT or SIGTERM
(`testbed.gateway`; docs/design.md §3 "Routing live"). Refused input prints one ``error:`` line
and exits 2.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from testbed.config.cli import check_group_choices, exit_on_bad_input


@hydra.main(version_base=None, config_path="../conf", config_name="route")
def main(cfg: DictConfig) -> None:
    from testbed.gateway.launch import route_forever
    from testbed.gateway.settings import assemble_route, replica_overrides

    with exit_on_bad_input():
        route_forever(assemble_route(cfg), replica_overrides(sys.argv[1:]))


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], name="route")
    main()
