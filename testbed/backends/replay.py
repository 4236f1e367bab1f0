"""The replay backend: requests served one at a time in arrival order, no time (docs/design.md §4).

For each request: match its prompt and protect the hit, make room for the rest of prompt+output
(evicting as needed), insert prompt+output, give duplicates back, unprotect. A request whose
sequence could never fit in the cache is served uncached: no hit, nothing evicted, nothing inserted
(the same rule for every cache, so their records stay comparable).

With lower tiers (host, disk), the part of the match below the GPU is loaded back right after the
match (there is no time here, so loading always wins unless the GPU cannot hold it); it counts as
hit, and the record says how many hit tokens came from each tier.
"""

from __future__ import annotations

from typing import Iterable

from tqdm import tqdm

from testbed.cache.base import PrefixCache
from testbed.cache.eviction import Requester
from testbed.results.metrics import RequestRecord, tier_fields
from testbed.perf import gc_paused
from testbed.workloads.request import Request


def replay(requests: Iterable[Request], cache: PrefixCache, save_token_ids: bool = False,
           progress: bool = False, check_invariants: bool = False) -> list[RequestRecord]:
    """One record per request, in order (``requests`` may be any iterable, read once); with
    ``check_invariants`` the cache checks its bookkeeping after every request."""
    records = []
    count_slots = getattr(cache, "count_slots", None)
    if count_slots is not None:  # no KV here: a pool that counts its slots, not names them
        count_slots()
    tiered = bool(cache.lower_tiers)
    serve = cache.replay_one
    with gc_paused():
        # (without a bar, the requests themselves: a disabled bar still wraps each in a generator)
        for r in (tqdm(requests, desc=f"replay {cache.name}", unit="req", disable=None) if progress
                  else requests):
            hit, evicted, inserted, loaded = serve(r.prompt, r.output,
                                                   Requester(r.id, r.priority, r.category))
            # positional: twice as fast as keywords, once per request (RequestRecord's order)
            record = RequestRecord(r.id, r.program, r.arrival_s, None, None, len(r.prompt), hit,
                                   len(r.output), evicted, inserted)
            if save_token_ids:
                record.prompt_ids, record.output_ids = r.prompt.tolist(), r.output.tolist()
            if tiered:
                for key, value in tier_fields(hit, loaded).items():
                    setattr(record, key, value)
            records.append(record)
            if check_invariants:
                cache.check_invariants()
    return records

