"""Size-aware eviction (SGLang PR 30300's hits per token) and WLFU (PR 23781's frequency age
penalty): exact keys and victims on hand-built trees, ties by LRU, sizes after splits and page
trims, WLFU with alpha 0 is LRU, and every victim is the brute-force minimum of the key."""

from __future__ import annotations

import math

import numpy as np
import pytest

from testbed.cache import EVICTION, RadixCache
from testbed.errors import BadInput
from testbed.backends.replay import replay
from testbed.workloads.synthetic import random_tree
from tests.conftest import toks
from tests.test_eviction import build, serve, use, victims

A, B, C = (1, 2), (3, 4), (5, 6, 7, 8)  # `build`: hits 3, 1, 2; last access 33, 10, 21


def keys(cache: RadixCache) -> dict[tuple[int, ...], object]:
    return {tuple(n.key.tolist()): cache.policy.priority(n) for n in cache.nodes()}


def test_size_aware_keys_are_hits_plus_one_per_token_then_recency():
    cache = build("size_aware")
    assert keys(cache) == {A: (4 / 2, 33), B: (2 / 2, 10), C: (3 / 4, 21)}
    assert victims(cache) == [C, B, A]  # the large C first, though LRU would take B


def test_size_aware_breaks_ties_by_recency():
    cache = RadixCache(100, policy=EVICTION.build("size_aware"))
    for seq in ([1, 1], [2, 2], [3, 3]):
        serve(cache, seq)
    use(cache, [1, 1])  # [1, 1] now has 2 hits: 3/2; [2, 2] and [3, 3] 1 each: 2/2
    assert victims(cache) == [(2, 2), (3, 3), (1, 1)]  # equal (1+1)/2: the older first


def test_size_aware_sees_a_leaf_shrink_when_a_walk_splits_it():
    cache = RadixCache(100, policy=EVICTION.build("size_aware"))
    serve(cache, [9, 9])  # 1 hit, 2 tokens: 1.0
    serve(cache, [1, 2, 3, 4, 5, 6, 7, 8])  # 1 hit, 8 tokens: 0.25
    assert cache.match(toks(1, 2, 3, 4, 5, 6, 7, 0)) == 7  # a look-up cuts it: tail [8]
    tail = next(n for n in cache.nodes() if n.key.tolist() == [8])
    assert cache.policy.priority(tail) == (2 / 1, tail.last_access)
    assert cache.eviction.queued()[tail.id] == (2.0, tail.last_access)  # re-offered as it shrank
    assert victims(cache) == [(9, 9), (8,), (1, 2, 3, 4, 5, 6, 7)]


def test_size_aware_with_page_eviction_requeues_a_trimmed_leaf_at_its_new_size():
    cache = RadixCache(12, policy=EVICTION.build("size_aware"), evict_unit="page")
    serve(cache, list(range(10, 20)))  # 10 tokens, 1 hit: 0.2
    serve(cache, [1, 1])  # 2 tokens, 1 hit: 1.0
    assert cache.evict(4) == 4  # the large leaf keeps its first 6 tokens
    big = next(n for n in cache.nodes() if n.size == 6)
    assert cache.eviction.queued()[big.id] == (2 / 6, big.last_access)
    cache.check_invariants()


@pytest.mark.parametrize("alpha, order", [(0.0, [B, C, A]), (2.0, [B, C, A]), (30.0, [C, B, A]),
                                          (100.0, [A, C, B])])
def test_wlfu_keys_are_recency_less_alpha_log1p_hits(alpha, order):
    cache = build("wlfu", alpha=alpha)
    assert keys(cache) == {A: (33 - alpha * math.log1p(3), 33), B: (10 - alpha * math.log1p(1), 10),
                           C: (21 - alpha * math.log1p(2), 21)}
    assert victims(cache) == order  # a large alpha: the most hit goes first (an age penalty)


def test_wlfu_with_alpha_zero_is_lru_request_for_request():
    requests = random_tree(num_requests=300, root_len=30, segment_len=8, output_len=6, seed=3)
    runs = [[(r.cached_tokens, r.evicted_tokens)
             for r in replay(requests, RadixCache(400, policy=EVICTION.build(params)))]
            for params in ({"name": "wlfu", "alpha": 0}, {"name": "lru"})]
    assert runs[0] == runs[1] and sum(e for _, e in runs[0]) > 0


@pytest.mark.parametrize("params, message", [
    ({"name": "wlfu", "alpha": -1}, "eviction.alpha must be a number >= 0, got -1"),
    ({"name": "size_aware", "hits": "most"}, "eviction.hits must be one of insert, match, none"),
])
def test_bad_settings_are_refused_in_one_line_naming_the_key(params, message):
    with pytest.raises(BadInput, match=message):
        EVICTION.build(params)


@pytest.mark.parametrize("policy", [{"name": "size_aware"}, {"name": "wlfu", "alpha": 5.0}])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_victim_is_the_brute_force_minimum_of_the_policys_key(policy, seed):
    """Replay to a full tree, then evict one node at a time: each is the unlocked leaf with the
    smallest key over all leaves (the heap holds no stale or missing entry)."""
    requests = random_tree(num_requests=120, root_len=20, segment_len=6, output_len=5, seed=seed)
    cache = RadixCache(500, policy=EVICTION.build(policy))
    replay(requests, cache)
    rng = np.random.default_rng(seed)
    for r in rng.choice(len(requests), 10):  # look-ups: cuts and refreshed recency
        cache.match(requests[int(r)].prompt[: int(rng.integers(1, len(requests[int(r)].prompt)))])
    while cache.total_size:
        leaves = [n for n in cache.nodes() if not n.children]
        expected = min(leaves, key=lambda n: (cache.policy.priority(n), n.id))
        cache.evict(1)
        assert not expected.alive
