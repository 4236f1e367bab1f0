"""Exact behaviour of the radix cache (DESIGN.md §4)."""

import numpy as np
import pytest

from testbed.cache.radix import RadixCache, common_prefix_length
from tests.conftest import toks


def put(cache: RadixCache, *ids: int) -> int:
    """Insert a sequence with freshly allocated pages, freeing duplicates like a request would."""
    key = toks(*ids)
    slots = cache.pool.alloc(cache.pool.round_up(len(key)))
    present = cache.insert(key, slots[: len(key)])
    cache.pool.free(slots[:present])
    cache.pool.free(slots[len(key) - len(key) % cache.page_size :])  # the last page: not cached
    return present


def edges(cache: RadixCache) -> list[list[int]]:
    return sorted(n.key.tolist() for n in cache.nodes())


def test_common_prefix_length_is_exact_at_every_boundary():
    a = np.arange(1000, dtype=np.int32)
    assert common_prefix_length(a, a) == 1000
    assert common_prefix_length(a, a[:10]) == 10
    b = a.copy()
    b[637] = -1
    assert common_prefix_length(a, b) == 637
    assert common_prefix_length(a[:0], a) == 0


def test_match_of_part_of_an_edge_splits_it_and_returns_the_head():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)
    n, node, slots = cache.match_prefix(toks(1, 2))
    assert n == 2
    assert node.key.tolist() == [1, 2]
    assert [c.key.tolist() for c in node.children.values()] == [[3]]
    assert slots.tolist() == [1, 2]
    cache.check_invariants()


def test_split_tail_keeps_the_original_node_object_and_its_slots():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)
    (original,) = cache.root.children.values()
    _, head, _ = cache.match_prefix(toks(1, 2, 9))
    assert head is not original
    assert original.parent is head
    assert original.key.tolist() == [3] and original.slots.tolist() == [3]


def test_diverging_sequences_share_their_prefix_node():
    cache = RadixCache(100)
    put(cache, *range(1, 9))
    assert put(cache, 1, 2, 9, 10) == 2
    assert cache.total_size == 10
    assert edges(cache) == [[1, 2], [3, 4, 5, 6, 7, 8], [9, 10]]
    cache.check_invariants()


def test_inserting_an_existing_sequence_returns_its_length_and_changes_nothing():
    cache = RadixCache(100)
    put(cache, 1, 2, 3, 4)
    before = (edges(cache), cache.total_size, cache.pool.num_free)
    key = toks(1, 2, 3, 4)
    slots = cache.pool.alloc(4)
    assert cache.insert(key, slots) == 4
    cache.pool.free(slots)
    assert (edges(cache), cache.total_size, cache.pool.num_free) == before
    cache.check_invariants()


def test_insert_of_a_prefix_of_an_edge_splits_it_without_a_new_leaf():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)
    assert put(cache, 1, 2) == 2
    assert edges(cache) == [[1, 2], [3]]


def test_matching_an_empty_key_touches_nothing():
    cache = RadixCache(100)
    put(cache, 1, 2)
    clock = cache._clock
    assert cache.match_prefix(toks())[0] == 0
    assert cache._clock == clock


def test_three_forks_keep_the_shared_prefix_locked_until_all_unlock():
    cache = RadixCache(100)
    put(cache, *range(1, 11))  # the shared 10-token prefix
    leases = [cache.acquire(toks(*range(1, 11), 100 + i)) for i in range(3)]
    assert [lease.hit for lease in leases] == [10, 10, 10]
    assert cache.protected_size == 10 and cache.evictable_size == 0
    assert cache.evict(100) == 0
    for i, lease in enumerate(leases[:2]):
        cache.release(lease, toks(*range(1, 11)), insert=False)
        assert cache.evict(100) == 0, f"evicted while {2 - i} forks still hold the prefix"
    cache.release(leases[2], toks(*range(1, 11)), insert=False)
    assert cache.evictable_size == 10
    assert cache.evict(1) == 10  # the whole node in one call
    assert cache.total_size == 0 and cache.pool.num_free == 100
    cache.check_invariants()


def test_lru_evicts_the_oldest_leaf_first_then_cascades_to_a_parent_that_became_a_leaf():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)      # leaf [3] after the split below
    put(cache, 1, 2, 4, 5)   # leaf [4, 5]; the split makes [1, 2] their parent
    put(cache, 7, 8)         # another root child
    cache.match_prefix(toks(7, 8))  # [7, 8] is now the most recent
    # Oldest leaf: [3] (touched by the second insert's walk before the split; [4,5] is newer).
    assert cache.evict(1) == 1
    assert edges(cache) == [[1, 2], [4, 5], [7, 8]]
    assert cache.evict(1) == 2
    assert edges(cache) == [[1, 2], [7, 8]]
    # [1, 2] became a leaf with its stored time, older than [7, 8]'s.
    assert cache.evict(1) == 2
    assert edges(cache) == [[7, 8]]
    cache.check_invariants()


def test_a_new_leaf_is_newer_than_the_split_off_tail_beside_it():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)
    put(cache, 1, 2, 4)
    tail = next(n for n in cache.nodes() if n.key.tolist() == [3])
    leaf = next(n for n in cache.nodes() if n.key.tolist() == [4])
    head = tail.parent
    assert tail.last_access < head.last_access < leaf.last_access


def test_lock_and_eviction_never_change_access_times():
    cache = RadixCache(100)
    put(cache, 1, 2, 3)
    put(cache, 5, 6)
    times = {tuple(n.key.tolist()): n.last_access for n in cache.nodes()}
    _, node, _ = cache.match_prefix(toks(1, 2, 3))
    times[(1, 2, 3)] = node.last_access
    cache.lock(node)
    cache.unlock(node)
    cache.evict(2)
    assert {tuple(n.key.tolist()): n.last_access for n in cache.nodes()} == \
        {k: v for k, v in times.items() if k != (5, 6)}


def test_evict_frees_whole_nodes_and_stops_once_enough_is_freed():
    cache = RadixCache(100)
    put(cache, *range(1, 6))
    put(cache, *range(11, 14))
    assert cache.evict(1) == 5  # the oldest node, whole
    assert cache.total_size == 3
    assert cache.pool.num_free == 97


def test_locked_leaf_is_skipped_and_an_unlocked_one_evicted_instead():
    cache = RadixCache(100)
    put(cache, 1, 2)
    put(cache, 3, 4)
    _, node, _ = cache.match_prefix(toks(1, 2))
    cache.lock(node)
    cache.match_prefix(toks(3, 4))
    assert cache.evict(10) == 2
    assert edges(cache) == [[1, 2]]
    cache.unlock(node)
    assert cache.evict(10) == 2


def test_unlock_of_an_unlocked_node_is_an_error():
    cache = RadixCache(10)
    put(cache, 1)
    (node,) = cache.root.children.values()
    with pytest.raises(RuntimeError):
        cache.unlock(node)


@pytest.mark.parametrize("page", [2, 4])
def test_paged_matches_are_page_aligned(page):
    cache = RadixCache(100, page_size=page)
    put(cache, *range(1, 10))  # 9 tokens: only 8 (whole pages) are inserted
    assert cache.total_size == 8
    assert cache.match_prefix(toks(*range(1, 8)))[0] == (4 if page == 4 else 6)
    assert cache.match_prefix(toks(1, 2, 3, 99, 98, 97, 96, 95))[0] == (2 if page == 2 else 0)
    assert cache.match_prefix(toks(*range(1, 10)))[0] == 8
    for node in cache.nodes():
        assert len(node.key) % page == 0
    cache.check_invariants()


def test_paged_release_frees_the_unaligned_tail():
    cache = RadixCache(20, page_size=4)
    lease = cache.acquire(toks(1, 2, 3, 4, 5, 6))
    assert lease.hit == 0
    assert cache.extend(lease, 7) == 0
    cache.release(lease, toks(1, 2, 3, 4, 5, 6, 7))
    assert cache.total_size == 4 and cache.pool.num_free == 16
    cache.check_invariants()


def test_extend_evicts_the_oldest_whole_leaf_when_the_pool_is_short():
    cache = RadixCache(10)
    for seq in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        lease = cache.acquire(toks(*seq))
        cache.extend(lease, 3)
        cache.release(lease, toks(*seq))
    lease = cache.acquire(toks(4, 5, 6, 10, 11))
    assert lease.hit == 3
    assert cache.extend(lease, 2) == 3  # 1 free slot; the oldest leaf [1, 2, 3] goes whole
    assert edges(cache) == [[4, 5, 6], [7, 8, 9]]
    assert cache.pool.num_free == 2
    cache.check_invariants([lease])


def test_extend_that_cannot_succeed_changes_nothing():
    cache = RadixCache(6)
    lease = cache.acquire(toks(1, 2, 3))
    cache.extend(lease, 3)
    cache.release(lease, toks(1, 2, 3))
    held = cache.acquire(toks(1, 2, 3, 4))
    assert cache.extend(held, 4) is None
    assert cache.total_size == 3 and cache.pool.num_free == 3
    cache.check_invariants([held])


def test_release_gives_back_duplicate_slots_of_tokens_cached_meanwhile():
    cache = RadixCache(20)
    a = cache.acquire(toks(1, 2, 3))
    b = cache.acquire(toks(1, 2, 3))
    cache.extend(a, 3)
    cache.extend(b, 3)
    cache.release(a, toks(1, 2, 3))
    released = cache.release(b, toks(1, 2, 3))
    assert released.already_cached == 3
    assert cache.total_size == 3 and cache.pool.num_free == 17
    cache.check_invariants()
