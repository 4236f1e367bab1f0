import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.cache.pool import KVSlotPool, OutOfSlots


def test_fresh_pool_hands_out_ascending_ids_from_one_and_never_slot_zero():
    pool = KVSlotPool(5)
    assert pool.alloc(3).tolist() == [1, 2, 3]
    assert pool.num_free == 2


def test_freed_slots_are_reused_and_counted():
    pool = KVSlotPool(4)
    a = pool.alloc(4)
    pool.free(a[1:3])
    assert pool.num_free == 2
    assert sorted(pool.alloc(2).tolist()) == [2, 3]
    assert pool.num_free == 0


def test_alloc_beyond_capacity_raises():
    pool = KVSlotPool(2)
    with pytest.raises(OutOfSlots):
        pool.alloc(3)
    assert not pool.can_alloc(3) and pool.can_alloc(2)


def test_unbounded_pool_mints_fresh_ids_after_reusing_freed_ones():
    pool = KVSlotPool(None)
    a = pool.alloc(3)
    pool.free(a[:1])
    b = pool.alloc(3)
    assert b.tolist() == [1, 4, 5]
    assert pool.num_minted == 5
    pool.check_ownership([a[1:], b])


def test_negative_capacity_is_rejected():
    with pytest.raises(ValueError, match="capacity"):
        KVSlotPool(-1)


def test_check_ownership_catches_a_slot_owned_twice():
    pool = KVSlotPool(3)
    a = pool.alloc(2)
    with pytest.raises(AssertionError):
        pool.check_ownership([a, a[:1]])
    pool.check_ownership([a])
    assert np.array_equal(np.sort(pool.free_slots()), [3])


# ---------------------------------------------------------------------------- pages
def test_paged_pool_rounds_capacity_down_to_whole_pages():
    pool = KVSlotPool(40, page_size=16)
    assert pool.capacity == 32 and pool.num_free == 32 and pool.num_minted == 32


def test_paged_pool_hands_out_whole_pages_starting_after_slot_zero():
    pool = KVSlotPool(48, page_size=16)
    assert pool.alloc(16).tolist() == list(range(1, 17))
    assert pool.alloc(32).tolist() == list(range(17, 49))
    assert pool.num_free == 0 and not pool.can_alloc(1)


def test_paged_pool_rejects_an_allocation_of_part_of_a_page():
    pool = KVSlotPool(32, page_size=16)
    with pytest.raises(ValueError, match="whole pages of 16"):
        pool.alloc(20)
    assert pool.num_free == 32


def test_round_up_counts_the_slots_of_the_pages_a_sequence_occupies():
    pool = KVSlotPool(64, page_size=16)
    assert [pool.round_up(n) for n in (0, 1, 16, 17, 20, 33)] == [0, 16, 16, 32, 32, 48]
    assert KVSlotPool(8).round_up(5) == 5


def test_paged_pool_takes_back_whole_pages_and_reuses_them():
    pool = KVSlotPool(48, page_size=16)
    a = pool.alloc(48)
    pool.free(a[16:32])
    assert pool.num_free == 16
    assert pool.free_slots().tolist() == list(range(17, 33))
    assert pool.alloc(16).tolist() == list(range(17, 33))


def test_paged_pool_asserts_that_freed_slots_are_whole_pages():
    pool = KVSlotPool(48, page_size=16)
    a = pool.alloc(48)
    with pytest.raises(AssertionError, match="not whole pages"):
        pool.free(a[:20])  # a page and a part of the next
    with pytest.raises(AssertionError, match="page boundary"):
        pool.free(a[4:20])  # 16 slots straddling two pages
    with pytest.raises(AssertionError, match="contiguous"):
        pool.free(np.concatenate([a[:1], a[2:16], a[1:2]]))  # a page out of order
    assert pool.num_free == 0


def test_unbounded_paged_pool_mints_whole_pages_after_reusing_freed_ones():
    pool = KVSlotPool(None, page_size=4)
    a = pool.alloc(8)
    pool.free(a[:4])
    b = pool.alloc(8)
    assert b.tolist() == [1, 2, 3, 4, 9, 10, 11, 12]
    assert pool.num_minted == 12
    pool.check_ownership([a[4:], b])


def test_page_size_below_one_is_rejected_naming_the_config_key():
    with pytest.raises(ValueError, match="cache.page_size"):
        KVSlotPool(16, page_size=0)


def test_freed_slots_wait_until_the_fresh_ones_run_out_then_come_back_lowest_first():
    pool = KVSlotPool(8)
    a = pool.alloc(6)
    pool.free(a[[4, 0, 2]])  # freed out of order: 5, 1, 3
    assert pool.num_free == 5 and sorted(pool.free_slots().tolist()) == [1, 3, 5, 7, 8]
    assert pool.alloc(2).tolist() == [7, 8]  # the fresh ones first
    assert pool.alloc(3).tolist() == [1, 3, 5]  # then every free slot, sorted
    pool.check_ownership([a[[1, 3, 5]], np.array([1, 3, 5, 7, 8])])


def test_an_allocation_larger_than_the_fresh_slots_runs_ascending_through_the_freed_ones():
    pool = KVSlotPool(6, page_size=2)
    a = pool.alloc(6)
    pool.free(np.concatenate([a[4:6], a[0:2]]))  # pages 5-6, then 1-2
    assert pool.alloc(4).tolist() == [1, 2, 5, 6]


# ------------------------------------------------------------------- alloc_after (decode runs)
def test_a_lone_sequence_decodes_into_the_slots_right_after_its_prompt():
    pool = KVSlotPool(256)
    prompt = pool.alloc(10)
    assert [int(pool.alloc_after(np.array([prompt[-1] + i]))[0]) for i in range(5)] == \
        [11, 12, 13, 14, 15]


def test_a_batch_decodes_in_runs_of_32_from_the_top_of_the_pool_not_interleaved():
    pool = KVSlotPool(512)
    prompts = [pool.alloc(10) for _ in range(4)]  # back to back: 1-10, 11-20, 21-30, 31-40
    last = np.array([p[-1] for p in prompts])
    steps = []
    for _ in range(33):
        last = pool.alloc_after(last)
        steps.append(last.tolist())
    # the last prompt runs on into 41...; the others' next slots are taken, so each starts a
    # block of 32 from the top down: 481-512, 449-480, 417-448
    assert steps[0] == [481, 449, 417, 41]
    assert steps[31] == [512, 480, 448, 72]
    # a run that meets a taken slot starts the next free block below the last one taken
    assert steps[32] == [385, 353, 321, 73]
    assert pool.num_free == 512 - 40 - 4 * 33


def test_sequences_ending_at_the_same_slot_share_no_next_slot():
    pool = KVSlotPool(128)
    prefix = pool.alloc(8)
    got = pool.alloc_after(np.array([prefix[-1], prefix[-1], 0]))
    assert got.tolist() == [9, 97, 65]  # the first runs on; the others (and one with no KV) start blocks


def test_alloc_after_falls_back_to_the_lowest_free_slots_when_no_block_is_whole():
    pool = KVSlotPool(64)
    every = pool.alloc(64)
    pool.free(every[::2])  # odd slots free: no run of 32 anywhere
    assert pool.alloc_after(np.array([2, 64])).tolist() == [3, 1]  # 3 follows 2; 65 does not exist
    with pytest.raises(OutOfSlots):
        pool.alloc_after(np.zeros(31, dtype=np.int32))


def test_alloc_after_is_plain_alloc_on_an_unbounded_pool_and_refused_on_a_paged_one():
    with pytest.raises(ValueError, match="pages of 16"):
        KVSlotPool(64, page_size=16).alloc_after(np.array([0]))
    assert KVSlotPool(None).alloc_after(np.array([5, 9])).tolist() == [1, 2]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "after", "free"]), st.integers(0, 40),
                          st.integers(0, 10 ** 6)), max_size=60))
def test_any_mix_of_alloc_alloc_after_and_free_keeps_every_slot_free_xor_held_once(ops):
    """Against a set of the free slots: the same counts, never a slot handed out twice or one
    that was not free, every free slot findable."""
    pool, free, held = KVSlotPool(100), set(range(1, 101)), []
    for op, n, seed in ops:
        rng = np.random.default_rng(seed)
        if op == "free" and held:
            chunk = held.pop(int(rng.integers(len(held))))
            pool.free(chunk)
            free |= set(chunk.tolist())
        elif op in ("alloc", "after"):
            if n > len(free):
                with pytest.raises(OutOfSlots):
                    pool.alloc(n) if op == "alloc" else pool.alloc_after(np.zeros(n, np.int32))
                continue
            lasts = rng.choice(np.arange(0, 102), size=n) if op == "after" else None
            got = pool.alloc(n) if op == "alloc" else pool.alloc_after(lasts)
            assert len(got) == n and len(set(got.tolist())) == n and set(got.tolist()) <= free
            free -= set(got.tolist())
            if n:
                held.append(got)
        assert pool.num_free == len(free)
        assert sorted(pool.free_slots().tolist()) == sorted(free)
    pool.check_ownership(held)
    assert pool.alloc(len(free)).tolist() == sorted(free)  # all of them, lowest first


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free"]), st.integers(0, 30),
                          st.integers(0, 10 ** 6)), max_size=60),
       st.integers(0, 60), st.sampled_from([1, 4]))
def test_alloc_hands_out_the_lowest_free_pages_once_the_freed_ones_are_merged(ops, keep_at, page):
    """Against a model of the free list (a stack, lowest page on top, refilled with every free
    page sorted when short): the exact slot ids, with or without page states (which the pool
    starts keeping, at operation ``keep_at``, from its first `alloc_after`)."""
    pool = KVSlotPool(100, page_size=page)
    stack = list(range(100 // page - 1, -1, -1))  # page numbers, the top last
    released: list[int] = []
    held: list[np.ndarray] = []
    for i, (op, n, seed) in enumerate(ops):
        if i == keep_at:
            pool._keep_states()
        if op == "free" and held:
            chunk = held.pop(int(np.random.default_rng(seed).integers(len(held))))
            pool.free(chunk)
            released += [(s - 1) // page for s in chunk[::page].tolist()]
        elif op == "alloc":
            if n > len(stack) and released:
                stack, released = sorted(stack + released, reverse=True), []
            if n > len(stack):
                with pytest.raises(OutOfSlots):
                    pool.alloc(n * page)
                continue
            want = stack[len(stack) - n :][::-1]
            del stack[len(stack) - n :]
            got = pool.alloc(n * page)
            assert got.tolist() == [p * page + j + 1 for p in want for j in range(page)]
            held.append(got)
        assert pool.num_free == (len(stack) + len(released)) * page
    pool.check_ownership(held)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "split", "free"]), st.integers(0, 30),
                          st.integers(0, 30)), max_size=30),
       st.sampled_from([None, 160]), st.sampled_from([1, 4]))
def test_alloc_split_hands_out_alloc_s_slots_cut_in_two_arrays_of_their_own(ops, capacity, page):
    """Two pools driven alike, one by ``alloc`` and one by ``alloc_split`` where the op says:
    the same slots, the first ``k`` of them first, neither array a view (each owns its memory);
    bounded or not, paged or not, with frees in between (the slow path's stale entries)."""
    plain, split = KVSlotPool(capacity, page_size=page), KVSlotPool(capacity, page_size=page)
    held: list[np.ndarray] = []
    for op, n, k in ops:
        n = n * page
        if op == "free":
            if held:
                slots = held.pop(k % len(held))
                plain.free(slots)
                split.free(slots)
            continue
        if not plain.can_alloc(n):
            continue
        whole = plain.alloc(n)
        if op == "alloc":
            assert split.alloc(n).tolist() == whole.tolist()
        else:
            cut = min(k * page, n)
            first, rest = split.alloc_split(n, cut)
            assert first.tolist() == whole[:cut].tolist() and rest.tolist() == whole[cut:].tolist()
            assert first.base is None and rest.base is None
        held.append(whole)
    assert split.num_free == plain.num_free


def test_alloc_split_refuses_a_cut_outside_the_allocation():
    with pytest.raises(ValueError, match="cannot cut 3 slots after 4"):
        KVSlotPool(8, page_size=2).alloc_split(3, 4)
