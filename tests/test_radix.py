"""Exact behaviour of the radix cache (docs/design.md §4)."""

import numpy as np
import pytest

from testbed.cache.pool import KVSlotPool
from testbed.cache.radix import RadixCache, common_prefix_length
from testbed.backends.replay import replay
from testbed.workloads.request import Request
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


# ---------------------------------------------------------------------------- page-granular KV
def running(cache: RadixCache, prompt: np.ndarray):
    """A request whose prompt has been prefilled: acquired and extended to its length."""
    lease = cache.acquire(prompt)
    assert cache.extend(lease, len(prompt) - lease.hit) is not None
    return lease


def test_a_running_request_of_20_tokens_holds_two_pages_of_16():
    cache = RadixCache(64, page_size=16)
    lease = running(cache, np.arange(20, dtype=np.int32))
    assert cache.available_size == 64 - 32
    assert lease.slots.tolist() == list(range(1, 21))
    assert lease.spare.tolist() == list(range(21, 33))  # the rest of page 1 is held, unused
    cache.check_invariants([lease])


def test_decode_tokens_fill_the_last_page_before_the_33rd_takes_a_new_one():
    cache = RadixCache(64, page_size=16)
    lease = running(cache, np.arange(20, dtype=np.int32))
    assert cache.extension_cost(lease, 1) == 0
    assert cache.extend(lease, 1) == 0 and cache.available_size == 32
    assert lease.slots[-1] == 21
    assert cache.extension_cost(lease, 11) == 0  # up to 32 tokens: still two pages
    cache.extend(lease, 11)
    assert cache.available_size == 32 and len(lease.spare) == 0
    assert cache.extension_cost(lease, 1) == 16  # the 33rd token
    cache.extend(lease, 1)
    assert cache.available_size == 16
    assert lease.slots[-1] == 33 and lease.spare.tolist() == list(range(34, 49))
    cache.check_invariants([lease])


def test_an_extension_past_the_spare_slots_takes_whole_new_pages_only_for_the_rest():
    cache = RadixCache(96, page_size=16)
    lease = running(cache, np.arange(20, dtype=np.int32))  # 12 spare
    assert cache.extension_cost(lease, 30) == 32  # 18 beyond the spare: two new pages
    cache.extend(lease, 30)
    assert lease.num_tokens == 50 and len(lease.spare) == 14
    assert cache.available_size == 96 - 64
    cache.check_invariants([lease])


def test_a_finished_20_token_request_leaves_16_tokens_cached_and_frees_the_rest():
    cache = RadixCache(64, page_size=16)
    key = np.arange(20, dtype=np.int32)
    lease = running(cache, key)
    released = cache.release(lease, key)
    assert released.inserted and released.already_cached == 0
    assert cache.total_size == 16 and cache.evictable_size == 16
    assert cache.pool.num_free == 48 and cache.available_size == 64
    assert [n.slots.tolist() for n in cache.nodes()] == [list(range(1, 17))]
    assert cache.acquire(np.arange(30, dtype=np.int32)).hit == 16
    assert cache.acquire(np.arange(15, dtype=np.int32)).hit == 0


def test_eviction_returns_whole_pages_to_the_pool():
    cache = RadixCache(96, page_size=16)
    for start in (0, 100):
        key = np.arange(start, start + 40, dtype=np.int32)
        cache.release(running(cache, key), key)  # 32 tokens cached each, the third page freed
    assert cache.total_size == 64 and cache.pool.num_free == 32
    assert cache.evict(1) == 32  # the older leaf: two whole pages
    assert cache.pool.num_free == 64
    # the first request's freed third page (33-48) waits: the second took the fresh 49-96
    assert sorted(cache.pool.free_slots().tolist()) == list(range(1, 49)) + list(range(81, 97))
    cache.check_invariants()


def test_extend_evicts_whole_pages_when_the_pool_is_short_of_pages():
    cache = RadixCache(48, page_size=16)
    key = np.arange(20, dtype=np.int32)
    cache.release(running(cache, key), key)  # 16 cached, 32 free
    lease = cache.acquire(np.arange(100, 140, dtype=np.int32))
    assert cache.extension_cost(lease, 40) == 48
    assert cache.extend(lease, 40) == 16
    assert cache.total_size == 0 and cache.available_size == 0
    assert cache.extend(lease, 9) is None  # the spare 8 do not cover it and nothing is left
    assert cache.extend(lease, 8) == 0 and len(lease.spare) == 0
    cache.check_invariants([lease])


def test_releasing_without_insert_returns_the_spare_slots_too():
    cache = RadixCache(64, page_size=16)
    key = np.arange(20, dtype=np.int32)
    cache.release(running(cache, key), key)
    lease = running(cache, np.arange(37, dtype=np.int32))  # 16 hit, 21 more: two new pages
    assert lease.hit == 16 and cache.available_size == 64 - 16 - 32
    cache.release(lease, np.arange(37, dtype=np.int32), insert=False)
    assert cache.total_size == 16 and cache.pool.num_free == 48
    cache.check_invariants()


def test_duplicate_pages_cached_meanwhile_go_back_to_the_pool_at_release():
    cache = RadixCache(128, page_size=16)
    key = np.arange(40, dtype=np.int32)
    a, b = running(cache, key), running(cache, key)
    cache.release(a, key)
    assert cache.release(b, key).already_cached == 32
    assert cache.total_size == 32 and cache.pool.num_free == 96
    cache.check_invariants()


def test_commit_caches_the_whole_pages_and_keeps_the_tail_and_spare_with_the_request():
    cache = RadixCache(64, page_size=16)
    key = np.arange(20, dtype=np.int32)
    lease = running(cache, key)
    cache.commit(lease, key)
    assert lease.cached == 16 and cache.protected_size == 16
    assert lease.slots[16:].tolist() == [17, 18, 19, 20]
    assert lease.spare.tolist() == list(range(21, 33))
    assert cache.available_size == 32
    assert cache.match(np.arange(30, dtype=np.int32)) == 16  # others can hit the whole page
    cache.check_invariants([lease])
    cache.extend(lease, 5)  # the next chunk fills the spare first
    assert cache.available_size == 32 and lease.slots[-1] == 25


def test_a_decode_step_batches_the_new_pages_of_the_leases_whose_spare_is_used_up():
    cache = RadixCache(64, page_size=16)
    a = running(cache, np.arange(20, dtype=np.int32))
    b = running(cache, np.arange(100, 116, dtype=np.int32))  # exactly one page: no spare
    assert [cache.extension_cost(x, 1) for x in (a, b)] == [0, 16]
    assert cache.extend_each([a, b], 1) == [0, 0]
    assert (a.slots[-1], b.slots[-1]) == (21, 49)
    assert b.spare.tolist() == list(range(50, 65))
    assert cache.available_size == 0
    cache.check_invariants([a, b])


def test_a_decode_step_that_must_evict_extends_lease_by_lease_in_whole_pages():
    cache = RadixCache(64, page_size=16)
    key = np.arange(200, 216, dtype=np.int32)
    cache.release(running(cache, key), key)  # one evictable page
    a = running(cache, np.arange(16, dtype=np.int32))
    b = running(cache, np.arange(100, 116, dtype=np.int32))
    assert cache.pool.num_free == 16 and cache.available_size == 32
    assert cache.extend_each([a, b], 1) == [0, 16]
    assert cache.total_size == 0 and cache.available_size == 0
    cache.check_invariants([a, b])


def test_paged_capacity_and_fits_count_whole_pages():
    cache = RadixCache(40, page_size=16)
    assert cache.pool.capacity == 32 and cache.available_size == 32
    assert cache.fits(32) and not cache.fits(33)
    with pytest.raises(ValueError, match="cache.page_size"):
        RadixCache(64, page_size=16, pool=KVSlotPool(64))


def test_paged_replay_hits_whole_pages_and_evicts_whole_pages():
    cache = RadixCache(48, page_size=16)
    requests = [Request("a", np.arange(18, dtype=np.int32), np.arange(90, 94, dtype=np.int32)),
                Request("b", np.arange(20, dtype=np.int32), np.zeros(0, dtype=np.int32)),
                Request("c", np.arange(100, 140, dtype=np.int32), np.zeros(0, dtype=np.int32))]
    records = replay(requests, cache)
    assert [(r.cached_tokens, r.evicted_tokens) for r in records] == [(0, 0), (16, 0), (0, 16)]
    assert cache.total_size == 32 and cache.pool.num_free == 16
    cache.check_invariants()
