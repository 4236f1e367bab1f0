"""Cascade groups of a step: which of its requests read a shared cached prefix once.

The ``attention`` key names how decode attention runs. Its ``cascade*`` names turn on cascade
decoding: in a step where every request computes one token, requests whose leases share a cached
radix node read that prefix's KV once per group (`testbed.cache.shared_prefix` picks the groups,
at the nodes where sharing pays on the device: `testbed.scheduler.cascade_rule`).
The engine plans its kernels from these groups (`testbed.engine.cascade`) and the simulator
prices the KV they do not read (`testbed.sim.cost_model.StepShape.shared`); both call the same
`DecodeGroups`, so they agree by construction. Nothing here changes what is scheduled.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from testbed.cache.shared_prefix import shared_prefix_groups
from testbed.errors import check_choice
from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.cascade_rule import CascadeRule

#: the ``attention`` key's names. ``cascade``: cascade decoding on the device's default kernels
#: (triton on CUDA, torch elsewhere); ``cascade_torch``, ``cascade_triton``: on those
ATTENTION_BACKENDS = ("torch", "triton", "cascade", "cascade_torch", "cascade_triton")


def default_attention(device: str) -> str:
    """The engine's kernels where ``attention`` is null: Triton on CUDA (its paged kernels read
    each request's KV in place); on any other device the torch kernels with cascade decoding.
    The torch backend copies every request's KV, padded, into one batch per layer and step, so a
    prefix that n requests share is copied n times; cascade copies it once per group and decodes
    plainly where no group forms (vLLM V1 likewise decodes in cascade by default where a batch
    shares a prefix)."""
    return "triton" if device.startswith("cuda") else "cascade"


def cascades(attention: Any, key: str = "attention") -> bool:
    """Whether ``attention`` (the config ``key``'s value; None: plain decode) decodes in
    cascade."""
    check_choice(key, attention, ATTENTION_BACKENDS, null=True)
    return attention is not None and attention.startswith("cascade")


def current_leases(entries: list[BatchEntry]) -> list[Any]:
    """Each entry's lease, or None where its slots were bound before the lease changed (the cache
    took over its prompt's slots since: its KV may sit in other slots than the lease's)."""
    leases = []
    for e in entries:
        lease = e.req.lease
        current = (lease is not None and e.gen == e.req.preemptions
                   and e.kv_slots().base is lease.slots.base)
        leases.append(lease if current else None)
    return leases


class DecodeGroups:
    """Groups ``(shared tokens, entry indices)`` of decode steps, from the radix tree.

    A step with an entry that computes more than one token gets none (cascade is for decode).
    An entry whose slots were bound before its lease changed (the cache took over its prompt's
    slots since) joins none: its prefix may sit in other slots than the tree's. Consecutive
    decode steps of the same requests usually hold the same tree nodes; then the last step's
    groups are reused. They stay right even if the tree has split a node on their paths since
    (a split keeps the node object and where it ends; locked nodes are never evicted), though a
    fresh pass might then pick other groups. The last step's tree nodes are held, so their ids
    (the reuse key) cannot pass to new nodes meanwhile; one instance may serve several caches
    (the simulator's replicas share an executor).

    ``min_saved`` (the ``cascade_min_saved`` key): a step whose groups would save fewer KV reads
    than this runs as plain decode. Cascade costs a second attention pass and a merge per layer
    whatever it saves; where those cost more than the reads saved (small groups on the CPU
    engine, whose steps are bound by per-operation overhead), plain decode is faster.

    ``rule`` (`CascadeRule`, from ``engine.cascade_rule``, the device and the model): a group
    forms only at a tree node where sharing pays (`testbed.scheduler.cascade_rule.sharing_pays`);
    the requests under a node that does not pay go to its children's groups, or read the prefix
    in their own pass. None: every shared node (a device without a grid to fill).
    """

    def __init__(self, min_tokens: int = 1, min_saved: int = 0,
                 rule: CascadeRule | None = None) -> None:
        self.min_tokens = min_tokens
        self.min_saved = min_saved  # a step saving fewer KV reads than this decodes plainly
        self.rule = rule or CascadeRule()
        self._pays = self.rule.pays()  # None: every node pays (nothing to call per node)
        self._last: tuple[tuple, list[tuple[int, list[int]]], list[Any]] | None = None

    def __call__(self, entries: list[BatchEntry]) -> list[tuple[int, list[int]]]:
        if any(e.new != 1 or e.draft is not None for e in entries):
            return []  # a verification step (speculative) reads each prefix per request
        leases = current_leases(entries)
        key = tuple((id(lease.handle), lease.cached) if lease else None for lease in leases)
        if self._last is None or self._last[0] != key:
            held = [lease.handle for lease in leases if lease]
            groups = shared_prefix_groups(leases, self.min_tokens, self._pays)
            if saved_reads(groups) < self.min_saved:
                groups = []
            self._last = key, groups, held
        return self._last[1]


def attach_groups(batch: Any, groups: DecodeGroups | None) -> None:
    """Put a formed batch's cascade groups on it (``batch.decode_groups``): the scheduler's
    fact about who shares which prefix, read by the engine's plan and the simulator's price.
    Nothing with ``groups`` None (no cascade decoding)."""
    if batch is not None and groups is not None:
        batch.decode_groups = groups(batch.entries)


def saved_reads(groups: list[tuple[int, list[int]]]) -> int:
    """KV tokens a cascade step does not read: ``(n - 1) · P`` per group."""
    return sum((len(members) - 1) * shared for shared, members in groups)


class SharedReads:
    """The KV a decode step reads again (`testbed.sim.step_shape.StepShape.reread`): of its
    requests' cached slots, every slot once per request that reads it after the first,
    ``Σ cached − |∪ cached slots|``.

    A CPU finds such KV in its caches (docs/design.md §3). It counts every repeated read: a tree
    whose leaves share the root's prompt and, in pairs, a thought below it counts both, where the
    cascade groups (`DecodeGroups`, disjoint) save only one of them. It reads slots, not a tree,
    so any cache's leases count (a radix node's or vLLM-style blocks a hit shares). Only cached
    slots can be shared; the requests' own tokens are theirs. The count is reused while the
    step's leases and their cached lengths stay the same.
    """

    def __init__(self) -> None:
        self._last: tuple[tuple, int, list[Any]] | None = None  # the leases held: ids stay theirs

    def __call__(self, entries: list[BatchEntry]) -> int:
        if len(entries) < 2 or any(e.new != 1 for e in entries):
            return 0
        leases = [lease for lease in current_leases(entries) if lease is not None]
        key = tuple((id(lease), lease.cached) for lease in leases)
        if self._last is None or self._last[0] != key:
            cached = [lease.slots[:lease.cached] for lease in leases if lease.cached]
            total = sum(len(c) for c in cached)
            repeated = total - len(np.unique(np.concatenate(cached))) if cached else 0
            self._last = key, repeated, leases
        return self._last[1]
