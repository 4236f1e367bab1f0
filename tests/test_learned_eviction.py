"""The learned eviction policy: registry build, LRU before its first model, labels from the past
only (its decisions on a trace's prefix do not depend on the trace's future), ghost labels and
turns of evicted nodes, the tree walked exactly as scikit-learn predicts, determinism and the
cache's invariants."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sklearn.tree import DecisionTreeRegressor

from testbed.cache import EVICTION, RadixCache
from testbed.cache.learned import LearnedEviction, TreeModel, log_bin
from testbed.backends.replay import replay
from testbed.workloads.synthetic import random_tree
from tests.conftest import toks

SMALL = {"name": "learned", "retrain_every": 100, "window": 2000, "horizon": 300, "min_train": 100,
         "max_depth": 4, "min_samples_leaf": 5}


def workload(seed: int = 0, num_requests: int = 400):
    return random_tree(num_requests=num_requests, root_len=30, segment_len=8, output_len=6,
                       seed=seed)


def run(params: dict, requests, capacity: int = 300):
    cache = RadixCache(capacity, policy=EVICTION.build(params))
    return cache, replay(requests, cache)


def serve(cache: RadixCache, seq) -> None:
    lease = cache.acquire(toks(*seq))
    cache.extend(lease, len(seq) - lease.hit)
    cache.release(lease, toks(*seq))


def test_builds_through_the_registry():
    policy = EVICTION.build({"name": "learned", "horizon": 123})
    assert isinstance(policy, LearnedEviction) and policy.horizon == 123


@pytest.mark.parametrize("key", ["retrain_every", "window", "horizon", "min_train", "max_depth",
                                 "min_samples_leaf", "scale"])
def test_a_setting_below_one_is_refused_naming_the_key(key):
    with pytest.raises(ValueError, match=f"eviction.{key} must be"):
        LearnedEviction(**{key: 0})


def test_log_bin_has_four_bins_per_octave():
    assert [log_bin(n) for n in (0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 16)] == \
        [0, 4, 8, 10, 12, 13, 14, 15, 16, 19, 20]


def test_the_tree_walk_predicts_what_scikit_learn_predicts():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 20, size=(500, 9))
    y = (x[:, 0] + 3 * x[:, 5] > 30).astype(float)
    fitted = DecisionTreeRegressor(max_depth=6, min_samples_leaf=5, random_state=0).fit(x, y)
    grid = rng.integers(-1, 22, size=(300, 9))
    walked = [TreeModel(fitted).predict(tuple(row)) for row in grid.tolist()]
    assert walked == fitted.predict(grid).tolist()


def test_before_its_first_model_it_is_lru():
    requests = workload()
    cache, records = run({**SMALL, "retrain_every": 10**9}, requests)
    _, lru = run({"name": "lru"}, requests)
    assert cache.policy.model is None
    assert [r.cached_tokens for r in records] == [r.cached_tokens for r in lru]


class Recording(LearnedEviction):
    """Checks, at every fit, that each label was known by then and covers only the past."""

    def _fit(self) -> None:
        for known, _, _ in self.window:
            assert known <= self.now
        self.checked = getattr(self, "checked", 0) + 1
        super()._fit()

    def _label(self, row, reused: int) -> None:
        assert reused in (0, 1)
        super()._label(row, reused)


def test_labels_are_known_when_they_are_used():
    params = {k: v for k, v in SMALL.items() if k != "name"}
    policy = Recording(**params)
    cache = RadixCache(300, policy=policy)
    replay(workload(), cache)
    assert policy.checked > 0 and policy.fits == policy.checked
    assert all(at <= policy.now for at, _ in policy._pending.values())


def prefix_run(params: dict, trace, unit: str, length: int = 300):
    """Replay ``trace[:length]`` with the policy built knowing the whole ``trace`` (as a run's
    assembly builds it): the evictions (start, tokens freed, node id) in order, each request's
    hit and the policy."""
    cache = RadixCache(300, policy=EVICTION.build(params, requests=trace), evict_unit=unit)
    seen: list[tuple[int, int, int]] = []
    hook = cache.policy.on_evict

    def on_evict(entry, key):
        seen.append((entry.start, len(entry.slots), entry.id))
        hook(entry, key)

    cache.policy.on_evict = on_evict
    hits = [r.cached_tokens for r in replay(trace[:length], cache)]
    return seen, hits, cache.policy


@pytest.mark.parametrize("unit", ["node", "page"])
def test_decisions_on_a_prefix_do_not_depend_on_the_future(unit):
    """Two traces with the same first 300 requests and different futures: the learned policy
    evicts the same entries in the same order, hits the same tokens and holds the same labels on
    the prefix (the oracle, which reads the future, does not: the test can fail)."""
    past = workload(seed=1, num_requests=300)
    # the futures re-send different parts of the past: the oldest or the newest requests
    traces = [past + [dataclasses.replace(r, id=f"again-{r.id}") for r in part]
              for part in (past[:100], past[200:])]
    a_seen, a_hits, a = prefix_run(SMALL, traces[0], unit)
    b_seen, b_hits, b = prefix_run(SMALL, traces[1], unit)
    assert a.fits > 0 and len(a_seen) > 100
    assert a_seen == b_seen and a_hits == b_hits
    assert list(a.window) == list(b.window)
    oracle = [prefix_run({"name": "oracle"}, t, unit)[0] for t in traces]
    assert oracle[0] != oracle[1]


def test_a_hit_on_a_split_head_labels_the_entry_it_was_cut_from():
    policy = LearnedEviction(horizon=10**6)
    cache = RadixCache(100, policy=policy)
    serve(cache, [1, 2, 3, 4, 5, 6])
    serve(cache, [1, 2, 3, 9])  # splits [1..6] after 3: its head is hit
    assert [label for _, _, label in policy.window] == [1]
    tail = next(n for n in cache.nodes() if n.key.tolist() == [4, 5, 6])
    assert policy._pending[tail.id][1][6] == 1  # the tail is pending, flagged as a tail
    cache.check_invariants()


def test_a_node_with_children_is_not_labelled():
    """The shared prefix [1, 2] is hit by every request but is never a candidate then."""
    policy = LearnedEviction(horizon=10**6)
    cache = RadixCache(100, policy=policy)
    serve(cache, [1, 2, 3])
    serve(cache, [1, 2, 4])  # splits [1,2,3]: labels it 1 (its head [1, 2] was hit)
    serve(cache, [1, 2, 5])  # [1, 2] hit again, with children: no label
    assert len(policy.window) == 1
    head = next(n for n in cache.nodes() if n.key.tolist() == [1, 2])
    assert head.id not in policy._pending


def test_an_evicted_leaf_wanted_again_is_labelled_reused_and_keeps_its_turn():
    policy = LearnedEviction(horizon=10**6)
    cache = RadixCache(8, policy=policy)
    serve(cache, [1, 2, 3])  # turn 1
    serve(cache, [1, 2, 3, 4, 5])  # hits the leaf [1, 2, 3] (label 1); [4, 5] below it: turn 2
    leaf = next(n for n in cache.nodes() if n.key.tolist() == [4, 5])
    assert policy._turn[leaf.id] == 2
    serve(cache, [7, 8, 9, 10, 11, 12])  # evicts [4, 5], then [1, 2, 3]: 8 tokens hold 6
    assert {tuple(n.key.tolist()) for n in cache.nodes()} == {(7, 8, 9, 10, 11, 12)}
    assert [label for _, _, label in policy.window] == [1]
    serve(cache, [1, 2, 3, 4, 5, 6])  # the evicted history wanted again, from the root
    # [1, 2, 3] (its second access's row) and [4, 5], carried by its evicted parent: both reused
    assert [(row[0], row[2], label) for _, row, label in policy.window] == \
        [(log_bin(3), 1, 1), (log_bin(3), 2, 1), (log_bin(2), 1, 1)]
    again = next(n for n in cache.nodes() if n.key.tolist()[:1] == [1])
    assert policy._turn[again.id] == 3  # after the evicted [4, 5] (turn 2), not 1
    cache.check_invariants()


@pytest.mark.parametrize("release", ["0.5.23", "0.4.10"])
def test_a_ghost_older_than_the_horizon_is_labelled_not_reused_and_forgotten(release):
    # the policy's clock counts requests, so 0.5.23's checkpoint walks (which tick the cache's
    # clock 2.5 times as fast on a conversation trace) move nothing here
    policy = LearnedEviction(horizon=5)
    cache = RadixCache(4, policy=policy, sglang=release)
    serve(cache, [1, 2, 3])  # request 1
    serve(cache, [7, 8, 9])  # request 2 evicts [1, 2, 3]: a ghost
    for i in range(6):
        serve(cache, [20 + i])  # requests 3-8, each evicting the one before
    serve(cache, [1, 2, 3])  # request 9: too late, no label 1
    assert policy.window[0] == (6, (log_bin(3), 0, 1, 0, 0, 1, 0, 1, log_bin(3)), 0)
    assert [label for _, _, label in policy.window] == [0] * 4  # requests 1-4, 5 requests on
    # ghosts older than the horizon are forgotten (when another node is evicted), keys and all
    assert sorted(g.id for ghosts in policy._ghosts.values() for g in ghosts) == [3, 4, 5, 6, 7]
    assert policy._ghosts_under == {0: dict.fromkeys(policy._ghosts)}  # all under the root


def test_runs_on_block_hash_blocks_which_have_no_tree():
    """Blocks have no parent: no turn, tail or ghosts; an evicted block is labelled 0."""
    from testbed.cache.block_hash import BlockHashCache

    policy = EVICTION.build({**SMALL, "retrain_every": 50, "min_train": 50})
    cache = BlockHashCache(160, block_size=4, policy=policy)
    records = replay(workload(seed=2), cache)
    assert policy.fits > 0 and not policy._ghosts and not policy._turn
    assert sum(r.cached_tokens for r in records) > 0
    assert {row[5:8] for _, row, _ in policy.window} == {(0, 0, 0)}


def test_deterministic_and_keeps_the_cache_invariants():
    requests = workload(seed=5)
    a, ra = run(SMALL, requests)
    b, rb = run(SMALL, requests)
    assert a.policy.fits > 0
    assert [(r.id, r.cached_tokens) for r in ra] == [(r.id, r.cached_tokens) for r in rb]
    a.check_invariants()
    b.check_invariants()


def test_a_saved_model_is_used_from_the_first_request_and_kept_without_refits(tmp_path):
    trained, _ = run(SMALL, workload(seed=0))
    assert trained.policy.fits > 0
    trained.policy.model.save(tmp_path / "model.json")
    policy = EVICTION.build({**SMALL, "model": str(tmp_path / "model.json"), "refit": False})
    rows = [tuple(r) for r in np.random.default_rng(0).integers(0, 20, size=(50, 9)).tolist()]
    assert [policy.model.predict(r) for r in rows] == [trained.policy.model.predict(r) for r in rows]
    cache = RadixCache(300, policy=policy)
    replay(workload(seed=1), cache)
    assert policy.fits == 0 and len(policy.window) > SMALL["retrain_every"]
    with pytest.raises(ValueError, match="eviction.model=.*: not a saved learned model"):
        EVICTION.build({"name": "learned", "model": str(tmp_path / "none.json")})
