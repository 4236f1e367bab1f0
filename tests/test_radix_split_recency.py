"""``cache.split_recency`` (docs/design.md §4): a walk that stops inside an edge splits it;
``refresh`` (SGLang) makes the unused tail the most recent entry, ``keep`` leaves its time."""

import pytest

from testbed.config.assembly import assemble, compose_config
from testbed.cache.radix import RadixCache
from testbed.backends.replay import replay
from testbed.workloads.traces import load_mooncake
from tests.conftest import toks
from tests.test_radix import edges, put


def two_turns(recency: str) -> RadixCache:
    """[1..6] (a turn: prompt [1, 2, 3] + output [4, 5, 6]), then [20, 21], then a look-up of
    [1, 2, 3, 9] that stops inside the first edge: it splits into [1, 2, 3] and the tail [4, 5, 6]."""
    cache = RadixCache(12, split_recency=recency)
    put(cache, 1, 2, 3, 4, 5, 6)
    put(cache, 20, 21)
    cache.match_prefix(toks(1, 2, 3, 9))
    return cache


def tail_of(cache: RadixCache):
    return next(n for n in cache.nodes() if int(n.key[0]) == 4)


def test_refresh_makes_the_unused_tail_newer_than_everything_else():
    cache = two_turns("refresh")
    other = next(n for n in cache.nodes() if int(n.key[0]) == 20)
    assert tail_of(cache).last_access > other.last_access
    assert cache.evict(1) == 2  # LRU takes [20, 21]
    assert edges(cache) == [[1, 2, 3], [4, 5, 6]]


def test_keep_leaves_the_tail_with_its_time_before_the_walk():
    cache = two_turns("keep")
    tail = tail_of(cache)
    other = next(n for n in cache.nodes() if int(n.key[0]) == 20)
    assert tail.last_access < other.last_access
    assert cache.evict(1) == 3  # LRU takes the stale tail [4, 5, 6]
    assert edges(cache) == [[1, 2, 3], [20, 21]]
    cache.check_invariants()


def test_keep_changes_nothing_when_no_walk_stops_inside_an_edge():
    def times(recency: str) -> list:
        cache = RadixCache(12, split_recency=recency)
        put(cache, 1, 2, 3)
        put(cache, 1, 2, 3, 4)
        put(cache, 7, 8)
        return sorted((n.key.tolist(), n.last_access) for n in cache.nodes())
    assert times("keep") == times("refresh")


def test_a_bad_value_and_lower_tiers_are_refused_in_one_line():
    with pytest.raises(ValueError, match="cache.split_recency must be one of refresh, keep"):
        RadixCache(10, split_recency="lru")
    cfg = compose_config(["backend=replay", "cache.host_tokens=100", "cache.split_recency=keep"])
    with pytest.raises(ValueError, match="cache.split_recency=keep needs cache.host_tokens=0"):
        assemble(cfg).build_cache(10, [])


def test_with_keep_page_eviction_equals_block_hash_lru_on_the_mooncake_conversation_trace(
        mooncake_conversation):
    """At 3M tokens, pages of 16: the block-hash cache's LRU (16-token blocks) hits 0.137664;
    radix page eviction 0.136100 with SGLang's refresh, and exactly block-hash's with keep."""
    records = replay(load_mooncake(mooncake_conversation),
                     RadixCache(3_000_000, page_size=16, evict_unit="page", split_recency="keep"))
    hit_rate = sum(r.cached_tokens for r in records) / sum(r.prompt_tokens for r in records)
    assert round(hit_rate, 6) == 0.137664
