"""Command-line helpers shared by the entry points: one clear line for a bad group choice.

Hydra reports an unknown option of a config group (``scheduler=sjf``) over several lines; users'
sweeps and scripts are better served by ``error: scheduler must be one of ...; got 'sjf'``.
"""

from __future__ import annotations

import sys
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


def group_options(group: str, conf_dir: Path = CONF_DIR) -> list[str]:
    """The selectable options of a config group (files starting with ``_`` are building blocks)."""
    return sorted(p.stem for p in (conf_dir / group).glob("*.yaml") if not p.stem.startswith("_"))


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit with one line if an override picks an option a config group does not have."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in groups:
            continue
        for choice in value.split(","):  # multirun lists
            options = group_options(key, conf_dir)
            if choice not in options:
                print(f"error: {key} must be one of {', '.join(options)}; got {choice!r}",
                      file=sys.stderr)
                sys.exit(2)
