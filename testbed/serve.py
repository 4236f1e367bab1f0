"""The server entry point: ``python -m testbed.serve [overrides] serve.host=H serve.port=P``.

Composes ``conf/serve.yaml`` (the run config with ``backend=engine`` and a ``serve`` block),
checks every value (`testbed.api.settings.assemble_serve`), builds the engine and serves the
OpenAI-compatible API until SIGINT or SIGTERM (`testbed.api`). Refused input prints one
``error:`` line and exits 2, as ``python -m testbed.run`` does.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from testbed.config.cli import check_group_choices, exit_on_bad_input


@hydra.main(version_base=None, config_path="../conf", config_name="serve")
def main(cfg: DictConfig) -> None:
    from testbed.api.server import serve_forever
    from testbed.api.settings import assemble_serve

    with exit_on_bad_input():
        run, settings = assemble_serve(cfg)
        serve_forever(run, settings)


if __name__ == "__main__":
    check_group_choices(sys.argv[1:], name="serve")
    main()
