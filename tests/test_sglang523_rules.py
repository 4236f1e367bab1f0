"""SGLang 0.5.23's rules (docs/design.md §4, "SGLang releases"): HRRN, the queue's whole-fill
look-up and in-batch tree, the waiting-prefix refresh, priority scheduling, insert hit counts,
SLRU, FILO and T-LRU, each with ``scheduler.sglang=0.4.10`` where it keeps the old rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache import EVICTION, RadixCache, Requester
from testbed.errors import BadInput
from testbed.scheduler.config import SchedulerConfig
from testbed.scheduler.scheduler import Scheduler
from testbed.workloads.request import Request
from tests.conftest import toks
from tests.test_scheduler import cache_with, drive, request


def insert(cache: RadixCache, seq, priority: int = 0, inserted: int = 0) -> None:
    slots = cache.pool.alloc(len(seq))
    present = cache.insert(toks(*seq), slots, Requester(priority=priority), inserted=inserted)
    cache.pool.free(slots[:present])


def victims(cache: RadixCache) -> list[tuple[int, ...]]:
    """Leaves in the order one-token evictions remove them (each its own key)."""
    order = []
    while cache.total_size:
        before = {tuple(n.key.tolist()) for n in cache.nodes()}
        cache.evict(1)
        order += sorted(before - {tuple(n.key.tolist()) for n in cache.nodes()})
    return order


# ---------------------------------------------------------------- HRRN
def hrrn(cache, *prompts, queued=(), processed=0, **config):
    s = Scheduler(cache, SchedulerConfig(name="hrrn", **config))
    reqs = [s.submit(request(rid, p), 0.0) for rid, p in prompts]
    for r, q in zip(reqs, queued):
        r.queued_tokens = q
    s.policy.processed_tokens = processed
    return s.policy.order(s.waiting)


def test_hrrn_serves_most_waited_tokens_per_uncached_prompt_token_first():
    cache = cache_with(range(100, 190))  # 90 tokens cached
    # r0: 100 uncached, waited 500 -> 5; r1: 10 uncached (90 hit), waited 100 -> 10;
    # r2: 50 uncached, waited 500 -> 10, tied with r1: ids as strings; r3: waited 0
    ordering = hrrn(cache, ("r0", range(1000, 1100)), ("r1", [*range(100, 190), *range(5, 15)]),
                    ("r2", range(2000, 2050)), ("r3", range(3000, 3004)),
                    queued=(500, 900, 500, 1000), processed=1000, in_batch_prefix_caching=False)
    assert [r.id for r in ordering.queue] == ["r1", "r2", "r0", "r3"]


def test_hrrn_breaks_ties_by_request_id_as_a_string_and_drains_fully_cached_prompts_first():
    cache = cache_with(range(100, 140))
    ordering = hrrn(cache, ("r2", range(10, 20)), ("r10", range(30, 40)),
                    ("r9", [*range(100, 140), 7]), in_batch_prefix_caching=False)
    # nobody waited: every ratio 0, ties by id ("r10" < "r2"); r9's prompt less one token is
    # cached, its last token not: uncached 1, not <= 0
    assert [r.id for r in ordering.queue] == ["r10", "r2", "r9"]
    whole = hrrn(cache_with(range(100, 140)), ("r2", range(10, 20)), ("r1", range(100, 140)),
                 in_batch_prefix_caching=False)
    assert [r.id for r in whole.queue] == ["r1", "r2"]  # outputs count: its prompt is all cached


def test_hrrn_sorts_the_in_batch_deprioritized_last_and_falls_back_to_fcfs():
    shared = list(range(500, 540))
    ordering = hrrn(RadixCache(None), ("r0", [*shared, 1]), ("r1", [*shared, 2]),
                    ("r2", range(10, 20)), queued=(0, 0, 0), processed=100)
    assert [r.id for r in ordering.queue] == ["r2", "r0", "r1"]  # r0 ratio 100/41 < r2's 10
    assert {r.id for r in ordering.queue if id(r) in ordering.deferred} == {"r1"}
    fallback = hrrn(RadixCache(None), ("r0", range(10, 20)), ("r1", range(30, 32)),
                    ("r2", range(40, 41)), processed=50, lpm_fallback_threshold=2)
    assert [r.id for r in fallback.queue] == ["r0", "r1", "r2"]


def test_the_scheduler_counts_prefill_tokens_and_marks_arrivals_and_retractions():
    s = Scheduler(RadixCache(40), SchedulerConfig(name="hrrn", clip_max_new_tokens=1))
    a = s.submit(request("a", range(10), out=20), 0.0)
    b = s.submit(request("b", range(50, 60), out=20), 0.0)
    assert (a.queued_tokens, b.queued_tokens) == (0, 0)
    step = 0
    while b.preemptions == 0:
        batch = s.next_batch(float(step))
        if b.preemptions:  # retracted while this decode step formed: re-queued now
            assert s.processed_tokens == 20 and (b.queued_tokens, b.queued_s) == (20, step)
        s.complete(batch, [int(e.req.request.output[len(e.req.output)]) for e in batch.entries],
                   float(step))
        step += 1
    drive(s)
    assert s.processed_tokens == 20 + 21  # and b's re-prefill: its fill past its cached prefix
    assert a.output == b.output == list(range(1000, 1020))


# ---------------------------------------------------------------- the queue's look-up
def deferred_ids(sglang: str) -> set[str]:
    a = list(range(300, 332))  # 32 tokens: r1's fill continues r0's whole fill
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lpm", sglang=sglang))
    s.submit(request("r0", a), 0.0)
    s.submit(request("r1", [*a, 7, 8]), 0.0)
    ordering = s.policy.order(s.waiting)
    return {r.id for r in ordering.queue if id(r) in ordering.deferred}


def test_in_batch_tree_holds_whole_fills_under_0_5_23_and_all_but_the_last_token_under_0_4_10():
    assert deferred_ids("0.5.23") == {"r1"}  # shares all 32 tokens of r0's fill
    assert deferred_ids("0.4.10") == set()  # r0's fill less one token: 31 shared


def test_the_queue_look_up_walks_the_whole_fill_under_0_5_23():
    for sglang, split in (("0.5.23", 20), ("0.4.10", 19)):
        cache = cache_with(range(100, 130))
        s = Scheduler(cache, SchedulerConfig(name="lpm", sglang=sglang))
        s.submit(request("r0", range(100, 120)), 0.0)
        s.policy.order(s.waiting)
        assert sorted(n.size for n in cache.nodes()) == sorted([split, 30 - split])


# ---------------------------------------------------------------- refresh and priorities
def fcfs_after_orders(sglang: str, orders: int) -> list[tuple[int, ...]]:
    cache = cache_with([1, 1], [2, 2], [3, 3])
    s = Scheduler(cache, SchedulerConfig(name="fcfs", sglang=sglang))
    s.submit(request("r0", [2, 2, 9]), 0.0)
    s.submit(request("r1", [1, 1, 9]), 0.0)
    for _ in range(orders):
        s.policy.order(s.waiting)
    return victims(cache)


def test_fcfs_refreshes_the_waiting_prefixes_last_first_every_32nd_order_under_0_5_23():
    # the refresh looks up r1's fill then r0's: [3,3] oldest, then [1,1], then [2,2]
    assert fcfs_after_orders("0.5.23", 1) == [(3, 3), (1, 1), (2, 2)]
    assert fcfs_after_orders("0.4.10", 1) == [(1, 1), (2, 2), (3, 3)]
    cache = cache_with([1, 1], [2, 2])
    s = Scheduler(cache, SchedulerConfig(name="fcfs"))
    s.submit(request("r0", [1, 1, 9]), 0.0)
    s.policy.order(s.waiting)  # refreshes [1,1]
    insert(cache, [5])
    for _ in range(31):  # the 2nd to 32nd orders refresh nothing
        s.policy.order(s.waiting)
    assert victims(cache)[:2] == [(2, 2), (1, 1)]


def test_priority_scheduling_sorts_fcfs_by_priority_then_queue_entry_and_lof_by_priority():
    s = Scheduler(RadixCache(None), SchedulerConfig(name="fcfs", enable_priority_scheduling=True))
    for rid, prio, t in (("a", 1, 0.0), ("b", 0, 2.0), ("c", 0, 1.0), ("d", -1, 3.0)):
        s.submit(Request(rid, toks(1, 2), toks(5), priority=prio), t)
    assert [r.id for r in s.policy.order(s.waiting).queue] == ["d", "c", "b", "a"]
    s = Scheduler(RadixCache(None), SchedulerConfig(name="lof", enable_priority_scheduling=True))
    for rid, prio, out in (("a", 1, 9), ("b", 0, 2), ("c", 0, 5)):
        s.submit(Request(rid, toks(1, 2), np.arange(out, dtype=np.int32), priority=prio), 0.0)
    assert [r.id for r in s.policy.order(s.waiting).queue] == ["c", "b", "a"]


def test_a_bad_release_is_refused_naming_the_key_and_the_choices():
    with pytest.raises(BadInput, match="scheduler.sglang must be one of 0.5.23, 0.4.10; got '0.4'"):
        SchedulerConfig.from_mapping({"name": "lpm", "sglang": "0.4"})


# ---------------------------------------------------------------- hit counts and strategies
def test_inserts_count_hits_once_per_request_and_matches_count_none():
    cache = RadixCache(None)
    insert(cache, [1, 2, 3])
    cache.match_prefix(toks(1, 2, 3), lookup=True)
    cache.match_prefix(toks(1, 2, 3))  # an admission: access_count, not an insert hit
    insert(cache, [1, 2, 3, 4, 5], inserted=0)  # a second request: [1,2,3] hit, new leaf [4,5]
    insert(cache, [1, 2, 3, 4, 5, 6], inserted=5)  # its own chunk, then more: only [6] counts
    hits = {tuple(n.key.tolist()): (n.hits, n.access_count) for n in cache.nodes()}
    assert hits == {(1, 2, 3): (2, 2), (4, 5): (1, 1), (6,): (1, 1)}
    insert(cache, [1, 2, 9])  # splits [1,2,3]: the head copies its count, then counts this one
    assert {tuple(n.key.tolist()): n.hits for n in cache.nodes()}[(1, 2)] == 3


@pytest.mark.parametrize("hits, expected", [
    ("insert", [(3,), (2,), (1,)]),  # [1] inserted twice; [3] and [2] once, [3] less recently
    ("match", [(1,), (2,), (3,)]),   # [3] matched at admission twice, the others never
    ("none", [(3,), (1,), (2,)]),    # 0.4.10: recency alone
])
def test_lfu_counts_hits_as_the_setting_says(hits, expected):
    cache = RadixCache(None, policy=EVICTION.build({"name": "lfu", "hits": hits}))
    insert(cache, [3])
    cache.match_prefix(toks(3))
    cache.match_prefix(toks(3))
    insert(cache, [1])
    insert(cache, [1])
    insert(cache, [2])
    cache.match_prefix(toks(1), lookup=True)
    cache.match_prefix(toks(2), lookup=True)
    assert victims(cache) == expected


def test_slru_protects_after_the_threshold_of_insert_hits_and_filo_evicts_newest_first():
    cache = RadixCache(None, policy=EVICTION.build({"name": "slru", "protected_threshold": 3}))
    insert(cache, [1])
    insert(cache, [1])
    insert(cache, [1])  # 3 hits: protected
    insert(cache, [2])
    insert(cache, [2])  # 2: probation, though more recent
    assert victims(cache) == [(2,), (1,)]
    cache = RadixCache(None, policy=EVICTION.build("filo"))
    for seq in ([1], [2], [3]):
        insert(cache, seq)
    cache.match_prefix(toks(3), lookup=True)
    assert victims(cache) == [(3,), (2,), (1,)]


def test_priority_eviction_leaves_a_split_tail_its_own_priority():
    cache = RadixCache(None, policy=EVICTION.build("priority"))
    insert(cache, [1, 2, 3, 4], priority=5)
    insert(cache, [1, 2, 9], priority=-1)  # urgent: the head [1,2] and the leaf [9]
    insert(cache, [7], priority=0)
    prio = {tuple(n.key.tolist()): n.priority for n in cache.nodes()}
    assert prio == {(1, 2): -1, (3, 4): 5, (9,): -1, (7,): 0}
    assert victims(cache) == [(3, 4), (7,), (9,), (1, 2)]


def test_tlru_evicts_what_lies_past_the_budget_of_each_conversation_first():
    # conversation A grew to 30 tokens ([0..9] + [10..29]); B to 12 ([50..57] + [60..63]).
    # threshold 15, next prompt 5: budgets A 30+5-15 = 20, B max(12+5-15, 0) = 2.
    cache = RadixCache(None, policy=EVICTION.build(
        {"name": "tlru", "threshold": 15, "next_prompt_estimate": 5}))
    insert(cache, range(10))
    insert(cache, range(30))
    insert(cache, [*range(50, 58)])
    insert(cache, [*range(50, 58), *range(60, 64)])
    insert(cache, [100, 101])  # a third, most recent: budget 0, its start 0: safe too
    # safe: B's tail (start 8 >= 2), [100,101] (0 >= 0); A's tail starts at 10 < 20: not safe
    assert victims(cache)[:2] == [tuple(range(60, 64)), (100, 101)]
    cache = RadixCache(None, policy=EVICTION.build("tlru"))  # T = Q = 0: budget = history
    lru = RadixCache(None, policy=EVICTION.build("lru"))
    for c in (cache, lru):
        for seq in ([1, 2], [1, 2, 3, 4], [5], [1, 2, 6]):
            insert(c, seq)
    assert victims(cache) == victims(lru)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=8), min_size=1, max_size=12))
def test_tlru_history_is_the_longest_sequence_inserted_through_each_node(seqs):
    cache = RadixCache(None, policy=EVICTION.build("tlru"))
    for seq in seqs:
        insert(cache, seq)
    for node in cache.nodes():
        path, x = [], node
        while x is not cache.root:
            path[:0] = x.key.tolist()
            x = x.parent
        longest = max(len(s) for s in seqs if s[: len(path)] == path)
        assert node.history == longest, (seqs, path)


def test_eviction_settings_are_checked_naming_the_key():
    with pytest.raises(BadInput, match="eviction.hits must be one of insert, match, none"):
        EVICTION.build({"name": "lfu", "hits": "often"})
    with pytest.raises(BadInput, match="eviction.threshold must be an integer >= 0"):
        EVICTION.build({"name": "tlru", "threshold": -1})


# ---------------------------------------------------------------- priority preemption
def preemption_case(**config):
    s = Scheduler(RadixCache(1000), SchedulerConfig(name="fcfs", enable_priority_scheduling=True,
                                                    max_running_requests=2, **config))
    out = np.arange(1000, 1005, dtype=np.int32)
    reqs = {}
    for t, (rid, prio) in enumerate((("a", 20), ("b", 20))):
        reqs[rid] = s.submit(Request(rid, toks(*range(10 * t, 10 * t + 8)), out, priority=prio),
                             float(t))
    batch = s.next_batch(1.0)
    s.complete(batch, [1000, 1000], 1.0)
    for t, (rid, prio) in enumerate((("c", 15), ("d", 0)), start=2):
        reqs[rid] = s.submit(Request(rid, toks(*range(10 * t, 10 * t + 8)), out, priority=prio),
                             float(t))
    return s, reqs, s.next_batch(3.0)


def test_an_urgent_request_preempts_the_least_urgent_latest_running_one_past_the_threshold():
    s, reqs, batch = preemption_case()
    assert batch.kind == "prefill" and [e.req.id for e in batch.entries] == ["d"]
    assert (reqs["a"].preemptions, reqs["b"].preemptions) == (0, 1)  # b entered the queue later
    assert [r.id for r in s.waiting] == ["c", "b"]  # c (15 vs 20: within 10) preempts nobody
    assert [r.id for r in s.running] == ["a"] and reqs["b"].lease is None
    s.complete(batch, [1000], 3.0)
    drive(s)
    assert all(r.output == list(range(1000, 1005)) for r in reqs.values())


def test_priority_scheduling_without_preemption_waits_for_a_free_slot():
    s, reqs, batch = preemption_case(disable_priority_preemption=True)
    assert batch.kind == "decode" and s.preemptions == 0
