"""Cascade decoding: requests that share a cached prefix read its KV once per step.

A decode step's requests are grouped by the radix tree (`testbed.scheduler.decode_groups`: the
leases the scheduler holds; the simulator prices the same groups). For a group of ``n`` requests
sharing ``P`` tokens, the ``n`` queries of each KV head's GQA group attend that prefix together,
as one sequence with ``n`` times the query rows (so the prefix's keys and values are read once);
every request then attends its own suffix (positions ``P ..``; all of its KV when it is in no
group, which is plain decode), and the two partial results merge exactly by their log-sum-exps
(`radix_kernels.merge_states`). The torch backend runs both parts as its ordinary `decode_part`
and merges them (`testbed.engine.attention.cascade_decode`); the Triton backend runs both parts
in one launch and folds the merge into the split-KV reduction, two launches a layer as plain
decode has (`radix_kernels.cascade`). This module is the plan, which both read.

Every tensor of a plan has a shape fixed by three numbers, the step's requests ``B``, its groups
``G`` and their widest ``W``, never by which request is where: the prefix pass runs ``G x W``
member places (a narrower group repeats its first member, whose result no one reads), and the
merge runs over all ``B`` requests, a request in no group keeping its own result (a select, not
a scatter). So a CUDA graph captured for ``(B, G, W)`` replays any step of that shape with its
plan copied in (`testbed.engine.cuda_graph`), and ``G``, ``W`` may be padded up to a bucket:
a padded group reads one key (the padding slot) and no request reads its result.

The plan is built with the step's other metadata on the host and travels in its one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from testbed.engine.metadata import KVRanges, indptr
from testbed.engine.slot_table import PAD_ROW
# the prefix pass's geometry, which cascade's rule prices (`testbed.scheduler.cascade_rule`):
# at most MAX_QUERY_ROWS query rows a program (a group's members times the GQA group; a wider
# group is split, each part reading the prefix once: `split_wide`); the prefix in chunks of
# KEY_TILE keys, at most MAX_PREFIX_SPLITS of them (a CUDA graph's: all of them), since one
# group's prefix is one sequence, whose parallelism comes from the chunks
from testbed.scheduler.cascade_rule import KEY_TILE, MAX_PREFIX_SPLITS, MAX_QUERY_ROWS

PREFIX_KEYS_PER_SPLIT = KEY_TILE  # the name the engine's plan uses


def device_slots(device: str | torch.device) -> int | None:
    """Programs ``device`` runs at once, for cascade's rule: a CUDA device's streaming
    multiprocessors; None elsewhere (the CPU runs them in turn: no grid to fill)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_wide(groups: list[tuple[int, list[int]]], gqa_group: int
               ) -> list[tuple[int, list[int]]]:
    """Groups of at most ``MAX_QUERY_ROWS // gqa_group`` members, a wider one cut in order."""
    width = max(1, MAX_QUERY_ROWS // gqa_group)
    return [(shared, members[i:i + width]) for shared, members in groups
            for i in range(0, len(members), width)]


def prefix_splits(longest: int, fixed: bool) -> int:
    """Split-KV chunks of the prefix pass: all of them under a CUDA graph (``fixed``)."""
    if fixed:
        return MAX_PREFIX_SPLITS
    return min(MAX_PREFIX_SPLITS, max(1, -(-longest // PREFIX_KEYS_PER_SPLIT)))


@dataclass
class CascadePlan:
    """Device tensors of a grouped decode step (``G`` groups of ``W`` member places)."""

    suffix: KVRanges  # per request: its row from its group's prefix length (0 alone) to its end
    prefix: KVRanges  # per group: its first member's row, columns 0 .. P - 1
    gather: torch.Tensor  # [G * W] request of each member place (padding: the group's first)
    places: torch.Tensor  # [B] each request's member place (0 for a request in no group)
    grouped: torch.Tensor  # [B] bool: the request is in a group
    num_groups: int
    width: int

    @staticmethod
    def host_arrays(groups: list[tuple[int, list[int]]], kv_lens: np.ndarray, rows: np.ndarray,
                    num_groups: int | None = None, width: int | None = None
                    ) -> tuple[list[np.ndarray], tuple]:
        """What `from_device` needs: arrays for the step's one transfer, and host sizes.
        ``num_groups``, ``width``: pad the plan to at least these (a CUDA graph's bucket)."""
        widest = max(len(m) for _, m in groups)
        width = max(width or 0, widest)
        num_groups = max(num_groups or 0, len(groups))
        n = len(kv_lens)
        starts = np.zeros(n, dtype=np.int64)
        places = np.zeros(n, dtype=np.int64)
        grouped = np.zeros(n, dtype=np.int64)
        gather = np.zeros(num_groups * width, dtype=np.int64)
        first_rows = np.full(num_groups, PAD_ROW, dtype=np.int64)
        prefix_lens = np.ones(num_groups, dtype=np.int64)  # a padded group: the padding slot
        for g, (shared, group) in enumerate(groups):
            starts[group] = shared
            at = g * width + np.arange(len(group))
            places[group] = at
            grouped[group] = 1
            gather[g * width:(g + 1) * width] = group[0]
            gather[at] = group
            first_rows[g] = rows[group[0]]
            prefix_lens[g] = shared
        suffix_lens = np.asarray(kv_lens, dtype=np.int64) - starts
        arrays = [rows, starts, suffix_lens, indptr(suffix_lens), first_rows,
                  np.zeros(num_groups, dtype=np.int64), prefix_lens, indptr(prefix_lens),
                  gather, places, grouped]
        return arrays, (suffix_lens, prefix_lens, num_groups, width)

    @classmethod
    def from_device(cls, arrays: list[torch.Tensor], sizes: tuple) -> CascadePlan:
        """``arrays``: `host_arrays`' arrays moved to the device; ``sizes``: its host sizes."""
        suffix_lens, prefix_lens, num_groups, width = sizes
        return cls(suffix=KVRanges(*arrays[0:4], lens_host=suffix_lens),
                   prefix=KVRanges(*arrays[4:8], lens_host=prefix_lens),
                   gather=arrays[8], places=arrays[9], grouped=arrays[10].bool(),
                   num_groups=num_groups, width=width)

    def planned(self, backend: Any, table: torch.Tensor, num_kv_splits: int | None = None
                ) -> tuple[CascadePlan, Any, Any]:
        """The backend's views of the suffixes (``num_kv_splits``: a graph's fixed count) and
        of the prefixes (`prefix_splits`)."""
        return (self, backend.plan_part(self.suffix, table, num_kv_splits),
                backend.plan_part(self.prefix, table,
                                  prefix_splits(self.prefix.longest, num_kv_splits is not None)))
