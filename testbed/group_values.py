"""Typed values out of a Hydra config group (a plain mapping), for the builders of specs.

`testbed.model_shape.ModelShape.from_group` and `testbed.sim.specs.hardware_spec` read their
groups through these, so a bad value stops a run with one line naming ``group.key`` and what is
allowed: ``model.num_layers must be >= 1, got 0``. A key that is absent or null takes the default,
or is reported as required when there is none.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

#: the default of a key that has none (it is required)
MISSING: Any = object()


def value(cfg: Mapping[str, Any], key: str, group: str, default: Any = MISSING) -> Any:
    """``cfg[key]``; ``default`` when absent or null."""
    if not isinstance(cfg, Mapping):
        raise ValueError(f"{group} config must be a mapping, got {type(cfg).__name__}")
    found = cfg.get(key, MISSING)
    if found is MISSING or found is None:
        if default is MISSING:
            raise ValueError(f"{group}.{key} is required")
        return default
    return found


def name(cfg: Mapping[str, Any], group: str) -> str:
    """The group's ``name``: a non-empty string."""
    found = value(cfg, "name", group)
    if not isinstance(found, str) or not found:
        raise ValueError(f"{group}.name must be a non-empty string, got {found!r}")
    return found


def number(cfg: Mapping[str, Any], key: str, group: str, default: Any = MISSING) -> float:
    """A finite int or float (not a bool), as a float."""
    found = value(cfg, key, group, default)
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
        # YAML 1.1 wants a dot and a signed exponent for a float; a user who wrote 312e12 gets a str
        hint = " (YAML reads 312e12 as a string: write 312.0e+12)" if isinstance(found, str) else ""
        raise ValueError(f"{group}.{key} must be a number, got {found!r}{hint}")
    return float(found)


def positive(cfg: Mapping[str, Any], key: str, group: str) -> float:
    """A required number > 0."""
    found = number(cfg, key, group)
    if found <= 0:
        raise ValueError(f"{group}.{key} must be > 0, got {found:g}")
    return found


def integer(cfg: Mapping[str, Any], key: str, group: str, minimum: int,
            default: Any = MISSING) -> int:
    """An int >= ``minimum`` (an integral float such as ``2.0`` from a command line counts)."""
    found = value(cfg, key, group, default)
    if isinstance(found, float) and found.is_integer():
        found = int(found)
    if isinstance(found, bool) or not isinstance(found, int):
        raise ValueError(f"{group}.{key} must be an integer >= {minimum}, got {found!r}")
    if found < minimum:
        raise ValueError(f"{group}.{key} must be >= {minimum}, got {found}")
    return found
