"""Traces of any length for the scaling table of `experiments.benchmarks.cache`, made one by one.

- `forest`: the requests of ``workload=random_tree`` (`testbed.workloads.synthetic.random_tree`:
  the same random draws in the same order, so the same tokens and ids), streamed: each call keeps
  only its own new tokens and its parent, and its prompt is spelled from its ancestors when it is
  yielded, so a million calls take ~100 MB instead of the generator's dozen GB.
- `mooncake_tiled`: the Mooncake conversation trace repeated: copy ``c`` of request ``i`` has the
  same lengths as the original and block ids shifted by ``c`` times the trace's largest block id
  plus one, so copies never share a block. A block id ``b`` becomes the 512 tokens
  ``b, 1, 2, ..., 511`` (token ids stay under 2^31 however many copies; two blocks differ in their
  first token, so prefixes share exactly as the blocks do: the first copy's hits and evictions are
  the trace's under ``workload.format=mooncake``) and output tokens are fresh ids from 2^30 up.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from testbed.workloads.request import TOKEN_DTYPE, Request

MOONCAKE_BLOCK = 512
OUTPUT_BASE = 1 << 30  # output token ids of the tiled trace start here, above every block id


def forest(num_requests: int, root_prob: float = 0.1, max_burst: int = 4, root_len: int = 256,
           segment_len: int = 32, output_len: int = 32, vocab_size: int = 32000,
           seed: int = 0) -> Iterator[Request]:
    """``random_tree(...)``'s requests, in its order, yielded one at a time (module docstring).

    The generator's own arrays (every call's new tokens and output, its parent and program: 212
    MB for a million calls of the speed benchmark's shape) are made and written here, when it is
    called, so a caller that measures memory from then on counts them as the trace's, not as
    what its loop over the requests holds."""
    width = root_len + segment_len
    own = np.full((num_requests, width), 0, TOKEN_DTYPE)  # a call's new prompt tokens
    own_len = np.full(num_requests, 0, np.int32)  # (np.full writes its pages: resident now)
    out = np.full((num_requests, output_len), 0, TOKEN_DTYPE)
    parent = np.full(num_requests, -1, np.int64)
    program = np.full(num_requests, 0, np.int64)
    return _forest_calls(num_requests, root_prob, max_burst, root_len, segment_len, output_len,
                         vocab_size, seed, own, own_len, out, parent, program)


def _forest_calls(num_requests: int, root_prob: float, max_burst: int, root_len: int,
                  segment_len: int, output_len: int, vocab_size: int, seed: int,
                  own: np.ndarray, own_len: np.ndarray, out: np.ndarray, parent: np.ndarray,
                  program: np.ndarray) -> Iterator[Request]:
    """`forest`'s requests, made one at a time into its arrays."""
    rng = np.random.default_rng(seed)
    ids: list[str] = []
    calls_in: list[int] = []  # calls of each program so far

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, vocab_size, size=n, dtype=TOKEN_DTYPE)

    def call(i: int, p: int, segment: np.ndarray) -> Request:
        """Call ``i``: ``segment`` after parent ``p``'s prompt and output (a root if ``p`` < 0)."""
        own[i, : len(segment)] = segment
        own_len[i] = len(segment)
        out[i] = tokens(output_len)
        parent[i] = p
        program[i] = program[p] if p >= 0 else len(calls_in)
        if p < 0:
            calls_in.append(0)
        chain, j = [], p
        while j >= 0:
            chain.append(j)
            j = parent[j]
        parts = [a for j in reversed(chain) for a in (own[j, : own_len[j]], out[j])]
        prog = int(program[i])
        ids.append(f"tree{prog}/n{calls_in[prog]}")
        calls_in[prog] += 1
        return Request(id=ids[i], prompt=np.concatenate([*parts, segment]), output=out[i].copy(),
                       program=f"tree{prog}", after=[ids[p]] if p >= 0 else [])

    n = 0
    while n < num_requests:
        if n == 0 or rng.random() < root_prob:
            yield call(n, -1, np.concatenate([tokens(root_len), tokens(segment_len)]))
            n += 1
            continue
        p = int(rng.integers(n))
        for _ in range(min(int(rng.integers(1, max_burst + 1)), num_requests - n)):
            yield call(n, p, tokens(segment_len))
            n += 1


def mooncake_rows(path: Path) -> list[tuple[int, int, list[int]]]:
    """(input length, output length, block ids) of every line of a Mooncake trace."""
    rows = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                rows.append((rec["input_length"], rec["output_length"], rec["hash_ids"]))
    return rows


def mooncake_tiled(num_requests: int, path: Path) -> Iterator[Request]:
    """``num_requests`` requests of the Mooncake trace at ``path``, repeated (module docstring)."""
    rows = mooncake_rows(path)
    stride = 1 + max(max(b) for _, _, b in rows if b)
    if (num_requests - 1) // len(rows) * stride + stride >= OUTPUT_BASE:
        raise ValueError(f"{num_requests} requests of {path}: block ids would reach 2^30")
    offsets = np.arange(MOONCAKE_BLOCK, dtype=TOKEN_DTYPE)
    fresh = OUTPUT_BASE
    for i in range(num_requests):
        n_in, n_out, blocks = rows[i % len(rows)]
        prompt = np.tile(offsets, len(blocks))
        prompt[::MOONCAKE_BLOCK] = np.asarray(blocks, dtype=TOKEN_DTYPE) + i // len(rows) * stride
        if fresh + n_out >= 1 << 31:
            raise ValueError(f"{num_requests} requests of {path}: output ids would reach 2^31")
        yield Request(id=str(i), prompt=prompt[:n_in],
                      output=np.arange(fresh, fresh + n_out, dtype=TOKEN_DTYPE))
        fresh += n_out
