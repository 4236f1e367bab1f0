"""One step's attention layout, built once on the host and used by every layer (FlashInfer's
``plan``/``run`` split).

KV is addressed through the engine's slot table (`testbed.engine.slot_table`): row ``r``, column
``j`` holds the KV slot of token ``j`` of the request given row ``r``. A `KVRanges` names, per
sequence, a run of columns of one row; backends turn it into what their kernels read (flat
``indptr``/``indices`` for Triton, a padded ``[n, longest]`` gather for torch) when they plan the
step, with the sizes they need (totals, longest run) known on the host, so no layer has to ask
the device and nothing is derived inside the forward.

Request ``i`` of a step has ``qo_len_i`` new tokens (``q[qo_indptr[i]:qo_indptr[i+1]]``) and reads
``kv_len_i`` tokens of KV: its cached prefix first, then its new tokens, whose K/V each layer
writes (at ``out_slots``) before attending. New token ``j`` sees KV positions ``<= prefix_i + j``:
a causal mask aligned to the lower right.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch


def to_device(arrays: list[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Integer host arrays as int64 device tensors, in one transfer (no persistent buffers:
    `testbed.engine.step_buffers.StepBuffers` is the engine's)."""
    sizes = [int(np.size(a)) for a in arrays]
    packed = np.concatenate([np.asarray(a, dtype=np.int64).reshape(-1) for a in arrays])
    return list(torch.from_numpy(packed).to(device).split(sizes))


def indptr(lens: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])


@dataclass
class KVRanges:
    """Sequence ``i`` reads columns ``starts[i] .. starts[i] + lens[i] - 1`` of slot-table row
    ``rows[i]``. ``rows``, ``starts``, ``lens``, ``indptr`` are int64 device tensors; the host
    keeps ``lens_host`` for sizes."""

    rows: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    indptr: torch.Tensor  # [n + 1] prefix sums of lens
    lens_host: np.ndarray

    @property
    def total(self) -> int:
        return int(self.lens_host.sum())

    @property
    def longest(self) -> int:
        return int(self.lens_host.max()) if len(self.lens_host) else 0

    def indices(self, table: torch.Tensor) -> torch.Tensor:
        """The slots of every sequence, concatenated (``[total]``, the table's dtype)."""
        total = self.total
        rep_rows = torch.repeat_interleave(self.rows * table.shape[1] - self.indptr[:-1]
                                           + self.starts, self.lens, output_size=total)
        cells = rep_rows + torch.arange(total, device=table.device)
        return table.view(-1).index_select(0, cells)

    def padded(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[n, longest]`` (past a sequence's end: some valid slot, masked) and the mask
        ``[n, longest]`` of real ones."""
        offsets = torch.arange(self.longest, device=table.device)
        width = table.shape[1]
        # one flat index_select: a 2-D advanced index costs twice as much on the CPU
        cells = (self.starts + self.rows * width)[:, None] + offsets
        cells = torch.minimum(cells, (self.rows * width + width - 1)[:, None])
        slots = table.view(-1).index_select(0, cells.view(-1)).view(cells.shape)
        return slots, offsets < self.lens[:, None]


@dataclass
class AttentionMetadata:
    """One step's layout, shared by every layer. Every tensor is made before the forward runs
    (in `from_table` and the backend's ``plan``): layers only read it."""

    qo_indptr: torch.Tensor  # [B + 1] int64
    kv: KVRanges  # each request's KV: row, from column 0, kv_len of them
    table: torch.Tensor  # the slot table (device, int32)
    out_slots: torch.Tensor  # [T] where the new tokens' K/V are written
    last_token_index: torch.Tensor | None  # [B] row of each request's last new token in [T];
    #                                        None: every row is one (a decode step)
    qo_lens: np.ndarray  # host copies, for planning
    kv_lens: np.ndarray
    rows: np.ndarray  # each request's slot-table row (host)
    cascade: Any = None  # a `testbed.engine.cascade.CascadePlan` for a grouped decode step
    plan: Any = None  # what the backend's ``plan`` precomputed for this step
    kv_indices: torch.Tensor | None = None  # every request's slots concatenated, when planned
    num_kv_splits: int | None = None  # decode split-KV chunks fixed by the caller (CUDA graphs)
    # a speculative token tree's entries: their ``[qo_len, kv_len]`` boolean masks (which keys
    # each query sees), None for every other entry; None: every entry plainly causal
    query_masks: list | None = None

    @property
    def batch_size(self) -> int:
        return len(self.qo_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_lens.sum())

    @property
    def max_qo(self) -> int:
        return int(self.qo_lens.max())

    @property
    def max_kv(self) -> int:
        return int(self.kv_lens.max())

    @property
    def is_decode(self) -> bool:
        """Every request has exactly one new token."""
        return bool((self.qo_lens == 1).all())

    @property
    def kv_indptr(self) -> torch.Tensor:
        return self.kv.indptr

    @classmethod
    def from_table(cls, qo_lens: np.ndarray, kv_lens: np.ndarray, rows: np.ndarray,
                   table: torch.Tensor, extra: list[np.ndarray] = (),
                   transfer: Callable[[list[np.ndarray]], list[torch.Tensor]] | None = None,
                   before_gather: Callable[[list[torch.Tensor]], None] | None = None
                   ) -> tuple[AttentionMetadata, list[torch.Tensor]]:
        """From per-request new-token counts, KV lengths (prefix + new) and slot-table rows;
        ``extra`` host arrays ride along in the same transfer (``transfer``: a `StepBuffers`'s,
        else a fresh one) and come back on the device. ``before_gather(extra)`` runs once they
        are there and before ``out_slots`` is read off the table (the runner writes the step's
        slot-table updates then)."""
        qo_lens = np.asarray(qo_lens, dtype=np.int64)
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        if len(qo_lens) == 0:
            raise ValueError("an attention step needs at least one request")
        if (qo_lens < 1).any() or (kv_lens < qo_lens).any():
            raise ValueError(f"each request needs >= 1 new token and kv_len >= qo_len, got "
                             f"qo_lens={qo_lens.tolist()} kv_lens={kv_lens.tolist()}")
        qo_ptr, kv_ptr = indptr(qo_lens), indptr(kv_lens)
        zeros = np.zeros(len(rows), dtype=np.int64)
        move = transfer or (lambda arrays: to_device(arrays, table.device))
        dev = move([qo_ptr, kv_ptr, rows, zeros, kv_lens, qo_lens, kv_lens - qo_lens,
                    qo_ptr[1:] - 1, *extra])
        qo_p, kv_p, rows_d, zeros_d, kv_d, qo_d, prefix_d, last = dev[:8]
        if before_gather is not None:
            before_gather(dev[8:])
        new = KVRanges(rows_d, prefix_d, qo_d, qo_p, qo_lens)
        decode = bool((qo_lens == 1).all())
        meta = cls(qo_indptr=qo_p, kv=KVRanges(rows_d, zeros_d, kv_d, kv_p, kv_lens),
                   table=table, out_slots=new.indices(table),
                   last_token_index=None if decode else last, qo_lens=qo_lens,
                   kv_lens=kv_lens, rows=np.asarray(rows))
        return meta, dev[8:]

    @classmethod
    def build(cls, qo_lens: np.ndarray, kv_lens: np.ndarray, kv_indices: np.ndarray,
              device: torch.device | str) -> AttentionMetadata:
        """From the concatenated slot ids of each request (a table of one row per request is
        made for them; the engine's `ModelRunner` keeps its table instead)."""
        kv_lens = np.asarray(kv_lens, dtype=np.int64)
        if len(kv_indices) != kv_lens.sum():
            raise ValueError(f"kv_indices has {len(kv_indices)} slots, kv_lens sum to "
                             f"{kv_lens.sum()}")
        host = np.zeros((len(kv_lens), max(int(kv_lens.max(initial=0)), 1)), dtype=np.int32)
        for i, (start, n) in enumerate(zip(indptr(kv_lens)[:-1], kv_lens)):
            host[i, :n] = kv_indices[start:start + n]
        table = torch.from_numpy(host).to(device)
        return cls.from_table(qo_lens, kv_lens, np.arange(len(kv_lens)), table)[0]


@dataclass
class StepInputs:
    """A step's flat inputs and its metadata, as `testbed.engine.runner.ModelRunner.prepare`
    builds them (a CUDA graph's static copies too, `testbed.engine.cuda_graph`)."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata

    def rows(self, n: int) -> torch.Tensor:
        """The slot-table rows of the step's first ``n`` entries (its own, padding aside)."""
        return self.meta.kv.rows[:n]
