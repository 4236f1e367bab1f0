"""A hash table from 64-bit keys to block ids, on numpy arrays, read and written a batch at a time.

The block-hash cache looks up, adds and drops hundreds of block keys per request. A Python dict
does each one at a time, each a few cache misses (~250 ns); here a whole batch moves through
open addressing with linear probing as a handful of vectorised gathers and scatters. The keys are
already uniformly mixed (chained hashes), so a key's home slot is its top bits; the table stays at
most half full, so a probe sequence is one or two slots long. A slot is one row (key, value), one
cache line fetch. A removed entry leaves a tombstone (probes go past it, adds reuse it);
tombstones are swept when they fill a quarter of the table. Values are distinct block ids, and the
table knows each one's slot, so an entry is removed by its value without probing.

>>> t = KeyTable(4)
>>> t.add(np.array([7, 9], np.uint64), np.array([70, 90])).tolist()
[70, 90]
>>> t.add(np.array([9, 5], np.uint64), np.array([91, 50])).tolist()  # 9 is kept as it was
[90, 50]
>>> t.lookup(np.array([5, 6, 7], np.uint64)).tolist()
[50, -1, 70]
>>> t.remove_values(np.array([90]))
>>> t.lookup(np.array([9], np.uint64)).tolist()
[-1]
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2
KEY, VALUE = 0, 1  # the columns of a slot
STRAGGLERS = 24  # keys still probing after a vectorised round: this few go on one by one
SMALL = 12  # batches this small go key by key: a dozen numpy calls cost more than the loop
_SIGN = 1 << 63


class KeyTable:
    def __init__(self, expected: int = 1024) -> None:
        self.live = 0
        self._where = np.full(64, -1, np.int64)  # value -> its slot, -1 when not in the table
        self._resize(max(64, 4 * expected))

    def __len__(self) -> int:
        return self.live

    def _resize(self, size: int) -> None:
        bits = max(6, int(size - 1).bit_length())
        self._shift = np.uint64(64 - bits)
        self._bits = bits
        self._mask = (1 << bits) - 1
        self._rows = np.zeros((1 << bits, 2), np.int64)  # keys stored as int64 bit patterns
        self._rows[:, VALUE] = EMPTY
        self._scratch = np.zeros(1 << bits, np.int64)
        self._dead = 0

    def _find(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slot holding each key or -1, the first free slot met on its probe sequence or -1)."""
        want = keys.view(np.int64)
        slot = (keys >> self._shift).astype(np.int64)
        rows = self._rows[slot]
        v = rows[:, VALUE]
        hit = (v >= 0) & (rows[:, KEY] == want)
        empty = v == EMPTY
        found = np.where(hit, slot, -1)
        free = np.where(empty, slot, -1)
        todo = (~(hit | empty)).nonzero()[0]
        while len(todo):  # the slot holds another key or a tombstone: probe on
            if len(todo) <= STRAGGLERS:
                for i in todo.tolist():
                    found[i], free[i] = self._probe(int(want[i]), int(slot[i]), int(free[i]))
                break
            at = slot[todo]
            gone = (self._rows[at, VALUE] == GONE) & (free[todo] < 0)
            free[todo[gone]] = at[gone]
            at = (at + 1) & self._mask
            slot[todo] = at
            rows = self._rows[at]
            v = rows[:, VALUE]
            hit = (v >= 0) & (rows[:, KEY] == want[todo])
            found[todo[hit]] = at[hit]
            empty = v == EMPTY
            fresh = empty & (free[todo] < 0)
            free[todo[fresh]] = at[fresh]
            todo = todo[~(hit | empty)]
        return found, free

    def _probe(self, key: int, slot: int, free: int) -> tuple[int, int]:
        """`_find` for one key whose probe sequence goes past ``slot`` (not it)."""
        rows = self._rows
        while True:
            value = int(rows[slot, VALUE])
            if value == GONE and free < 0:
                free = slot
            slot = (slot + 1) & self._mask
            value = int(rows[slot, VALUE])
            if value >= 0 and int(rows[slot, KEY]) == key:
                return slot, free
            if value == EMPTY:
                return -1, free if free >= 0 else slot

    def _slot_of(self, key: int) -> tuple[int, int]:
        """`_find` for one key (a Python int below 2^64): (its slot or -1, first free slot)."""
        rows, mask = self._rows, self._mask
        want = key - (_SIGN << 1) if key >= _SIGN else key  # as stored: int64 bits
        slot, free = key >> (64 - self._bits), -1
        while True:
            value = rows.item(slot, VALUE)
            if value == EMPTY:
                return -1, free if free >= 0 else slot
            if value >= 0:
                if rows.item(slot, KEY) == want:
                    return slot, free
            elif free < 0:
                free = slot
            slot = (slot + 1) & mask

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The value of each key, -1 where absent."""
        if len(keys) <= SMALL:
            rows = self._rows
            out = []
            for key in keys.tolist():
                slot = self._slot_of(key)[0]
                out.append(rows.item(slot, VALUE) if slot >= 0 else -1)
            return np.array(out, np.int64)
        found, _ = self._find(keys)
        return np.where(found >= 0, self._rows[found, VALUE], -1)

    def leading(self, keys: np.ndarray) -> np.ndarray:
        """The values of the keys before the first absent one, looked up in growing runs (a
        lead of k keys costs O(k) however many follow)."""
        if len(keys) <= SMALL:
            rows, out = self._rows, []
            for key in keys.tolist():
                slot = self._slot_of(key)[0]
                if slot < 0:
                    break
                out.append(rows.item(slot, VALUE))
            return np.array(out, np.int64)
        found, at, run = [], 0, 32
        while at < len(keys):
            values = self.lookup(keys[at : at + run])
            missing = (values < 0).nonzero()[0]
            if len(missing):
                found.append(values[: missing[0]])
                break
            found.append(values)
            at += run
            run *= 4
        return np.concatenate(found) if len(found) > 1 else found[0]

    def add(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Add the keys not present with their ``values`` (keys of one call distinct, values
        distinct and not in the table); returns the value each key now has (its old one where it
        was present)."""
        if 2 * (self.live + self._dead + len(keys)) > len(self._rows):
            self._rehash(self.live + len(keys))
        if len(keys) <= SMALL:
            return self._add_each(keys, values)
        found, free = self._find(keys)
        out = np.asarray(values, np.int64).copy()
        present = found >= 0
        out[present] = self._rows[found[present], VALUE]
        todo = (~present).nonzero()[0]
        slot = free[todo]
        while len(todo):  # two new keys may want one free slot: the first wins, the other probes on
            self._scratch[slot] = todo
            won = self._scratch[slot] == todo
            self._place(slot[won], keys[todo[won]], out[todo[won]])
            todo, slot = todo[~won], slot[~won]
            for i in range(len(todo)):  # rare: walk each loser to the next free slot
                s = slot[i]
                while self._rows[s, VALUE] >= 0:
                    s = (s + 1) & self._mask
                slot[i] = s
        return out

    def _add_each(self, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        """`add`, key by key."""
        rows, where = self._rows, self._where
        out = []
        for key, value in zip(keys.tolist(), np.asarray(values).tolist()):
            slot, free = self._slot_of(key)
            if slot >= 0:
                out.append(rows.item(slot, VALUE))
                continue
            if rows.item(free, VALUE) == GONE:
                self._dead -= 1
            rows[free, KEY] = key - (_SIGN << 1) if key >= _SIGN else key
            rows[free, VALUE] = value
            if value >= len(where):
                self._index(np.array([value]), np.array([free]))
                where = self._where
            else:
                where[value] = free
            self.live += 1
            out.append(value)
        return np.array(out, np.int64)

    def _place(self, slots: np.ndarray, keys: np.ndarray, values: np.ndarray) -> None:
        self._dead -= int(np.count_nonzero(self._rows[slots, VALUE] == GONE))
        self._rows[slots, KEY] = keys.view(np.int64)
        self._rows[slots, VALUE] = values
        self._index(values, slots)
        self.live += len(slots)

    def _index(self, values: np.ndarray, slots: np.ndarray) -> None:
        """Record where ``values`` now are."""
        if len(values) and values.max() >= len(self._where):
            grown = np.full(max(int(values.max()) + 1, 2 * len(self._where)), -1, np.int64)
            grown[: len(self._where)] = self._where
            self._where = grown
        self._where[values] = slots

    def holds(self, values: np.ndarray) -> np.ndarray:
        """Whether each value is in the table."""
        return (values < len(self._where)) & (self._where[np.minimum(values, len(self._where) - 1)] >= 0)

    def replace_values(self, old: np.ndarray, new: np.ndarray) -> None:
        """The entries holding values ``old`` hold ``new`` instead (same keys)."""
        slots = self._where[old]
        assert (slots >= 0).all(), "a value not in the table"
        self._where[old] = -1
        self._rows[slots, VALUE] = new
        self._index(new, slots)

    def remove_values(self, values: np.ndarray) -> None:
        """Remove the entries holding ``values`` (each in the table)."""
        if len(values) <= SMALL:
            rows, where = self._rows, self._where
            for value in values.tolist():
                slot = where.item(value)
                assert slot >= 0, "a value not in the table"
                where[value] = -1
                rows[slot, VALUE] = GONE
            self.live -= len(values)
            self._dead += len(values)
            if 4 * self._dead > len(self._rows):
                self._rehash(self.live)
            return
        slots = self._where[values]
        assert (slots >= 0).all(), "a value not in the table"
        self._where[values] = -1
        self._rows[slots, VALUE] = GONE
        self.live -= len(slots)
        self._dead += len(slots)
        if 4 * self._dead > len(self._rows):
            self._rehash(self.live)

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """Every (key, value), in slot order."""
        live = self._rows[:, VALUE] >= 0
        return self._rows[live, KEY].view(np.uint64), self._rows[live, VALUE]

    def _rehash(self, expected: int) -> None:
        keys, values = self.items()
        self._where[values] = -1
        self._resize(max(len(self._rows), 4 * expected))
        self.live = 0
        if len(keys):
            self.add(keys, values)
