"""Trace loaders and the token-trace writer (DESIGN.md §3 formats).

- ``tokens``: JSONL ``{"prompt": [ints], "output": [ints]}`` with optional ``id``, ``arrival_s``,
  ``program``, ``after``; read and written, so any workload can be saved and replayed.
- ``mooncake``: FAST'25 JSONL with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (chained hashes of 512-token blocks). Block id ``b`` becomes the 512 tokens
  ``b*512 .. b*512+511`` (distinct, determined by ``b`` alone); the last block is cut to the remainder
  of ``input_length``; output tokens are fresh ids above every block token, unique per request.

Malformed input raises ``TraceError`` naming the file, the line and what is wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE, Request, as_tokens

MOONCAKE_BLOCK = 512


class TraceError(ValueError):
    """A trace file that cannot be read; the message names file and line."""


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
    if not path.is_file():
        raise TraceError(f"workload.path: no such file: {path}")
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{lineno}: expected a JSON object")
            yield lineno, record


def _field(record: dict, name: str, kind: type | tuple, where: str):
    if name not in record:
        raise TraceError(f"{where}: missing field {name!r}")
    value = record[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceError(f"{where}: field {name!r} has the wrong type ({type(value).__name__})")
    return value


def load_tokens(path: str | Path) -> list[Request]:
    """Read a token trace (DESIGN.md §3)."""
    path = Path(path)
    requests = []
    for lineno, rec in _json_lines(path):
        where = f"{path}:{lineno}"
        try:
            prompt = as_tokens(_field(rec, "prompt", list, where), f"{where}: prompt")
            if "output" in rec:
                output = as_tokens(_field(rec, "output", list, where), f"{where}: output")
            elif "max_new_tokens" in rec:
                # Generate mode belongs to the engine; replay needs concrete output ids.
                raise TraceError(f"{where}: 'max_new_tokens' without 'output' needs the engine "
                                 "backend; replay needs concrete output ids")
            else:
                raise TraceError(f"{where}: missing field 'output'")
        except ValueError as e:
            raise TraceError(str(e)) from None
        arrival = rec.get("arrival_s", 0.0)
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool) or arrival < 0:
            raise TraceError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
        after = rec.get("after", [])
        if not isinstance(after, list):
            raise TraceError(f"{where}: 'after' must be a list of ids")
        requests.append(Request(
            id=str(rec.get("id", len(requests))), prompt=prompt, output=output,
            arrival_s=float(arrival), program=rec.get("program"), after=[str(a) for a in after],
        ))
    return requests


def save_tokens(requests: list[Request], path: str | Path) -> None:
    """Write requests as a token trace that `load_tokens` reads back identically."""
    with Path(path).open("w") as f:
        for r in requests:
            rec = {"id": r.id, "arrival_s": r.arrival_s, "prompt": r.prompt.tolist(),
                   "output": r.output.tolist()}
            if r.program is not None:
                rec["program"] = r.program
            if r.after:
                rec["after"] = r.after
            f.write(json.dumps(rec) + "\n")


def load_mooncake(path: str | Path) -> list[Request]:
    """Read a Mooncake FAST'25 trace; token ids are made from the block hashes (module docstring)."""
    path = Path(path)
    rows = []
    for lineno, rec in _json_lines(path):
        where = f"{path}:{lineno}"
        ts = _field(rec, "timestamp", (int, float), where)
        n_in = _field(rec, "input_length", int, where)
        n_out = _field(rec, "output_length", int, where)
        blocks = _field(rec, "hash_ids", list, where)
        if n_in < 0 or n_out < 0:
            raise TraceError(f"{where}: lengths must be >= 0")
        if len(blocks) != -(-n_in // MOONCAKE_BLOCK):
            raise TraceError(f"{where}: {len(blocks)} hash_ids for input_length {n_in} "
                             f"(expected ceil({n_in}/{MOONCAKE_BLOCK}))")
        if not all(isinstance(b, int) and b >= 0 for b in blocks):
            raise TraceError(f"{where}: hash_ids must be non-negative integers")
        rows.append((lineno, ts, n_in, n_out, blocks))
    top_block = max((max(b) for *_, b in rows if b), default=-1)
    next_fresh = (top_block + 1) * MOONCAKE_BLOCK  # output ids live above every block's tokens
    if next_fresh + sum(r[3] for r in rows) > np.iinfo(TOKEN_DTYPE).max:
        raise TraceError(f"{path}: hash ids too large to map to 32-bit token ids")
    offsets = np.arange(MOONCAKE_BLOCK, dtype=TOKEN_DTYPE)
    requests = []
    for lineno, ts, n_in, n_out, blocks in rows:
        starts = np.asarray(blocks, dtype=TOKEN_DTYPE) * MOONCAKE_BLOCK
        prompt = (starts[:, None] + offsets[None, :]).reshape(-1)[:n_in]
        output = np.arange(next_fresh, next_fresh + n_out, dtype=TOKEN_DTYPE)
        next_fresh += n_out
        requests.append(Request(id=str(len(requests)), prompt=prompt, output=output,
                                arrival_s=ts / 1000.0))
    return requests


TRACE_FORMATS: dict[str, Callable[[str | Path], list[Request]]] = {
    "tokens": load_tokens,
    "mooncake": load_mooncake,
}


def load_trace(path: str | Path, fmt: str) -> list[Request]:
    try:
        loader = TRACE_FORMATS[fmt]
    except KeyError:
        raise ValueError(f"workload.format must be one of {', '.join(TRACE_FORMATS)}; "
                         f"got {fmt!r}") from None
    return loader(path)
