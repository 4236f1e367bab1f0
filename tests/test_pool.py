import numpy as np
import pytest

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
