"""Cascade decoding: requests that share a cached prefix read its KV once per step.

A decode step's requests are grouped by the radix tree (`testbed.scheduler.decode_groups`: the
leases the scheduler holds; the simulator prices the same groups). For a group of ``n`` requests
sharing ``P`` tokens, the ``n`` queries of each KV head's GQA group attend that prefix together,
as one sequence with ``n`` times the query rows (so the prefix's keys and values are read once);
every request then attends its own suffix (positions ``P ..``; all of its KV when it is in no
group, which is plain decode), and the two partial results merge exactly by their log-sum-exps
(`radix_kernels.merge_states`). Both parts are the backend's ordinary `decode_part`, so the torch
and the Triton backends cascade the same way.

The plan is built with the step's other metadata on the host and travels in its one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from testbed.engine.metadata import KVRanges, indptr


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
