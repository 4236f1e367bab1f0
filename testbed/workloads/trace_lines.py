"""Reading a JSON-lines trace: its records, line by line, and their typed fields, every refusal a
`TraceError` that names the file and the line (``PATH:LINE: what is wrong``).

The token trace (`traces.py`) and the Mooncake and Bailian traces (`production_traces.py`) read
their files through these; what each field means is the loader's business.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE
from testbed.workloads.trace_format import TraceError, require_file


def json_records(path: Path) -> Iterator[tuple[int, dict]]:
    """Each non-blank line's JSON object with its line number (from 1)."""
    require_file(path)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte "
                                 f"{e.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            except RecursionError:  # json's parser recurses once per level of nesting
                raise TraceError(f"{path}:{lineno}: not valid JSON (nested too deeply)") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, record


def field(record: dict, name: str, kind: type | tuple, where: str):
    """``record[name]``, which must be present and of ``kind`` (a bool is no number)."""
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    return value


def seconds(record: dict, name: str, where: str, default: float | None = None) -> float:
    """A finite number >= 0 (``default`` when absent, if one is given)."""
    if default is not None and name not in record:
        return default
    value = field(record, name, (int, float), where)
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a number >= 0, got {value!r}")
    return float(value)


def token_ids(items: list, where: str) -> np.ndarray:
    """A JSON list of token ids as the project's dtype, each an integer in [0, 2^31); ``where``
    names the list (``PATH:LINE: prompt``) in the message, which names the first bad item."""
    top = np.iinfo(TOKEN_DTYPE).max
    if set(map(type, items)) <= {int}:  # the usual case, checked at numpy's speed
        if not items or (min(items) >= 0 and max(items) <= top):
            return np.asarray(items, dtype=TOKEN_DTYPE)
        i = next(i for i, x in enumerate(items) if not 0 <= x <= top)
        raise TraceError(f"{where}: token ids must lie in [0, 2^31), got {items[i]} at "
                         f"position {i}")
    i, x = next((i, x) for i, x in enumerate(items) if type(x) is not int)
    # a bool, a float, a string, a list, an object: none of them is a token id
    raise TraceError(f"{where}: token ids must be integers, got {json.dumps(x)[:40]} at "
                     f"position {i}")
