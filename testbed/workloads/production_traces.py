"""The public production traces, which hold lengths and block hashes rather than token ids
(docs/design.md §3); each loader makes token ids that share exactly what the trace says is shared.

- ``mooncake``: FAST'25 JSONL with ``timestamp`` (ms), ``input_length``, ``output_length`` and
  ``hash_ids`` (chained hashes of 512-token blocks). Block id ``b`` becomes the 512 tokens
  ``b*512 .. b*512+511`` (distinct, determined by ``b`` alone); the last block is cut to the remainder
  of ``input_length``; output tokens are fresh ids above every block token, unique per request.
- ``bailian``: the Qwen/Alibaba Bailian trace (ATC'25, "KVCache Cache in the Wild"): like mooncake
  with 16-token blocks, ``timestamp`` in seconds, and conversation links (``chat_id``,
  ``parent_chat_id``) that become ``after`` dependencies and programs.
- ``azure``: the Azure LLM inference 2023 CSV (Splitwise): arrival times and lengths only, so every
  token is fresh and nothing is shared.

Malformed input raises ``TraceError`` naming the file, the line and what is wrong.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE, Request, fresh_token_ids
from testbed.workloads.trace_format import TraceError, require_file
from testbed.workloads.trace_lines import field, json_records, seconds

MOONCAKE_BLOCK = 512
BAILIAN_BLOCK = 16
AZURE_HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _check_blocks(rec: dict, n_in: int, block: int, where: str) -> list[int]:
    blocks = field(rec, "hash_ids", list, where)
    if len(blocks) != -(-n_in // block):
        raise TraceError(f"{where}: {len(blocks)} hash_ids for input_length {n_in} "
                         f"(expected ceil({n_in}/{block}))")
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in blocks):
        raise TraceError(f"{where}: hash_ids must be non-negative integers")
    return blocks


def _lengths(rec: dict, where: str) -> tuple[int, int]:
    n_in = field(rec, "input_length", int, where)
    n_out = field(rec, "output_length", int, where)
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
    for lineno, rec in json_records(path):
        where = f"{path}:{lineno}"
        ts = field(rec, "timestamp", (int, float), where)
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
    for lineno, rec in json_records(path):
        where = f"{path}:{lineno}"
        chat = field(rec, "chat_id", int, where)
        parent = field(rec, "parent_chat_id", int, where)
        ts = seconds(rec, "timestamp", where)
        n_in, n_out = _lengths(rec, where)
        # `type` (text/image/search/file) and `turn` become the request's category, what the
        # workload-aware eviction policy estimates reuse by (turns beyond 4 pooled).
        kind = field(rec, "type", str, where)
        turn = field(rec, "turn", int, where)
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
    since_first = (parsed - parsed.iloc[0]).dt.total_seconds().to_numpy()  # exact ns differences
    early = np.flatnonzero(since_first < 0)
    if early.size:
        i = int(early[0])
        raise TraceError(f"{path}:{lines[i]}: TIMESTAMP {stamps[i]!r} is before the first row's "
                         f"({stamps[0]!r}); arrival times are counted from the first row")
    return since_first


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
