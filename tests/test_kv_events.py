"""Cache events and ``router=kv_events`` in the simulator: a radix cache publishing its changes
keeps its eviction order; the exact index fed by the events equals every replica's tree after a
run with eviction (whole leaves and tail pages); a gap or a removal the index cannot place voids
the replica's part until its state is re-read; policies choose among the replicas in rotation."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import RadixCache
from testbed.cache.events import (CacheEvent, EventLog, cached_sequences, publishing,
                                  sequence_set)
from testbed.cache.eviction import LRU
from testbed.router import ROUTERS, ApproxTree, KvEvents, KvIndex, Loads, NoWorker
from testbed.serving.cluster import simulate_cluster
from testbed.workloads.paper import chat
from tests.conftest import toks
from tests.test_sim import a10g_llama2_executor


def small_chat():
    return chat(num_sessions=8, turns=3, system_prompt_len=40, min_question_len=16,
                max_question_len=48, min_output_len=2, max_output_len=8, think_time_s=0.0)


# ---------------------------------------------------------------------- the index's tree
def test_removing_a_branch_keeps_its_siblings_and_the_shared_head():
    t = ApproxTree(2)
    t.insert(toks(1, 2, 3, 4), 0)
    t.insert(toks(1, 2, 7, 7), 0)
    t.insert(toks(1, 2, 3, 4), 1)
    assert t.remove_below(toks(1, 2, 3, 4), 2, 0)  # worker 0's leaf 3 4 goes
    assert t.sequences(0) == {(1, 2, 7, 7)}
    assert t.sequences(1) == {(1, 2, 3, 4)}
    assert t.size == [4, 4]
    t.check_invariants()


def test_removing_a_leaf_keeps_what_a_sibling_shares_of_its_first_page():
    # pages of 4: the cache's leaves 1 2 3 4 | 5 5 5 5 and 1 2 3 4 | 5 5 9 9 are siblings (their
    # first pages differ); the index splits them after 5 5, which the sibling still holds
    t = ApproxTree(1)
    t.insert(toks(1, 2, 3, 4, 5, 5, 5, 5), 0)
    t.insert(toks(1, 2, 3, 4, 5, 5, 9, 9), 0)
    assert t.remove_below(toks(1, 2, 3, 4, 5, 5, 5, 5), 4, 0)
    assert t.sequences(0) == {(1, 2, 3, 4, 5, 5, 9, 9)} and t.size == [8]
    assert not t.remove_below(toks(1, 2, 3, 4, 5, 5, 5, 5), 4, 0)  # gone: out of step now
    t.check_invariants()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("evict_unit", ["node", "page"])
def test_the_index_fed_by_events_equals_a_paged_tree_of_a_two_token_vocabulary(page_size,
                                                                              evict_unit):
    # the fuzzer, seed 6006 #7712: at pages of 16 an evicted leaf took its first-page sibling's
    # shared tokens out of the index, and the sibling's removal then found nothing to remove
    log = EventLog()
    cache = RadixCache(96, policy=publishing(LRU(), log), page_size=page_size,
                       evict_unit=evict_unit)
    index = KvIndex(1)
    rng = np.random.default_rng(page_size)
    evicted = 0
    for i in range(150):
        prompt = rng.integers(0, 2, int(rng.integers(page_size, 40))).astype(np.int32)
        evicted += cache.replay_one(prompt, rng.integers(0, 2, 3).astype(np.int32))[1]
        assert index.apply(0, log.since(index.seq[0])), f"out of step at replay {i}"
        assert index.tree.sequences(0) == sequence_set(cached_sequences(cache))
    assert evicted > 10 * 96  # the pool turned over many times
    index.tree.check_invariants()


def test_a_trim_inside_an_edge_cuts_every_continuation():
    t = ApproxTree(1)
    t.insert(toks(5, 6, 7, 8, 9), 0)
    assert t.remove_below(toks(5, 6, 7), 3, 0, branch=False)
    assert t.sequences(0) == {(5, 6, 7)} and t.size == [3]
    t.check_invariants()


def test_a_removal_the_index_cannot_place_is_refused():
    t = ApproxTree(1)
    t.insert(toks(1, 2), 0)
    assert not t.remove_below(toks(1, 2, 3), 2, 0)  # 1 2 3 was never held
    assert not t.remove_below(toks(4, 4), 0, 0)
    assert t.sequences(0) == {(1, 2)}


def test_remove_worker_forgets_only_that_worker():
    t = ApproxTree(2)
    t.insert(toks(1, 2, 3), 0)
    t.insert(toks(1, 2), 1)
    t.remove_worker(0)
    assert t.sequences(0) == set() and t.sequences(1) == {(1, 2)} and t.size == [0, 2]
    assert t.num_nodes == 2
    t.check_invariants()


# ---------------------------------------------------------------------- the log
def test_the_log_hands_out_what_follows_a_number_or_says_it_cannot():
    log = EventLog(capacity=2)
    for i in range(3):
        log.publish("stored", toks(i).tobytes(), 0)
    assert [e.seq for e in log.since(1)] == [2, 3]
    assert log.since(3) == []
    assert log.since(0) is None  # event 1 is no longer kept
    assert log.since(7) is None  # ahead of the log: another epoch's number
    e = log.since(2)[0]
    assert CacheEvent.from_dict(e.as_dict()) == e


def test_publishing_keeps_the_caches_decisions():
    def hits(policy):
        cache = RadixCache(120, policy=policy)
        rng = np.random.default_rng(3)
        out = []
        for _ in range(60):
            p = np.concatenate([toks(1, 2, 3), rng.integers(0, 5, 20)]).astype(np.int32)
            out.append(cache.replay_one(p, rng.integers(0, 5, 4).astype(np.int32))[:2])
        return out, cache

    plain, _ = hits(LRU())
    log = EventLog()
    published, cache = hits(publishing(LRU(), log))
    assert published == plain and log.seq > 0
    index = KvIndex(1)
    assert index.apply(0, log.since(0))
    assert index.tree.sequences(0) == sequence_set(cached_sequences(cache))


# ---------------------------------------------------------------------- the simulator
@pytest.mark.parametrize("cache_kw", [{}, {"page_size": 4, "evict_unit": "page"}])
def test_the_index_equals_every_replicas_tree_after_a_run_with_eviction(cache_kw):
    def make_cache(events=None):
        return RadixCache(400, policy=publishing(LRU(), events), **cache_kw)

    router = ROUTERS.build("kv_events")
    result = simulate_cluster(small_chat(), make_cache, {"name": "lpm"}, a10g_llama2_executor(),
                              router, replicas=2)
    assert sum(r.evicted_tokens for r in result.reqs) > 0  # the pools were too small to keep all
    for w, rep in enumerate(result.replicas):
        assert router.index.tree.sequences(w) == sequence_set(cached_sequences(rep.cache))
    router.index.tree.check_invariants()
    assert result.decisions.get("cache", 0) > 0


def test_event_delay_leaves_the_index_exact_at_the_end():
    def make_cache(events=None):
        return RadixCache(400, policy=publishing(LRU(), events))

    router = ROUTERS.build("kv_events", event_delay_s=0.05)
    result = simulate_cluster(small_chat(), make_cache, {"name": "lpm"}, a10g_llama2_executor(),
                              router, replicas=3)
    for w, rep in enumerate(result.replicas):
        assert router.index.tree.sequences(w) == sequence_set(cached_sequences(rep.cache))


def test_a_gap_voids_the_replicas_part_until_it_is_reloaded():
    index = KvIndex(2)
    e = [CacheEvent(i + 1, "stored", toks(1, 2, i).tobytes(), 0) for i in range(3)]
    assert index.apply(0, e[:1])
    assert not index.apply(0, e[2:])  # event 2 missing
    assert index.match(toks(1, 2, 0)) == [0, 0] and not index.synced[0]
    assert not index.apply(0, e[1:2])  # void until reloaded
    index.load(0, "epoch", 3, [toks(1, 2, 0), toks(1, 2, 2)])
    assert index.apply(0, [CacheEvent(4, "removed", toks(1, 2, 2).tobytes(), 2)])
    assert index.tree.sequences(0) == {(1, 2, 0)}


def test_kv_events_routes_to_the_replica_that_holds_the_prompt():
    r = KvEvents()
    r.bind(3)
    r.on_cache_events(2, [CacheEvent(1, "stored", toks(1, 2, 3, 4).tobytes(), 0)])
    assert r.route(toks(1, 2, 3, 9), Loads((0, 0, 0), (0, 0, 0)), 0.0) == 2
    assert r.decisions == {"cache": 1}


# ---------------------------------------------------------------------- availability
@pytest.mark.parametrize("name", ["round_robin", "random", "least_load", "cache_aware",
                                  "oracle", "kv_events"])
def test_policies_choose_only_replicas_in_rotation(name):
    router = ROUTERS.build(name, max_tree_size=None)
    caches = [RadixCache(100) for _ in range(3)]
    router.bind(3, caches)
    loads = Loads((0, 0, 0), (0, 0, 0), available=(True, False, True))
    picks = {router.route(toks(1, 2, i % 5), loads, 0.0) for i in range(20)}
    assert picks <= {0, 2}
    assert "unavailable" not in router.decisions
    with pytest.raises(NoWorker):
        router.route(toks(1), Loads((0,) * 3, (0,) * 3, available=(False,) * 3), 0.0)


def test_round_robin_with_everyone_up_is_unchanged_by_availability():
    a, b = ROUTERS.build("round_robin"), ROUTERS.build("round_robin")
    a.bind(3)
    b.bind(3)
    up = Loads((0,) * 3, (0,) * 3, available=(True,) * 3)
    assert [a.route(toks(1), up, 0) for _ in range(7)] == \
        [b.route(toks(1), Loads((0,) * 3, (0,) * 3), 0) for _ in range(7)]


def test_cache_aware_forgets_a_restarted_worker():
    r = ROUTERS.build("cache_aware", max_tree_size=None)
    r.bind(2)
    r.route(toks(1, 2, 3), Loads((0, 0), (0, 0)), 0.0)  # goes to 0, inserted there
    r.forget_worker(0)
    assert r.tree.match(toks(1, 2, 3)) == [0, 0]
