"""The shared scheduler: queue orders, in-batch deferral, admission, chunking, retraction."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import BlockHashCache, NoCache, RadixCache
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.policy import dfs_weight_order
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.request import Request
from tests.conftest import toks


def request(rid: str, prompt, out: int = 4) -> Request:
    return Request(rid, toks(*prompt), np.arange(1000, 1000 + out, dtype=np.int32))


def cache_with(*seqs, capacity=None) -> RadixCache:
    cache = RadixCache(capacity)
    for seq in seqs:
        lease = cache.acquire(toks(*seq))
        cache.extend(lease, len(seq) - lease.hit)
        cache.release(lease, toks(*seq))
    return cache


def waiting(scheduler: Scheduler, *prompts):
    return [scheduler.submit(request(f"r{i}", p), 0.0) for i, p in enumerate(prompts)]


def test_lpm_orders_by_longest_cached_prefix_with_fcfs_ties():
    cache = cache_with(range(100, 150), range(200, 210))
    s = Scheduler(cache, SchedulerConfig(name="lpm", in_batch_prefix_caching=False))
    reqs = waiting(s, [9, 9, 9], [*range(200, 210), 1], [*range(100, 150), 2], [*range(200, 205), 3],
                   [*range(100, 150), 4])
    order = s.policy.order(s.waiting).queue
    assert [r.id for r in order] == ["r2", "r4", "r1", "r3", "r0"]


def test_lpm_falls_back_to_fcfs_above_the_threshold():
    cache = cache_with(range(100, 150))
    s = Scheduler(cache, SchedulerConfig(name="lpm", lpm_fallback_threshold=2))
    waiting(s, [1, 2], [3, 4], [*range(100, 150), 5])
    assert s.policy.effective(3) == "fcfs"
    assert [r.id for r in s.policy.order(s.waiting).queue] == ["r0", "r1", "r2"]
    assert s.policy.effective(2) == "lpm"


def test_lpm_with_no_cache_is_fcfs():
    s = Scheduler(NoCache(100), SchedulerConfig(name="lpm"))
    waiting(s, [5, 6], [1, 2])
    assert s.policy.effective(2) == "fcfs"
    assert s.policy.order(s.waiting).deferred == set()


def test_dfs_weight_visits_heavier_subtrees_first_and_a_nodes_requests_after_its_subtree():
    # Tree: A=[1..10] with children B=[11..20] and C=[21..30]; D=[50..59] beside A.
    cache = cache_with([*range(1, 11), *range(11, 21)], [*range(1, 11), *range(21, 31)], range(50, 60))
    s = Scheduler(cache, SchedulerConfig(name="dfs_weight", in_batch_prefix_caching=False))
    waiting(s,
            [*range(50, 60), 7],                      # r0 ends in D
            [*range(1, 11), *range(21, 31), 7],       # r1 ends in C
            [*range(1, 11), 99],                      # r2 ends in A
            [*range(1, 11), *range(21, 31), 8],       # r3 ends in C
            [*range(1, 11), *range(11, 21), 7])       # r4 ends in B
    order = [r.id for r in s.policy.order(s.waiting).queue]
    # A's subtree holds 4 requests, D's 1: A first; inside A, C (2) before B (1), then A's own.
    assert order == ["r1", "r3", "r4", "r2", "r0"]


def test_dfs_weight_order_on_an_empty_tree_keeps_fcfs():
    cache = RadixCache(None)
    s = Scheduler(cache, SchedulerConfig(name="dfs_weight"))
    reqs = waiting(s, [1, 2], [3, 4])
    assert dfs_weight_order(cache.root, reqs, [cache.root, cache.root]) == reqs


def test_lpm_sorts_a_request_whose_prefix_another_will_compute_last_and_still_admits_it():
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm"))
    shared = list(range(500, 540))  # 40 tokens: above the 32-token thresholds
    reqs = waiting(s, [*shared, 1, 2], [*shared, 3, 4], [7, 8, 9])
    ordering = s.policy.order(s.waiting)
    assert ordering.deferred == {id(reqs[1])} and not ordering.held
    batch = s.next_batch()  # SGLang 0.4.10: deprioritized = sorted last, not skipped
    assert [(e.req.id, e.context, e.new) for e in batch.entries] == [
        ("r0", 0, 42), ("r2", 0, 3), ("r1", 0, 42)]


def test_in_batch_hold_holds_the_deprioritized_request_until_it_hits_the_shared_prefix():
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm", in_batch_hold=True))
    shared = list(range(500, 540))
    waiting(s, [*shared, 1, 2], [*shared, 3, 4], [7, 8, 9])
    batch = s.next_batch()
    assert [e.req.id for e in batch.entries] == ["r0", "r2"]
    s.complete(batch, [1000, 1000], now=1.0)  # r0 decodes on; its prompt is in the tree now
    batch = s.next_batch()
    assert [(e.req.id, e.context) for e in batch.entries] == [("r1", 40)]


def test_in_batch_hold_holds_no_request_that_shares_nothing_even_at_a_threshold_of_0():
    """SGLang deprioritizes every request at ``in_batch_deprioritize_threshold=0``, the first
    too, and so puts none in its tree of the prefixes the step computes: held, the whole queue
    sat out and the run stalled (found by the fuzzer, issue 58). Nothing shares a prefix with a
    request of that tree, so nothing is held: the step is SGLang's."""
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm", in_batch_hold=True,
                                                    in_batch_deprioritize_threshold=0))
    shared = list(range(500, 510))
    waiting(s, [*shared, 1, 2], [*shared, 3, 4], [7, 8, 9])
    ordering = s.policy.order(s.waiting)
    assert ordering.held and ordering.deferred == set()
    assert [e.req.id for e in s.next_batch().entries] == ["r0", "r1", "r2"]


def test_dfs_weight_defers_nothing():
    s = Scheduler(RadixCache(None), SchedulerConfig(name="dfs_weight"))
    shared = list(range(500, 540))
    waiting(s, [*shared, 1, 2], [*shared, 3, 4], [7, 8, 9])
    assert s.policy.order(s.waiting).deferred == set()
    assert len(s.next_batch().entries) == 3


def test_short_shared_prefixes_are_not_deferred():
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm"))
    waiting(s, [*range(20), 1], [*range(20), 2])
    assert s.policy.order(s.waiting).deferred == set()


def test_unknown_policy_and_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="scheduler must be one of fcfs, lpm, dfs_weight, random, lof"):
        SchedulerConfig.from_mapping({"name": "sjf"})
    with pytest.raises(ValueError, match="scheduler.max_prefill_tokens must be >= 1, got 0"):
        SchedulerConfig.from_mapping({"name": "fcfs", "max_prefill_tokens": 0})
    with pytest.raises(ValueError, match="scheduler.chunk is not a setting of scheduler=fcfs; allowed: name, sglang, enable_priority_scheduling, max_running_requests"):
        SchedulerConfig.from_mapping({"chunk": 3})


@pytest.mark.parametrize("second, admitted", [(51, ["r0", "r1"]), (52, ["r0"])])
def test_admission_refuses_a_request_whose_tokens_reach_the_kv_budget(second, admitted):
    # SGLang 0.4.10's add_one_req refuses when extend + min(max_new, clip) >= rem_total: r0
    # takes 40 + 4 of 100; r1 needs second + 4 against the 56 left (0.5.23: test_sglang523_steps)
    s = Scheduler(RadixCache(100), SchedulerConfig(name="fcfs", init_new_token_ratio=0.0,
                                                   sglang="0.4.10"))
    waiting(s, list(range(40)), list(range(100, 100 + second)), [7, 7])
    assert [e.req.id for e in s.next_batch().entries] == admitted
    assert s.batch_is_full  # (r2, or r1) refused for KV: no prefill until the batch shrinks


@pytest.mark.parametrize("second, admitted", [(49, ["r0", "r1"]), (50, ["r0"])])
def test_the_prefill_token_budget_refuses_an_extend_equal_to_what_is_left(second, admitted):
    # 0.4.10 caps the input with chunking on too (0.5.23: only without, test_sglang523_steps)
    s = Scheduler(RadixCache(None), SchedulerConfig(name="fcfs", max_prefill_tokens=90,
                                                    sglang="0.4.10"))
    waiting(s, list(range(40)), list(range(100, 100 + second)))
    assert [e.req.id for e in s.next_batch().entries] == admitted
    assert not s.batch_is_full  # a step budget, not KV: the next step tries again


def test_a_long_prompt_is_chunked_and_each_chunk_is_shared_at_once():
    cache = RadixCache(1000)
    s = Scheduler(cache, SchedulerConfig(name="fcfs", chunked_prefill_size=16))
    (r,) = waiting(s, list(range(40)))
    contexts = []
    for _ in range(3):
        batch = s.next_batch()
        contexts.append([(e.context, e.new, e.produces_token) for e in batch.entries])
        s.complete(batch, [1000 if e.produces_token else None for e in batch.entries], now=1.0)
        cache.check_invariants(s.leases())
        if s.chunked:
            assert cache.match(toks(*range(40))) == r.computed  # committed: others can hit it
    assert contexts == [[(0, 16, False)], [(16, 16, False)], [(32, 8, True)]]
    assert r.output == [1000] and not r.finished
    assert cache.match(toks(*range(40), 5)) == 40  # the whole prompt, while it decodes


def drive(scheduler: Scheduler, max_steps: int = 10_000) -> int:
    """Run the scheduler to completion with predetermined tokens, checking invariants each step."""
    steps = 0
    while scheduler.has_work:
        batch = scheduler.next_batch()
        assert batch is not None, "stuck with work left"
        scheduler.cache.check_invariants(scheduler.leases())
        tokens = [int(e.req.request.output[len(e.req.output)])
                  if e.produces_token and e.req.remaining_new_tokens else None for e in batch.entries]
        scheduler.complete(batch, tokens, now=float(steps))
        steps += 1
        assert steps < max_steps
    return steps


@pytest.mark.parametrize("make_cache", [lambda: RadixCache(60), lambda: BlockHashCache(64, block_size=4),
                                        lambda: NoCache(60)])
def test_retraction_requeues_and_every_request_finishes_with_its_tokens(make_cache):
    cache = make_cache()
    s = Scheduler(cache, SchedulerConfig(name="fcfs", init_new_token_ratio=0.0,
                                         min_new_token_ratio_factor=0.0, clip_max_new_tokens=1))
    reqs = [s.submit(request(f"r{i}", [i, *range(10, 18)], out=12), 0.0) for i in range(5)]
    drive(s)
    assert s.preemptions > 0
    for r in reqs:
        assert r.finished and r.output == list(range(1000, 1012))
    cache.check_invariants()
    assert cache.protected_size == 0
    if isinstance(cache, (RadixCache, NoCache)):  # no KV slot leaked
        assert cache.pool.num_free + cache.total_size == 60


def test_a_request_that_can_never_fit_is_aborted_at_submission():
    s = Scheduler(RadixCache(10), SchedulerConfig())
    r = s.submit(request("big", range(20)), 0.0)
    assert r.aborted and r.finished and not s.has_work


def test_retracted_requests_keep_their_tokens_and_re_prefill_them():
    cache = RadixCache(40)  # both run (reservations clipped to 1 token), then outgrow the pool
    s = Scheduler(cache, SchedulerConfig(name="fcfs", clip_max_new_tokens=1))
    a = s.submit(request("a", range(10), out=20), 0.0)
    b = s.submit(request("b", range(50, 60), out=20), 0.0)
    drive(s)
    assert (a.preemptions, b.preemptions) == (0, 1)  # same outputs and prompt: the later one goes
    assert a.output == b.output == list(range(1000, 1020))
    assert b.first_token_s < a.finish_s  # b had started decoding before it was retracted


@pytest.mark.parametrize("sglang", ["0.5.23", "0.4.10"])
@pytest.mark.parametrize("page", [4, 16])
def test_a_paged_cache_serves_chunks_decode_and_retraction_without_leaking_a_page(page, sglang):
    cache = RadixCache(48, page_size=page)  # small enough to retract under both releases
    s = Scheduler(cache, SchedulerConfig(name="fcfs", init_new_token_ratio=0.0,
                                         min_new_token_ratio_factor=0.0,
                                         chunked_prefill_size=2 * page - 1,  # ends mid-page
                                         clip_max_new_tokens=1, sglang=sglang))
    reqs = [s.submit(request(f"r{i}", [i, *range(10, 18 + 3 * i)], out=12), 0.0) for i in range(5)]
    drive(s)  # checks the cache's invariants (pages, spare slots) at every step
    assert s.preemptions > 0
    for r in reqs:
        assert r.finished and r.output == list(range(1000, 1012))
    cache.check_invariants()
    assert cache.protected_size == 0
    assert cache.pool.num_free + cache.total_size == 48


def test_a_chunk_budget_below_one_page_is_refused_with_both_keys():
    with pytest.raises(ValueError, match="scheduler.chunked_prefill_size=8 must be at least "
                                         "cache.page_size=16"):
        Scheduler(RadixCache(64, page_size=16), SchedulerConfig(chunked_prefill_size=8))


@pytest.mark.parametrize("policy", ["lpm", "dfs_weight"])
def test_ordering_the_queue_counts_no_hits_for_frequency_policies(policy):
    from testbed.cache import EVICTION
    cache = RadixCache(1000, policy=EVICTION.build("lfu"))
    for seq in (range(100, 150), range(200, 210)):
        lease = cache.acquire(toks(*seq))
        cache.extend(lease, len(seq))
        cache.release(lease, toks(*seq))
    counts = sorted(n.access_count for n in cache.nodes())
    s = Scheduler(cache, SchedulerConfig(name=policy))
    waiting(s, [*range(100, 150), 1], [*range(200, 210), 2], [*range(100, 150), 3])
    for _ in range(5):
        s.policy.order(s.waiting)
    assert sorted(n.access_count for n in cache.nodes()) == counts


def test_under_overlap_a_request_needing_its_last_tokens_slot_beyond_the_pool_is_aborted():
    # Overlap decodes a request once more after its last token (the finish is applied a step
    # late), so it holds prompt + output slots, one more than without overlap. A 30-token
    # prompt with 3 outputs fits 8 pages of 4 (32 slots) without overlap, not with it: the
    # decode step used to find no room for the lone request ("extend_each: could not make room").
    from testbed.cache import RadixCache
    from testbed.scheduler.config import SchedulerConfig
    from testbed.scheduler.scheduler import Scheduler
    from testbed.workloads.request import Request
    from tests.conftest import toks

    request = Request("r", toks(*range(30)), toks(1, 2, 3))
    plain = Scheduler(RadixCache(capacity=34, page_size=4), SchedulerConfig(overlap=False))
    overlap = Scheduler(RadixCache(capacity=34, page_size=4), SchedulerConfig(overlap=True))
    assert not plain.submit(request, 0.0).aborted
    assert overlap.submit(request, 0.0).aborted


def test_lpm_keeps_each_waiting_fills_bytes_until_its_output_grows():
    # FillKeys: the same bytes object while the fill is unchanged, new ones after a retraction
    # added outputs to the fill, and only the requests of the latest queue are kept
    from testbed.scheduler.policy import FillKeys

    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm"))
    a, b = waiting(s, [1, 2, 3], [4, 5])
    keys = FillKeys()
    first = keys([a, b])
    assert first == [toks(1, 2, 3).tobytes(), toks(4, 5).tobytes()]
    assert keys([a, b])[0] is first[0]
    a.output.append(9)
    assert keys([a])[0] == toks(1, 2, 3, 9).tobytes()
    assert list(keys._kept) == [id(a)]
