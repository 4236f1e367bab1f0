"""Cascade decoding: requests that share a cached prefix read its KV once per step.

A decode step's requests are grouped by the radix tree (`testbed.cache.shared_prefix`: the
leases the scheduler holds). For a group of ``n`` requests sharing ``P`` tokens, the ``n``
queries of each KV head's GQA group attend that prefix together, as one sequence with ``n``
times the query rows (so the prefix's keys and values are read once); every request then
attends its own suffix (positions ``P ..``; all of its KV when it is in no group, which is plain
decode), and the two partial results merge exactly by their log-sum-exps
(`radix_kernels.merge_states`). Both parts are the backend's ordinary `decode_part`, so the torch
and the Triton backends cascade the same way.

The plan is built with the step's other metadata on the host and travels in its one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from testbed.cache.shared_prefix import shared_prefix_groups
from testbed.engine.metadata import KVRanges, indptr
from testbed.scheduler.batch import BatchEntry


class DecodeGroups:
    """Groups ``(shared tokens, entry indices)`` of decode steps, from the radix tree.

    An entry whose slots were bound before its lease changed (the cache took over its prompt's
    slots since) joins none: its prefix may sit in other slots than the tree's. Consecutive
    decode steps of the same requests usually hold the same tree nodes; then the last step's
    groups are reused. They stay right even if the tree has split a node on their paths since
    (a split keeps the node object and where it ends; locked nodes are never evicted), though a
    fresh pass might then pick other groups.
    """

    def __init__(self, min_tokens: int = 1) -> None:
        self.min_tokens = min_tokens
        self._last: tuple[tuple, list[tuple[int, list[int]]]] | None = None

    def __call__(self, entries: list[BatchEntry]) -> list[tuple[int, list[int]]]:
        leases = []
        for e in entries:
            lease = e.req.lease
            current = (lease is not None and e.gen == e.req.preemptions
                       and e.kv_slots().base is lease.slots.base)
            leases.append(lease if current else None)
        key = tuple((id(lease.handle), lease.cached) if lease else None for lease in leases)
        if self._last is None or self._last[0] != key:
            self._last = key, shared_prefix_groups(leases, self.min_tokens)
        return self._last[1]


@dataclass
class CascadePlan:
    """Device tensors of a grouped decode step (``G`` groups, ``W`` members at most)."""

    suffix: KVRanges  # per request: its row from its group's prefix length (0 alone) to its end
    prefix: KVRanges  # per group: its first member's row, columns 0 .. P - 1
    gather: torch.Tensor  # [G * W] request of each member place (padding: the group's first)
    members: torch.Tensor  # [M] the grouped requests, group by group
    places: torch.Tensor  # [M] their places in [G * W]
    width: int

    @staticmethod
    def host_arrays(groups: list[tuple[int, list[int]]], kv_lens: np.ndarray,
                    rows: np.ndarray) -> tuple[list[np.ndarray], tuple]:
        """What `from_device` needs: arrays for the step's one transfer, and host sizes."""
        width = max(len(m) for _, m in groups)
        starts = np.zeros(len(kv_lens), dtype=np.int64)
        gather, members, places = [], [], []
        for g, (shared, group) in enumerate(groups):
            starts[group] = shared
            gather += group + [group[0]] * (width - len(group))
            members += group
            places += range(g * width, g * width + len(group))
        prefix_lens = np.array([shared for shared, _ in groups], dtype=np.int64)
        suffix_lens = np.asarray(kv_lens, dtype=np.int64) - starts
        first_rows = np.asarray(rows)[[group[0] for _, group in groups]]
        arrays = [rows, starts, suffix_lens, indptr(suffix_lens), first_rows,
                  np.zeros(len(groups), dtype=np.int64), prefix_lens, indptr(prefix_lens),
                  gather, members, places]
        return arrays, (suffix_lens, prefix_lens, width)

    @classmethod
    def from_device(cls, arrays: list[torch.Tensor], sizes: tuple) -> CascadePlan:
        """``arrays``: `host_arrays`' arrays moved to the device; ``sizes``: its host sizes."""
        suffix_lens, prefix_lens, width = sizes
        return cls(suffix=KVRanges(*arrays[0:4], lens_host=suffix_lens),
                   prefix=KVRanges(*arrays[4:8], lens_host=prefix_lens),
                   gather=arrays[8], members=arrays[9], places=arrays[10], width=width)

    def planned(self, backend: Any, table: torch.Tensor) -> tuple[CascadePlan, Any, Any]:
        return self, backend.plan_part(self.suffix, table), backend.plan_part(self.prefix, table)


def cascade_decode(backend: Any, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                   planned: tuple[CascadePlan, Any, Any], sm_scale: float) -> torch.Tensor:
    """Decode attention of ``q [n, heads, dim]`` (one query per request), prefixes shared."""
    plan, suffix, prefix = planned
    n, heads, dim = q.shape
    kv_heads = k_buf.shape[1]
    group = heads // kv_heads
    o, lse = backend.decode_part(q.reshape(n, kv_heads, group, dim), k_buf, v_buf, suffix,
                                 sm_scale)
    o, lse = o.reshape(n, heads, dim), lse.reshape(n, heads)
    g, w = len(plan.prefix.lens_host), plan.width
    shared = q.index_select(0, plan.gather).view(g, w, kv_heads, group, dim)
    shared = shared.transpose(1, 2).reshape(g, kv_heads, w * group, dim)
    o_p, lse_p = backend.decode_part(shared, k_buf, v_buf, prefix, sm_scale)
    o_p = o_p.view(g, kv_heads, w, group, dim).transpose(1, 2).reshape(g * w, heads, dim)
    lse_p = lse_p.view(g, kv_heads, w, group).transpose(1, 2).reshape(g * w, heads)
    merged = backend.merge(o_p.index_select(0, plan.places), lse_p.index_select(0, plan.places),
                           o.index_select(0, plan.members), lse.index_select(0, plan.members))
    return o.index_copy(0, plan.members, merged)
