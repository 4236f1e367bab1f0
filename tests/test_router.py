"""Routing policies on hand-built states, and the approximate tree's bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from testbed.cache import BlockHashCache, NoCache, RadixCache
from testbed.errors import BadInput
from testbed.router import (ROUTERS, ApproxTree, CacheAware, LeastLoad, Loads, Oracle, RandomRouter,
                            RoundRobin, cluster_delays, is_imbalanced, peek_match)
from tests.conftest import toks


def loads(*tokens: int, requests: tuple[int, ...] | None = None) -> Loads:
    return Loads(tokens=tokens, requests=requests or (0,) * len(tokens))


# ---------------------------------------------------------------------- approximate tree
def test_tree_match_gives_each_worker_its_own_longest_prefix():
    t = ApproxTree(3)
    t.insert(toks(1, 2, 3, 4, 5), 0)
    t.insert(toks(1, 2, 3, 9), 1)
    t.insert(toks(7, 7), 2)
    assert t.match(toks(1, 2, 3, 4, 6)) == [4, 3, 0]
    assert t.match(toks(1, 2)) == [2, 2, 0]
    assert t.match(toks(8)) == [0, 0, 0]
    assert t.size == [5, 4, 2]
    t.check_invariants()


def test_tree_insert_counts_only_tokens_new_to_that_worker():
    t = ApproxTree(2)
    t.insert(toks(1, 2, 3), 0)
    t.insert(toks(1, 2, 3), 0)  # already there
    t.insert(toks(1, 2), 1)  # splits the edge; worker 0 keeps 3 tokens
    assert t.size == [3, 2]
    t.insert(toks(1, 2, 3, 4), 1)
    assert t.size == [3, 4]
    t.check_invariants()


def test_pruning_removes_the_workers_least_recently_touched_leaves_first():
    t = ApproxTree(2)
    t.insert(toks(1, 1, 1), 0)  # oldest
    t.insert(toks(2, 2, 2), 0)
    t.insert(toks(3, 3, 3), 0)  # newest
    t.insert(toks(1, 1, 1), 1)  # the other worker shares the oldest
    t.insert(toks(2, 2, 2), 0)  # refreshes 2 2 2: now 1 1 1 is oldest, then 3 3 3
    removed = t.prune(max_size=4, workers=[0])
    assert removed == 6 and t.size == [3, 3]
    assert t.match(toks(2, 2, 2)) == [3, 0]
    assert t.match(toks(1, 1, 1)) == [0, 3]  # the node stays: worker 1 still carries it
    assert t.match(toks(3, 3, 3)) == [0, 0]  # deleted: nobody carries it
    t.check_invariants()


def test_pruning_works_leaf_up_and_a_shared_prefix_goes_last():
    t = ApproxTree(1)
    t.insert(toks(5, 5, 1, 1), 0)
    t.insert(toks(5, 5, 2, 2), 0)
    t.prune(max_size=2, workers=[0])  # both tails go before the shared head
    assert t.size == [2] and t.match(toks(5, 5, 9)) == [2]
    t.prune(max_size=0)
    assert t.size == [0] and t.num_nodes == 1
    t.check_invariants()


def test_size_equals_a_recount_after_random_inserts_and_prunes():
    rng = np.random.default_rng(0)
    t = ApproxTree(4)
    for step in range(400):
        base = rng.integers(0, 3)  # few first tokens: many shared prefixes and splits
        seq = np.concatenate([[base], rng.integers(0, 4, size=rng.integers(0, 12))])
        t.insert(seq.astype(np.int32), int(rng.integers(4)))
        if step % 37 == 0:
            t.prune(max_size=int(rng.integers(0, 30)))
            for w in range(4):
                assert t.size[w] == t.recount(w)
            t.check_invariants()
    t.prune(max_size=10)
    assert all(t.size[w] == t.recount(w) <= 10 for w in range(4))
    t.check_invariants()


# ---------------------------------------------------------------------- simple policies
def test_round_robin_cycles_and_random_is_seeded():
    rr = RoundRobin()
    rr.bind(3)
    assert [rr.route(toks(1), loads(0, 0, 0), 0.0) for _ in range(5)] == [0, 1, 2, 0, 1]
    picks = []
    for _ in range(2):
        r = RandomRouter(seed=7)
        r.bind(4)
        picks.append([r.route(toks(1), loads(0, 0, 0, 0), 0.0) for _ in range(20)])
    assert picks[0] == picks[1] and len(set(picks[0])) > 1
    assert dict(rr.decisions) == {"round_robin": 5}


def test_least_load_picks_fewest_outstanding_tokens_or_requests():
    r = LeastLoad()
    r.bind(3)
    assert r.route(toks(1), loads(50, 10, 10, requests=(0, 5, 1)), 0.0) == 1  # tie: lowest index
    r = LeastLoad(load="requests")
    r.bind(3)
    assert r.route(toks(1), loads(50, 10, 10, requests=(0, 5, 1)), 0.0) == 0


def test_imbalance_needs_both_the_absolute_and_the_relative_gap():
    assert is_imbalanced([100, 10], abs_threshold=32, rel_threshold=1.0001)
    assert not is_imbalanced([40, 10], abs_threshold=32, rel_threshold=1.0001)  # gap 30
    assert not is_imbalanced([1000, 900], abs_threshold=32, rel_threshold=1.5)  # ratio 1.11


# ---------------------------------------------------------------------- cache aware
def cache_aware(n: int = 3, **kw) -> CacheAware:
    kw = {"balance_abs_threshold": 32, "load": "tokens", "max_tree_size": None} | kw
    r = CacheAware(**kw)
    r.bind(n)
    return r


def test_cache_aware_routes_to_the_best_match_above_the_threshold():
    r = cache_aware()
    r.tree.insert(toks(1, 2, 3, 4, 5, 6), 2)
    r.tree.insert(toks(1, 2, 3), 1)
    assert r.route(toks(1, 2, 3, 4, 5, 9), loads(0, 0, 5), 0.0) == 2  # 5/6 > 0.5
    assert r.decisions["cache"] == 1
    assert r.tree.match(toks(1, 2, 3, 4, 5, 9))[2] == 6  # the prompt was inserted for worker 2


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded():
    r = cache_aware()  # SGLang's default threshold, 0.3
    r.tree.insert(toks(1, 9, 9, 9), 2)
    assert r.route(toks(1, 2, 3, 4, 5), loads(20, 0, 10), 0.0) == 1  # 1/5 is not above 0.3
    assert dict(r.decisions) == {"low_match": 1}
    r = cache_aware()
    r.tree.insert(toks(1, 2, 9, 9), 2)
    assert r.route(toks(1, 2, 3, 4, 5), loads(20, 0, 10), 0.0) == 2  # 2/5 is above 0.3
    r = cache_aware(cache_threshold=0.5)  # sglang-router 0.1's
    r.tree.insert(toks(1, 2, 9, 9), 2)
    assert r.route(toks(1, 2, 3, 4, 5), loads(20, 0, 10), 0.0) == 1  # 2/5 is not above 0.5


def test_cache_aware_smallest_tree_fallback():
    r = cache_aware(fallback="smallest_tree")
    r.tree.insert(toks(7, 7, 7, 7), 0)
    r.tree.insert(toks(8, 8), 1)
    assert r.route(toks(1, 2, 3), loads(0, 0, 20), 0.0) == 2  # empty tree, despite its load


def test_imbalance_overrides_a_cache_hit():
    r = cache_aware()
    r.tree.insert(toks(1, 2, 3, 4, 5, 6), 0)
    assert r.route(toks(1, 2, 3, 4, 5, 6, 7), loads(100, 60, 90), 0.0) == 1  # gap 40 > 32
    assert dict(r.decisions) == {"balance": 1}
    assert r.tree.match(toks(1, 2, 3, 4, 5, 6, 7))[1] == 7  # inserted for the balance choice too
    r = cache_aware()
    r.tree.insert(toks(1, 2, 3, 4, 5, 6), 0)
    assert r.route(toks(1, 2, 3, 4, 5, 6, 7), loads(92, 60, 90), 0.0) == 0  # gap 32: not above
    assert dict(r.decisions) == {"cache": 1}


@pytest.mark.parametrize("router", [CacheAware, Oracle])
def test_a_tie_of_loads_goes_to_the_lowest_index_or_to_the_replica_sent_fewest(router):
    """Replica 0 is sent two requests and replica 1 one; then a new prompt meets a tie of loads
    (2 and 2 requests in flight): by index it goes to replica 0, by ``fewest_sent`` to replica 1;
    a replica with less load still wins over one sent fewer."""
    picks = {}
    for tie_break in ("index", "fewest_sent"):
        r = router(tie_break=tie_break)
        r.bind(2, [filled_radix(), filled_radix()])
        tied = Loads(tokens=(0, 0), requests=(2, 2))
        assert r.route(toks(1, 1, 1), Loads(tokens=(0, 0), requests=(0, 1)), 0.0) == 0
        assert r.route(toks(2, 2, 2), Loads(tokens=(0, 0), requests=(1, 0)), 0.0) == 1
        assert r.route(toks(1, 1, 1, 1), tied, 0.0) == 0  # its prefix is believed on 0
        assert r.requests_sent == {0: 2, 1: 1}
        picks[tie_break] = (r.route(toks(9, 9, 9), tied, 0.0),
                            r.route(toks(8, 8, 8), Loads(tokens=(0, 0), requests=(1, 2)), 0.0))
    assert picks == {"index": (0, 0), "fewest_sent": (1, 0)}


def test_a_bad_tie_break_names_the_key_and_the_choices():
    with pytest.raises(BadInput, match="router.tie_break must be one of index, fewest_sent"):
        CacheAware(tie_break="random")


def test_ties_in_match_length_go_to_the_least_loaded_of_them():
    r = cache_aware()
    r.tree.insert(toks(1, 2, 3, 4), 0)
    r.tree.insert(toks(1, 2, 3, 4), 2)
    assert r.route(toks(1, 2, 3, 4, 5), loads(20, 0, 10), 0.0) == 2


def test_periodic_pruning_caps_each_workers_tree():
    r = cache_aware(n=2, max_tree_size=4, eviction_interval_s=10.0)
    for t, tok in enumerate((1, 2, 3)):  # no match, equal loads: all to worker 0
        r.route(toks(tok, tok, tok), loads(0, 0), float(t))
    assert r.tree.size == [9, 0]  # over the cap, but the interval has not passed
    r.route(toks(4, 4, 4), loads(0, 0), 10.0)  # interval passed: prune, then insert
    assert r.tree.size == [3 + 3, 0]  # pruned to 3 (whole nodes), then 4 4 4 added
    assert r.tree.match(toks(3, 3, 3)) == [3, 0] and r.tree.match(toks(1, 1, 1)) == [0, 0]
    r.tree.check_invariants()


def test_interval_zero_prunes_after_every_insert():
    r = cache_aware(n=1, max_tree_size=5, eviction_interval_s=0.0)
    for i in range(1, 6):
        r.route(toks(i, i, i), loads(0), float(i))
        assert r.tree.size[0] <= 5 and r.tree.size[0] == r.tree.recount(0)


def test_lazy_update_inserts_prompt_and_output_for_the_worker():
    r = cache_aware()
    r.on_complete(1, toks(1, 2, 3), toks(4, 5), 0.0)
    assert r.tree.match(toks(1, 2, 3, 4, 5, 6)) == [0, 5, 0]
    r.on_complete(2, toks(9, 9), None, 0.0)  # aborted: nothing to learn
    assert r.tree.size[2] == 0
    off = cache_aware(update_on_complete=False)
    assert not off.wants_completions


# ---------------------------------------------------------------------- oracle
def filled_radix(*seqs: np.ndarray) -> RadixCache:
    cache = RadixCache(1000)
    for seq in seqs:
        lease = cache.acquire(seq)
        cache.extend(lease, len(seq) - lease.hit)
        cache.release(lease, seq)
    return cache


def test_peek_match_reads_the_real_cache_without_touching_it():
    cache = filled_radix(toks(1, 2, 3, 4))
    before = [(n.id, n.last_access) for n in cache.nodes()]
    assert peek_match(cache, toks(1, 2, 3, 9)) == 3  # would split the edge if it were a lookup
    assert peek_match(cache, toks(1, 2, 3, 4, 5), limit=2) == 2
    assert [(n.id, n.last_access) for n in cache.nodes()] == before
    assert peek_match(NoCache(100), toks(1, 2)) == 0
    bh = BlockHashCache(64, block_size=2)
    lease = bh.acquire(toks(1, 2, 3, 4, 5))
    bh.extend(lease, 5)
    bh.release(lease, toks(1, 2, 3, 4, 5))
    assert peek_match(bh, toks(1, 2, 3, 4, 9)) == bh.match(toks(1, 2, 3, 4, 9)) == 4


def test_oracle_follows_the_real_caches_and_in_flight_prompts():
    caches = [filled_radix(), filled_radix(toks(1, 2, 3)), filled_radix(toks(1, 2, 3, 4, 5))]
    r = Oracle(balance_abs_threshold=32, load="tokens")
    r.bind(3, caches)
    assert r.route(toks(1, 2, 3, 4, 5, 6), loads(0, 0, 10), 0.0) == 2
    assert r.route(toks(8, 8, 8, 8), loads(0, 5, 10), 0.0) == 0  # no hit anywhere: least loaded
    # in flight on worker 0 now: 8 8 8 8, so a prompt extending it goes there
    assert r.route(toks(8, 8, 8, 8, 1), loads(3, 0, 0), 0.0) == 0
    r.on_complete(0, toks(8, 8, 8, 8), toks(2), 0.0)
    r.on_complete(0, toks(8, 8, 8, 8, 1), None, 0.0)
    assert r.hits(toks(8, 8, 8, 8, 1)) == [0, 0, 0]  # finished and never cached here
    assert r.route(toks(1, 2, 3, 4, 5, 6), loads(100, 60, 90), 0.0) == 1  # imbalance first
    assert dict(r.decisions) == {"cache": 2, "low_match": 1, "balance": 1}


def test_oracle_needs_the_caches():
    with pytest.raises(ValueError, match="needs every replica's cache"):
        Oracle().bind(2, [])


# ---------------------------------------------------------------------- config
def test_routers_build_from_the_config_group_and_reject_unknown_keys():
    r = ROUTERS.build({"name": "cache_aware", "cache_threshold": 0.3, "network_delay_s": 0.01},
                    max_tree_size=1234)
    assert isinstance(r, CacheAware) and r.cache_threshold == 0.3 and r.max_tree_size == 1234
    capped = ROUTERS.build({"name": "cache_aware", "max_tree_size": 99}, max_tree_size=5)
    assert capped.max_tree_size == 99
    assert ROUTERS.build("random", seed=3).seed == 3
    with pytest.raises(ValueError, match="cache_threshold is not a setting of router=least_load"):
        ROUTERS.build({"name": "least_load", "cache_threshold": 0.5})
    with pytest.raises(ValueError, match="router must be one of"):
        ROUTERS.build("sticky")
    with pytest.raises(ValueError, match=r"router.cache_threshold must be in \[0, 1\], got 2"):
        ROUTERS.build({"name": "cache_aware", "cache_threshold": 2})
    with pytest.raises(ValueError, match="router.load must be one of tokens, requests"):
        ROUTERS.build({"name": "least_load", "load": "bytes"})
    assert cluster_delays({"name": "x", "network_delay_s": 0.002}) == (0.002, 0.0)
    with pytest.raises(ValueError, match="router.network_delay_s must be >= 0"):
        cluster_delays({"network_delay_s": -1})


def test_every_config_file_builds_its_router():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from tests.test_sim import REPO

    for path in sorted((REPO / "conf" / "router").glob("[!_]*.yaml")):
        if path.stem == "custom":  # needs router.target: tests/test_configs.py builds it
            continue
        with initialize_config_dir(config_dir=str(REPO / "conf" / "router"), version_base=None):
            cfg = OmegaConf.to_container(compose(path.stem))
        router = ROUTERS.build(cfg, max_tree_size=1000)
        assert router.name == path.stem
        assert cluster_delays(cfg) == (0.0, 0.0)
