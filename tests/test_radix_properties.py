"""Property tests of the radix cache against brute-force models (hypothesis, derandomized).

Each property runs at least 10^4 cache operations per CI run (examples x operations).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache.radix import RadixCache, TreeNode

SETTINGS = settings(max_examples=250, deadline=None, derandomize=True)
seqs = st.lists(st.integers(0, 3), min_size=0, max_size=12)


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def peek(cache: RadixCache, key: list[int]) -> int:
    """Cached length of ``key``'s prefix, found token by token without touching anything."""
    node, n = cache.root, 0
    while True:
        child = next((c for c in node.children.values()
                      if n < len(key) and c.key[0] == key[n]), None)
        if child is None:
            return n
        k = lcp(child.key.tolist(), key[n:])
        n += k
        if k < len(child.key):
            return n - n % cache.page_size
        node = child


def path_of(node: TreeNode) -> tuple[int, ...]:
    """The tokens from the root to the end of ``node``."""
    parts = []
    while node.parent is not None:
        parts.append(node.key.tolist())
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def cached_pages(cache: RadixCache) -> set[tuple[int, ...]]:
    """Every cached page-aligned prefix, read off the tree."""
    page = cache.page_size
    return {path[:n] for node in cache.nodes() for path in [path_of(node)]
            for n in range(node.start + page, len(path) + 1, page)}


def brute_force_eviction(cache: RadixCache, n: int, unit: str) -> tuple[dict[int, int], int]:
    """What `evict(n)` must leave (node id -> tokens) and free: rescan all nodes for the oldest
    unlocked leaf each time; under ``unit="page"`` take only the tail pages still needed of
    a leaf larger than that."""
    nodes = {node.id: node for node in cache.nodes()}
    sizes = {k: v.size for k, v in nodes.items()}
    children = {k: len(v.children) for k, v in nodes.items()}
    freed = 0
    while freed < n:
        leaves = [v for k, v in nodes.items() if children[k] == 0 and v.lock_ref == 0]
        if not leaves:
            break
        victim = min(leaves, key=lambda v: v.last_access)
        need = -(-(n - freed) // cache.page_size) * cache.page_size
        if unit == "page" and need < sizes[victim.id]:
            sizes[victim.id] -= need
            return sizes, freed + need
        freed += sizes.pop(victim.id)
        del nodes[victim.id]
        if victim.parent is not cache.root:
            children[victim.parent.id] -= 1
    return sizes, freed


class PageModel:
    """The cached page-aligned prefixes, kept apart from the tree: inserts add theirs; an eviction
    (checked against the cache's, wherever the cache calls it) removes what
    `brute_force_eviction` says, and its freed tokens must be the cache's."""

    def __init__(self, cache: RadixCache, unit: str) -> None:
        self.cache, self.unit = cache, unit
        self.content: set[tuple[int, ...]] = set()
        self.evicted = 0
        self._evict = cache.evict
        cache.evict = self.evict  # extend's evictions come here too

    def hit(self, seq: list[int]) -> int:
        page = self.cache.page_size
        return max((n for n in range(page, len(seq) + 1, page) if tuple(seq[:n]) in self.content),
                   default=0)

    def insert(self, seq: list[int]) -> None:
        page = self.cache.page_size
        self.content |= {tuple(seq[:n]) for n in range(page, len(seq) + 1, page)}

    def evict(self, n: int) -> int:
        cache = self.cache
        assert cached_pages(cache) == self.content, "the tree's content drifted from the model's"
        sizes, freed = brute_force_eviction(cache, n, self.unit)
        removed = {path[:k] for node in cache.nodes() for path in [path_of(node)]
                   for k in range(node.start + sizes.get(node.id, 0) + cache.page_size,
                                  len(path) + 1, cache.page_size)}
        ids_before = {node.id for node in cache.nodes()}
        got = self._evict(n)
        assert got == freed, f"freed {got}, the brute-force model {freed}"
        assert ids_before - {node.id for node in cache.nodes()} == ids_before - set(sizes), \
            "victims differ from the brute-force LRU scan"
        assert {node.id: node.size for node in cache.nodes()} == sizes, "trimmed differently"
        self.content -= removed
        assert cached_pages(cache) == self.content
        self.evicted += freed
        return got


@SETTINGS
@given(st.sampled_from([1, 2, 4]), st.lists(st.tuples(st.booleans(), seqs), min_size=40, max_size=60))
def test_unlimited_match_equals_longest_common_prefix_with_any_inserted_sequence(page, ops):
    cache = RadixCache(None, page_size=page)
    inserted: list[list[int]] = []
    for is_insert, seq in ops:
        expected = max((lcp(seq, s) for s in inserted), default=0)
        expected -= expected % page
        key = np.asarray(seq, dtype=np.int32)
        if is_insert:
            lease = cache.acquire(key)
            assert lease.hit == expected
            cache.extend(lease, len(seq) - lease.hit)
            cache.release(lease, key)
            inserted.append(seq[: len(seq) - len(seq) % page])
        else:
            assert cache.match(key) == expected
            for limit in (None, 0, 3, len(seq) - 1, -2):  # as tokens[:limit] cuts
                assert cache.match_bytes(key.tobytes(), limit) == cache.match(key, limit)
    cache.check_invariants()


op = st.one_of(
    st.tuples(st.just("request"), seqs),
    st.tuples(st.just("hold"), seqs),
    st.tuples(st.just("drop"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("match"), seqs),
    st.tuples(st.just("evict"), st.integers(0, 12)),
    st.tuples(st.just("grow"), st.integers(0, 3), seqs),
    st.tuples(st.just("decode"), st.integers(0, 3)),
    st.tuples(st.just("commit"), st.integers(0, 3)),
)


def drop(cache: RadixCache, model: PageModel, held: list, i: int, insert: bool) -> None:
    """End held lease ``i`` (modulo their number), inserting its sequence or not, and tell the
    model."""
    lease, key = held.pop(i % len(held))
    cache.release(lease, key, insert=insert)
    if insert:
        model.insert(key.tolist())


def held_by_leases(leases: list) -> int:
    """Slots the running requests own: beyond their cached prefix, spare slots included."""
    return sum(len(lease.owned) for lease in leases)


@pytest.mark.parametrize("unit", ["node", "page"])
@SETTINGS
@given(st.sampled_from([1, 2, 4]), st.integers(4, 24), st.lists(op, min_size=40, max_size=60))
def test_invariants_hold_under_random_operations_and_locked_prefixes_survive(unit, page, capacity,
                                                                              ops):
    cache = RadixCache(capacity, page_size=page, evict_unit=unit)
    model = PageModel(cache, unit)  # checks hits, content and every eviction (tokens freed)
    capacity -= capacity % page  # whole pages only
    assert cache.pool.capacity == capacity
    held = []  # (lease, tokens of its sequence)
    evicted_total = 0  # what extend and evict report
    for step in ops:
        kind = step[0]
        if kind in ("request", "hold"):
            key = np.asarray(step[1], dtype=np.int32)
            lease = cache.acquire(key)
            assert lease.hit == model.hit(step[1]), "hit differs from the model's"
            evicted = cache.extend(lease, len(key) - lease.hit)
            evicted_total += evicted or 0
            if kind == "hold" and evicted is not None and len(held) < 3:
                held.append((lease, key))
            else:
                cache.release(lease, key, insert=evicted is not None)
                if evicted is not None:
                    model.insert(step[1])
        elif kind == "drop" and held:
            drop(cache, model, held, step[1], step[2])
        elif kind == "match":
            assert cache.match(np.asarray(step[1], dtype=np.int32)) == model.hit(step[1])
        elif kind == "evict":
            size_before = cache.total_size
            freed = cache.evict(step[1])
            evicted_total += freed
            assert cache.total_size == size_before - freed
            assert freed % page == 0, "eviction freed part of a page"
        elif kind == "grow" and held:
            i = step[1] % len(held)
            lease, key = held[i]
            more = np.asarray(step[2], dtype=np.int32)
            cost = cache.extension_cost(lease, len(more))
            assert cost == -(-max(0, len(more) - len(lease.spare)) // page) * page
            before = cache.available_size
            evicted = cache.extend(lease, len(more))
            evicted_total += evicted or 0
            if evicted is not None:
                assert cache.available_size == before - cost, "extend took other than its cost"
                held[i] = (lease, np.concatenate([key, more]))
            else:
                assert cost > before and cache.available_size == before
        elif kind == "decode" and held:
            leases = [lease for lease, _ in held]
            cost = sum(cache.extension_cost(lease, 1) for lease in leases)
            if cost <= cache.available_size:  # the scheduler's check before a decode step
                before = cache.available_size
                evicted_total += sum(cache.extend_each(leases, 1))
                assert cache.available_size == before - cost
                held = [(lease, np.append(key, np.int32(step[1]))) for lease, key in held]
        elif kind == "commit" and held:
            lease, key = held[step[1] % len(held)]
            spare, tail = lease.spare.copy(), lease.slots[len(key) - len(key) % page :].copy()
            cache.commit(lease, key)
            model.insert(key.tolist())
            assert lease.cached == len(key) - len(key) % page
            assert np.array_equal(lease.spare, spare), "commit took the spare slots"
            assert np.array_equal(lease.slots[lease.cached :], tail), "commit took the tail"
        leases = [lease for lease, _ in held]
        cache.check_invariants(leases)
        assert cache.pool.num_free + cache.total_size + held_by_leases(leases) == capacity
        for lease, key in held:
            assert lease.num_tokens == len(key)
            assert peek(cache, key.tolist()) >= lease.hit, "a locked prefix was evicted"
    assert evicted_total == model.evicted, "evicted tokens reported differ from the model's"
    for lease, key in held:
        cache.release(lease, key)
        model.insert(key.tolist())
    assert cached_pages(cache) == model.content
    cache.check_invariants()
    assert cache.protected_size == 0
    assert cache.pool.num_free + cache.total_size == capacity


def test_tree_node_ids_are_unique():
    cache = RadixCache(None)
    for seq in ([1, 2, 3], [1, 2, 4], [1, 5]):
        key = np.asarray(seq, dtype=np.int32)
        lease = cache.acquire(key)
        cache.extend(lease, len(key) - lease.hit)
        cache.release(lease, key)
    ids = [n.id for n in cache.nodes()]
    assert len(ids) == len(set(ids)) == 5
    assert all(isinstance(n, TreeNode) for n in cache.nodes())
