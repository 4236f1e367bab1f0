"""Typed values out of a Hydra config group (a plain mapping), for the builders of specs.

`testbed.config.model_shape.ModelShape.from_group` and `testbed.sim.specs.hardware_spec` read their
groups through these, so a bad value stops a run with one line (`testbed.errors.BadInput`)
naming ``group.key`` and what is allowed: ``model.num_layers must be >= 1, got 0``. A key that is
absent or null takes the default, or is reported as required when there is none. ``group=""``
reads a top-level key of the run config (``temperature``).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from testbed.errors import BadInput

#: the default of a key that has none (it is required)
MISSING: Any = object()


def _float_hint(found: Any) -> str:
    """Why a number came as a string: YAML 1.1 wants a dot and a signed exponent for a float, so
    a user who wrote 312e12 gets the string '312e12'."""
    if isinstance(found, str):
        try:
            float(found)
        except ValueError:
            return ""
        return " (YAML reads 312e12 as a string: write 312.0e+12)"
    return ""


def _key(group: str, key: str) -> str:
    """``group.key``, or ``key`` alone for a top-level key of the run config (``group=""``)."""
    return f"{group}.{key}" if group else key


def value(cfg: Mapping[str, Any], key: str, group: str, default: Any = MISSING) -> Any:
    """``cfg[key]``; ``default`` when absent or null."""
    if not isinstance(cfg, Mapping):
        raise BadInput(f"{group} config must be a mapping, got {type(cfg).__name__}")
    found = cfg.get(key, MISSING)
    if found is MISSING or found is None:
        if default is MISSING:
            raise BadInput(f"{_key(group, key)} is required")
        return default
    return found


def name(cfg: Mapping[str, Any], group: str) -> str:
    """The group's ``name``: a non-empty string."""
    found = value(cfg, "name", group)
    if not isinstance(found, str) or not found:
        raise BadInput(f"{group}.name must be a non-empty string, got {found!r}")
    return found


def number(cfg: Mapping[str, Any], key: str, group: str, default: Any = MISSING) -> float:
    """A finite int or float (not a bool), as a float."""
    found = value(cfg, key, group, default)
    if isinstance(found, bool) or not isinstance(found, (int, float)) or not math.isfinite(found):
        raise BadInput(f"{_key(group, key)} must be a number, got {found!r}{_float_hint(found)}")
    return float(found)


def positive(cfg: Mapping[str, Any], key: str, group: str) -> float:
    """A required number > 0."""
    found = number(cfg, key, group)
    if found <= 0:
        raise BadInput(f"{_key(group, key)} must be > 0, got {found:g}")
    return found


def integer(cfg: Mapping[str, Any], key: str, group: str, minimum: int,
            default: Any = MISSING) -> int:
    """An int >= ``minimum`` (an integral float such as ``2.0`` from a command line counts)."""
    found = value(cfg, key, group, default)
    if isinstance(found, float) and found.is_integer():
        found = int(found)
    if isinstance(found, bool) or not isinstance(found, int):
        raise BadInput(f"{_key(group, key)} must be an integer >= {minimum}, got {found!r}")
    if found < minimum:
        raise BadInput(f"{_key(group, key)} must be >= {minimum}, got {found}")
    return found


#: what a config value must be for a parameter annotated with one of these (or ``X | None``)
SCALAR_KINDS = {"int": "an integer", "float": "a number", "bool": "true or false"}


def check_setting(key: str, annotation: Any, found: Any) -> Any:
    """``found``, the value of config key ``key`` for a parameter annotated ``annotation``: for
    ``int``, ``float`` and ``bool`` (also ``| None``) one of those or BadInput naming the key (an
    integral float for an ``int`` comes back as an int, as a command line's ``2.0``); null, and
    any other annotation, are the entry's to check."""
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    kind = kind.removesuffix(" | None")
    if found is None or kind not in SCALAR_KINDS:
        return found
    if kind == "int" and isinstance(found, float) and found.is_integer():
        found = int(found)
    types = {"int": int, "float": (int, float), "bool": bool}[kind]
    if not isinstance(found, types) or (kind != "bool" and isinstance(found, bool)):
        hint = _float_hint(found) if kind == "float" else ""
        raise BadInput(f"{key} must be {SCALAR_KINDS[kind]}, got {found!r}{hint}")
    return found
