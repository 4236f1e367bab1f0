"""The token → KV-slot table on the engine's device (SGLang's ``req_to_token_pool``).

Each request being served has a row; column ``j`` holds the KV slot of its token ``j``. A step
writes only what changed since the request's last step — normally its new tokens' slots — so the
step's index arrays are gathered on the device from small per-request metadata instead of being
rebuilt on the host and copied whole.

What changed is found without reading the whole row: a lease's slot buffer only ever gains slots
past its end; a rewrite (the cache taking over slots when the prompt is inserted, a retraction)
comes in a new buffer (`testbed.cache.base.Lease.reset`). So a row whose request's slots still
live in the buffer they were synced from needs only the new tail; one whose buffer changed is
compared with the host's copy of the row (rare: once per insert or page-buffer growth). A row is
given back when its request holds no lease (finished or retracted) and is not in the step.

Beside it, the token table (``tokens``, one entry a row; SGLang's future map, mini-sglang's
token pool): the token each request's last step produced, written there on the device by the step
that sampled it (`store_tokens`). A decode step reads its inputs from it, so the next step can be
launched before this one's tokens have reached the host (`testbed.serving.step_cycle`). A row's
token is valid from the step that produced it until the row is given back; a retracted request
re-prefills from the host.

Row 0 (`PAD_ROW`) is never given to a request: it stays all zeros, the padding slot, so a step
padded to a CUDA graph's batch size points its extra rows there (one key: the padding slot; its
token 0).
The table grows (doubling) when a step needs more rows or columns; no captured graph reads it
(a step's indices are gathered from it before the forward, `testbed.engine.cuda_graph`).
"""

from __future__ import annotations

import numpy as np
import torch

from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.request_state import Req

PAD_ROW = 0  # the row of padded entries: all zeros (the padding slot)


class SlotTable:
    def __init__(self, device: torch.device | str, rows: int = 16, width: int = 256) -> None:
        self.device = torch.device(device)
        self.table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)  # the last token
        self.host = np.zeros((rows, width), dtype=np.int32)  # what the device rows hold
        self.row_of: dict[Req, int] = {}
        self.synced: dict[int, tuple[np.ndarray, int]] = {}  # row -> (slot buffer, columns)
        self.free = list(range(rows - 1, PAD_ROW, -1))

    @property
    def rows(self) -> int:
        return self.table.shape[0]

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def _grow(self, rows: int, width: int) -> None:
        rows, width = max(rows, self.rows), max(width, self.width)
        table = torch.zeros((rows, width), dtype=torch.int32, device=self.device)
        table[: self.rows, : self.width] = self.table
        host = np.zeros((rows, width), dtype=np.int32)
        host[: self.rows, : self.width] = self.host
        tokens = torch.zeros(rows, dtype=torch.int64, device=self.device)
        tokens[: self.rows] = self.tokens
        self.free = list(range(rows - 1, self.rows - 1, -1)) + self.free
        self.table, self.host, self.tokens = table, host, tokens

    def _release_idle(self, batch: set[Req]) -> None:
        for req in [r for r in self.row_of if r.lease is None and r not in batch]:
            row = self.row_of.pop(req)
            self.synced.pop(row, None)
            self.free.append(row)

    def update(self, entries: list[BatchEntry]) -> tuple[np.ndarray, list[np.ndarray]]:
        """Rows of the step's entries and the writes that bring them up to date:
        ``(rows [B], [write_rows, write_cols, write_slots])``, host arrays for `apply`."""
        self._release_idle({e.req for e in entries})
        longest = max(e.context + e.new for e in entries)
        need = len([e for e in entries if e.req not in self.row_of])
        if need > len(self.free) or longest > self.width:
            width = self.width
            while width < longest:
                width *= 2
            self._grow(self.rows + max(need - len(self.free), 0) * 2, width)
        rows, w_rows, w_cols, w_slots = [], [], [], []
        for e in entries:
            row = self.row_of.get(e.req)
            if row is None:
                row = self.row_of[e.req] = self.free.pop()
            kv = e.kv_slots()
            buf = kv.base if kv.base is not None else kv
            start = self._unchanged(row, kv, buf)
            if start < len(kv):
                w_rows.append(np.full(len(kv) - start, row))
                w_cols.append(np.arange(start, len(kv)))
                w_slots.append(kv[start:])
                self.host[row, start:len(kv)] = kv[start:]
            self.synced[row] = (buf, len(kv))
            rows.append(row)
        writes = [np.concatenate(w) if w else np.zeros(0, dtype=np.int64)
                  for w in (w_rows, w_cols, w_slots)]
        return np.asarray(rows, dtype=np.int64), writes

    def _unchanged(self, row: int, kv: np.ndarray, buf: np.ndarray) -> int:
        """How many leading columns of ``row`` already hold ``kv``."""
        if row not in self.synced:
            return 0
        was, n = self.synced[row]
        n = min(n, len(kv))
        if was is buf:
            return n
        differ = np.flatnonzero(self.host[row, :n] != kv[:n])
        return int(differ[0]) if differ.size else n

    def apply(self, rows: torch.Tensor, cols: torch.Tensor, slots: torch.Tensor) -> None:
        """Write on the device what `update` planned (its arrays, moved there)."""
        if rows.numel():
            self.table[rows, cols] = slots.to(torch.int32)

    def rows_of(self, entries: list[BatchEntry]) -> np.ndarray:
        """The entries' rows, a row given to each that has none (a step whose entries did not
        go through `update`: a blend prefill's)."""
        missing = [e.req for e in entries if e.req not in self.row_of]
        if len(missing) > len(self.free):
            self._grow(self.rows + (len(missing) - len(self.free)) * 2, self.width)
        for req in missing:
            self.row_of[req] = self.free.pop()
        return np.asarray([self.row_of[e.req] for e in entries], dtype=np.int64)

    def store_tokens(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """The tokens a step produced, into its entries' rows (on the device, no sync)."""
        self.tokens.index_copy_(0, rows, tokens.to(torch.int64))

    def last_tokens(self, rows: torch.Tensor) -> torch.Tensor:
        """The token each row's last step produced: a decode step's inputs."""
        return self.tokens.index_select(0, rows)
