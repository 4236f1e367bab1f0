"""The replay's pool counts its slots (`testbed.cache.slot_count`): every hit, eviction, node and
count as with `KVSlotPool`, which names them; other caches and paths keep named slots."""

import pytest

from testbed.backends.replay import replay
from testbed.cache import EVICTION, KVSlotPool, RadixCache, Requester
from testbed.cache.pool import OutOfSlots
from testbed.cache.slot_count import SlotCount
from testbed.cache.tiers import TieredRadixCache
from testbed.workloads.synthetic import random_tree


def nodes_but_ids(cache: RadixCache) -> list:
    """Every node's fields a later request or a policy could see, its run's length for its slots."""
    nodes = [(n.id, n.parent.id, n.key.tolist(), len(n.slots), n.last_access, n.access_count,
              n.created, n.lock_ref, n.priority, n.category, n.start, n.hits, n.history)
             for n in cache.nodes()]
    live = sorted((priority, node) for node, priority in cache.eviction.queued().items())
    return [nodes, live, cache._clock, cache.evictable_size, cache.pool.num_free]


# (policy, release, capacity, evict unit): one walk (lru, lfu), every walk (workload_aware's
# hooks), keys that drift (gdsf), Belady's oracle; unbounded, roomy and tight
CASES = [(policy, release, capacity, unit)
         for policy in ("lru", "lfu", "gdsf", "workload_aware", "oracle")
         for release, capacity, unit in (("0.5.23", None, "node"), ("0.5.23", 150, "page"),
                                         ("0.4.10", 150, "node"), ("0.5.23", 600, "node"))]


@pytest.mark.parametrize("policy,release,capacity,unit", CASES)
def test_the_replay_counting_slots_equals_the_replay_naming_them(policy, release, capacity,
                                                                 unit):
    # three-token vocabularies: splits, evictions and outputs that run into cached tokens
    requests = random_tree(num_requests=200, root_len=9, segment_len=5, output_len=3,
                           vocab_size=3, seed=4)
    for i, r in enumerate(requests):
        r.priority, r.category = i % 3, f"c{i % 2}"
    counted, named = (RadixCache(capacity, policy=EVICTION.build(policy, requests=requests),
                                 evict_unit=unit, sglang=release) for _ in range(2))
    records = replay(requests, counted, check_invariants=True)
    assert type(counted.pool) is SlotCount
    served = [named.replay_one(r.prompt, r.output, Requester(r.id, r.priority, r.category))
              for r in requests]
    assert type(named.pool) is KVSlotPool
    assert [(r.cached_tokens, r.evicted_tokens, r.inserted) for r in records] == \
        [(hit, evicted, inserted) for hit, evicted, inserted, _ in served]
    assert nodes_but_ids(counted) == nodes_but_ids(named)
    assert counted.pool.held == counted.total_size  # every slot handed out is a node's


def test_named_slots_stay_where_the_replay_takes_another_path_or_has_allocated():
    paged = RadixCache(64, page_size=4)
    tiered = TieredRadixCache(64, host_tokens=64)
    used = RadixCache(64)
    used.pool.alloc(3)
    for cache in (paged, tiered, used):
        cache.count_slots()
        assert type(cache.pool) is KVSlotPool
    fresh = RadixCache(64)
    fresh.count_slots()
    assert type(fresh.pool) is SlotCount and fresh.pool.capacity == 64


def test_a_slot_count_counts_as_the_named_pool_does():
    pool = SlotCount(10)
    head, tail = pool.alloc_split(7, 3)
    assert (len(head), len(tail), pool.num_free, pool.can_alloc(3), pool.can_alloc(4)) == \
        (3, 4, 3, True, False)
    with pytest.raises(OutOfSlots, match="asked for 4 slots, 3 free of 10"):
        pool.alloc(4)
    pool.free(tail[1:])
    assert pool.num_free == 6
    pool.check_ownership([head, tail[:1]])
    with pytest.raises(AssertionError, match="3 slots accounted for, 4 handed out"):
        pool.check_ownership([head])
    unbounded = SlotCount(None)
    assert unbounded.can_alloc(10**9) and len(unbounded.alloc(10**9)) == 10**9
