"""Exact behaviour of ``cache.evict_unit`` on the radix cache (docs/design.md §4): ``node`` frees
whole leaves (SGLang), ``page`` only the tail pages still needed."""

import numpy as np
import pytest

from testbed.config.assembly import assemble, compose_config
from testbed.cache.eviction import LRU
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads.request import Request
from testbed.workloads.traces import load_mooncake
from tests.conftest import toks
from tests.test_radix import edges, put


def leaf(cache: RadixCache, first: int):
    return next(n for n in cache.nodes() if int(n.key[0]) == first)


def forked(page: int, unit: str) -> RadixCache:
    """[1, 2, 3] with children [4, 5, 6] (older) and [7, 8] at page 1; at page 4 pages
    [1..4][5..8] under which [9..16] (older) and [101..108]."""
    if page == 1:
        cache = RadixCache(12, evict_unit=unit)
        put(cache, 1, 2, 3, 4, 5, 6)
        put(cache, 1, 2, 3, 7, 8)
    else:
        cache = RadixCache(32, page_size=4, evict_unit=unit)
        put(cache, *range(1, 17))
        put(cache, *range(1, 9), *range(101, 109))
    return cache


def test_node_unit_frees_the_whole_oldest_leaf():
    cache = forked(1, "node")
    assert cache.evict(2) == 3
    assert edges(cache) == [[1, 2, 3], [7, 8]]


def test_page_unit_at_page_1_frees_only_the_last_tokens_needed_of_the_oldest_leaf():
    cache = forked(1, "page")
    tail = leaf(cache, 4)
    stats = (tail.id, tail.last_access, tail.access_count, tail.created, tail.start)
    assert cache.evict(2) == 2
    assert edges(cache) == [[1, 2, 3], [4], [7, 8]]
    assert leaf(cache, 4) is tail and (tail.id, tail.last_access, tail.access_count, tail.created,
                                       tail.start) == stats
    assert cache.pool.num_free == 4 + 2 and cache.evictable_size == 6
    cache.check_invariants()
    # [4] is still the oldest: removed whole (1), then [7, 8] wholly needed (2); [1, 2, 3] is
    # left childless and stays (nothing more is needed)
    assert cache.evict(3) == 3
    assert edges(cache) == [[1, 2, 3]]
    cache.check_invariants()


def test_page_unit_at_page_4_frees_whole_tail_pages_only():
    cache = forked(4, "page")
    assert edges(cache) == [list(range(1, 9)), list(range(9, 17)), list(range(101, 109))]
    assert cache.evict(3) == 4  # one page of the older leaf [9..16]
    assert edges(cache) == [list(range(1, 9)), [9, 10, 11, 12], list(range(101, 109))]
    cache.check_invariants()
    # 5 tokens are two pages: [9..12] goes whole, then one page of [101..108]
    assert cache.evict(5) == 8
    assert edges(cache) == [list(range(1, 9)), [101, 102, 103, 104]]
    assert cache.pool.num_free == 32 - 12
    cache.check_invariants()


def test_a_trimmed_leaf_removed_whole_leaves_its_parent_a_candidate():
    cache = RadixCache(10, evict_unit="page")
    put(cache, 9)
    put(cache, 1, 2, 3, 4)
    put(cache, 1, 2, 5)  # [9] oldest, then [3, 4] (touched), the split-off [1, 2], then [5]
    assert cache.evict(2) == 2  # [9] whole, then one token of [3, 4]
    assert edges(cache) == [[1, 2], [3], [5]]
    assert cache.evict(4) == 4  # [3], [5], then the parent [1, 2]: all it had
    assert edges(cache) == []
    cache.check_invariants()


def test_protected_nodes_are_never_trimmed():
    cache = forked(1, "page")
    _, node, slots = cache.match_prefix(toks(1, 2, 3, 4, 5, 6))
    cache.lock(node)
    assert cache.evict(5) == 2  # only [7, 8] is unlocked
    assert edges(cache) == [[1, 2, 3], [4, 5, 6]]
    assert np.array_equal(cache.match_prefix(toks(1, 2, 3, 4, 5, 6))[2], slots)
    cache.unlock(node)
    assert cache.evict(1) == 1
    assert edges(cache) == [[1, 2, 3], [4, 5]]
    cache.check_invariants()


def test_extend_evicts_exactly_the_shortfall_in_whole_pages():
    cache = forked(4, "page")  # 24 cached of 32: 8 free
    lease = cache.acquire(toks(*range(200, 209)))  # nothing cached; 9 tokens take 3 pages
    assert cache.extend(lease, 9) == 4  # 12 - 8 free: the last page of the oldest leaf
    assert edges(cache) == [list(range(1, 9)), [9, 10, 11, 12], list(range(101, 109))]
    cache.check_invariants([lease])


def test_the_policy_hears_of_a_trim_with_the_key_it_was_popped_with():
    heard = []

    class Spy(LRU):
        def on_evict(self, entry, key):
            heard.append((entry.key.tolist(), key))

    cache = RadixCache(10, policy=Spy(), evict_unit="page")
    put(cache, 1, 2, 3)
    time = leaf(cache, 1).last_access
    cache.evict(1)
    assert heard == [([1, 2], time)]


def test_page_unit_replay_evicts_what_each_request_lacks():
    requests = [Request(str(i), np.arange(100 * i, 100 * i + 20, dtype=np.int32),
                        np.zeros(0, dtype=np.int32)) for i in range(4)]
    node = replay(requests, RadixCache(50, evict_unit="node"))
    page = replay(requests, RadixCache(50, evict_unit="page"))
    assert [r.evicted_tokens for r in node] == [0, 0, 20, 20]
    assert [r.evicted_tokens for r in page] == [0, 0, 10, 20]


def test_unknown_units_and_lower_tiers_with_page_are_refused_in_one_line():
    with pytest.raises(ValueError, match="cache.evict_unit must be one of node, page"):
        RadixCache(10, evict_unit="leaf")
    cfg = compose_config(["backend=replay", "cache.host_tokens=100", "cache.evict_unit=page"])
    with pytest.raises(ValueError, match="cache.evict_unit=page needs cache.host_tokens=0"):
        assemble(cfg).build_cache(10, [])
    cfg = compose_config(["backend=replay", "cache=block_hash", "+cache.evict_unit=page"])
    with pytest.raises(ValueError, match="evict_unit"):
        assemble(cfg).build_cache(10, [])


@pytest.mark.parametrize("release, page, expected", [
    ("0.5.23", 1, 0.136238), ("0.5.23", 16, 0.136327),
    ("0.4.10", 1, 0.136032), ("0.4.10", 16, 0.136100)])
def test_mooncake_conversation_hit_rates_with_page_eviction_at_3m(mooncake_conversation, release,
                                                                   page, expected):
    # node at 3M: 0.135499 under 0.5.23, 0.135347 under 0.4.10 (page 1, test_replay.py);
    # 0.135504 and 0.135345 at page 16; the block-hash cache's LRU: 0.137664, which keeps the
    # recency of a block a request did not use where SGLang's split refreshes the tail it cuts
    # off (docs/results/eviction.md, "Partial-leaf eviction")
    records = replay(load_mooncake(mooncake_conversation),
                     RadixCache(3_000_000, page_size=page, evict_unit="page", sglang=release))
    hit_rate = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    assert round(hit_rate, 6) == expected
