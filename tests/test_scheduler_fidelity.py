"""The scheduler as SGLang 0.4.10 runs it: insert after prefill, in-batch deprioritization, the
batch-full state, retraction room, overlap, LPM aging. Outputs are longer than one token
everywhere, so requests run concurrently and decode while others are admitted."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import RadixCache
from experiments.studies.fairness_setup import hot_cold_requests, run_aging
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.executor import SimExecutor
from testbed.serving.serve import serve
from testbed.sim.specs import hardware_spec, model_spec
from testbed.workloads.request import Request
from tests.conftest import toks

PREFIX = np.arange(10_000, 11_024, dtype=np.int32)  # 1,024 shared tokens
SUFFIXES = [16, 24, 32, 40, 48, 56, 64, 20]


def burst() -> list[Request]:
    """8 requests sharing a 1,024-token prefix, arriving together, 32-token outputs."""
    reqs = []
    for i, n in enumerate(SUFFIXES):
        suffix = np.arange(20_000 + 100 * i, 20_000 + 100 * i + n, dtype=np.int32)
        reqs.append(Request(f"b{i}", np.concatenate([PREFIX, suffix]),
                            np.arange(1, 33, dtype=np.int32)))
    return reqs


def h100_llama3_executor() -> SimExecutor:
    from tests.test_sim import config
    model = model_spec(dict(config("model=llama3_8b").model))
    return SimExecutor(RooflineCostModel(model, hardware_spec(dict(config("hardware=h100").hardware))))


def run_burst(**scheduler):
    cache = RadixCache(200_000)
    sched, result = serve(burst(), cache, {"name": "lpm", **scheduler}, h100_llama3_executor(),
                          record_steps=True)
    prefills = [s for s in result.steps if s.kind == "prefill"]
    hits = {r.id: r.cached_tokens for r in result.reqs}
    return prefills, hits


def test_burst_runs_as_sglang_sorting_the_deprioritized_last_in_one_chunked_batch():
    prefills, hits = run_burst()
    # b0 first, b1..b7 deprioritized but admitted behind it: 7 whole requests fill 7,448 of the
    # 8,192-token chunk budget, b7 gets the remaining 744 tokens and finishes in a second step.
    assert [s.ids for s in prefills] == [tuple(f"b{i}" for i in range(8)), ("b7",)]
    assert [s.new for s in prefills] == [(1040, 1048, 1056, 1064, 1072, 1080, 1088, 744), (300,)]
    assert set(hits.values()) == {0}


def test_burst_with_in_batch_hold_computes_the_prefix_once_and_seven_requests_hit_it():
    prefills, hits = run_burst(in_batch_hold=True)
    assert len(prefills) == 2 and prefills[0].ids == ("b0",)
    assert sorted(hits.values()) == [0] + [1024] * 7
    assert sum(sum(s.new) for s in prefills) == 1024 + sum(SUFFIXES)


def test_a_request_admitted_while_another_decodes_hits_its_prompt():
    cache = RadixCache(10_000)
    s = Scheduler(cache, SchedulerConfig(name="fcfs"))
    a = s.submit(Request("a", toks(*range(100)), np.arange(1, 11, dtype=np.int32)), 0.0)
    batch = s.next_batch(0.0)
    s.complete(batch, [1], 1.0)
    assert cache.match(toks(*range(100), 5)) == 100  # inserted after prefill, not at finish
    assert cache.protected_size == 100  # ... and the running request's lock moved onto it
    b = s.submit(Request("b", toks(*range(100), 7, 8), np.arange(1, 5, dtype=np.int32)), 1.0)
    batch = s.next_batch(1.0)
    assert batch.kind == "prefill" and [(e.req.id, e.context, e.new) for e in batch.entries] == [
        ("b", 100, 2)]
    assert b.cached_tokens == 100 and not a.finished
    cache.check_invariants(s.leases())


def drive(s: Scheduler, now: float = 0.0):
    """Run to completion with forced tokens; returns (kind, ids) per step."""
    steps = []
    while s.has_work:
        batch = s.next_batch(now)
        if batch is None:  # (with overlap the last results are applied by a call that forms none)
            assert not s.has_work, "stuck"
            break
        s.cache.check_invariants(s.leases())
        steps.append((batch.kind, tuple(e.req.id for e in batch.entries)))
        tokens = [int(e.req.request.output[min(len(e.req.output), len(e.req.request.output) - 1)])
                  if e.produces_token else None for e in batch.entries]
        s.complete(batch, tokens, now)
        now += 1.0
        assert len(steps) < 10_000
    return steps


def test_a_batch_that_ran_out_of_kv_tries_no_prefill_until_the_running_batch_shrinks():
    # capacity 100; 20-token prompts, 10 outputs, reservations at ratio 1.0: r0, r1, r2 take
    # 3 × 30 of 100 and r3 does not fit (30 >= 10): the batch is full. After one decode the
    # ratio has decayed to 0, so r3 would fit (30 < 100 - 3 × 21), but a full batch tries no
    # prefill until it shrinks: the nine decodes that finish r0..r2 come first.
    cache = RadixCache(100)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", init_new_token_ratio=1.0,
                                         min_new_token_ratio_factor=0.0,
                                         new_token_ratio_decay_steps=1))
    reqs = [s.submit(Request(f"r{i}", toks(*range(100 * i, 100 * i + 20)),
                             np.arange(1, 11, dtype=np.int32)), 0.0) for i in range(4)]
    steps = drive(s)
    assert steps[0] == ("prefill", ("r0", "r1", "r2"))
    assert steps[1:10] == [("decode", ("r0", "r1", "r2"))] * 9
    assert steps[10] == ("prefill", ("r3",))
    assert all(r.finished for r in reqs)


def test_under_0410_finished_requests_hold_their_running_slot_until_the_next_decode_step():
    cache = RadixCache(10_000)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", max_running_requests=2, sglang="0.4.10"))
    out = lambda n: np.arange(1, n + 1, dtype=np.int32)  # noqa: E731
    s.submit(Request("short", toks(*range(10)), out(2)), 0.0)
    s.submit(Request("long", toks(*range(100, 110)), out(6)), 0.0)
    s.submit(Request("late", toks(*range(200, 210)), out(2)), 0.0)
    steps = drive(s)
    # "short" finishes in the first decode; the batch was full (2 running), so the next step is a
    # decode that filters it out; only then is "late" admitted.
    assert steps[:4] == [("prefill", ("short", "long")), ("decode", ("short", "long")),
                         ("decode", ("long",)), ("prefill", ("late",))]


def test_under_0410_retraction_leaves_the_rest_room_for_retract_decode_steps_tokens_each():
    cache = RadixCache(120)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", clip_max_new_tokens=1,
                                         retract_decode_steps=20, sglang="0.4.10"))
    reqs = [s.submit(Request(f"r{i}", toks(*range(100 * i, 100 * i + 10)),
                             np.arange(1, 41, dtype=np.int32)), 0.0) for i in range(4)]
    retractions = []
    while s.has_work:
        before = s.preemptions
        batch = s.next_batch(0.0)
        if s.preemptions > before:
            running = [r for r in s.running if not r.finished]
            retractions.append((s.preemptions - before, len(running), cache.available_size))
            # (this step's tokens are already allocated: one slot each)
            assert cache.available_size + len(running) >= 20 * len(running) or len(running) == 1
        tokens = [int(e.req.request.output[len(e.req.output)]) if e.produces_token else None
                  for e in batch.entries]
        s.complete(batch, tokens, 0.0)
    assert retractions and all(r.output == list(range(1, 41)) for r in reqs)
    # the first retraction: 4 requests of 10 + 19 tokens fill 120 - 4 = 116; one goes (frees
    # 29), 3 left need 60 > 33 free: a second goes; 2 left need 40 <= 62
    assert retractions[0][:2] == (2, 2)


def test_0410_overlap_decodes_a_finished_request_once_more_and_inserts_after_the_next_batch():
    cache = RadixCache(10_000)  # (0.5.23 skips that step: test_sglang523_steps)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", overlap=True, sglang="0.4.10"))
    a = s.submit(Request("a", toks(*range(50)), np.arange(1, 3, dtype=np.int32)), 0.0)
    b1 = s.next_batch(0.0)
    s.complete(b1, [1], 1.0)
    assert cache.match(toks(*range(50), 9)) == 0  # results not applied yet
    b2 = s.next_batch(1.0)  # formed first (a decode of a), then b1's results applied
    assert b2.kind == "decode" and a.output == [1]
    assert cache.match(toks(*range(50), 9)) == 50
    s.complete(b2, [2], 2.0)
    b3 = s.next_batch(2.0)  # a is still decoded: its finish is not known when b3 forms
    assert b3.kind == "decode" and [e.req.id for e in b3.entries] == ["a"]
    assert a.finished and s.take_finished() == [a] and a.output == [1, 2]
    s.complete(b3, [None], 3.0)
    assert s.next_batch(3.0) is None and not s.has_work
    assert cache.protected_size == 0 and cache.pool.num_free + cache.total_size == 10_000
    cache.check_invariants()


def test_overlap_never_decodes_a_prefill_only_call_and_forms_again_once_its_results_free_room():
    """A prefill-only call (SGLang's fork, no output) makes no token, so the batch formed while
    its prefill is in flight must not decode it (there is no input token: the engine crashed on
    an empty ``input_ids``). And when no batch forms until its results are applied, which
    unlocks its 50 tokens, the step forms again at once: b fits only then, and nothing else
    would wake the driver."""
    cache = RadixCache(100)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", overlap=True))
    fork = s.submit(Request("fork", toks(*range(50)), toks()), 0.0)
    b1 = s.next_batch(0.0)
    assert [e.req.id for e in b1.entries] == ["fork"]
    b = s.submit(Request("b", toks(*range(200, 260)), np.arange(1, 11, dtype=np.int32)), 0.5)
    s.complete(b1, [None], 1.0)
    b2 = s.next_batch(1.0)  # before fork's results: 60 + 10 > 100 - 50 locked; after: it fits
    assert fork.finished and s.take_finished() == [fork] and fork.output == []
    assert b2.kind == "prefill" and [e.req.id for e in b2.entries] == ["b"]
    assert all(len(e.input_ids()) == e.new for e in b2.entries)
    drive(s)
    assert b.finished and b.output == list(range(1, 11))
    cache.check_invariants()
    assert cache.protected_size == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_every_request_finishes_with_its_tokens_under_eviction_and_retraction(overlap):
    cache = RadixCache(90)
    s = Scheduler(cache, SchedulerConfig(name="lpm", clip_max_new_tokens=2, overlap=overlap))
    shared = list(range(500, 520))
    reqs = [s.submit(Request(f"r{i}", toks(*shared, *range(100 * i, 100 * i + 5)),
                             np.arange(1, 26, dtype=np.int32)), 0.0) for i in range(6)]
    drive(s)
    assert all(r.finished and r.output == list(range(1, 26)) for r in reqs)
    assert s.preemptions > 0
    cache.check_invariants()
    assert cache.protected_size == 0 and cache.pool.num_free + cache.total_size == 90


def test_lpm_aging_lets_a_long_waiting_cold_request_overtake_warm_ones():
    cache = RadixCache(None)
    for seq in ([*range(1000, 1100)],):
        lease = cache.acquire(toks(*seq))
        cache.extend(lease, len(seq))
        cache.release(lease, toks(*seq))
    warm = lambda i, t: Request(f"w{i}", toks(*range(1000, 1100), i), toks(1, 2))  # noqa: E731
    for aging, expected in [(0.0, ["w0", "cold"]), (10.0, ["cold", "w0"])]:
        s = Scheduler(cache, SchedulerConfig(name="lpm", lpm_aging=aging))
        s.submit(Request("cold", toks(7, 7, 7), toks(1, 2)), 0.0)
        s.submit(warm(0, 20.0), 20.0)
        order = s.policy.order(s.waiting, now=20.0).queue
        # cold: 0 + 10 × 20 = 200 > warm's 100 + 0
        assert [r.id for r in order] == expected


def test_lpm_aging_halves_the_cold_requests_p99_ttft_under_overload_at_the_same_hit_rate():
    requests = hot_cold_requests(600, cold_share=0.2)
    plain, aged = (run_aging(requests, aging, in_flight=120, capacity=200_000, max_running=16)
                   for aging in (0.0, 1024.0))
    assert plain["ttft_p99_cold_s"] > 2 * plain["ttft_p99_warm_s"]  # LPM starves the cold
    assert aged["ttft_p99_cold_s"] <= 0.5 * plain["ttft_p99_cold_s"]
    assert abs(aged["hit_rate"] - plain["hit_rate"]) <= 0.05 * plain["hit_rate"]
