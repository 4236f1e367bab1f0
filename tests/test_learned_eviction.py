"""The learned eviction policy: registry build, LRU before its first model, labels from the past
only, determinism and the cache's invariants."""

from __future__ import annotations

from testbed.cache import EVICTION, RadixCache
from testbed.cache.learned import LearnedEviction
from testbed.replay import replay
from testbed.workloads.synthetic import random_tree

SMALL = {"name": "learned", "retrain_every": 200, "window": 2000, "horizon": 300, "min_train": 100,
         "max_iter": 5}


def workload(seed: int = 0):
    return random_tree(num_requests=400, root_len=30, segment_len=8, output_len=6, seed=seed)


def run(params: dict, requests, capacity: int = 300):
    cache = RadixCache(capacity, policy=EVICTION.build(params))
    return cache, replay(requests, cache)


def test_builds_through_the_registry():
    policy = EVICTION.build({"name": "learned", "horizon": 123})
    assert isinstance(policy, LearnedEviction) and policy.horizon == 123


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

    def _label(self, row, gap: int) -> None:
        assert 0 <= gap <= self.horizon
        super()._label(row, gap)


def test_labels_come_from_the_past_only():
    params = {k: v for k, v in SMALL.items() if k != "name"}
    policy = Recording(**params)
    cache = RadixCache(300, policy=policy)
    replay(workload(), cache)
    assert policy.checked > 0 and policy.fits == policy.checked
    # a pending entry's access time is never later than the clock
    assert all(at <= policy.now for at, _ in policy._pending.values())


def test_deterministic_and_keeps_the_cache_invariants():
    requests = workload(seed=5)
    a, ra = run(SMALL, requests)
    b, rb = run(SMALL, requests)
    assert a.policy.fits > 0
    assert [(r.id, r.cached_tokens) for r in ra] == [(r.id, r.cached_tokens) for r in rb]
    a.check_invariants()
    b.check_invariants()


def test_a_hit_on_a_split_head_labels_the_entry_it_was_cut_from():
    from tests.conftest import toks

    policy = LearnedEviction(horizon=10**6)
    cache = RadixCache(100, policy=policy)
    for seq in ([1, 2, 3, 4, 5, 6], [1, 2, 3, 9]):  # the second walk splits [1..6] after 3
        lease = cache.acquire(toks(*seq))
        cache.extend(lease, len(seq) - lease.hit)
        cache.release(lease, toks(*seq))
    assert [gap for _, _, gap in policy.window] != []  # the reuse became a label, not censored
    cache.check_invariants()
