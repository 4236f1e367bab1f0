"""Trace loaders and the token-trace writer (docs/design.md §3 formats).

- ``tokens``: JSONL ``{"prompt": [ints], "output": [ints]}`` with optional ``id``, ``arrival_s``,
  ``program``, ``after``, ``think_time_s``, ``priority``; read and written, so any workload can be
  saved and replayed. ``"max_new_tokens": N`` instead of ``output`` makes the engine generate
  (``"beam_width": W`` too: by beam search); a prompt item ``{"output": "ID"}`` splices in call
  ID's output (the real one when generating; a beam call's best sequence).
- ``mooncake``: FAST'25 JSONL with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (chained hashes of 512-token blocks). Block id ``b`` becomes the 512 tokens
  ``b*512 .. b*512+511`` (distinct, determined by ``b`` alone); the last block is cut to the remainder
  of ``input_length``; output tokens are fresh ids above every block token, unique per request.
- ``bailian``: the Qwen/Alibaba Bailian trace (ATC'25, "KVCache Cache in the Wild"): like mooncake
  with 16-token blocks, ``timestamp`` in seconds, and conversation links (``chat_id``,
  ``parent_chat_id``) that become ``after`` dependencies and programs.
- ``azure``: the Azure LLM inference 2023 CSV (Splitwise): arrival times and lengths only, so every
  token is fresh and nothing is shared.
- ``sharegpt``: ShareGPT conversations tokenized with a local HF tokenizer (`sharegpt.py`).

The format table (`TRACE_FORMATS`, each format's options) and ``TraceError`` are in
``trace_format.py``, shared with ``sharegpt.py``. Malformed input raises ``TraceError`` naming the
file, the line and what is wrong.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from testbed.data import resolve_trace
from testbed.errors import BadInput
from testbed.workloads.request import (TOKEN_DTYPE, OutputRef, Request, as_tokens,
                                       fresh_token_ids, materialize)
from testbed.workloads.sharegpt import load_sharegpt
from testbed.workloads.trace_format import TRACE_FORMATS, TRACE_OPTIONS, TraceError, require_file

__all__ = ["TRACE_FORMATS", "TRACE_OPTIONS", "TraceError", "load_azure", "load_bailian",
           "load_mooncake", "load_sharegpt", "load_tokens", "load_trace", "save_tokens"]

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _json_lines(path: Path) -> Iterator[tuple[int, dict]]:
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


def _seconds(record: dict, name: str, where: str, default: float | None = None) -> float:
    """A finite number >= 0 (``default`` when absent, if one is given)."""
    if default is not None and name not in record:
        return default
    value = _field(record, name, (int, float), where)
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a number >= 0, got {value!r}")
    return float(value)


def _prompt(rec: dict, where: str, outputs: dict[str, np.ndarray], after: set[str]
            ) -> tuple[np.ndarray, tuple | None]:
    """The prompt and, when it splices in earlier calls' outputs (items ``{"output": ID}``), its
    segments: the engine rebuilds it from the real outputs; here they are the trace's (empty for
    a call that generates)."""
    items = _field(rec, "prompt", list, where)
    if not any(isinstance(x, dict) for x in items):
        return as_tokens(items, f"{where}: prompt"), None
    segments, run = [], []
    for x in items:
        if not isinstance(x, dict):
            run.append(x)
            continue
        call = x.get("output")
        if set(x) != {"output"} or not isinstance(call, str):
            raise TraceError(f'{where}: a prompt item that is not a token id must be '
                             f'{{"output": "ID"}}, got {json.dumps(x)}')
        if call not in after or call not in outputs:
            raise TraceError(f"{where}: the prompt splices in the output of {call!r}, which must "
                             "be an earlier line that this one waits for ('after')")
        segments += [as_tokens(run, f"{where}: prompt"), OutputRef(call)]
        run = []
    segments.append(as_tokens(run, f"{where}: prompt"))
    segments = tuple(s for s in segments if isinstance(s, OutputRef) or len(s))
    return materialize(segments, outputs), segments


def load_tokens(path: str | Path) -> list[Request]:
    """Read a token trace (docs/design.md §3). A line with ``max_new_tokens`` instead of
    ``output`` is a call the model generates (engine backend only); a prompt may splice in an
    earlier call's whole output as ``{"output": "ID"}`` (ID in its ``after``)."""
    path = Path(path)
    requests = []
    outputs: dict[str, np.ndarray] = {}
    waits_for: dict[str, set[str]] = {}  # id -> every earlier call it waits for, transitively
    for lineno, rec in _json_lines(path):
        where = f"{path}:{lineno}"
        after = rec.get("after", [])
        if not isinstance(after, list):
            raise TraceError(f"{where}: 'after' must be a list of ids")
        after = [str(a) for a in after]
        waits = set(after).union(*(waits_for.get(a, set()) for a in after))
        max_new = None
        try:
            prompt, segments = _prompt(rec, where, outputs, waits)
            if "output" in rec and "max_new_tokens" in rec:
                raise TraceError(f"{where}: give 'output' (replayed) or 'max_new_tokens' "
                                 "(generated by the engine), not both")
            if "output" in rec:
                output = as_tokens(_field(rec, "output", list, where), f"{where}: output")
            elif "max_new_tokens" in rec:
                max_new = _field(rec, "max_new_tokens", int, where)
                if max_new < 0:
                    raise TraceError(f"{where}: 'max_new_tokens' must be >= 0, got {max_new}")
                output = np.zeros(0, dtype=TOKEN_DTYPE)
            else:
                raise TraceError(f"{where}: missing field 'output' (or 'max_new_tokens')")
            beam = _beam_width(rec, max_new, where)
        except ValueError as e:  # also numpy's, on a ragged list of token ids
            raise TraceError(str(e) if isinstance(e, BadInput) else f"{where}: {e}") from None
        arrival = _seconds(rec, "arrival_s", where, default=0.0)
        think = _seconds(rec, "think_time_s", where, default=0.0)
        priority = _field(rec, "priority", int, where) if "priority" in rec else 0
        request = Request(
            id=str(rec.get("id", len(requests))), prompt=prompt, output=output,
            arrival_s=arrival, program=rec.get("program"), after=after,
            think_time_s=think, priority=priority, segments=segments, max_new_tokens=max_new,
            beam_width=beam,
        )
        outputs[request.id] = output
        waits_for[request.id] = waits
        requests.append(request)
    return requests


def _beam_width(rec: dict, max_new: int | None, where: str) -> int | None:
    """A beam call's ``beam_width`` (None for other calls): an int >= 1, with ``max_new_tokens``
    >= 1 (beam search generates; testbed/scheduler/beam.py)."""
    if "beam_width" not in rec:
        return None
    width = _field(rec, "beam_width", int, where)
    if width < 1:
        raise TraceError(f"{where}: 'beam_width' must be >= 1, got {width}")
    if max_new is None or max_new < 1:
        raise TraceError(f"{where}: a call with 'beam_width' needs 'max_new_tokens' >= 1 (beam "
                         "search generates its output)")
    return width


def save_tokens(requests: list[Request], path: str | Path) -> None:
    """Write requests as a token trace that `load_tokens` reads back identically. A prompt that
    splices in the output of a call that generates keeps the reference (``{"output": ID}``)."""
    generating = {r.id for r in requests if r.generates}
    with Path(path).open("w") as f:
        for r in requests:
            refs = [s.call for s in r.segments or () if isinstance(s, OutputRef)]
            prompt = r.prompt.tolist()
            if generating.intersection(refs):
                prompt = [x for s in r.segments for x in
                          ([{"output": s.call}] if isinstance(s, OutputRef) else s.tolist())]
            rec = {"id": r.id, "arrival_s": r.arrival_s, "prompt": prompt}
            if r.generates:
                rec["max_new_tokens"] = r.max_new_tokens
                if r.beam_width is not None:
                    rec["beam_width"] = r.beam_width
            else:
                rec["output"] = r.output.tolist()
            if r.program is not None:
                rec["program"] = r.program
            if r.after:
                rec["after"] = r.after
            if r.think_time_s != 0:
                rec["think_time_s"] = r.think_time_s
            if r.priority != 0:
                rec["priority"] = r.priority
            f.write(json.dumps(rec) + "\n")


def _check_blocks(rec: dict, n_in: int, block: int, where: str) -> list[int]:
    blocks = _field(rec, "hash_ids", list, where)
    if len(blocks) != -(-n_in // block):
        raise TraceError(f"{where}: {len(blocks)} hash_ids for input_length {n_in} "
                         f"(expected ceil({n_in}/{block}))")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise TraceError(f"{where}: hash_ids must be non-negative integers")
    return blocks


def _lengths(rec: dict, where: str) -> tuple[int, int]:
    n_in = _field(rec, "input_length", int, where)
    n_out = _field(rec, "output_length", int, where)
    if n_in < 0 or n_out < 0:
        raise TraceError(f"{where}: lengths must be >= 0")
    return n_in, n_out


class _BlockTokens:
    """Block id ``b`` -> the ``block`` tokens ``b*block ..``; fresh output ids above all of them."""

    def __init__(self, path: Path, block: int, all_blocks: list[list[int]], total_out: int):
        top_block = max((max(b) for b in all_blocks if b), default=-1)
        self.block = block
        self.next_fresh = (top_block + 1) * block  # output ids live above every block's tokens
        if self.next_fresh + total_out > np.iinfo(TOKEN_DTYPE).max:
            raise TraceError(f"{path}: hash ids too large to map to 32-bit token ids")
        self.offsets = np.arange(block, dtype=TOKEN_DTYPE)

    def prompt(self, blocks: list[int], n_in: int) -> np.ndarray:
        starts = np.asarray(blocks, dtype=TOKEN_DTYPE).reshape(-1) * self.block
        return (starts[:, None] + self.offsets[None, :]).reshape(-1)[:n_in]

    def output(self, n_out: int) -> np.ndarray:
        out = fresh_token_ids(self.next_fresh, n_out)
        self.next_fresh += n_out
        return out


def load_mooncake(path: str | Path) -> list[Request]:
    """Read a Mooncake FAST'25 trace; token ids are made from the block hashes (module docstring)."""
    path = Path(path)
    rows = []
    for lineno, rec in _json_lines(path):
        where = f"{path}:{lineno}"
        ts = _field(rec, "timestamp", (int, float), where)
        n_in, n_out = _lengths(rec, where)
        rows.append((ts, n_in, n_out, _check_blocks(rec, n_in, MOONCAKE_BLOCK, where)))
    tokens = _BlockTokens(path, MOONCAKE_BLOCK, [r[3] for r in rows], sum(r[2] for r in rows))
    return [Request(id=str(i), prompt=tokens.prompt(blocks, n_in), output=tokens.output(n_out),
                    arrival_s=ts / 1000.0)
            for i, (ts, n_in, n_out, blocks) in enumerate(rows)]


def load_bailian(path: str | Path) -> list[Request]:
    """Read a Qwen/Alibaba Bailian (ATC'25) trace: 16-token blocks, conversations as programs.

    Each line: ``chat_id`` (int >= 0, unique), ``parent_chat_id`` (int; -1 for none), ``timestamp``
    (s), ``input_length``, ``output_length``, ``type`` (str), ``turn`` (int), ``hash_ids`` (chained
    hashes of 16-token blocks, ``ceil(input_length / 16)`` of them). Request id is ``str(chat_id)``,
    ``arrival_s`` the timestamp. A parent that appears earlier in the file becomes ``after`` and
    the request joins its program, named by the conversation's first turn in the file; a request
    whose parent is -1 or not (earlier) in the file starts its own program with no dependency.
    """
    path = Path(path)
    rows = []
    program_of: dict[int, str] = {}  # chat_id -> program (root chat id) of every request so far
    for lineno, rec in _json_lines(path):
        where = f"{path}:{lineno}"
        chat = _field(rec, "chat_id", int, where)
        parent = _field(rec, "parent_chat_id", int, where)
        ts = _seconds(rec, "timestamp", where)
        n_in, n_out = _lengths(rec, where)
        # `type` (text/image/search/file) and `turn` become the request's category, what the
        # workload-aware eviction policy estimates reuse by (turns beyond 4 pooled).
        kind = _field(rec, "type", str, where)
        turn = _field(rec, "turn", int, where)
        blocks = _check_blocks(rec, n_in, BAILIAN_BLOCK, where)
        if chat < 0:
            raise TraceError(f"{where}: 'chat_id' must be >= 0, got {chat}")
        if parent < -1:
            raise TraceError(f"{where}: 'parent_chat_id' must be -1 (none) or a chat id, got {parent}")
        if chat in program_of:
            raise TraceError(f"{where}: duplicate chat_id {chat}")
        linked = parent in program_of  # only an earlier line can be waited for
        program_of[chat] = program_of[parent] if linked else str(chat)
        rows.append((chat, [str(parent)] if linked else [], program_of[chat], ts, n_in, n_out,
                     blocks, f"{kind}/turn{min(turn, 4)}"))
    tokens = _BlockTokens(path, BAILIAN_BLOCK, [r[6] for r in rows], sum(r[5] for r in rows))
    return [Request(id=str(chat), prompt=tokens.prompt(blocks, n_in), output=tokens.output(n_out),
                    arrival_s=ts, program=program, after=after, category=category)
            for chat, after, program, ts, n_in, n_out, blocks, category in rows]


def _count(text: str, name: str, where: str) -> int:
    text = text.strip()
    if not (text.isascii() and text.isdigit()):
        raise TraceError(f"{where}: {name} must be a non-negative integer, got {text!r}")
    return int(text)


def _azure_seconds(path: Path, stamps: list[str], lines: list[int]) -> np.ndarray:
    """Seconds since the first timestamp; a bad one is reported with its line."""
    import pandas as pd

    try:
        parsed = pd.to_datetime(pd.Series(stamps, dtype=object), format="ISO8601", errors="coerce")
    except (ValueError, TypeError):  # e.g. time zones mixed: find the first offending line
        first_tz = None
        for i, (s, lineno) in enumerate(zip(stamps, lines)):
            try:
                tz = pd.Timestamp(s).tzinfo is not None
            except (ValueError, TypeError):
                raise TraceError(f"{path}:{lineno}: TIMESTAMP {s!r} is not a date and time") from None
            if i == 0:
                first_tz = tz
            elif tz != first_tz:
                raise TraceError(f"{path}:{lineno}: TIMESTAMP {s!r} mixes time-zone-aware and "
                                 "naive times") from None
        raise TraceError(f"{path}: TIMESTAMP column could not be parsed") from None
    bad = np.flatnonzero(parsed.isna().to_numpy())
    if bad.size:
        i = int(bad[0])
        raise TraceError(f"{path}:{lines[i]}: TIMESTAMP {stamps[i]!r} is not a date and time")
    seconds = (parsed - parsed.iloc[0]).dt.total_seconds().to_numpy()  # exact ns differences
    early = np.flatnonzero(seconds < 0)
    if early.size:
        i = int(early[0])
        raise TraceError(f"{path}:{lines[i]}: TIMESTAMP {stamps[i]!r} is before the first row's "
                         f"({stamps[0]!r}); arrival times are counted from the first row")
    return seconds


def load_azure(path: str | Path) -> list[Request]:
    """Read an Azure LLM inference 2023 CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``).

    ``arrival_s`` is seconds since the first row's timestamp. These traces carry no prefix
    information, so prompt and output tokens are fresh: consecutive ids from 0 across the whole
    file (row by row, prompt then output), and no two requests share a token. Request ids are the
    row numbers from 0. Line numbers in errors count the header as line 1.
    """
    path = Path(path)
    require_file(path)
    stamps, lines, n_in, n_out = [], [], [], []
    with path.open(newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
            if header is None or tuple(h.strip() for h in header) != AZURE_HEADER:
                got = repr(",".join(header)) if header is not None else "an empty file"
                raise TraceError(f"{path}:1: expected the header {','.join(AZURE_HEADER)}, "
                                 f"got {got}")
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if not any(cell.strip() for cell in row):
                    continue
                if len(row) != 3:
                    raise TraceError(f"{where}: expected 3 comma-separated fields, got {len(row)}")
                stamps.append(row[0].strip())
                lines.append(reader.line_num)
                n_in.append(_count(row[1], "ContextTokens", where))
                n_out.append(_count(row[2], "GeneratedTokens", where))
        except csv.Error as e:
            raise TraceError(f"{path}:{reader.line_num}: not valid CSV ({e})") from None
    arrivals = _azure_seconds(path, stamps, lines) if stamps else np.zeros(0)
    if sum(n_in) + sum(n_out) > np.iinfo(TOKEN_DTYPE).max:
        raise TraceError(f"{path}: too many tokens to give unique 32-bit ids")
    requests, next_id = [], 0
    for i, (a, p, o) in enumerate(zip(arrivals.tolist(), n_in, n_out)):
        prompt, output = fresh_token_ids(next_id, p), fresh_token_ids(next_id + p, o)
        next_id += p + o
        requests.append(Request(id=str(i), prompt=prompt, output=output, arrival_s=a))
    return requests


# The loader of each format in `TRACE_FORMATS` (sharegpt's imports transformers only when called).
LOADERS: dict[str, Callable[..., list[Request]]] = {
    "tokens": load_tokens,
    "mooncake": load_mooncake,
    "bailian": load_bailian,
    "azure": load_azure,
    "sharegpt": load_sharegpt,
}


def load_trace(path: str | Path, fmt: str | None = None, **options) -> list[Request]:
    """Load a trace of format ``fmt``; an option (`TRACE_OPTIONS`, e.g. ``tokenizer=DIR``) is passed
    to the formats that take it (sharegpt), ignored by the others.
    ``path`` may be ``data:NAME``, a registered public trace (`testbed.data`): its file in the data
    folder, fetched on first use, read in its registered format (``fmt`` None: that format; a
    plain file's default is ``tokens``)."""
    path, fmt = resolve_trace(path, fmt)
    fmt = fmt or "tokens"
    try:
        spec = TRACE_FORMATS[fmt]
    except KeyError:
        raise BadInput(f"workload.format must be one of {', '.join(TRACE_FORMATS)}; "
                       f"got {fmt!r}") from None
    unknown = sorted(set(options) - set(TRACE_OPTIONS))
    if unknown:
        raise ValueError(f"unknown trace option(s) {', '.join(unknown)}; "
                         f"known: {', '.join(TRACE_OPTIONS)}")
    return LOADERS[fmt](path, **{k: options.get(k) for k in spec.options})
