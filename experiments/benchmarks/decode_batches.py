"""Synthetic decode batches for the engine's step benchmarks (no environment set on import, so
a GPU script may import it after Triton: `experiments.benchmarks.engine_step` sets the
interpreter for CPU runs)."""

from __future__ import annotations

import numpy as np

from testbed.cache.base import Lease
from testbed.scheduler.batch import Batch, BatchEntry
from testbed.scheduler.request_state import Req
from testbed.workloads.request import Request


def decode_batch(n: int, context: int, shared: int, vocab: int, seed: int = 0) -> Batch:
    """``n`` requests of ``context`` cached tokens decoding one token; the first ``shared``
    tokens are one prefix in the same slots (a tree's siblings)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, vocab, shared)
    prefix_slots = np.arange(1, shared + 1)
    entries, next_slot = [], shared + 1
    for i in range(n):
        own = context + 1 - shared
        tokens = np.concatenate([prefix, rng.integers(0, vocab, own)]).astype(np.int32)
        slots = np.concatenate([prefix_slots, np.arange(next_slot, next_slot + own)])
        next_slot += own
        request = Request(f"r{i}", tokens[:context], tokens[context:context + 1])
        req = Req(request=request, prompt=request.prompt, submitted_s=0.0, seq=i)
        req.lease = Lease(hit=context, slots=slots.astype(np.int32))
        req.output.append(int(tokens[context]))
        req.computed = context
        entries.append(BatchEntry(req, context, 1, produces_token=True))
    return Batch("decode", entries)
