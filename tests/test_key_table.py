"""`KeyTable` (the block-hash cache's key index) against a dict, through tombstones and rehashes."""

import numpy as np

from testbed.cache.key_table import KeyTable


def test_a_key_table_answers_like_a_dict_through_adds_removals_and_rehashes():
    rng = np.random.default_rng(3)
    table, model = KeyTable(8), {}
    fresh = iter(range(10**9))  # values are distinct
    universe = rng.integers(0, 1 << 63, 400, dtype=np.uint64) << np.uint64(1)
    universe[:40] = (np.uint64(5) << np.uint64(58)) | np.arange(40, dtype=np.uint64)  # one home slot
    for step in range(3000):
        batch = np.unique(rng.choice(universe, int(rng.integers(1, 40))))
        rng.shuffle(batch)
        kind = rng.integers(4)
        if kind == 0:
            values = np.array([next(fresh) for _ in batch])
            got = table.add(batch, values)
            want = [model.setdefault(int(k), int(v)) for k, v in zip(batch, values)]
            assert got.tolist() == want
        elif kind == 1:
            present = np.array([k for k in batch.tolist() if k in model], np.uint64)
            table.remove_values(np.array([model.pop(k) for k in present.tolist()], np.int64))
        elif kind == 2:
            present = np.array([k for k in batch.tolist() if k in model], np.uint64)
            old = np.array([model[k] for k in present.tolist()], np.int64)
            values = np.array([next(fresh) for _ in old], np.int64)
            table.replace_values(old, values)
            model.update(zip(present.tolist(), values.tolist()))
        got = table.lookup(batch).tolist()
        assert got == [model.get(int(k), -1) for k in batch], step
        assert len(table) == len(model)
        assert table.holds(np.array(list(model.values()) + [10**9 + 5], np.int64)).tolist() == \
            [True] * len(model) + [False]
    keys, values = table.items()
    assert dict(zip(keys.tolist(), values.tolist())) == model
