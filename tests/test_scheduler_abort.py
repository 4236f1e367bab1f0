"""The scheduler's online controls: `Scheduler.abort` (a client went away) at each point of a
request's life, and the per-request stop rules of generate mode (``ignore_eos``, ``min_tokens``,
``stop_token_ids``). After an abort the cache's invariants hold, nothing stays locked, the KV the
request computed is cached, and every slot is free or in the tree."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import RadixCache
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.request import Request
from tests.conftest import toks


def replayed(rid: str, prompt, out: int) -> Request:
    return Request(rid, toks(*prompt), np.arange(1000, 1000 + out, dtype=np.int32))


def generated(rid: str, prompt, max_new: int, **stops) -> Request:
    return Request(rid, toks(*prompt), toks(), max_new_tokens=max_new, **stops)


def step(s: Scheduler, now: float, script=None) -> None:
    """One step: each entry gets its workload token, or ``script[len(output)]``. (Under overlap
    the last call may only apply the pending results: no batch, no work left.)"""
    batch = s.next_batch(now)
    if batch is None:
        assert not s.has_work, "stuck with work left"
        return
    tokens = []
    for e in batch.entries:
        req = e.req
        if not (e.produces_token and req.remaining_new_tokens):
            tokens.append(None)
        elif script is not None:
            tokens.append(script[len(req.output)])
        else:
            tokens.append(int(req.request.output[len(req.output)]))
    s.complete(batch, tokens, now)
    s.cache.check_invariants(s.leases())


def finish_all(s: Scheduler, now: float = 100.0) -> None:
    while s.has_work:
        step(s, now)
        now += 1
    s.take_finished()


def assert_drained(s: Scheduler, capacity: int) -> None:
    s.check_drained()  # no request left, no lease, nothing locked, invariants
    cache = s.cache
    assert cache.protected_size == 0
    assert cache.pool.num_free + cache.evictable_size == capacity
    assert cache.available_size == capacity


def test_aborting_a_waiting_request_takes_it_out_of_the_queue_and_touches_no_kv():
    cache = RadixCache(100)
    s = Scheduler(cache, SchedulerConfig(name="fcfs"))
    r = s.submit(replayed("r", range(10), 4), 0.0)
    assert s.abort(r, 1.0)
    assert (r.aborted, r.finish_s, r.output) == (True, 1.0, [])
    assert not s.has_work and s.next_batch(2.0) is None
    assert cache.total_size == 0
    assert_drained(s, 100)
    assert not s.abort(r, 3.0)  # already over: nothing to do


def test_aborting_mid_chunked_prefill_caches_the_chunks_computed_and_unlocks_them():
    cache = RadixCache(100)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", chunked_prefill_size=16))
    r = s.submit(replayed("r", range(40), 4), 0.0)
    other = s.submit(replayed("o", range(200, 205), 3), 0.0)
    step(s, 1.0)  # the first 16-token chunk
    assert s.chunked is r and r.computed == 16
    assert s.abort(r, 2.0)
    assert s.chunked is None and r.lease is None and r.inserted
    assert cache.match(toks(*range(40))) == 16  # its chunk stays cached, unlocked
    finish_all(s)
    assert other.output == [1000, 1001, 1002] and r.output == []
    assert_drained(s, 100)


@pytest.mark.parametrize("overlap", [False, True])
def test_aborting_mid_decode_caches_prompt_and_outputs_with_kv_and_drops_pending_tokens(overlap):
    cache = RadixCache(100)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", overlap=overlap))
    r = s.submit(replayed("r", range(10), 8), 0.0)
    keep = s.submit(replayed("k", range(50, 56), 5), 0.0)
    for t in range(3):  # prefill, then two decode steps
        step(s, float(t))
    assert s.abort(r, 3.0)
    # without overlap 3 tokens were applied, the last without KV; with overlap the third step's
    # token is still pending (dropped now) and its KV (the second token's) exists
    assert r.output == [1000, 1001, 1002] if not overlap else r.output == [1000, 1001]
    assert r.computed == 12
    assert cache.match(toks(*range(10), 1000, 1001, 1002)) == 12
    assert r not in s.running
    finish_all(s)
    assert keep.output == [1000, 1001, 1002, 1003, 1004]
    assert r.output == ([1000, 1001, 1002] if not overlap else [1000, 1001])
    assert_drained(s, 100)


def test_aborting_a_retracted_request_leaves_the_queue_and_the_other_finishes():
    cache = RadixCache(40)  # both run (reservations clipped), then outgrow the pool
    s = Scheduler(cache, SchedulerConfig(name="fcfs", clip_max_new_tokens=1))
    a = s.submit(replayed("a", range(10), 20), 0.0)
    b = s.submit(replayed("b", range(50, 60), 20), 0.0)
    now = 0.0
    while b.preemptions == 0:
        step(s, now)
        now += 1
    assert b.lease is None and b in s.waiting
    assert s.abort(b, now)
    assert b not in s.waiting and b.aborted
    finish_all(s, now + 1)
    assert a.output == list(range(1000, 1020)) and a.finished and not a.aborted
    assert_drained(s, 40)


def test_aborts_at_every_point_of_a_busy_run_leave_no_lock_and_no_slot_behind():
    cache = RadixCache(64, page_size=4)
    s = Scheduler(cache, SchedulerConfig(name="lpm", chunked_prefill_size=8,
                                         clip_max_new_tokens=1))
    reqs = [s.submit(replayed(f"r{i}", [1, 2, 3, 4, i, *range(10, 14 + 3 * i)], 10), 0.0)
            for i in range(8)]
    now = 0.0
    for i, r in enumerate(reqs):  # one abort after each step, wherever its request is
        step(s, now)
        now += 1
        if i % 2 == 0:
            s.abort(r, now)
    finish_all(s, now)
    assert all(r.finished for r in reqs)
    for i, r in enumerate(reqs):
        if not r.aborted:
            assert r.output == list(range(1000, 1010))
    assert_drained(s, 64)


EOS = 7
SCRIPT = [7, 3, 7, 7, 5, 6]  # what the "model" writes, token by token


@pytest.mark.parametrize("stops, output", [
    ({}, [7]),                                            # EOS ends it, kept
    ({"min_tokens": 2}, [7, 3, 7]),                       # EOS counts only after 2 tokens
    ({"ignore_eos": True}, [7, 3, 7, 7, 5]),              # max_new_tokens ends it
    ({"ignore_eos": True, "min_tokens": 4}, [7, 3, 7, 7, 5]),
    ({"ignore_eos": True, "stop_token_ids": (3,)}, [7, 3]),
    ({"stop_token_ids": (5,), "min_tokens": 3}, [7, 3, 7, 7]),
])
def test_generated_requests_stop_by_eos_min_tokens_ignore_eos_and_stop_ids(stops, output):
    s = Scheduler(RadixCache(100), SchedulerConfig(name="fcfs"), eos_token_ids=[EOS])
    r = s.submit(generated("g", range(10), 5, **stops), 0.0)
    now = 0.0
    while s.has_work:
        step(s, now, SCRIPT)
        now += 1
    assert r.output == output and r.finished and not r.aborted
    assert_drained(s, 100)
