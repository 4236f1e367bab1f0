"""Decode steps over a radix tree's leases, for the cascade tests (`test_cascade.py`,
`test_cascade_rule.py`)."""

from __future__ import annotations

import numpy as np

from testbed.cache import RadixCache
from testbed.scheduler.batch import BatchEntry
from testbed.scheduler.request_state import Req
from testbed.workloads.request import Request


def leases_of(prompts: list[np.ndarray]):
    """Each prompt cached in one radix tree, then a lease on each (the step's requests)."""
    cache = RadixCache(sum(len(p) for p in prompts) + 10)
    for p in prompts:
        lease = cache.acquire(p)
        cache.extend(lease, len(p) - lease.hit)
        cache.release(lease, p)
    return [cache.acquire(p) for p in prompts]


def decode_entries(leases) -> list[BatchEntry]:
    """A decode step of the leases' requests: each computes the token after its cached prompt."""
    out = []
    for i, lease in enumerate(leases):
        req = Req(request=Request(f"r{i}", np.zeros(1, np.int32), np.zeros(1, np.int32)),
                  prompt=np.zeros(1, np.int32), submitted_s=0.0, seq=i)
        req.lease = lease
        out.append(BatchEntry(req, lease.cached - 1, 1, produces_token=True))
    return out
