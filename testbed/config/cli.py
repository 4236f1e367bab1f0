"""Command-line helpers shared by the entry points: one clear line for a bad override.

Hydra reports an unknown option of a config group (``scheduler=sjf``) or an unknown key
(``cache.capacity=100``) over several lines; users' sweeps and scripts are better served by
``error: scheduler must be one of ...; got 'sjf'`` and exit status 2, before Hydra starts
(`testbed.config.overrides`).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from testbed.errors import BadInput
from testbed.config.overrides import CONF_DIR, check_overrides, group_options, search_dirs

__all__ = ["CONF_DIR", "check_group_choices", "exit_on_bad_input", "group_options", "search_dirs"]


@contextmanager
def exit_on_bad_input() -> Iterator[None]:
    """Refused input raised inside (`BadInput`) prints its one ``error:`` line and exits with
    status 2; anything else is a defect and goes on (its traceback, exit status 1)."""
    try:
        yield
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR, name: str = "config"
                        ) -> None:
    """Exit with one line (status 2) if an override picks an option a config group does not
    have (in ``conf/`` or a folder of ``hydra.searchpath``) or sets a key the config ``NAME``
    (``conf/NAME.yaml``) does not have."""
    with exit_on_bad_input():
        check_overrides(argv, name, conf_dir)
