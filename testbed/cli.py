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


def search_dirs(argv: list[str]) -> list[Path]:
    """Config folders added by ``hydra.searchpath=[file://DIR,...]`` (your own group files)."""
    dirs = []
    for arg in argv:
        key, _, value = arg.partition("=")
        if key.lstrip("+") == "hydra.searchpath":
            dirs += [Path(v.strip()[len("file://"):]) for v in value.strip("[]").split(",")
                     if v.strip().startswith("file://")]
    return dirs


def check_group_choices(argv: list[str], conf_dir: Path = CONF_DIR) -> None:
    """Exit with one line if an override picks an option a config group does not have (in
    ``conf/`` or a folder of ``hydra.searchpath``)."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    extra = search_dirs(argv)
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in groups:
            continue
        for choice in value.split(","):  # multirun lists
            options = sorted({*group_options(key, conf_dir),
                              *(o for d in extra if (d / key).is_dir()
                                for o in group_options(key, d))})
            if choice not in options:
                print(f"error: {key} must be one of {', '.join(options)}; got {choice!r}",
                      file=sys.stderr)
                sys.exit(2)
